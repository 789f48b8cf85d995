"""report.html: one self-contained page per results dir, its charts inline SVG drawn from the rows. Checked against
hand-made rows (a circle per point that ran, a cross per point out of memory, a line per value of the other axis,
the bars' parts in proportion to the rows' bytes), the card's published capacity, a size limit for 100 points,
and in a real browser (Chromium, tests/browser.py): the charts render with no console error and no request."""

import json
import re
import xml.etree.ElementTree as ET

import pandas as pd
import pytest

from browser import open_browser
from vlmprobe.results.html_report import breakdown_svg, line_chart_svg, report_html, timeline_svg
from vlmprobe.results.report import write_reports
from vlmprobe.results.table import RowWriter, columns_for

SVG = "{http://www.w3.org/2000/svg}"
GiB, MiB = 2**30, 2**20
RTX4090 = 25_756_696_576  # conf/device/rtx4090.yaml: total_memory, 23.99 GiB


def svgs(text: str) -> list[ET.Element]:
    return [ET.fromstring(s) for s in re.findall(r"<svg .*?</svg>", text, flags=re.S)]


def row(batch: int, length: int, peak: int, status: str = "ok", **more) -> dict:
    base = {"sweep": "hand", "point_id": f"data.batch_size={batch},data.lm_max_length={length}", "model": "m",
            "batch_size": batch, "lm_max_length": length, "backend": "estimate", "status": status,
            "peak_allocated_bytes": peak, "params_bytes": GiB, "grads_bytes": GiB, "optimizer_state_bytes": 2 * GiB}
    return {**base, **more}


# batch x length; the 4 x 64 point runs out of memory
ROWS = [row(1, 32, 5 * GiB), row(2, 32, 6 * GiB), row(4, 32, 8 * GiB),
        row(1, 64, 5 * GiB + 512 * MiB), row(2, 64, 7 * GiB), row(4, 64, 9 * GiB, "oom", peak_phase="backward")]
AXES = ["data.batch_size", "data.lm_max_length"]


def test_a_line_per_value_of_the_other_axis_a_circle_per_point_that_ran_a_cross_per_oom():
    by_batch, by_length = svgs(report_html(pd.DataFrame(ROWS), AXES, {}))[:2]
    assert len(by_batch.findall(f".//{SVG}g[@class='series']")) == 2  # one line per length
    assert len(by_length.findall(f".//{SVG}g[@class='series']")) == 3  # one line per batch size
    for chart in (by_batch, by_length):
        assert len(chart.findall(f".//{SVG}circle[@class='point']")) == 5
        (oom,) = chart.findall(f".//{SVG}path[@class='oom']")
        assert "out of memory in backward (estimate)" in oom.get("data-tip")
    length_32 = by_batch.find(f".//{SVG}g[@data-series='0']")  # the line of the length seen first, 32
    circles = length_32.findall(f"{SVG}circle")
    assert [c.get("data-tip").split("peak allocated ")[1] for c in circles] == \
        ["5.00 GiB (estimate)", "6.00 GiB (estimate)", "8.00 GiB (estimate)"]
    heights = [float(c.get("cy")) for c in circles]
    assert heights == sorted(heights, reverse=True)  # a larger peak is drawn higher
    xs = [float(c.get("cx")) for c in circles]  # batch 1, 2, 4 on a linear axis: 2 is a third of the way
    assert xs[1] - xs[0] == pytest.approx((xs[2] - xs[0]) / 3, abs=0.15)


