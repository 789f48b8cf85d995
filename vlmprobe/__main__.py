"""`python -m vlmprobe [+sweep=NAME] [overrides]`: plan every point, run them, write the tables.

Overrides are Hydra's (key=value; +key=value adds a key or a sweep axis). dry_run=true plans and validates
every point and runs and writes nothing.

Exit codes: 0 the sweep ran (OOM points are results); 1 every point failed for a reason other than memory,
or vlmprobe itself failed (one line, and a log file with the traceback); 2 bad input (one line on stderr,
before any point runs and before anything is written); 130 interrupted (Ctrl-C: one line saying how many
rows are kept, where, and the command that resumes).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

# Keys that do not decide the rows: a resumed dir may be given them differently.
NOT_DECIDING = ("results_dir", "resume", "dry_run", "sweep.max_points", "launcher")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(cfg, overrides: list[str], compose, state: dict) -> int:
    from omegaconf import OmegaConf

    from vlmprobe import interrupt

    # the first imports of torch (backends) and pandas (plan): a Ctrl-C raised inside their native start-up code
    # crashes the process, there or at their next use (the interrupted line reads the rows kept with pandas)
    with interrupt.deferred():
        from vlmprobe import backends, launchers
        from vlmprobe.plan import grid_points

    base = OmegaConf.to_container(cfg, resolve=True)
    base.pop("hydra", None)
    check_top_level(base)
    backend, note = backends.resolve(base["measure"]["backend"])
    launchers.check(base["launcher"], backend)
    if base["resume"]:
        check_resume(Path(base["resume"]), base)
        state["out_dir"] = Path(base["resume"])  # its rows are kept whatever happens next
    points = len(grid_points(overrides, base))
    check_size(compose, overrides, base, points)
    return run_planned(base, backend, note, overrides, compose, state)


def run_planned(base: dict, backend: str, note: str | None, overrides: list[str], compose, state: dict) -> int:
    """run() from the planning on."""
    import datetime

    from omegaconf import OmegaConf

    from vlmprobe.errors import ConfigError
    from vlmprobe.find import MaxBatchSearch
    from vlmprobe.grid import flatten_axes, flatten_cases
    from vlmprobe.plan import plan
    from vlmprobe.provenance import environment, write_env
    from vlmprobe.report import write_reports
    from vlmprobe.results import columns_for
    from vlmprobe.sweep import Runner, describe_backend, run_sweep

    search = MaxBatchSearch(compose, overrides, base) if base["find"] else None
    planned = search.planned if search else plan(compose, overrides, base)
    if note:
        say(note)
    what = counted(len(planned), "configuration to bisect" if search else "point")
    if base["dry_run"]:
        say(f"vlmprobe: dry run: {what} planned and valid, backend {backend}; nothing run, nothing written")
        return 0
    axes = list(flatten_axes(base["sweep"]["axes"] or {}))
    cases = flatten_cases(base["sweep"].get("cases"))
    columns = columns_for(axes + sorted({k for case in cases for k in case}))
    if base["sweep"].get("cases"):
        axes = ["case", *axes]  # the report pivots on the case like on an axis
    if search:
        axes = ["data.batch_size", *axes]  # the probes vary the batch size like an axis
    if base["resume"]:
        out_dir = Path(base["resume"])
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out_dir = Path(base["results_dir"]) / base["sweep"]["name"] / stamp
        try:
            out_dir.mkdir(parents=True, exist_ok=False)
        except OSError as exc:
            raise ConfigError(f"results_dir={base['results_dir']} is not allowed: {out_dir} cannot be made there "
                              f"({exc.strerror}); give a directory you can write") from None
        # Known before its config exists, so that a Ctrl-C from here on is told about the dir (interrupted_line
        # removes it while it has no config.yaml); the config appears whole or not at all
        state["out_dir"] = out_dir
        partial = out_dir / "config.yaml.partial"
        partial.write_text(OmegaConf.to_yaml(OmegaConf.create({k: v for k, v in base.items() if k != "resume"})))
        partial.replace(out_dir / "config.yaml")
    state["out_dir"] = out_dir
    say(f"vlmprobe: {what}, backend {backend}, results in {out_dir}")
    env = {**environment(describe_backend(backend, planned[0].config), base), "overrides": overrides}
    env_path = out_dir / "env.json"
    if not env_path.exists():
        write_env(env_path, env)
    runner = Runner(out_dir, columns)
    interrupted = None
    try:
        if search:
            search.run(runner)
        else:
            run_sweep(planned, runner, base["launcher"])
    except KeyboardInterrupt as exc:  # the CSV holds every finished row: make the tables from them, then say so
        interrupted = exc
    table, failures = write_reports(out_dir, axes, env)
    if search and not interrupted:
        search.report(out_dir)
    for failure in failures:
        say(f"vlmprobe: {failure}")
    if interrupted:
        raise interrupted
    written = ", ".join(n for n in ("results.csv", "results.parquet", "summary.md", "plot.png") if (out_dir / n).exists())
    say(f"vlmprobe: wrote {out_dir}: {written} ({counted(len(table), 'row')})")
    failed = [s for s in runner.statuses if s not in ("ok", "oom", "skipped")]
    return 1 if runner.statuses and len(failed) == len(runner.statuses) else 0


def check_top_level(base: dict) -> None:
    """The keys of config.yaml itself (the groups are checked per point by plan.py)."""
    from vlmprobe.errors import ConfigError
    from vlmprobe.sizes import parse_bytes

    if not isinstance(base["dry_run"], bool):
        raise ConfigError(f"dry_run={base['dry_run']!r} is not allowed: use true or false")
    parse_bytes(base["memory_budget"], "memory_budget")
    name = base["sweep"]["name"]
    if not isinstance(name, str) or not name.strip() or "/" in name or name in (".", ".."):
        raise ConfigError(f"sweep.name={name!r} is not allowed: give a name (it names the results folder)")
    limit = base["sweep"].get("max_points")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        raise ConfigError(f"sweep.max_points={limit!r} is not allowed: it must be a positive integer")
    for key in ("results_dir", "resume"):
        value = base[key]
        if key == "resume" and value is None:
            continue
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{key}={value!r} is not allowed: give a directory path")
    results = Path(base["results_dir"])
    existing = next(p for p in (results, *results.parents) if p.exists() or p == Path("."))
    if not existing.is_dir():
        raise ConfigError(f"results_dir={base['results_dir']} is not allowed: {existing} is a file, not a directory; "
                          f"give a directory (it is made if missing)")
    if base["resume"] and not Path(base["resume"]).is_dir():
        raise ConfigError(f"resume={base['resume']} is not allowed: it is not a directory; give the results dir "
                          f"of an earlier run (results/<sweep>/<timestamp>)")


def check_size(compose, overrides: list[str], base: dict, count: int) -> None:
    """A grid larger than sweep.max_points is refused, saying how long it would take at the rate one of
    its points runs here (one point is run to measure it; nothing is written)."""
    import time

    from vlmprobe.errors import ConfigError
    from vlmprobe.plan import Composer, grid_points, plan_point
    from vlmprobe.sweep import run_point

    limit = base["sweep"]["max_points"]
    if count <= limit:
        return
    what = f"this sweep has {count:,} points, more than sweep.max_points={limit:,}"
    if base["dry_run"]:
        raise ConfigError(f"{what}: raise it (sweep.max_points={count}) to run them")
    first = plan_point(Composer(compose, overrides), grid_points(overrides, base)[0])
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


def deciding(config: dict) -> dict:
    """The config without the keys that do not decide the rows (NOT_DECIDING, dotted)."""
    import copy

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


def check_resume(out_dir: Path, base: dict) -> None:
    """A resumed dir must hold the same sweep, so that its rows and the new ones belong to one table; only
    what decides the rows is compared (not where they are written)."""
    from omegaconf import OmegaConf

    from vlmprobe.errors import ConfigError

    saved = out_dir / "config.yaml"
    if not saved.exists():
        raise ConfigError(f"resume={out_dir} is not allowed: it has no config.yaml (not a vlmprobe results dir)")
    try:
        before = OmegaConf.to_container(OmegaConf.load(saved), resolve=True)
    except Exception as exc:
        raise ConfigError(f"resume={out_dir} is not allowed: its config.yaml cannot be read ({exc})") from None
    changed = differences(deciding(before), deciding(base))
    if changed:
        raise ConfigError(f"resume={out_dir} is not allowed: it was run with a different config "
                          f"(differs in: {', '.join(changed)}); run the same command with resume=DIR")


def interrupted_line(argv: list[str], out_dir: Path | None) -> str:
    """What an interrupted command leaves, and the command that continues it."""
    if out_dir is not None and {p.name for p in out_dir.iterdir()} <= {"config.yaml.partial"}:
        # made a moment ago, before its config was whole: nothing in it to resume
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir = None
    if out_dir is None:  # a resumed command interrupted at start-up, before it read its dir: its rows are there
        given = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == "resume" and "=" in a]
        if given and (Path(given[-1]) / "config.yaml").is_file():
            out_dir = Path(given[-1])
    if out_dir is None:
        return "vlmprobe: interrupted before any point ran; nothing was written"
    from vlmprobe.results import read_table

    csv = out_dir / "results.csv"
    try:
        rows = len(read_table(csv)) if csv.exists() else 0
    except Exception:  # a CSV cut mid-header: no row is kept
        rows = 0
    again = [a for a in argv if a.split("=", 1)[0].lstrip("+") != "resume"]
    command = shlex.join(["python", "-m", "vlmprobe", *again, f"resume={out_dir}"])
    return f"vlmprobe: interrupted: {rows} rows kept in {csv}; resume with: {command}"


def run_command(argv: list[str], state: dict) -> int:
    import functools

    from vlmprobe.overrides import CONF, check_group_choices, check_syntax, compose_checked

    check_syntax(argv)
    check_group_choices(argv)
    import hydra
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        @functools.lru_cache(maxsize=None)  # a single point is the command line itself: composed once
        def composed(extra: tuple):
            return hydra.compose(config_name="config", overrides=list(extra))

        def compose(extra):
            return composed(tuple(extra))

        return run(compose_checked(compose, argv), argv, compose, state)


def main(argv: list[str] | None = None) -> int:
    """The command; returns its exit code. Every failure is one line on stderr, never a traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\nSee README.md for the config keys and sweeps.")
        return 0
    state: dict = {"out_dir": None}  # where rows go, once there is such a place
    import logging

    # A library's log call that cannot format its own message (transformers, given a strange setting) makes the
    # logging module print a traceback of its own; the setting's refusal is the line the user needs
    logging.raiseExceptions = False
    from vlmprobe import interrupt

    with interrupt.watching():
        try:  # everything, imports included: a Ctrl-C at any moment gets its one line too
            from vlmprobe.errors import ConfigError, first_line, log_internal_error
            from vlmprobe.overrides import CONF

            if not CONF.is_dir():
                say(f"vlmprobe: config directory {CONF} not found; install from a checkout with `pip install -e .`")
                return 2
            try:
                return run_command(argv, state)
            except ConfigError as exc:
                if interrupt.received():  # a library failed because Ctrl-C struck inside it
                    raise KeyboardInterrupt from None
                say(f"vlmprobe: {exc}")
                return 2
            except Exception as exc:
                if interrupt.received():
                    raise KeyboardInterrupt from None
                log = log_internal_error(exc, state["out_dir"])
                say(f"vlmprobe: internal error, not a problem with your input ({type(exc).__name__}: "
                    f"{first_line(exc)}); the traceback is in {log}")
                return 1
        except KeyboardInterrupt:
            say(interrupted_line(argv, state["out_dir"]))
            return 130


if __name__ == "__main__":
    import atexit
    import os

    # The process ends without the interpreter's teardown, after every exit handler has run (logging's flush,
    # weakref finalizers, multiprocessing's): handlers run last-registered first, and this one is registered
    # before anything else is imported. The teardown deallocates torch's, transformers' and sympy's objects module
    # by module: 1.1 s of every command here, after its last line was written (measured 2026-11-24).
    exit_code = [1]
    atexit.register(lambda: (sys.stdout.flush(), sys.stderr.flush(), os._exit(exit_code[0])))
    exit_code[0] = main()
    sys.exit(exit_code[0])
