"""The command's work between its composed config and its tables: check the command's own keys, plan every
point, make the results dir and its provenance, run the points through the launcher, write the reports.

Exit codes: 0 the sweep ran (OOM points are results); 1 every point failed for a reason other than memory; 2 bad
input (ConfigError, raised before any point runs and before anything is written).
"""

from __future__ import annotations

import datetime
import itertools
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from vlmprobe import backends
from vlmprobe.config.checks import check_top_level
from vlmprobe.config.grid import flatten_axes, flatten_cases
from vlmprobe.config.overrides import resolved
from vlmprobe.config.notices import notices
from vlmprobe.config.plan import Composer, PlannedPoint, grid_points, plan, plan_point
from vlmprobe.distributed import options as dist_options
from vlmprobe.errors import ConfigError
from vlmprobe.results.answer import answer_lines, json_lines
from vlmprobe.results.provenance import environment, write_env
from vlmprobe.results.report import write_reports
from vlmprobe.results.table import columns_for, replacing
from vlmprobe.run import launchers
from vlmprobe.run.advise import Advisor
from vlmprobe.run.max_batch import MaxBatchSearch
from vlmprobe.run.resume import check_resume, locked
from vlmprobe.run.sweep import Runner, run_point
from vlmprobe.run.workers import describe_backend
from vlmprobe.states import Status

__all__ = ["counted", "duration", "run", "say"]

# what the closing line names, those that exist
WRITTEN = ("results.csv", "results.parquet", "summary.md", "report.html", "plot.png", "timeline.png", "steps.csv",
           "steps.png")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(cfg, overrides: list[str], compose, state: dict) -> int:
    """The command for its composed config `cfg`; `state["out_dir"]` is where rows go, once there is such a
    place (the caller names it if the command is interrupted)."""
    base = resolved(cfg)
    check_top_level(base)
    backend, note = backends.resolve(base["measure"]["backend"])
    launchers.check(base["launcher"], backend)
    if base["resume"]:
        check_resume(Path(base["resume"]), base, overrides)
        state["out_dir"] = Path(base["resume"])  # its rows are kept whatever happens next
    points = len(grid_points(overrides, base))
    check_size(compose, overrides, base, points)
    return run_planned(base, backend, note, overrides, compose, state)


def run_planned(base: dict, backend: str, note: str | None, overrides: list[str], compose, state: dict) -> int:
    """run() from the planning on."""
    search = MaxBatchSearch(compose, overrides, base) if base["find"] else None
    advisor = Advisor(compose, overrides, base) if base["advise"] else None
    planned = search.planned if search else advisor.planned if advisor else plan(compose, overrides, base)
    if note:
        say(note)
    for path in sorted({str(p.config["dist"]["deepspeed_config"]) for p in planned
                        if p.config["dist"].get("deepspeed_config")}):
        if line := dist_options.deepspeed_notice(path):
            say(line)
    for line in notices(planned):
        say(line)
    what = (counted(len(planned), "configuration to bisect") if search else
            f"your point and {counted(len(planned) - 1, 'knob')} to try" if advisor else counted(len(planned), "point"))
    if base["dry_run"]:
        say(f"vlmprobe: dry run: {what} planned and valid, backend {backend}; nothing run, nothing written")
        return 0
    axes, columns = table_axes(base, search is not None)
    if advisor:
        columns = columns_for(advisor.keys)
    out_dir = results_dir(base, state)
    with locked(out_dir):
        return run_in(out_dir, planned, search or advisor, base, backend, what, axes, columns, overrides)


