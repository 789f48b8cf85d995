"""The tables a person reads at the end of a sweep: results.parquet, summary.md and plot.png."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from vlmprobe.results import GiB, MiB, axis_column, mib, pivot, read_table

BACKEND_WORDS = {
    "cuda": "measured on a CUDA GPU (torch.cuda.max_memory_allocated)",
    "estimate": "ESTIMATES for a CUDA GPU from the real step on fake tensors (no GPU was used)",
    "cpu": "CPU proxy figures (live tensor bytes on the CPU), not GPU measurements",
}


def write_reports(out_dir: Path, axes: list[str], env: dict) -> pd.DataFrame:
    table = read_table(out_dir / "results.csv")
    table.to_parquet(out_dir / "results.parquet", index=False)
    (out_dir / "summary.md").write_text(summary_markdown(table, axes, env))
    if len(table):
        plot(table, axes, out_dir / "plot.png")
    return table


def summary_markdown(table: pd.DataFrame, axes: list[str], env: dict) -> str:
    backends = sorted(table["backend"].dropna().unique()) if len(table) else []
    sweep = table["sweep"].iloc[0] if len(table) else "?"
    lines = [f"# vlmprobe: {sweep}", ""]
    lines += [f"- backend `{b}`: {BACKEND_WORDS.get(b, b)}" for b in backends]
    lines += [
        f"- device: {env.get('device_name', '?')}; torch {env.get('torch')}, transformers {env.get('transformers')}; "
        f"commit {env.get('git_commit')}",
        "- units: MiB = 1024^2 bytes, GiB = 1024^3 bytes; the tables on disk (results.csv / .parquet) hold bytes.",
        "",
        "## Peak allocated memory over all steps (MiB)",
        "",
    ]
    if len(table):
        lines += [pivot(table, axes).to_markdown(), "", "## Every point", ""]
        cols = ["point_id", "backend", "status", "peak_allocated_bytes", "last_step_peak_allocated_bytes",
                "peak_reserved_bytes", "nvml_process_bytes", "peak_phase", "step_time_s"]
        shown = table[cols].copy()
        for c in cols:
            if c.endswith("_bytes"):
                shown[c] = shown[c].map(mib)
        shown.columns = [c.replace("_bytes", " MiB") for c in cols]
        lines += [shown.to_markdown(index=False), ""]
        failed = table[~table["status"].isin(["ok", "oom"])]
        if len(failed):
            lines += ["## Points that failed", ""]
            lines += [f"- `{r.point_id}`: {r.status}: {str(r.error).splitlines()[-1][:300]}" for r in failed.itertuples()]
            lines.append("")
    else:
        lines += ["(no rows)", ""]
    return "\n".join(lines)


def plot(table: pd.DataFrame, axes: list[str], path: Path, capacity_bytes: int | None = None,
         reference: pd.DataFrame | None = None) -> None:
    """Peak GiB against batch size (or the first axis), one line per combination of the other axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = "batch_size" if "data.batch_size" in axes or not axes else axis_column(axes[0])
    others = [axis_column(a) for a in axes if axis_column(a) != x]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = table.groupby(others, sort=False) if others else [((), table)]
    for key, group in groups:
        key = key if isinstance(key, tuple) else (key,)
        label = ", ".join(f"{k}={v}" for k, v in zip(others, key)) or "peak"
        ok = group[group["status"] == "ok"]
        line, = ax.plot(ok[x], ok["peak_allocated_bytes"].astype(float) / GiB, marker="o", label=label)
        oom = group[group["status"] == "oom"]
        if len(oom):
            ax.scatter(oom[x], [ax.get_ylim()[1]] * len(oom), marker="x", color=line.get_color(), s=60,
                       label=f"{label}: OOM")
    if reference is not None:
        for label, ref in reference.groupby("label", sort=False):
            ax.plot(ref[x], ref["peak_bytes"] / GiB, linestyle="--", marker=".", alpha=0.7, label=label)
    if capacity_bytes:
        ax.axhline(capacity_bytes / GiB, color="red", linestyle=":", label=f"{capacity_bytes / GiB:.0f} GiB capacity")
    backends = ", ".join(sorted(table["backend"].dropna().unique()))
    ax.set_xlabel(x)
    ax.set_ylabel("peak allocated (GiB, 1024^3 B)")
    ax.set_title(f"{table['sweep'].iloc[0]}: {table['model'].iloc[0]} [{backends}]")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