def test_the_cards_capacity_is_a_line_on_the_scale_or_named_at_the_edge():
    rows = [dict(r, device="rtx4090", imposed_capacity_bytes=RTX4090) for r in ROWS]
    chart = ET.fromstring(line_chart_svg(rows, "batch_size", ["lm_max_length"], (RTX4090, "NVIDIA GeForce RTX 4090 capacity")))
    (line,) = chart.findall(f".//{SVG}line[@class='capacity']")
    assert line.get("data-tip") == "NVIDIA GeForce RTX 4090 capacity: 23.99 GiB"
    tiny = [dict(r, peak_allocated_bytes=20 * MiB) for r in rows]  # far below the card: not squashed into a sliver
    chart = ET.fromstring(line_chart_svg(tiny, "batch_size", ["lm_max_length"], (RTX4090, "capacity")))
    assert not chart.findall(f".//{SVG}line[@class='capacity']")
    (edge,) = chart.findall(f".//{SVG}text[@class='capacity off-scale']")
    assert edge.get("data-tip") == "capacity: 23.99 GiB (far above)"
    assert "peak allocated (MiB, 1024-based)" in ET.tostring(chart, encoding="unicode")


def test_a_bars_parts_are_the_rows_weights_gradients_optimizer_state_and_the_rest():
    (point,) = svgs(breakdown_svg([ROWS[2]]))  # 8 GiB: 1 + 1 + 2 + 4
    widths = [float(r.get("width")) for r in point.findall(f".//{SVG}rect[@class='part']")]
    assert [w / widths[0] for w in widths] == pytest.approx([1, 1, 2, 4], rel=1e-3)
    assert point.find(f".//{SVG}g[@class='bar']").get("data-tip") == ("data.batch_size=4,data.lm_max_length=32: "
        "weights 1.00 GiB, gradients 1.00 GiB, optimizer state 2.00 GiB, rest 4.00 GiB (estimate)")
    (oom,) = svgs(breakdown_svg([ROWS[5]]))
    assert "OOM (9.00 GiB held)" in ET.tostring(oom, encoding="unicode")


def test_every_results_dir_gets_report_html_with_ranks_and_timeline_where_they_exist(tmp_path):
    writer = RowWriter(tmp_path / "results.csv", columns_for(AXES))
    for r in ROWS[:2]:
        writer.append(r)
    ranks = pd.DataFrame([{"point_id": ROWS[0]["point_id"], "rank": k, "backend": "estimate", "status": "ok",
                           "peak_allocated_bytes": (5 + k) * GiB, "params_bytes": GiB, "grads_bytes": GiB,
                           "optimizer_state_bytes": 2 * GiB} for k in range(2)])
    ranks.to_csv(tmp_path / "ranks.csv", index=False)
    timeline = {ROWS[0]["point_id"]: {"samples": [[0.0, GiB, 2 * GiB], [1.0, 3 * GiB, 4 * GiB], [2.0, 2 * GiB, 4 * GiB]],
                                      "phases": [{"name": "forward", "start": 0.0, "end": 1.0}, ["backward", 1.0, 2.0]]},
                "broken": {"samples": "no"}}
    first = {"point_id": ROWS[0]["point_id"], "unit": "allocations", "allocations": 2, "width": 1, "x": [0, 1, 2],
             "allocated": [GiB, 3 * GiB, 2 * GiB], "reserved": [2 * GiB, 4 * GiB, 4 * GiB],
             "phases": [["forward", 0, 1], ["backward", 1, 2]]}  # as the allocator model's Timeline.data writes it
    (tmp_path / "timeline.jsonl").write_text(json.dumps(first) + "\n")
    table, failures = write_reports(tmp_path, AXES, {"torch": "2.13.0"})
    assert failures == []
    text = (tmp_path / "report.html").read_text()
    assert all(r["point_id"] in text for r in ROWS[:2]) and "ESTIMATE for a CUDA GPU" in text
    assert "MiB = 1024<sup>2</sup> bytes, GiB = 1024<sup>3</sup> bytes" in text
    rank_chart = next(s for s in svgs(text) if s.get("aria-label") == "what fills the peak, per rank")
    assert len(rank_chart.findall(f".//{SVG}g[@class='bar']")) == 2
    (drawn,) = [s for s in svgs(text) if s.get("aria-label", "").startswith("memory over the step")]
    assert [p.text for p in drawn.findall(f".//{SVG}rect[@class='phase']/{SVG}title")] == ["forward", "backward"]
    assert len(drawn.findall(f".//{SVG}polyline[@class='timeline']")) == 2  # allocated and reserved
    assert timeline_svg("broken", timeline["broken"]) is None and timeline_svg("x", "not a mapping") is None
    (tmp_path / "timeline.jsonl").unlink()
    write_reports(tmp_path, AXES, {})
    assert "memory over the step" not in (tmp_path / "report.html").read_text()
    kept = {"point_id": ROWS[1]["point_id"], "unit": "allocations", "allocations": 9, "width": 4, "x": [0, 4],
            "allocated": [GiB, 3 * GiB], "reserved": [2 * GiB, 4 * GiB], "phases": [["forward", 0, 5], ["backward", 5, None]]}
    (tmp_path / "timeline.jsonl").write_text(json.dumps(kept) + "\nnot json\n")  # the allocator model's timeline
    write_reports(tmp_path, AXES, {})
    (drawn,) = [s for s in svgs((tmp_path / "report.html").read_text())
                if s.get("aria-label", "").startswith("memory over the step")]
    (allocated, _) = drawn.findall(f".//{SVG}polyline[@class='timeline']")
    assert len(allocated.get("points").split()) == 3  # the two buckets, the last held to allocation 9
    assert [float(r.get("width")) for r in drawn.findall(f".//{SVG}rect[@class='phase']")] == \
        pytest.approx([520 * 5 / 9, 520 * 4 / 9], abs=0.1)  # forward 0-5, backward 5 to the end (9)


