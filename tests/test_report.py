"""The report never stops at a value: summary.md, results.parquet and plot.png are written for any rows,
whatever the swept columns hold (null, numbers, text, lists, a mix) and however the points ended."""

import json
import tempfile
from pathlib import Path

import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmprobe.results import report
from vlmprobe.results.report import write_reports
from vlmprobe.results.table import RowWriter, axis_column, columns_for

AXES = ["data.batch_size", "measure.alloc_conf", "train.autocast_dtype", "model.text.hidden_size",
        "train.lora_target_modules"]
STATUSES = ["ok", "oom", "error", "timeout", "crash", "skipped"]

values = st.one_of(
    st.none(), st.integers(-5, 10**12), st.floats(allow_nan=False, allow_infinity=False, width=32), st.booleans(),
    st.text("abcXYZ019 :_-/.,=[]{}'\"é|", max_size=12),  # text, with what a table or a label could trip on
    st.lists(st.text("abcq_", max_size=4), max_size=3).map(json.dumps),  # a list value lands as JSON text
)


@st.composite
def tables(draw):
    axes = draw(st.lists(st.sampled_from(AXES), min_size=0, max_size=3, unique=True))
    if draw(st.booleans()):
        axes = ["case", *axes]
    rows = []
    for i in range(draw(st.integers(0, 6))):
        status = draw(st.sampled_from(STATUSES))
        peak = draw(st.none() | st.integers(0, 2**40)) if status != "ok" else draw(st.integers(0, 2**40))
        row = {"sweep": "prop", "point_id": f"p{i}", "model": "nanovlm_tiny", "batch_size": 1,
               "backend": "estimate", "status": status, "peak_allocated_bytes": peak,
               "error": draw(st.sampled_from([None, "", "boom", "Traceback\n  x\nValueError: bad"]))}
        row.update({axis_column(a): draw(values) for a in axes if axis_column(a) != "batch_size"})
        if "data.batch_size" in axes:
            row["batch_size"] = draw(st.integers(1, 64))
        rows.append(row)
    return axes, rows


def write_rows(out: Path, axes: list[str], rows: list[dict]) -> None:
    writer = RowWriter(out / "results.csv", columns_for([a for a in axes if a != "case"]))
    for row in rows:
        writer.append(row)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(tables())
def test_every_table_the_rows_allow_is_written_whatever_the_axes_hold(drawn):
    axes, rows = drawn
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        write_rows(out, axes, rows)
        table, failures = write_reports(out, axes, {})
        assert failures == []
        assert len(table) == len(rows)
        assert len(pd.read_parquet(out / "results.parquet")) == len(rows)
        summary = (out / "summary.md").read_text()
        assert all(f"| p{i} " in summary for i in range(len(rows)))  # every point listed
        assert (out / "plot.png").exists() == bool(rows)


def test_a_report_that_fails_costs_only_itself(tmp_path, monkeypatch):
    write_rows(tmp_path, ["data.batch_size"], [{"sweep": "s", "point_id": "p0", "model": "m", "batch_size": 1,
                                                "backend": "estimate", "status": "ok", "peak_allocated_bytes": 2**20}])

    def broken(*args, **kwargs):
        raise RuntimeError("no plot today")

    monkeypatch.setattr(report, "plot", broken)
    table, failures = write_reports(tmp_path, ["data.batch_size"], {})
    assert len(table) == 1 and (tmp_path / "summary.md").exists() and (tmp_path / "results.parquet").exists()
    (failure,) = failures
    assert failure.startswith("plot.png could not be written (RuntimeError: no plot today); traceback in ")
    assert "Traceback" in (tmp_path / "vlmprobe-error.log").read_text()


def test_host_memory_of_offloaded_points_is_shown_per_rank_in_gib():
    import pandas as pd

    from vlmprobe.results.report import host_memory

    table = pd.DataFrame({"point_id": ["offloaded", "kept"], "peak_allocated_bytes": [3 * 2**30, 5 * 2**30],
                          "peak_host_bytes": [int(1.5 * 2**30), None], "after_step_host_bytes": [2**30, None]})
    text = "\n".join(host_memory(table))
    assert "| offloaded  | 3.00              | 1.50            | 1.00" in text and "kept" not in text
    assert host_memory(table.drop(index=0)) == []  # no offload: no section


def test_the_summary_says_what_an_estimate_for_no_card_leaves_out_and_only_then():
    def summary(backend, device):
        table = pd.DataFrame({"sweep": ["s"], "point_id": ["p"], "backend": [backend], "status": ["ok"],
                              "device": pd.array([device], dtype="object"), "batch_size": [1],
                              "peak_allocated_bytes": pd.array([2**30], dtype="Int64")})
        return report.summary_markdown(table, ["data.batch_size"], {})

    assert report.NO_CARD in summary("estimate", None).splitlines()
    assert report.NO_CARD not in summary("estimate", "rtx3090")
    assert report.NO_CARD not in summary("cuda", None)  # a measurement holds whatever its card added
