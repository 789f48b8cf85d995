"""The tables a person reads at the end of a sweep: results.parquet, summary.md, plot.png, timeline.png and steps.png.

steps.png draws steps.csv (points that ran a dataset's steps, data.source: vlmprobe.point.dataset_steps): the peak
allocated and reserved of each step (the highest of its micro batches; with several ranks each rank's allocated
line and the highest reserved), the capacity the point ran against as a line, an out-of-memory step marked; one
panel per point, the first six.

timeline.png draws what timeline.jsonl keeps (estimate and cpu points; cuda keeps none): allocated and reserved
over one point's run, each sample the maximum of its bucket of allocations, so no peak is lost
(vlmprobe.estimate.allocator.Timeline), its phases shaded; one panel per point, the largest six by peak.

A sweep the published nanoVLM issue #103 table speaks to (vlmprobe.results.published.matches) also gets our figures
beside the published ones, the finding as numbers, and the RTX 3090's capacity on the plot.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from vlmprobe.errors import WriteError, first_line, log_internal_error
from vlmprobe.results import finding, html_report, published
from vlmprobe.results.answer import breakdown, card_name, records
from vlmprobe.results.table import axis_column, mib, pivot, read_table, read_timelines, replacing, value_text
from vlmprobe.sizes import GiB
from vlmprobe.states import Status

__all__ = ["host_memory", "NO_CARD", "on_the_card", "out_of_memory", "plot", "pyplot", "summary_markdown",
           "steps_plot", "STEPS_FILE", "timeline_plot", "write_reports"]

BACKEND_WORDS = {
    "cuda": "measured on a CUDA GPU (torch.cuda.max_memory_allocated)",
    "estimate": "ESTIMATES for a CUDA GPU from the real step on fake tensors (no GPU was used)",
    "cpu": "CPU proxy figures (live tensor bytes on the CPU), not GPU measurements",
}
STEPS_FILE = "steps.csv"  # vlmprobe.point.dataset_steps writes it beside results.csv
RANKS_NAMED = 8  # steps.png names each rank's line up to this many ranks
BACKEND_TITLES = {"cuda": "measured on CUDA", "estimate": "ESTIMATE (no GPU)", "cpu": "CPU proxy (not GPU)"}


def write_reports(out_dir: Path, axes: list[str], env: dict) -> tuple[pd.DataFrame, list[str]]:
    """Every table the rows allow: (the table, one line per file that could not be written). A file that
    fails does not stop the others; its traceback goes to the results dir's error log."""
    table = read_table(out_dir / "results.csv")
    shown = labelled(table, [axis_column(a) for a in axes])  # what the tables and the plot show
    failures: list[str] = []

    def attempt(name: str, make, default=None):
        try:
            return make()
        except WriteError as exc:  # not vlmprobe's fault (a full disk): its line names the file, no traceback
            failures.append(str(exc))
            return default
        except Exception as exc:  # a report is never worth the rows: say so in one line, keep the rest
            log = log_internal_error(exc, out_dir)
            failures.append(f"{name} could not be written ({type(exc).__name__}: {first_line(exc)}); "
                            f"traceback in {log}")
            return default

    attempt("results.parquet", lambda: write_parquet(table, out_dir / "results.parquet"))
    columns = [axis_column(a) for a in axes]
    matched = attempt("the comparison with the published figures", lambda: published.matches(table, columns), False)
    beside = attempt("the comparison with the published figures",
                     lambda: published_markdown(out_dir, table), "") if matched else ""
    attempt("summary.md", lambda: write_text(out_dir / "summary.md", summary_markdown(shown, axes, env, beside)))
    attempt("report.html", lambda: html_report.write_report_html(out_dir, shown, axes, env))
    if len(table):
        overlay = dict(capacity_bytes=published.DEVICE_BYTES, capacity_label=f"{published.DEVICE} capacity",
                       reference=published.load(), reference_label=f"published ({published.DEVICE})")
        attempt("plot.png", lambda: plot(shown, axes, out_dir / "plot.png", **(overlay if matched else card(table))))
        timelines = attempt("timeline.jsonl", lambda: read_timelines(out_dir), {})
        if timelines:
            attempt("timeline.png", lambda: timeline_plot(table, timelines, out_dir / "timeline.png"))
        if (out_dir / STEPS_FILE).is_file():
            attempt("steps.png", lambda: steps_plot(table, pd.read_csv(out_dir / STEPS_FILE), out_dir / "steps.png"))
    return table, failures