def test_a_100_point_sweep_is_one_file_under_200_kb_that_asks_for_nothing():
    rows = [row(b, n, (b * n) * MiB + 4 * GiB, device="rtx4090", imposed_capacity_bytes=RTX4090,
                predicted_device_bytes=(b * n) * MiB + 5 * GiB, peak_reserved_bytes=(b * n) * MiB + 4 * GiB)
            for b in range(1, 11) for n in range(128, 1408, 128)][:100]
    text = report_html(pd.DataFrame(rows), AXES, {})
    assert len(text.encode()) < 200 * 1024
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|url\(|@import", text)
    assert set(re.findall(r"https?://[^\s\"'<]+", text)) == {"http://www.w3.org/2000/svg"}  # the SVG namespace only
    assert len(svgs(text)[0].findall(f".//{SVG}circle[@class='point']")) == 100


@pytest.mark.slow  # ~20 s here: a 4-point sweep, then Chromium
@pytest.mark.browser
def test_report_html_renders_in_chromium_with_no_console_error_and_no_request(tmp_path):
    with open_browser() as browser:
        from vlmprobe.api import run

        result = run("+sweep=smoke", results_dir=str(tmp_path), launcher="local", device="rtx4090",
                     **{"measure.backend": "estimate"})  # nanovlm_tiny, batch 1, 2 x length 32, 64
        page, url = browser.page, (result.out_dir / "report.html").as_uri()
        page.goto(url)
        charts = page.locator("svg.chart")  # against batch size, against length, the breakdown, then timelines
        assert page.locator("svg.chart[aria-label^='peak allocated against']").count() == 2
        kept = (result.out_dir / "timeline.jsonl").is_file()  # where the estimate keeps each point's timeline
        assert page.locator("svg.chart[aria-label^='memory over the step']").count() == (4 if kept else 0)
        assert charts.count() == 3 + (4 if kept else 0)
        for i in range(2):
            assert charts.nth(i).locator("circle.point").count() == 4
            assert charts.nth(i).locator("g.series").count() == 2
        assert charts.nth(2).locator("g.bar").count() == 4
        assert page.locator("table.rows tbody tr").count() == 4
        first = charts.nth(0).locator("circle.point").first
        first.hover(force=True)  # the 1 x 32 and 1 x 64 circles nearly coincide: whichever is on top answers
        assert page.locator("#tip").is_visible() and "(estimate)" in page.locator("#tip").inner_text()
        charts.nth(0).locator(".legend-item[data-series='0']").click()
        assert charts.nth(0).locator("g.series[data-series='0']").evaluate("g => getComputedStyle(g).display") == "none"
        assert browser.errors == []
        assert browser.requests == [url]
