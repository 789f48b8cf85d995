"""Resuming a sweep (resume=DIR): the folder must hold the same sweep, so that its rows and the new ones belong to
one table; and the line an interrupted command leaves, naming the rows kept and the command that resumes them."""

from __future__ import annotations

import contextlib
import copy
import re
import shlex
import shutil
from pathlib import Path

import filelock
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from vlmprobe.errors import ConfigError
from vlmprobe.paths import CONF
from vlmprobe.results.table import read_table

__all__ = ["LOCK_NAME", "NOT_DECIDING", "check_resume", "deciding", "differences", "holds", "hydra_value",
           "interrupted_line", "locked", "override_value"]

LOCK_NAME = ".vlmprobe.lock"  # in a results dir while a command runs its points there
# Keys that do not decide the rows: a resumed dir may be given them differently.
NOT_DECIDING = ("results_dir", "resume", "dry_run", "sweep.max_points", "launcher")


def deciding(config: dict) -> dict:
    """The config without the keys that do not decide the rows (NOT_DECIDING, dotted)."""
    config = copy.deepcopy(config)
    for dotted in NOT_DECIDING:
        *parents, leaf = dotted.split(".")
        node = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return config


def differences(before, now, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two configs."""
    if isinstance(before, dict) and isinstance(now, dict):
        return [d for k in sorted(set(before) | set(now), key=str)
                for d in differences(before.get(k), now.get(k), f"{prefix}{k}.")]
    return [] if before == now else [prefix.rstrip(".")]


def holds(config: dict, dotted: str) -> bool:
    """Whether `config` has the dotted key."""
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def check_resume(out_dir: Path, base: dict, overrides: list[str] = ()) -> None:
    """A resumed dir must hold the same sweep; only what decides the rows is compared (not where they are
    written). A key the dir's config lacks (a newer vlmprobe added it) is no difference while this command leaves
    it at its default (no override names it): a new option's default keeps what the rows were made with."""
    saved = out_dir / "config.yaml"
    if not saved.exists():
        raise ConfigError(f"resume={out_dir} is not allowed: it has no config.yaml (not a vlmprobe results dir)")
    try:
        before = OmegaConf.to_container(OmegaConf.load(saved), resolve=True)
    except Exception as exc:
        raise ConfigError(f"resume={out_dir} is not allowed: its config.yaml cannot be read ({exc})") from None
    named = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    named = [n for n in named if not (CONF / n).is_dir()]  # a group's option (dist=zero3) sets no key by name
    changed = [k for k in differences(deciding(before), deciding(base))
               if holds(before, k) or any(k == n or k.startswith(n + ".") or n.startswith(k + ".") for n in named)]
    if changed:
        raise ConfigError(f"resume={out_dir} is not allowed: it was run with a different config "
                          f"(differs in: {', '.join(changed)}); run the same command with resume=DIR")


@contextlib.contextmanager
def locked(out_dir: Path):
    """The results dir held by this command while it runs its points and writes its tables there: a second
    command on it (a resume of a sweep still running, two resumes at once) is refused in one line, before it writes
    anything. An advisory lock on LOCK_NAME (filelock), released when the command ends, however it ends."""
    lock = filelock.FileLock(out_dir / LOCK_NAME)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise ConfigError(f"resume={out_dir} is not allowed: another vlmprobe command is running its points there "
                          f"now; resume it once that one has ended") from None
    try:
        yield
    finally:
        lock.release()


def interrupted_line(argv: list[str], out_dir: Path | None, signal_name: str = "SIGINT") -> str:
    """What an interrupted command leaves, and the command that continues it; `signal_name`: what interrupted it
    (Ctrl-C's SIGINT is said as "interrupted", another signal by its name)."""
    how = "interrupted" if signal_name == "SIGINT" else f"interrupted by {signal_name}"
    if out_dir is not None and {p.name for p in out_dir.iterdir()} <= {"config.partial.yaml"}:
        # made a moment ago, before its config was whole: nothing in it to resume
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir = None
    if out_dir is None:  # a resumed command interrupted at start-up, before it read its dir: its rows are there
        given = [override_value(a) for a in argv if a.split("=", 1)[0].lstrip("+") == "resume" and "=" in a]
        if given and isinstance(given[-1], str) and (Path(given[-1]) / "config.yaml").is_file():
            out_dir = Path(given[-1])
    if out_dir is None:
        return f"vlmprobe: {how} before any point ran; nothing was written"
    csv = out_dir / "results.csv"
    try:
        rows = len(read_table(csv)) if csv.exists() else 0
    except Exception:  # a CSV cut mid-header: no row is kept
        rows = 0
    again = [a for a in argv if a.split("=", 1)[0].lstrip("+") != "resume"]
    command = shlex.join(["python", "-m", "vlmprobe", *again, f"resume={hydra_value(str(out_dir))}"])
    return f"vlmprobe: {how}: {rows} rows kept in {csv}; resume with: {command}"


def override_value(arg: str):
    """The value of a `key=value` command-line override as Hydra reads it (None where Hydra cannot read it)."""
    try:
        return OverridesParser.create().parse_overrides([arg])[0].value()
    except Exception:
        return None


def hydra_value(text: str) -> str:
    """`text` as an override's value Hydra reads back as that text: as it is where it can be, else quoted (a path
    with spaces, commas, brackets or letters outside ASCII). In Hydra's quoted strings backslashes are literal but
    for a run of them before a quote or at the end, which are doubled; a quote is escaped."""
    if override_value(f"k={text}") == text:
        return text
    quoted = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    quoted = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, quoted)
    return f"'{quoted}'"