def run_in(out_dir: Path, planned: list, search, base: dict, backend: str, what: str, axes: list[str],
           columns: list[str], overrides: list[str]) -> int:
    """`search`: a MaxBatchSearch or an Advisor that runs the points itself, or None."""
    """run_planned() in its results dir, held (resume.locked): the rows, then the tables."""
    runner = Runner(out_dir, columns)
    runner.check_kept(planned)
    say(f"vlmprobe: {what}, backend {backend}, results in {out_dir}")
    env = {**environment(describe_backend(backend, planned[0].config), base), "overrides": overrides}
    if not (out_dir / "env.json").exists():
        write_env(out_dir / "env.json", env)
    interrupted = None
    try:
        if isinstance(search, Advisor):
            search.run(runner, lambda points, runs: launchers.run_sweep(points, runs, base["launcher"]))
        elif search:
            search.run(runner)
        else:
            launchers.run_sweep(planned, runner, base["launcher"])
    except KeyboardInterrupt as exc:  # the CSV holds every finished row: make the tables from them, then say so
        interrupted = exc
    table, failures = write_reports(out_dir, axes, env)
    advice = None
    if search and not interrupted:
        advice = search.report(out_dir)
    for failure in failures:
        say(f"vlmprobe: {failure}")
    if interrupted:
        raise interrupted
    written = ", ".join(n for n in WRITTEN if (out_dir / n).exists())
    say(f"vlmprobe: wrote {out_dir}: {written} ({counted(len(table), 'row')})")
    answer(table, base["output"], advice)
    failed = [s for s in runner.statuses if s not in (Status.OK, Status.OOM, Status.SKIPPED)]
    if runner.statuses and len(failed) == len(runner.statuses):
        return 1
    return 1 if base["fail_on_oom"] and (table["status"] == Status.OOM).any() else 0


def answer(table, output: str, advice: list[str] | None = None) -> None:
    """The rows' answer on stdout (vlmprobe.results.answer): the table and verdicts, or a search's own lines
    (the advisor's ranking, the largest batch), or JSON lines."""
    lines = json_lines(table) if output == "json" else advice or answer_lines(table)
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        sys.stdout = None


def table_axes(base: dict, searched: bool) -> tuple[list[str], list[str]]:
    """(the axes the report pivots on, the results table's columns)."""
    axes = list(flatten_axes(base["sweep"]["axes"] or {}))
    cases = flatten_cases(base["sweep"].get("cases"))
    columns = columns_for(axes + sorted({k for case in cases for k in case}))
    if base["sweep"].get("cases"):
        axes = ["case", *axes]  # the report pivots on the case like on an axis
    if searched:
        axes = ["data.batch_size", *axes]  # the probes vary the batch size like an axis
    return axes, columns


def results_dir(base: dict, state: dict) -> Path:
    """The resumed dir, or a new one (results_dir/<sweep>/<timestamp>) holding the sweep's config.yaml."""
    if base["resume"]:
        out_dir = Path(base["resume"])
        state["out_dir"] = out_dir
        return out_dir
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    sweep_dir = Path(base["results_dir"]) / base["sweep"]["name"]
    for n in itertools.count(1):  # two sweeps started in the same second get a folder each
        out_dir = sweep_dir / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            out_dir.mkdir(parents=True, exist_ok=False)
            break
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"results_dir={base['results_dir']} is not allowed: {out_dir} cannot be made there "
                              f"({exc.strerror}); give a directory you can write") from None
    # Known before its config exists, so that a Ctrl-C from here on is told about the dir (interrupted_line
    # removes it while it has no config.yaml); the config appears whole or not at all
    state["out_dir"] = out_dir
    with replacing(out_dir / "config.yaml") as partial:
        partial.write_text(OmegaConf.to_yaml(OmegaConf.create({k: v for k, v in base.items() if k != "resume"})))
    return out_dir


def check_size(compose, overrides: list[str], base: dict, count: int) -> None:
    """A grid larger than sweep.max_points is refused, saying how long it would take at the rate one of
    its points runs here (one point is run to measure it; nothing is written)."""
    limit = base["sweep"]["max_points"]
    if count <= limit:
        return
    what = f"this sweep has {count:,} points, more than sweep.max_points={limit:,}"
    if base["dry_run"]:
        raise ConfigError(f"{what}: raise it (sweep.max_points={count}) to run them")
    first: PlannedPoint = plan_point(Composer(compose, overrides), grid_points(overrides, base)[0])
    say(f"vlmprobe: {what}: timing one point to say how long they would take")
    start = time.perf_counter()
    run_point(first.config)
    took = time.perf_counter() - start
    raise ConfigError(f"{what}: raise it (sweep.max_points={count}) to run them; one point took {took:.1f} s "
                      f"here, so all would take about {duration(took * count)}")


def counted(n: int, noun: str) -> str:
    """'1 point', '8 points', '1 configuration to bisect' (the noun's first word takes the plural)."""
    first, _, rest = noun.partition(" ")
    return f"{n:,} {first if n == 1 else first + 's'}{' ' + rest if rest else ''}"


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
