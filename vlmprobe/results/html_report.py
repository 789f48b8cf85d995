"""report.html: the results dir as one self-contained page, its charts drawn here as inline SVG.

The rule: everything the page shows is in the file (no server, no network, no JS library): the charts are SVG
written by this module, and a few lines of hand-written JS add hover values, series toggled from the legend and
a sortable table. Charts: peak allocated against each swept axis (one line per combination of the other axes,
out-of-memory points as crosses above the data, the card's capacity drawn where the rows share one), the
breakdown of each point's peak (weights, gradients, optimizer state, the rest, as vlmprobe.results.answer splits
it), the same per rank where ranks.csv exists, and memory over the step where the results dir keeps a timeline
(the TIMELINES largest points). Sizes are 1024-based (MiB = 2^20 B, GiB = 2^30 B); every figure carries its
row's backend (estimate or measurement).
Known limits: a non-numeric axis (cases, optimizers) is drawn as evenly spaced categories; a timeline is read from
timeline.jsonl (the estimate's allocator model, vlmprobe/estimate/allocator.py Timeline.data) or timeline.json
({point_id: {"samples": [[t, allocated, reserved], ...], "phases": [...]}}), and skipped when absent or unreadable.
SVG text follows the SVG 1.1 spec; the browser-side parts use only DOM APIs every current browser has.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

import pandas as pd

from vlmprobe.results.answer import breakdown, card_name, records, shown
from vlmprobe.results.table import axis_column, read_timelines, replacing
from vlmprobe.sizes import GiB, MiB
from vlmprobe.states import Status

__all__ = ["as_samples", "breakdown_svg", "capacity_of", "line_chart_svg", "load_ranks", "load_timelines",
           "report_html", "timeline_svg", "write_report_html"]

BACKEND_LABELS = {"cuda": "measured on a CUDA GPU", "estimate": "ESTIMATE for a CUDA GPU (no GPU was used)",
                  "cpu": "CPU proxy figures, not GPU measurements"}
PART_COLOURS = {"weights": "#4e79a7", "gradients": "#f28e2b", "optimizer state": "#59a14f", "rest": "#9c9c9c"}
SERIES_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                  "#bcbd22", "#17becf"]
WIDTH, HEIGHT = 760, 380
TIMELINES = 6  # points whose timeline is drawn: the largest peaks (a 100-point sweep's page stays small)
MAX_TIMELINE_SAMPLES = 200  # per point: enough for the shape of a step, and the file stays small


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def number(value) -> float | None:
    """A figure as float, None for a missing one (None, NaN, pandas' NA, text)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(out) or math.isinf(out) else out


def unit_for(largest: float | None) -> tuple[str, int]:
    """GiB from 1 GiB, MiB below it (a tiny model's figures are not 0.00 GiB)."""
    return ("GiB", GiB) if largest is not None and largest >= GiB else ("MiB", MiB)


def size_text(value, unit: tuple[str, int]) -> str:
    value = number(value)
    return "-" if value is None else f"{value / unit[1]:,.2f} {unit[0]}"


def nice_top(value: float) -> tuple[float, float]:
    """(an axis top at or above `value`, its tick step): 1, 2 or 5 times a power of ten, about five ticks."""
    if value <= 0:
        return 1.0, 0.2
    raw = value / 5
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return step * math.ceil(value / step - 1e-9), step


def label_of(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "null" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def backend_of(row: dict) -> str:
    return str(row.get("backend") or "?")


def capacity_of(rows: list[dict]) -> tuple[int | None, str]:
    """The capacity the rows ran against where they share one, with the card's name; (None, "") otherwise."""
    capacities = {int(v) for r in rows if (v := number(r.get("imposed_capacity_bytes"))) is not None}
    if len(capacities) != 1:
        return None, ""
    names = {card_name({"device": d}) for d in {r.get("device") for r in rows}} - {None}  # a profile read per card
    return capacities.pop(), (f"{names.pop()} capacity" if len(names) == 1 else "capacity")


def on_the_scale(capacity: float, data_top: float) -> bool:
    """Whether the capacity shares the chart's scale with the data: not where it would squash them into a sliver
    (a tiny model against an 80 GiB card); the capacity is then written at the chart's edge instead."""
    return data_top <= 0 or capacity <= 3 * data_top


def off_scale(label: str, x: float, y: float) -> str:
    return (f'<text class="capacity off-scale" x="{x:.1f}" y="{y:.1f}" text-anchor="end" fill="#d00" '
            f'data-tip="{esc(label)}">{esc(label)}</text>')


def capacity_mark(body: list[str], cap_bytes: int, cap_label: str, on_scale: bool, line: tuple, far: str,
                  at: tuple) -> tuple[str, str, str]:
    """The card's capacity on a chart: a dashed line from (x1, x2, y1, y2) `line` where it is on the scale, else its
    label at `at` saying how `far` it is; its legend item."""
    label = f"{cap_label}: {size_text(cap_bytes, unit_for(cap_bytes))}"
    if on_scale:
        x1, x2, y1, y2 = line
        body.append(f'<line class="capacity" x1="{x1:.1f}" x2="{x2:.1f}" y1="{y1:.1f}" y2="{y2:.1f}" '
                    f'stroke="#d00" stroke-dasharray="6 4" stroke-width="1.5" data-tip="{esc(label)}"/>')
    else:
        label += f" ({far})"
        body.append(off_scale(label, *at))
    return label, "#d00", ""


def short(label: str, limit: int = 34) -> str:
    return label if len(label) <= limit else label[:limit - 1] + "\u2026"


def frame(title: str, x_label: str, y_label: str, body: list[str], legend: list[str], height: int = HEIGHT,
          css_class: str = "chart") -> str:
    return "\n".join([
        f'<svg class="{css_class}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" '
        f'width="{WIDTH}" height="{height}" role="img" aria-label="{esc(title)}">',
        f'<text class="title" x="{WIDTH / 2}" y="18" text-anchor="middle">{esc(title)}</text>',
        *body,
        f'<text class="axis-label" x="{WIDTH / 2}" y="{height - 6}" text-anchor="middle">{esc(x_label)}</text>',
        f'<text class="axis-label" transform="translate(14,{height / 2}) rotate(-90)" text-anchor="middle">'
        f'{esc(y_label)}</text>',
        *legend, "</svg>"])


def legend_items(names: list[tuple[str, str, str]], x0: float, y0: float) -> list[str]:
    """(label, colour, series index or "") per entry; an entry with a series index toggles that series."""
    out = []
    for i, (label, colour, series) in enumerate(names):
        y = y0 + 16 * i
        attrs = f' data-series="{series}"' if series != "" else ""
        out.append(f'<g class="legend-item"{attrs}><title>{esc(label)}</title><rect x="{x0}" y="{y - 9}" '
                   f'width="12" height="10" fill="{colour}"/><text x="{x0 + 16}" y="{y}">{esc(short(label))}'
                   f'</text></g>')
    return out


def line_chart_svg(rows: list[dict], x: str, others: list[str], capacity: tuple[int | None, str] = (None, "")) -> str:
    """Peak allocated against column `x`, one line per combination of the `others` columns: a circle per
    point that ran (`ok`), a cross above the data per point that ran out of memory, the capacity as a dashed line."""
    cap_bytes, cap_label = capacity
    xs = list(dict.fromkeys(label_of(r.get(x)) for r in rows))
    numeric = all(number(r.get(x)) is not None for r in rows)
    if numeric:
        values = sorted({number(r.get(x)) for r in rows})
        lo, hi = values[0], values[-1]
        span = (hi - lo) or 1.0
    peaks = [number(r.get("peak_allocated_bytes")) for r in rows if r.get("status") == Status.OK]
    data_top = max([p for p in peaks if p is not None], default=0.0)
    on_scale = bool(cap_bytes) and on_the_scale(cap_bytes, data_top)
    largest = max(data_top, cap_bytes if on_scale else 0.0)
    unit = unit_for(largest)
    top, step = nice_top(largest / unit[1] * 1.05 if largest else 1.0)
    left, right, upper, lower = 70, 250, 40, 50
    plot_w, plot_h = WIDTH - left - right, HEIGHT - upper - lower
    band = 18  # the out-of-memory crosses sit in a band above the plot

    def px(value) -> float:
        if numeric:
            return left + (number(value) - lo) / span * plot_w if len(values) > 1 else left + plot_w / 2
        return left + (xs.index(label_of(value)) + 0.5) / len(xs) * plot_w

    def py(value_bytes: float) -> float:
        return upper + band + (plot_h - band) * (1 - value_bytes / unit[1] / top)

    body = [f'<rect class="plot-area" x="{left}" y="{upper}" width="{plot_w}" height="{plot_h}" fill="none"/>']
    tick = 0.0
    while tick <= top + 1e-9:
        y = py(tick * unit[1])
        body.append(f'<line class="grid" x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}"/>'
                    f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{tick:g}</text>')
        tick += step
    ticks = values if numeric else xs
    for value in ticks:
        body.append(f'<text class="tick" x="{px(value):.1f}" y="{upper + plot_h + 16}" text-anchor="middle">'
                    f'{esc(label_of(value))}</text>')
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(label_of(row.get(o)) for o in others), []).append(row)
    legend = []
    for index, (key, group) in enumerate(groups.items()):
        colour = SERIES_COLOURS[index % len(SERIES_COLOURS)]
        name = ", ".join(f"{o}={k}" for o, k in zip(others, key)) or "peak allocated"
        ok = [r for r in group if r.get("status") == Status.OK and number(r.get("peak_allocated_bytes")) is not None]
        ok.sort(key=lambda r: number(r.get(x)) if numeric else xs.index(label_of(r.get(x))))
        parts = [f'<g class="series" data-series="{index}">']
        if len(ok) > 1:
            points = " ".join(f"{px(r.get(x)):.1f},{py(number(r['peak_allocated_bytes'])):.1f}" for r in ok)
            parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for r in ok:
            tip = (f"{r.get('point_id')}: {x}={label_of(r.get(x))}, peak allocated "
                   f"{size_text(r['peak_allocated_bytes'], unit)} ({backend_of(r)})")
            cy = py(number(r["peak_allocated_bytes"]))
            parts.append(f'<circle class="point" cx="{px(r.get(x)):.1f}" cy="{cy:.1f}" '
                         f'r="4" fill="{colour}" data-tip="{esc(tip)}"/>')
        for r in group:
            if r.get("status") == Status.OOM:
                cx, cy = px(r.get(x)), upper + 9 + 4 * (index % 3)
                tip = (f"{r.get('point_id')}: {x}={label_of(r.get(x))}: out of memory"
                       f"{' in ' + str(r['peak_phase']) if r.get('peak_phase') else ''} ({backend_of(r)})")
                parts.append(f'<path class="oom" d="M{cx - 5:.1f},{cy - 5:.1f}L{cx + 5:.1f},{cy + 5:.1f}'
                             f'M{cx - 5:.1f},{cy + 5:.1f}L{cx + 5:.1f},{cy - 5:.1f}" stroke="{colour}" '
                             f'stroke-width="2.5" data-tip="{esc(tip)}"/>')
        parts.append("</g>")
        body += parts
        legend.append((name, colour, str(index)))
    if any(r.get("status") == Status.OOM for r in rows):
        body.append(f'<text class="tick" x="{left + 4}" y="{upper + 12}">OOM</text>')
    if cap_bytes:
        y = py(cap_bytes) if on_scale else 0
        legend.append(capacity_mark(body, cap_bytes, cap_label, on_scale, (left, left + plot_w, y, y), "far above",
                                    (left + plot_w - 4, upper - 4)))
    x_label = {"batch_size": "batch size (samples per step)", "world_size": "world size (GPUs)"}.get(x, x)
    return frame(f"peak allocated against {x}", x_label, f"peak allocated ({unit[0]}, 1024-based)", body,
                 legend_items(legend, WIDTH - right + 16, upper + 10))


def breakdown_svg(rows: list[dict], labels: list[str] | None = None,
                  capacity: tuple[int | None, str] = (None, ""), title: str = "what fills the peak, per point") -> str:
    """One horizontal bar per row: its peak allocated split into weights, gradients, optimizer state and the rest
    (vlmprobe.results.answer.breakdown), or the peak alone where a part is missing; a row that ran out of memory
    shows what it held then and says so. The capacity as a dashed vertical line, and 'on the card' (peak reserved
    + CUDA context, where the row has it) as a tick."""
    cap_bytes, cap_label = capacity
    labels = labels or [str(r.get("point_id")) for r in rows]
    data_top = max([number(r.get("peak_allocated_bytes")) or 0.0 for r in rows]
                   + [number(shown(r)) or 0.0 for r in rows if r.get("status") == Status.OK], default=0.0)
    on_scale = bool(cap_bytes) and on_the_scale(cap_bytes, data_top)
    largest = max(data_top, cap_bytes if on_scale else 0.0)
    unit = unit_for(largest)
    top, step = nice_top(largest / unit[1] * 1.05 if largest else 1.0)
    left = min(300, 20 + 6.2 * max((len(s) for s in labels), default=4))
    right, upper, bar = 240, 34, 18
    height = max(upper + 40 + (bar + 8) * max(len(rows), 1), 160)  # room for the legend
    plot_w = WIDTH - left - right

    def px(value_bytes: float) -> float:
        return left + value_bytes / unit[1] / top * plot_w

    body = []
    tick = 0.0
    while tick <= top + 1e-9:
        x = px(tick * unit[1])
        body.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{upper}" y2="{height - 36}"/>'
                    f'<text class="tick" x="{x:.1f}" y="{height - 22}" text-anchor="middle">{tick:g}</text>')
        tick += step
    for i, (row, label) in enumerate(zip(rows, labels)):
        y = upper + 6 + i * (bar + 8)
        body.append(f'<text class="tick" x="{left - 6}" y="{y + bar - 5}" text-anchor="end">{esc(short(label, 46))}'
                    f'<title>{esc(label)}</title></text>')
        peak = number(row.get("peak_allocated_bytes"))
        parts = breakdown(row) if row.get("status") == Status.OK else {}
        whole = bool(parts) and None not in parts.values() and min(parts.values()) >= 0
        tip = (f"{label}: " + ", ".join(f"{name} {size_text(value, unit)}" for name, value in parts.items())
               + f" ({backend_of(row)})" if whole else
               f"{label}: peak allocated {size_text(peak, unit)} ({row.get('status')}, {backend_of(row)})")
        body.append(f'<g class="bar" data-tip="{esc(tip)}">')  # one tip for the bar's parts: the file stays small
        x = px(0)
        if whole:
            for name, value in parts.items():
                width = px(value) - px(0)
                body.append(f'<rect class="part" x="{x:.1f}" y="{y}" width="{width:.1f}" height="{bar}" '
                            f'fill="{PART_COLOURS[name]}"/>')
                x += width
        elif peak is not None:
            colour = "#c44" if row.get("status") == Status.OOM else PART_COLOURS["rest"]
            body.append(f'<rect class="part" x="{x:.1f}" y="{y}" width="{px(peak) - x:.1f}" height="{bar}" '
                        f'fill="{colour}"/>')
            x = px(peak)
        card = number(shown(row)) if row.get("status") == Status.OK and row.get("predicted_device_bytes") is not None \
            else None
        if card is not None:
            tip = f"{label}: on the card {size_text(card, unit)} (peak reserved + CUDA context)"
            body.append(f'<line class="on-card" x1="{px(card):.1f}" x2="{px(card):.1f}" y1="{y - 3}" '
                        f'y2="{y + bar + 3}" stroke="#000" stroke-width="2" data-tip="{esc(tip)}"/>')
        status = row.get("status")
        text = size_text(peak, unit) if status == Status.OK else str(status).upper() + (
            f" ({size_text(peak, unit)} held)" if peak is not None else "")
        body.append(f'<text class="value" x="{max(x, px(card) if card else x) + 5:.1f}" y="{y + bar - 5}">'
                    f'{esc(text)}</text></g>')
    legend = [(name, colour, "") for name, colour in PART_COLOURS.items()]
    if any(r.get("predicted_device_bytes") is not None for r in rows):
        legend.append(("on the card (reserved + context)", "#000", ""))
    if cap_bytes:
        x = px(cap_bytes) if on_scale else 0
        legend.append(capacity_mark(body, cap_bytes, cap_label, on_scale, (x, x, upper, height - 36),
                                    "far to the right", (left + plot_w - 4, upper - 2)))
    return frame(title, f"peak allocated ({unit[0]}, 1024-based)", "", body,
                 legend_items(legend, WIDTH - right + 16, upper + 10), height, "chart breakdown")


def timeline_svg(point_id: str, entry: dict) -> str | None:
    """Allocated and reserved over one point's step from its load_timelines entry ({"samples": [[t,
    allocated, reserved], ...], "phases": [...]}), phases as shaded bands with their names; None where the entry
    has no usable samples. A phase is {"name", "start", "end"} or [name, start, end]; others are skipped."""
    if not isinstance(entry, dict):
        return None
    samples = []
    for sample in entry.get("samples") or []:
        if isinstance(sample, (list, tuple)) and len(sample) >= 2:
            t, alloc = number(sample[0]), number(sample[1])
            reserved = number(sample[2]) if len(sample) > 2 else None
            if t is not None and alloc is not None:
                samples.append((t, alloc, reserved))
    if not samples:
        return None
    if len(samples) > MAX_TIMELINE_SAMPLES:  # keep the peak: the max of each stretch, not every n-th sample
        per = math.ceil(len(samples) / MAX_TIMELINE_SAMPLES)
        samples = [max(samples[i:i + per], key=lambda s: s[1]) for i in range(0, len(samples), per)]
    t0, t1 = samples[0][0], samples[-1][0]
    span = (t1 - t0) or 1.0
    largest = max(max(s[1], s[2] or 0.0) for s in samples)
    unit = unit_for(largest)
    top, step = nice_top(largest / unit[1] * 1.05 if largest else 1.0)
    left, right, upper, lower = 70, 170, 40, 50
    plot_w, plot_h = WIDTH - left - right, HEIGHT - upper - lower

    def px(t: float) -> float:
        return left + (t - t0) / span * plot_w

    def py(value_bytes: float) -> float:
        return upper + plot_h * (1 - value_bytes / unit[1] / top)

    body = []
    for phase in entry.get("phases") or []:
        if isinstance(phase, dict):
            name, start, end = phase.get("name"), number(phase.get("start")), number(phase.get("end"))
        elif isinstance(phase, (list, tuple)) and len(phase) >= 3:
            name, start, end = phase[0], number(phase[1]), number(phase[2])
        else:
            continue
        if start is None or end is None:
            continue
        body.append(f'<rect class="phase" x="{px(start):.1f}" y="{upper}" width="{max(px(end) - px(start), 0):.1f}" '
                    f'height="{plot_h}" fill="#eee" stroke="#ccc"><title>{esc(name)}</title></rect>'
                    f'<text class="tick" x="{(px(start) + px(end)) / 2:.1f}" y="{upper + 12}" text-anchor="middle">'
                    f'{esc(name)}</text>')
    tick = 0.0
    while tick <= top + 1e-9:
        y = py(tick * unit[1])
        body.append(f'<line class="grid" x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}"/>'
                    f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{tick:g}</text>')
        tick += step
    legend = []
    for index, (name, column, colour) in enumerate((("allocated", 1, "#1f77b4"), ("reserved", 2, "#ff7f0e"))):
        points = " ".join(f"{px(s[0]):.1f},{py(s[column]):.1f}" for s in samples if s[column] is not None)
        if points:
            peak = max(s[column] for s in samples if s[column] is not None)
            tip = f"{point_id}: peak {name} {size_text(peak, unit)}"
            body.append(f'<g class="series" data-series="{index}"><polyline class="timeline" points="{points}" '
                        f'fill="none" stroke="{colour}" stroke-width="1.5" data-tip="{esc(tip)}"/></g>')
            legend.append((name, colour, str(index)))
    x_label = "allocations, in the run's order" if entry.get("unit") == "allocations" else "time"
    return frame(f"memory over the step: {point_id}", x_label,
                 f"memory ({unit[0]}, 1024-based)", body, legend_items(legend, WIDTH - right + 16, upper + 10))


def load_timelines(out_dir: Path) -> dict | None:
    """Each point's timeline in a results dir as timeline_svg takes it (as_samples), from timeline.jsonl as
    vlmprobe.results.table.read_timelines reads it; None where there is none."""
    return {str(point): as_samples(record) for point, record in read_timelines(out_dir).items()} or None


def as_samples(record: dict) -> dict:
    """A timeline.jsonl record as timeline_svg takes it: samples [x, allocated, reserved] (the last held to the end
    of the run), phases [name, first, end] (an open end: the run's end)."""
    xs, allocated, reserved = record.get("x") or [], record.get("allocated") or [], record.get("reserved") or []
    end = record.get("allocations")
    samples = [list(s) for s in zip(xs, allocated, reserved)]
    if samples and isinstance(end, (int, float)) and end > samples[-1][0]:
        samples.append([end, samples[-1][1], samples[-1][2]])
    phases = [[p[0], p[1], end if p[2] is None else p[2]] for p in record.get("phases") or []
              if isinstance(p, (list, tuple)) and len(p) >= 3]
    return {"samples": samples, "phases": phases, "unit": record.get("unit")}


def load_ranks(out_dir: Path) -> list[dict]:
    """ranks.csv of a results dir (points of several ranks: one row per rank), or [] without one."""
    path = Path(out_dir) / "ranks.csv"
    if not path.is_file():
        return []
    return records(pd.read_csv(path, on_bad_lines="skip", engine="python"))


TABLE_COLUMNS = [  # (header, the row's figure or text)
    ("peak alloc", "peak_allocated_bytes"), ("peak reserved", "peak_reserved_bytes"), ("on the card", shown),
    ("capacity", "imposed_capacity_bytes"), ("weights", "params_bytes"), ("grads", "grads_bytes"),
    ("optimizer", "optimizer_state_bytes"),
]


def table_html(rows: list[dict], axis_columns: list[str], unit: tuple[str, int]) -> str:
    """Every point: its swept values, backend, status and figures (in `unit`), sortable by a click on a header."""
    heads = ["point", *axis_columns, "backend", "status", *(f"{h} {unit[0]}" for h, _ in TABLE_COLUMNS),
             f"rest {unit[0]}", f"left {unit[0]}", "peak in"]
    lines = ['<table class="rows sortable"><thead><tr>'
             + "".join(f"<th>{esc(h)}</th>" for h in heads) + "</tr></thead><tbody>"]
    for row in rows:
        cells = [(str(row.get("point_id")), None), *((label_of(row.get(c)), number(row.get(c))) for c in axis_columns),
                 (backend_of(row), None), (str(row.get("status")), None)]
        for _, key in TABLE_COLUMNS:
            value = key(row) if callable(key) else number(row.get(key))
            value = None if key is shown and row.get("status") != Status.OK else value
            cells.append((size_text(value, unit).rsplit(" ", 1)[0], number(value)))
        rest = breakdown(row)["rest"] if row.get("status") == Status.OK else None
        capacity, need = number(row.get("imposed_capacity_bytes")), number(shown(row))
        left = capacity - need if capacity is not None and need is not None and row.get("status") == Status.OK else None
        cells += [(size_text(rest, unit).rsplit(" ", 1)[0], number(rest)),
                  (size_text(left, unit).rsplit(" ", 1)[0], left), (str(row.get("peak_phase") or "-"), None)]
        lines.append("<tr>" + "".join(f'<td data-sort="{"" if v is None else v}">{esc(t)}</td>' for t, v in cells)
                     + "</tr>")
    lines.append("</tbody></table>")
    return "\n".join(lines)


STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1100px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
.chart{display:block;margin:.6em 0;border:1px solid #ddd;background:#fff;max-width:100%;height:auto}
.chart text{font-size:11px;fill:#222}.chart .title{font-size:14px;font-weight:600}
.grid{stroke:#e5e5e5}.plot-area{stroke:#999}.legend-item{cursor:pointer}.legend-item.off{opacity:.35}
.hidden{display:none}.note{color:#555;font-size:.92em}.estimate{color:#a40;font-weight:600}
table.rows{border-collapse:collapse;font-size:12px}table.rows td,table.rows th{border:1px solid #ccc;padding:2px 6px;
text-align:right}table.rows th{cursor:pointer;background:#f3f3f3}table.rows td:first-child{text-align:left}
#tip{position:fixed;pointer-events:none;background:#222;color:#fff;padding:3px 6px;font-size:12px;border-radius:3px;
display:none;z-index:9}
"""

SCRIPT = """
(function(){
  var tip=document.getElementById('tip');
  document.addEventListener('mouseover',function(e){
    var t=e.target.closest&&e.target.closest('[data-tip]');
    if(!t){tip.style.display='none';return;}
    tip.textContent=t.getAttribute('data-tip');tip.style.display='block';
  });
  document.addEventListener('mousemove',function(e){
    tip.style.left=(e.clientX+12)+'px';tip.style.top=(e.clientY+12)+'px';
  });
  document.addEventListener('click',function(e){
    var item=e.target.closest&&e.target.closest('.legend-item[data-series]');
    if(item){
      var svg=item.closest('svg'),s=item.getAttribute('data-series');
      item.classList.toggle('off');
      svg.querySelectorAll('.series[data-series="'+s+'"]').forEach(function(g){g.classList.toggle('hidden');});
      return;
    }
    var th=e.target.closest&&e.target.closest('table.sortable th');
    if(!th)return;
    var table=th.closest('table'),i=Array.prototype.indexOf.call(th.parentNode.children,th);
    var up=th.getAttribute('data-up')!=='1';th.setAttribute('data-up',up?'1':'0');
    var body=table.tBodies[0],rows=Array.prototype.slice.call(body.rows);
    rows.sort(function(a,b){
      var x=a.cells[i].getAttribute('data-sort'),y=b.cells[i].getAttribute('data-sort');
      var c=(x!==''&&y!==''&&!isNaN(x)&&!isNaN(y))?(x-y):a.cells[i].textContent.localeCompare(b.cells[i].textContent);
      return up?c:-c;
    });
    rows.forEach(function(r){body.appendChild(r);});
  });
})();
"""


def report_html(table: pd.DataFrame, axes: list[str], env: dict, ranks: list[dict] | None = None,
                timelines: dict | None = None) -> str:
    """The page for these rows (`axes`: the sweep's config keys, as write_reports takes them)."""
    rows = records(table)
    sweep = str(rows[0].get("sweep")) if rows else "?"
    backends = sorted({backend_of(r) for r in rows})
    capacity = capacity_of(rows)
    columns = [c for c in dict.fromkeys(axis_column(a) for a in axes) if c in table.columns]
    varying = [c for c in columns if len({label_of(r.get(c)) for r in rows}) > 1]
    largest = max([number(r.get("peak_allocated_bytes")) or 0.0 for r in rows], default=0.0)
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>vlmprobe: {esc(sweep)}</title>", f"<style>{STYLE}</style></head><body>",
        '<div id="tip"></div>', f"<h1>vlmprobe: {esc(sweep)}</h1>", "<ul>",
        *(f'<li class="{"estimate" if b == "estimate" else "backend"}">backend <code>{esc(b)}</code>: '
          f'{esc(BACKEND_LABELS.get(b, b))}</li>' for b in backends),
        f"<li>{len(rows)} point{'s' if len(rows) != 1 else ''}; model {esc(rows[0].get('model')) if rows else '-'}; "
        f"device: {esc(env.get('device_name', '?'))}; torch {esc(env.get('torch', '?'))}, transformers "
        f"{esc(env.get('transformers', '?'))}; commit {esc(env.get('git_commit', '?'))}</li>",
        "<li>units: MiB = 1024<sup>2</sup> bytes, GiB = 1024<sup>3</sup> bytes (results.csv holds bytes); hover a "
        "mark for its value, click a legend entry to hide or show its line, a table header to sort</li>", "</ul>",
    ]
    if not rows:
        parts.append("<p>(no rows)</p>")
    if varying:
        parts.append("<h2>Peak allocated against each swept axis</h2>")
        for x in varying:
            parts.append(line_chart_svg(rows, x, [c for c in varying if c != x], capacity))
    if rows:
        parts += ["<h2>What fills the peak, per point</h2>",
                  '<p class="note">Weights, gradients and optimizer state as they stand after the step; the rest '
                  "(activations, the loss, workspaces) is the difference to the peak allocated.</p>",
                  breakdown_svg(rows, capacity=capacity)]
    if ranks:
        parts += ["<h2>Per rank (ranks.csv)</h2>",
                  breakdown_svg(ranks, [f"{r.get('point_id')} rank {label_of(r.get('rank'))}" for r in ranks],
                                capacity, "what fills the peak, per rank")]
    peaks = {str(r.get("point_id")): number(r.get("peak_allocated_bytes")) or 0.0 for r in rows}
    chosen = sorted(timelines or {}, key=lambda p: -peaks.get(str(p), 0.0))[:TIMELINES]
    pictures = [svg for point in chosen if (svg := timeline_svg(str(point), timelines[point]))]
    if pictures:
        parts += [f"<h2>Memory over the step (the {len(pictures)} largest points)</h2>", *pictures]
    if rows:
        unit = unit_for(largest)
        parts += [f"<h2>Every point ({unit[0]}, 1024-based)</h2>", table_html(rows, columns, unit)]
    parts += [f"<script>{SCRIPT}</script>", "</body></html>"]
    return "\n".join(parts)


def write_report_html(out_dir: Path, table: pd.DataFrame, axes: list[str], env: dict) -> None:
    """report.html in the results dir, written whole or not at all; ranks.csv and a timeline drawn where present."""
    text = report_html(table, axes, env, load_ranks(out_dir), load_timelines(out_dir))
    with replacing(Path(out_dir) / "report.html") as partial:
        partial.write_text(text)
