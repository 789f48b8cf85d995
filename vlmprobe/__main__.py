"""`python -m vlmprobe [+sweep=NAME] [overrides]`: plan every point, run them, write the tables.

Exit codes: 0 the sweep ran (OOM points are results); 1 every point failed for a reason other than memory;
2 bad input (one line on stderr, before any heavy work).
"""

from __future__ import annotations

import sys
from pathlib import Path

CONF = Path(__file__).resolve().parent.parent / "conf"


def run(cfg, overrides: list[str], compose) -> int:
    import datetime

    from omegaconf import OmegaConf

    from vlmprobe import backends
    from vlmprobe.find import MaxBatchSearch
    from vlmprobe.grid import flatten_axes, flatten_cases
    from vlmprobe.plan import plan
    from vlmprobe.provenance import environment, write_env
    from vlmprobe.report import write_reports
    from vlmprobe.results import columns_for
    from vlmprobe.sweep import Runner, describe_backend, run_sweep

    base = OmegaConf.to_container(cfg, resolve=True)
    base.pop("hydra", None)
    backend, note = backends.resolve(base["measure"]["backend"])
    search = MaxBatchSearch(compose, overrides, base) if base["find"] else None
    planned = search.planned if search else plan(compose, overrides, base)
    if note:
        print(note, file=sys.stderr)
    axes = list(flatten_axes(base["sweep"]["axes"] or {}))
    cases = flatten_cases(base["sweep"].get("cases"))
    columns = columns_for(axes + sorted({k for case in cases for k in case}))
    if base["sweep"].get("cases"):
        axes = ["case", *axes]  # the report pivots on the case like on an axis
    if search:
        axes = ["data.batch_size", *axes]  # the probes vary the batch size like an axis
    if base["resume"]:
        out_dir = Path(base["resume"])
        check_resume(out_dir, base)
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out_dir = Path(base["results_dir"]) / base["sweep"]["name"] / stamp
        out_dir.mkdir(parents=True, exist_ok=False)
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create({k: v for k, v in base.items() if k != "resume"})))
    what = f"{len(planned)} configurations to bisect" if search else f"{len(planned)} points"
    print(f"vlmprobe: {what}, backend {backend}, results in {out_dir}", file=sys.stderr)
    env = {**environment(describe_backend(backend, planned[0].config), base), "overrides": overrides}
    env_path = out_dir / "env.json"
    if not env_path.exists():
        write_env(env_path, env)
    runner = Runner(out_dir, columns)
    try:
        if search:
            search.run(runner)
        else:
            run_sweep(planned, runner)
    finally:  # also on Ctrl-C: the CSV already holds every finished row; make the tables from them
        table = write_reports(out_dir, axes, env)
        if search:
            search.report(out_dir)
        print(f"vlmprobe: wrote {out_dir}/results.csv, results.parquet, summary.md ({len(table)} rows)", file=sys.stderr)
    failed = [s for s in runner.statuses if s not in ("ok", "oom", "skipped")]
    return 1 if runner.statuses and len(failed) == len(runner.statuses) else 0


def check_resume(out_dir: Path, base: dict) -> None:
    """A resumed dir must hold the same sweep, so that its rows and the new ones belong to one table."""
    from omegaconf import OmegaConf

    from vlmprobe.errors import ConfigError

    saved = out_dir / "config.yaml"
    if not saved.exists():
        raise ConfigError(f"resume={out_dir} is not allowed: it has no config.yaml (not a vlmprobe results dir)")
    before = OmegaConf.to_container(OmegaConf.load(saved), resolve=True)
    now = {k: v for k, v in base.items() if k not in ("resume",)}
    if before != now:
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        raise ConfigError(f"resume={out_dir} is not allowed: it was run with a different config "
                          f"(differs in: {', '.join(changed)}); run the same command with resume=DIR")


def check_group_choices(args: list[str]) -> None:
    """Name an unknown group option (model=..., +sweep=...) and the allowed ones, before Hydra's longer error."""
    from vlmprobe.errors import ConfigError

    for arg in args:
        key, sep, value = arg.partition("=")
        group = key.lstrip("+")
        if not sep or "." in group or not (CONF / group).is_dir():
            continue
        options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        if value not in options:
            raise ConfigError(f"{group}={value!r} is not allowed: use one of {', '.join(options)}")
        if group == "sweep" and not key.startswith("+"):
            raise ConfigError(f"{arg} is not allowed: a sweep is added to the config, write +sweep={value}")


def main() -> None:
    from vlmprobe.errors import ConfigError

    if not CONF.is_dir():
        print(f"vlmprobe: config directory {CONF} not found; install from a checkout with `pip install -e .`",
              file=sys.stderr)
        sys.exit(2)
    try:
        check_group_choices(sys.argv[1:])
    except ConfigError as exc:
        print(f"vlmprobe: {exc}", file=sys.stderr)
        sys.exit(2)
    import hydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
    def app(cfg) -> None:
        overrides = list(HydraConfig.get().overrides.task)
        try:
            code = run(cfg, overrides, lambda extra: hydra.compose(config_name="config", overrides=extra))
        except ConfigError as exc:
            print(f"vlmprobe: {exc}", file=sys.stderr)
            code = 2
        sys.exit(code)

    app()


if __name__ == "__main__":
    main()