def write_parquet(table: pd.DataFrame, path: Path) -> None:
    """The typed table; if pyarrow cannot type a column (numbers and names in one swept column), the
    columns of mixed cells are written as text rather than losing the file."""
    with replacing(path) as partial:
        try:
            table.to_parquet(partial, index=False)
        except (TypeError, ValueError):  # pyarrow's ArrowTypeError / ArrowInvalid
            mixed = {c: table[c].map(lambda v: None if pd.isna(v) else str(v)) for c in table.columns
                     if table[c].dtype == object}
            table.assign(**mixed).to_parquet(partial, index=False)


def write_text(path: Path, text: str) -> None:
    """A text file written whole or not at all (`replacing`)."""
    with replacing(path) as partial:
        partial.write_text(text)


def cell_text(value) -> str:
    """A swept value as a label: null for a missing one, 8 rather than 8.0 for a whole number."""
    if isinstance(value, (list, tuple, dict)):  # pd.isna of a list is a list, not a bool
        return str(value)
    return value_text(value, "null")


def labelled(table: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """The table with every swept column that holds a null or a non-number turned into text labels, so
    that tables and plots group, pivot and label every point (pandas drops NaN keys and keeps NaN through
    astype(str))."""
    shown = table.copy()
    for column in dict.fromkeys(columns):
        if column in shown and (shown[column].isna().any() or not pd.api.types.is_numeric_dtype(shown[column])):
            shown[column] = shown[column].map(cell_text).astype(object)
    return shown


def summary_markdown(table: pd.DataFrame, axes: list[str], env: dict, beside: str = "") -> str:
    """`beside`: markdown sections put right after the peak table (the published figures, when they apply)."""
    backends = sorted(table["backend"].dropna().unique()) if len(table) else []
    sweep = table["sweep"].iloc[0] if len(table) else "?"
    lines = [f"# vlmprobe: {sweep}", ""]
    lines += [f"- backend `{b}`: {BACKEND_WORDS.get(b, b)}" for b in backends]
    cards = sorted(table["device"].dropna().unique()) if "device" in table else []
    if cards:
        lines.append(f"- target card (`device=`, conf/device/): {', '.join(map(str, cards))}")
    if no_card_estimated(table):
        lines.append(NO_CARD)
    lines += [
        f"- device: {env.get('device_name', '?')}; torch {env.get('torch')}, transformers {env.get('transformers')}; "
        f"commit {env.get('git_commit')}",
        "- units: MiB = 1024^2 bytes, GiB = 1024^3 bytes; the tables on disk (results.csv / .parquet) hold bytes.",
        "",
        "## Peak allocated memory over all steps (MiB)",
        "",
    ]
    if len(table):
        lines += [pivot(table, axes).to_markdown(), "", *([beside] if beside else []), "## Every point", ""]
        cols = ["point_id", "backend", "status", "peak_allocated_bytes", "last_step_peak_allocated_bytes",
                "peak_reserved_bytes", "nvml_process_bytes", "predicted_device_bytes", "peak_phase", "step_time_s"]
        cols = [c for c in cols if c in table]  # results written before a column existed lack it
        shown = table[cols].copy()
        for c in cols:
            if c.endswith("_bytes"):
                shown[c] = shown[c].map(mib)
        shown.columns = [c.replace("_bytes", " MiB") for c in cols]
        lines += [shown.to_markdown(index=False), ""]
        lines += on_the_card(table)
        lines += rank_spread(table)
        lines += host_memory(table)
        lines += out_of_memory(table)
        failed = table[~table["status"].isin([Status.OK, Status.OOM])]
        if len(failed):
            lines += ["## Points that failed", ""]
            lines += [f"- `{r.point_id}`: {r.status}: {last_line(r.error)[:300]}" for r in failed.itertuples()]
            lines.append("")
    else:
        lines += ["(no rows)", ""]
    return "\n".join(lines)


NO_CARD = ("- no target card (`device=none`) on the estimated points: their figures leave out what a card adds on "
           "CUDA, its two cuBLAS workspaces (2 x 8.1 MiB below Hopper, 2 x 32 MiB on Hopper) and the CUDA context; "
           "name one with `device=` (conf/device/)")


def no_card_estimated(table: pd.DataFrame) -> bool:
    """Whether some estimate or cpu row was made for no card in particular."""
    if not len(table) or "device" not in table:
        return False
    return bool(table.loc[table["backend"].isin(["estimate", "cpu"]), "device"].isna().any())


def on_the_card(table: pd.DataFrame) -> list[str]:
    """The points with predicted_device_bytes (estimated points with a device profile): what the card
    would show in use at the peak, against the capacity the point ran with."""
    if "predicted_device_bytes" not in table or not table["predicted_device_bytes"].notna().any():
        return []
    rows = table[table["predicted_device_bytes"].notna()]
    capacity = rows["imposed_capacity_bytes"].astype("Float64")
    shown = pd.DataFrame({
        "point_id": rows["point_id"], "device": rows["device"],
        "peak allocated MiB": rows["peak_allocated_bytes"].map(mib),
        "predicted on the card MiB": rows["predicted_device_bytes"].map(mib),
        "predicted GiB": rows["predicted_device_bytes"].map(gib),
        "capacity GiB": capacity.map(gib),
        "left GiB": (capacity - rows["predicted_device_bytes"].astype("Float64")).map(gib)})
    return ["## On the card (predicted_device_bytes)", "",
            "What the card would show in use at the peak (nvidia-smi's figure for the process): the allocator "
            "model's peak reserved bytes (the card's two cuBLAS workspaces among its blocks) + the profile's CUDA context, "
            "or where the profile has none the 760 MiB measured on an H100 and an H200, as the row's notes say "
            "(vlmprobe/gpu/device_profile.py). Capacity: the memory the point ran against (the card's total memory "
            "as CUDA reports it, or measure.device_memory); a negative `left` does not fit.", "",
            shown.to_markdown(index=False, disable_numparse=True), ""]


def gib(value) -> str:
    return "" if pd.isna(value) else f"{value / GiB:,.2f}"


def rank_spread(table: pd.DataFrame) -> list[str]:
    """The points whose ranks do not all peak alike: max and min rank peaks (ranks.csv has every rank)."""
    if "rank_imbalance" not in table:
        return []
    uneven = table[table["rank_imbalance"].astype(float).fillna(1.0) != 1.0]
    if not len(uneven):
        return []
    shown = pd.DataFrame({
        "point_id": uneven["point_id"], "world_size": uneven["world_size"], "max_rank": uneven["max_rank"],
        "max rank peak MiB": uneven["peak_allocated_bytes"].map(mib),
        "min rank peak MiB": uneven["min_rank_peak_allocated_bytes"].map(mib),
        "max / min": uneven["rank_imbalance"]})
    return ["## Per-rank spread (points whose ranks differ; every rank in ranks.csv)", "",
            shown.to_markdown(index=False), ""]


def host_memory(table: pd.DataFrame) -> list[str]:
    """The points that offload to the CPU on estimate/cpu: the host memory of one rank, outside every device
    figure (a node holds dist.ranks_per_node such ranks)."""
    if "peak_host_bytes" not in table or not table["peak_host_bytes"].notna().any():
        return []
    rows = table[table["peak_host_bytes"].notna()]
    shown = pd.DataFrame({"point_id": rows["point_id"], "peak device GiB": rows["peak_allocated_bytes"].map(gib),
                          "peak host GiB": rows["peak_host_bytes"].map(gib),
                          "host after a step GiB": rows["after_step_host_bytes"].map(gib)})
    return ["## Host memory per rank (offload to the CPU)", "",
            "What one rank keeps in host memory (offloaded partitions, optimizer state, pinned buffers): outside "
            "every device column; a node holds dist.ranks_per_node such ranks.", "",
            shown.to_markdown(index=False, disable_numparse=True), ""]


def out_of_memory(table: pd.DataFrame) -> list[str]:
    """The points that ran out of memory: where, what it asked for, and what filled the memory then (oom_filled,
    estimate and cpu rows)."""
    if "oom_filled" not in table:
        return []
    rows = table[(table["status"] == Status.OOM) & table["oom_filled"].notna()]
    if not len(rows):
        return []
    shown = pd.DataFrame({"point_id": rows["point_id"], "ran out in": rows["peak_phase"],
                          "asked MiB": rows["oom_block_bytes"].map(mib),
                          "allocated MiB": rows["peak_allocated_bytes"].map(mib),
                          "largest live groups (module, kind, dtype)": rows["oom_filled"]})
    return ["## What filled the memory when a point ran out", "",
            "The blocks live when the allocator could not serve the request, grouped by the module that made them "
            "(its forward or backward running), their kind (weights, gradients and optimizer state by what holds "
            "them; activations by the phase that made them) and dtype; the five largest "
            "(vlmprobe/estimate/tracker.py, Attribution).", "",
            shown.to_markdown(index=False, disable_numparse=True), ""]


def last_line(error) -> str:
    """The last line of a failed row's error text (a traceback ends with the exception), or '' for none."""
    lines = [] if error is None or (not isinstance(error, str) and pd.isna(error)) else str(error).strip().splitlines()
    return lines[-1] if lines else ""


def published_markdown(out_dir: Path, table: pd.DataFrame) -> str:
    """Our figures beside nanoVLM issue #103's, and the finding as numbers for both."""
    side = published.side_by_side(table)
    backends = ", ".join(sorted(table["backend"].dropna().unique()))
    ours, theirs = finding.finding(side, "ours"), finding.finding(side, "published")
    short, long, cap = finding.SHORT, finding.LONG, published.DEVICE_BYTES

    def number(value, fmt="{:,.1f}"):
        return "-" if value is None else fmt.format(value)

    def fits(f: finding.Finding, length: int) -> str:
        text = ", ".join(map(str, f.fits[length])) or "none"
        return text + (f" ({', '.join(map(str, f.no_figure[length]))}: no figure)" if f.no_figure[length] else "")

    rows = [
        (f"batch-1 peak at {short} / {long} (MiB)", *(f"{number(f.batch1[short])} / {number(f.batch1[long])}"
                                                    for f in (ours, theirs))),
        *((f"MiB per sample, batch {finding.SLOPE_FROM} -> {finding.SLOPE_TO}, length {n}",
           number(ours.slope[n]), number(theirs.slope[n])) for n in (long, short)),
        (f"slope ratio {long} / {short}", number(ours.slope_ratio, "{:.2f}"), number(theirs.slope_ratio, "{:.2f}")),
        *((f"batch sizes that fit the {published.DEVICE}, length {n}", fits(ours, n), fits(theirs, n))
          for n in (long, short)),
    ]
    figures = pd.DataFrame(rows, columns=["", f"ours ({backends})", f"published ({published.DEVICE})"])
    return "\n".join([
        f"## Against the published figures (nanoVLM issue #103, {published.DEVICE}, measured)",
        "",
        f"Ours (backend {backends}): {'; '.join(BACKEND_WORDS.get(b, b) for b in backends.split(', '))}. "
        "Published: torch.cuda.max_memory_allocated() / 1024**2 (\"MB\" = MiB) from nanoVLM's measure_vram.py. "
        "Ratio = ours / published.",
        "",
        finding.table_text(side, backends),
        "",
        "## The finding, as numbers",
        "",
        figures.to_markdown(index=False, disable_numparse=True),
        "",
        f"Fit = peak allocated at most {cap:,} B = {cap / GiB:.2f} GiB, the {published.DEVICE}'s total memory as "
        "CUDA reports it (the card's nominal 24 GB is 24 GiB = 24,576 MiB; 24e9 B would be lower still). The "
        "CUDA context and allocator fragmentation take a few hundred MiB outside this figure, so a point just "
        "under the line may still run out of memory on the card.",
        "",
        f"Test the finding: `python -m vlmprobe.results.finding {out_dir}`",
        "",
    ])


def pyplot():
    """matplotlib's pyplot on the Agg backend (files, no display), the backend's module imported too (pyplot
    would at its first figure). The first call is ~1 s here: a sweep process that only waits on its workers
    or on a forked child makes it while they run (vlmprobe.run.launchers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.pyplot as plt

    return plt


def card(table: pd.DataFrame) -> dict:
    """The capacity line the rows ran against, where they share one (plot's capacity arguments); none otherwise."""
    capacities = table["imposed_capacity_bytes"].dropna().unique() if "imposed_capacity_bytes" in table else []
    if len(capacities) != 1:
        return {}
    names = {card_name(row) for row in records(table)} - {None}
    return {"capacity_bytes": int(capacities[0]),
            "capacity_label": f"{names.pop()} capacity" if len(names) == 1 else "capacity"}


def plot(table: pd.DataFrame, axes: list[str], path: Path, capacity_bytes: int | None = None,
         reference: pd.DataFrame | None = None, capacity_label: str = "capacity",
         reference_label: str = "reference") -> None:
    """Peak GiB against batch size (or the first axis), one solid line per combination of the other axes.

    `reference` (rows with the same axis columns, `status` and `peak_bytes`) is drawn dashed in the colour of
    our line for the same combination. Points without a figure (OOM) are crosses in a band above the data,
    since they have no height of their own.
    """
    plt = pyplot()

    if not axes and len(table) == 1:  # one point: its breakdown against the card
        return bar_plot(table, ["point_id"], path, capacity_bytes, capacity_label)
    x = "batch_size" if "data.batch_size" in axes or not axes else axis_column(axes[0])
    if "dist.world_size" in axes and x != "batch_size":  # per-GPU memory against the number of GPUs
        x = "world_size"
    others = [axis_column(a) for a in axes if axis_column(a) != x]
    if not pd.api.types.is_numeric_dtype(table[x]):  # cases, optimizers, ...: no line between them
        return bar_plot(table, [x, *others], path, capacity_bytes, capacity_label)
    fig, ax = plt.subplots(figsize=(8, 5))
    ours = "ours " if reference is not None else ""  # only needed to tell the two sides apart
    sides = [(table, "peak_allocated_bytes", "-", "o", "X", ours)]
    if reference is not None:
        sides.append((reference, "peak_bytes", "--", "s", "x", f"{reference_label} "))
    colours, ooms, heights = {}, [], [capacity_bytes / GiB] if capacity_bytes else []
    for frame, value, style, marker, oom_marker, prefix in sides:
        groups = frame.groupby(others, sort=False, dropna=False) if others else [((), frame)]
        for key, group in groups:
            key = key if isinstance(key, tuple) else (key,)
            name = ", ".join(f"{k}={v}" for k, v in zip(others, key)) or "peak"
            if key not in colours:  # the reference takes the colour of our line of the same combination
                colours[key] = f"C{len(colours)}"
            ok = group[group["status"] == Status.OK].sort_values(x)
            gib = ok[value].astype(float) / GiB
            ax.plot(ok[x], gib, linestyle=style, marker=marker, color=colours[key], label=f"{prefix}{name}")
            heights += list(gib)
            oom = group[group["status"] == Status.OOM]
            if len(oom):
                ooms.append((oom[x], oom_marker, colours[key], f"{prefix}{name}: OOM"))
    top = max(heights, default=1.0) * 1.08
    step = top * 0.05  # one row per OOM series above the data, so crosses at the same x do not hide each other
    for row, (xs, oom_marker, colour, label) in enumerate(ooms):
        ax.scatter(xs, [top + row * step] * len(xs), marker=oom_marker, color=colour, s=80, zorder=3, label=label)
    for x_value in sorted({v for xs, *_ in ooms for v in xs}):
        ax.annotate("OOM", (x_value, top), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    top += max(len(ooms) - 1, 0) * step
    if capacity_bytes:
        ax.axhline(capacity_bytes / GiB, color="red", linestyle=":",
                   label=f"{capacity_label}: {capacity_bytes / GiB:.2f} GiB ({capacity_bytes:,} B)")
    ax.set_ylim(0, top * 1.04)
    if pd.api.types.is_numeric_dtype(table[x]):  # ticks at the swept values, not matplotlib's round numbers
        ax.set_xticks(sorted(set(pd.concat([frame[x] for frame, *_ in sides]).dropna())))
    ax.set_xlabel({"batch_size": "batch size (samples per step)", "world_size": "world size (GPUs)"}.get(x, x))
    ax.set_ylabel("peak allocated memory" + (" per GPU, max over ranks" if x == "world_size" else "")
                  + " (GiB = 1024^3 B)")
    backends = ", ".join(BACKEND_TITLES.get(b, b) for b in sorted(table["backend"].dropna().unique()))
    ax.set_title(f"{table['sweep'].iloc[0]}: {table['model'].iloc[0]}, {backends}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    with replacing(path) as partial:
        fig.savefig(partial, dpi=120)
    plt.close(fig)


PHASE_COLOURS = {"load": "0.85", "generate": "C4", "reference": "C5", "forward": "C2", "backward": "C3",
                 "optimizer": "C1"}
TIMELINE_PANELS = 6


def timeline_plot(table: pd.DataFrame, timelines: dict[str, dict], path: Path) -> None:
    """Allocated and reserved over each point's run (timelines: point_id -> vlmprobe.estimate.allocator.Timeline
    .data), one panel per point, the TIMELINE_PANELS largest by their highest allocated; phases shaded; the
    capacity the point ran against as a line where it is on the panel's scale, else in its title."""
    plt = pyplot()

    rows = {row["point_id"]: row for row in records(table)}
    chosen = sorted((p for p in timelines if p in rows and timelines[p].get("allocated")),
                    key=lambda p: -max(timelines[p]["allocated"]))[:TIMELINE_PANELS]
    if not chosen:
        return
    fig, axes = plt.subplots(len(chosen), 1, figsize=(9, 2.6 * len(chosen) + 0.6), squeeze=False)
    for ax, point_id in zip(axes[:, 0], chosen):
        data, row = timelines[point_id], rows[point_id]
        top = max(max(data["reserved"]), max(data["allocated"]))
        unit, scale = panel_unit(top)
        end = data["allocations"]
        shaded = set()
        for name, first, last in data["phases"]:
            label = name if name not in shaded else None
            shaded.add(name)
            ax.axvspan(first, end if last is None else last, color=PHASE_COLOURS.get(name, "0.7"), alpha=0.15,
                       lw=0, label=label)
        x = [*data["x"], end]
        for key, colour in (("reserved", "C0"), ("allocated", "k")):
            values = [v / scale for v in data[key]]
            ax.step(x, [*values, values[-1]], where="post", color=colour, lw=1, label=key)
        ax.set_xlim(0, max(end, 1))
        finish_panel(ax, row, f"{point_id}: {row['status']}", top, scale, unit)
    save_panels(plt, fig, axes, table, "allocations so far (each sample the highest of its bucket of allocations)",
                "allocated and reserved over a point's run", path)


def steps_plot(table: pd.DataFrame, steps: pd.DataFrame, path: Path) -> None:
    """Peak allocated and reserved per step of each point in `steps` (steps.csv's rows; the last rows of a point
    run again on resume win), the capacity it ran against as a line, an `oom` step marked (module docstring)."""
    plt = pyplot()

    rows = {row["point_id"]: row for row in records(table)}
    chosen = [p for p in dict.fromkeys(steps["point_id"]) if p in rows][:TIMELINE_PANELS]
    if not chosen:
        return
    fig, axes = plt.subplots(len(chosen), 1, figsize=(9, 2.6 * len(chosen) + 0.6), squeeze=False)
    for ax, point_id in zip(axes[:, 0], chosen):
        mine = steps[steps["point_id"] == point_id].drop_duplicates(["step", "micro", "rank"], keep="last")
        per_step = mine.groupby("step").agg(allocated=("peak_allocated_bytes", "max"),
                                            reserved=("peak_reserved_bytes", "max"),
                                            oom=("status", lambda s: (s == Status.OOM).any()))
        row = rows[point_id]
        top = max(per_step["reserved"].max(), per_step["allocated"].max())
        unit, scale = panel_unit(top)
        ranks = sorted(mine["rank"].unique())
        if len(ranks) == 1:
            ax.plot(per_step.index, per_step["reserved"] / scale, marker="o", color="C0", lw=1, label="peak reserved")
            ax.plot(per_step.index, per_step["allocated"] / scale, marker="o", color="k", lw=1, label="peak allocated")
        else:  # each rank its own allocated line; reserved: the highest rank's
            ax.plot(per_step.index, per_step["reserved"] / scale, marker="o", color="C0", lw=1,
                    label="peak reserved (highest rank)")
            for i, rank in enumerate(ranks):
                own = mine[mine["rank"] == rank].groupby("step")["peak_allocated_bytes"].max()
                label = f"rank {rank} allocated" if len(ranks) <= RANKS_NAMED else \
                    ("each rank's peak allocated" if i == 0 else None)
                ax.plot(own.index, own / scale, marker=".", lw=0.8, color=f"C{1 + i % 9}", label=label)
        for step in per_step.index[per_step["oom"]]:
            ax.axvline(step, color="C3", lw=1, alpha=0.6, label=f"out of memory (step {step})")
        ax.set_xticks(list(per_step.index))
        finish_panel(ax, row, f"{point_id}: {row['status']}", top, scale, unit)
    save_panels(plt, fig, axes, table, "optimizer step (each point the highest of its micro batches)",
                "a dataset's steps", path)


def panel_unit(top: float) -> tuple[str, int]:
    """A memory panel's unit: GiB from 1 GiB, MiB below."""
    return ("GiB", GiB) if top >= GiB else ("MiB", 2**20)


def finish_panel(ax, row: dict, title: str, top: float, scale: int, unit: str) -> None:
    """A memory panel's capacity (the row's imposed_capacity_bytes: a line where it is within twice the panel's
    top, else said in the title), title, scale with room for the legend, labels and grid."""
    capacity = row.get("imposed_capacity_bytes")
    if capacity is not None and not pd.isna(capacity):
        name = card_name(row)
        if capacity <= 2 * top:
            ax.axhline(capacity / scale, color="red", linestyle=":", label=f"{name or 'capacity'}: "
                       f"{capacity / scale:,.2f} {unit}")
            top = max(top, capacity)
        else:
            title += f" (capacity {capacity / GiB:,.2f} GiB{' of the ' + name if name else ''}, off the scale)"
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, top / scale * 1.3)  # room for the legend above the curves
    ax.set_ylabel(f"{unit} (1024-based)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=4)


def save_panels(plt, fig, axes, table: pd.DataFrame, xlabel: str, what: str, path: Path) -> None:
    """The panels' x label and the figure's title (the sweep, `what`, the backends), written to `path`."""
    axes[-1, 0].set_xlabel(xlabel)
    backends = ", ".join(BACKEND_TITLES.get(b, b) for b in sorted(table["backend"].dropna().unique()))
    fig.suptitle(f"{table['sweep'].iloc[0]}: {what}, {backends}", fontsize=10)
    fig.tight_layout()
    with replacing(path) as partial:
        fig.savefig(partial, dpi=110)
    plt.close(fig)


def bar_plot(table: pd.DataFrame, columns: list[str], path: Path, capacity_bytes: int | None,
             capacity_label: str) -> None:
    """Peak GiB as one horizontal bar per point, in sweep order, for axes whose values are names (sweep
    cases, optimizers); a point without a figure shows its status where its bar would be."""
    plt = pyplot()

    labels = [", ".join(cell_text(v) for v in row) for row in table[columns].itertuples(index=False)]
    gib = [float(v) / GiB if s == Status.OK else 0.0 for v, s in zip(table["peak_allocated_bytes"], table["status"])]
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.38 * len(labels)))
    rows = range(len(labels))
    parts = [breakdown(row) if row["status"] == Status.OK else {} for row in records(table)]
    if all(p and None not in p.values() for p in parts):  # stacked: weights, gradients, optimizer state, the rest
        left = [0.0] * len(labels)
        for i, name in enumerate(parts[0]):
            widths = [p[name] / GiB for p in parts]
            ax.barh(rows, widths, left=left, color=("C0", "C1", "C2", "C7")[i], label=name)
            left = [a + b for a, b in zip(left, widths)]
    else:
        ax.barh(rows, gib, color="C0")
    for row, (value, status) in enumerate(zip(gib, table["status"])):
        ax.annotate(f"{value:,.2f}" if status == Status.OK else status.upper(), (value, row), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=8)
    if capacity_bytes:
        ax.axvline(capacity_bytes / GiB, color="red", linestyle=":", label=f"{capacity_label}: {capacity_bytes / GiB:.2f} GiB")
    if capacity_bytes or ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_yticks(list(rows), labels, fontsize=8)
    ax.invert_yaxis()  # first point on top, as in the tables
    ax.set_xlabel("peak allocated memory (GiB = 1024^3 B)")
    backends = ", ".join(BACKEND_TITLES.get(b, b) for b in sorted(table["backend"].dropna().unique()))
    ax.set_title(f"{table['sweep'].iloc[0]}: {table['model'].iloc[0]}, {backends}")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    with replacing(path) as partial:
        fig.savefig(partial, dpi=120)
    plt.close(fig)
