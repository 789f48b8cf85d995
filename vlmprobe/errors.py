"""Bad input and internal failures, as the user sees them: one line each, never a traceback.

ConfigError is bad input: its message is the single line the user sees (exit 2). A value that a library
(torch's optimizers, peft, transformers, Hydra) refuses becomes a ConfigError quoting the library's own
message (`refused`). Anything else that escapes is vlmprobe's fault: one line and a log file holding the
traceback (`log_internal_error`).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from pathlib import Path

__all__ = ["ConfigError", "WriteError", "first_line", "log_internal_error", "refused", "require_counts", "require_flags",
           "whole"]

LOG_NAME = "vlmprobe-error.log"


class ConfigError(ValueError):
    """A configuration value that is not allowed; the message names the value and what is allowed."""


class WriteError(OSError):
    """A results file that cannot be written (a full disk, a quota, a folder made read-only): the message names
    the file and the system's error, and says what is kept. Not vlmprobe's fault, so no traceback is logged."""


def require_flags(prefix: str, values: dict, keys) -> None:
    """One line for the first of `keys` whose value is not true or false (`prefix`: the config section)."""
    for key in keys:
        if not isinstance(values[key], bool):
            raise ConfigError(f"{prefix}.{key}={values[key]!r} is not allowed: use true or false")


def whole(value) -> bool:
    """An int that is not a bool (YAML's true is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_counts(prefix: str, values: dict, keys, low: int = 1) -> None:
    """One line for the first of `keys` whose value is not an integer >= `low`."""
    for key in keys:
        value = values[key]
        if not whole(value) or value < low:
            raise ConfigError(f"{prefix}.{key}={value!r} is not allowed: it must be an integer >= {low}")


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type's name when it has none."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def refused(setting: str, library: str, exc: BaseException) -> ConfigError:
    """`setting` (e.g. "optimizer.lr=-1") refused by `library` (e.g. "torch.optim.AdamW"), quoting it."""
    return ConfigError(f"{setting} is not allowed: {library} refuses it: {first_line(exc)}")


def log_internal_error(exc: BaseException, out_dir: Path | None = None) -> Path | str:
    """Write the traceback of an unexpected exception to a log file and return its path: in the results
    dir when there is one (it belongs with the rows), else in the temp dir (bad input writes nothing). Where
    neither can be written (a full disk), the words that say so instead of a path."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    temp = Path(tempfile.gettempdir()) / f"vlmprobe-error-{stamp}-{os.getpid()}.log"
    places = ([out_dir / LOG_NAME] if out_dir is not None and out_dir.is_dir() else []) + [temp]
    for path in places:
        try:
            with path.open("a") as f:
                f.write(f"--- {stamp}\n{''.join(traceback.format_exception(exc))}\n")
            return path
        except OSError as error:
            problem = error
    return f"no file: no log could be written ({first_line(problem)})"
