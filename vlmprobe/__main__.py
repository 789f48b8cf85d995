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
    from vlmprobe.grid import flatten_axes, flatten_cases
    from vlmprobe.plan import plan
    from vlmprobe.provenance import environment, write_env
    from vlmprobe.report import write_reports
    from vlmprobe.results import columns_for
    from vlmprobe.sweep import Runner, describe_backend, run_sweep

    base = OmegaConf.to_container(cfg, resolve=True)
    base.pop("hydra", None)
    backend, note = backends.resolve(base["measure"]["backend"])
    search = MaxBatchSearch(compose, overrides, base, backend) if base["find"] else None
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
            search.run(runner, out_dir)
        else:
            run_sweep(planned, runner)
    finally:  # also on Ctrl-C: the CSV already holds every finished row; make the tables from them
        table = write_reports(out_dir, axes, env)
        if search:
            search.report(out_dir)
        print(f"vlmprobe: wrote {out_dir}/results.csv, results.parquet, summary.md ({len(table)} rows)", file=sys.stderr)
    failed = [s for s in runner.statuses if s not in ("ok", "oom", "skipped")]
    return 1 if runner.statuses and len(failed) == len(runner.statuses) else 0


class MaxBatchSearch:
    """+find=max_batch: the largest batch size that fits memory_budget, for every grid point (vlmprobe.find)."""

    def __init__(self, compose, overrides: list[str], base: dict, backend: str):
        from vlmprobe.errors import ConfigError
        from vlmprobe.grid import Point
        from vlmprobe.plan import grid_points, parse_bytes, plan_point

        self.budget = parse_bytes(base["memory_budget"], "memory_budget")
        if self.budget is None:
            raise ConfigError("memory_budget=null is not allowed with +find=max_batch: give bytes or a size like 24GiB")
        self.low, self.high = base["find"]["low"], base["find"]["high"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.low, self.high)) or not 1 <= self.low <= self.high:
            raise ConfigError(f"find.low={self.low!r}, find.high={self.high!r} are not allowed: give integers with 1 <= low <= high")
        self.points = grid_points(overrides, base)
        if any("data.batch_size" in p.values for p in self.points):
            raise ConfigError("data.batch_size is both swept and searched by +find=max_batch: drop the axis")
        self.overrides = [o for o in overrides if o.split("=", 1)[0] != "data.batch_size"]
        if backend != "cuda" and base["measure"]["device_memory"] is None:
            # the allocator model runs out of memory where a card of the budget's size would
            self.overrides.append(f"measure.device_memory={self.budget}")
        self.compose, self.plan_point, self.Point = compose, plan_point, Point
        self.planned = [self.probe_point(p, self.low) for p in self.points]  # validates every configuration
        self.found: list[dict] = []

    def probe_point(self, point, batch_size: int):
        values = {**point.values, "data.batch_size": batch_size}
        return self.plan_point(self.compose, self.overrides, self.Point(point.index, values, point.case))

    def run(self, runner, out_dir: Path) -> None:
        from tqdm import tqdm

        from vlmprobe.find import largest_fitting

        for point in tqdm(self.points, desc="configurations", unit="config", dynamic_ncols=True):
            probes = []

            def probe(batch_size: int) -> dict:
                probes.append(batch_size)
                return runner.run(self.probe_point(point, batch_size))

            best = largest_fitting(probe, self.low, self.high, self.budget)
            self.found.append({"configuration": point.id, "largest_batch_size": best, "memory_budget_bytes": self.budget,
                               "probes": len(probes), "probed": " ".join(map(str, probes))})

    def report(self, out_dir: Path) -> None:
        import pandas as pd

        from vlmprobe.results import GiB, MiB

        table = pd.DataFrame(self.found, columns=["configuration", "largest_batch_size", "memory_budget_bytes",
                                                  "probes", "probed"])
        table.to_csv(out_dir / "max_batch.csv", index=False)
        shown = table.drop(columns="memory_budget_bytes").fillna({"largest_batch_size": "none fits"})
        budget = f"{self.budget / GiB:.2f} GiB" if self.budget >= GiB else f"{self.budget / MiB:.1f} MiB"
        section = (f"\n## Largest batch size that fits {budget} (1 GiB = 1024^3 bytes, 1 MiB = 1024^2 bytes)\n\n"
                   f"Bisected over [{self.low}, {self.high}]; every probe is a row above. A probe fits when it ends `ok`\n"
                   f"with its peak (reserved where measured, else allocated) within the budget.\n\n"
                   f"{shown.to_markdown(index=False)}\n")
        with (out_dir / "summary.md").open("a") as f:
            f.write(section)
        print(section, file=sys.stderr)


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
