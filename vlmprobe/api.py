"""vlmprobe from Python (a notebook, a launch script): the command's three questions as functions returning a Result.

    from vlmprobe.api import advise, max_batch, run
    result = run(model="qwen2_vl_7b", device="rtx4090", **{"data.batch_size": 4, "train.lora_r": 16})
    result.table  # the rows (pandas DataFrame), result.out_dir the results folder, result.fits

Arguments are the command line's overrides: positional as written ("+sweep=seq_len"), keywords as key=value (a
dotted key through **{...}). Each call is the command in this process: the same checks (a bad value raises
ConfigError, one line naming it), the same folder of results, the same answer on stdout. A sweep interrupted by
Ctrl-C raises KeyboardInterrupt with every finished row kept.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from vlmprobe.config.grid import format_value
from vlmprobe.config.overrides import composing, with_hub_ids
from vlmprobe.config.recipes import apply_recipe
from vlmprobe.errors import ConfigError
from vlmprobe.results.table import read_table
from vlmprobe.run import command
from vlmprobe.states import Status

__all__ = ["Result", "advise", "max_batch", "run"]


@dataclass(frozen=True)
class Result:
    table: pd.DataFrame  # results.csv: one row per point (for advise, per knob tried; for max_batch, per probe)
    out_dir: Path  # the results folder (summary.md, plot.png, advise.csv / max_batch.csv)
    exit_code: int  # what the command would have exited with

    @property
    def fits(self) -> bool:
        """Whether every point ended `ok` (an `oom` row does not fit)."""
        return bool(len(self.table)) and bool((self.table["status"] == Status.OK).all())

    @property
    def advice(self) -> pd.DataFrame | None:
        """advise.csv of an advise() call: the knobs ranked by what they save."""
        path = self.out_dir / "advise.csv"
        return pd.read_csv(path) if path.is_file() else None

    @property
    def largest_batch(self) -> pd.DataFrame | None:
        """max_batch.csv of a max_batch() call: the largest batch size per configuration."""
        path = self.out_dir / "max_batch.csv"
        return pd.read_csv(path) if path.is_file() else None


def overrides_of(args: tuple[str, ...], settings: dict) -> list[str]:
    return with_hub_ids([*args, *(f"{key}={format_value(value)}" for key, value in settings.items())])


def run(*args: str, **settings) -> Result:
    """The command with these overrides (`python -m vlmprobe ARGS`)."""
    argv = overrides_of(args, settings)
    state: dict = {"out_dir": None}
    with composing() as compose:
        applied = apply_recipe(compose, argv)
        for line in applied.lines:
            print(line, file=sys.stderr, flush=True)
        code = command.run(applied.cfg, applied.argv, compose, state)
    if state["out_dir"] is None:  # dry_run=true: nothing written
        raise ConfigError("dry_run=true is not allowed from Python: it writes no table to return; plan with the "
                          "command line instead")
    return Result(read_table(Path(state["out_dir"]) / "results.csv"), Path(state["out_dir"]), code)


def max_batch(*args: str, **settings) -> Result:
    """+find=max_batch with these overrides: `result.largest_batch`."""
    return run("+find=max_batch", *args, **settings)


def advise(*args: str, **settings) -> Result:
    """+advise=fit with these overrides: `result.advice`, the knobs ranked."""
    return run("+advise=fit", *args, **settings)
