"""scripts/check_allocator.py on snapshots built by hand in the schema torch writes (torch/cuda/memory.py,
`_snapshot`'s docstring; torch/csrc/cuda/Module.cpp): a recorded run the model reproduces event by event, one it
does not, and files that are not snapshots."""

import pickle
from pathlib import Path

import pytest

from conftest import load_script

MiB = 1 << 20
A, B, C, D = 0x7F0000000000, 0x7F0002000000, 0x7F0004000000, 0x7F0008000000  # cudaMalloc'd addresses


def _script():
    return load_script("check_allocator")


def _event(action, addr, size):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0, "frames": [], "pool_id": (0, 0)}


def _recorded_run(extra_segment: bool = False) -> dict:
    """A default-allocator run, worked by hand: 3 MiB and 5 MiB share a 20 MiB segment; 1000 B gets a 2 MiB small
    segment (block 1024 B); the 3 MiB block, freed, takes 2 MiB + 1 B whole (2 MiB + 512 rounded leaves
    1 MiB - 512 B: not > 1 MiB, no split); 30 MiB needs a segment of its own. 52 MiB reserved;
    3 MiB + 5 MiB + 1024 B allocated at the end. `extra_segment`: the recording instead shows a new 20 MiB
    segment for the 2 MiB + 1 B request, which the model does not make."""
    trace = [_event("segment_alloc", A, 20 * MiB), _event("alloc", A, 3 * MiB),
             _event("alloc", A + 3 * MiB, 5 * MiB),
             _event("segment_alloc", B, 2 * MiB), _event("alloc", B, 1000),
             _event("free_requested", A, 3 * MiB), _event("free_completed", A, 3 * MiB)]
    if extra_segment:
        trace += [_event("segment_alloc", D, 20 * MiB), _event("alloc", D, 2 * MiB + 1)]
    else:
        trace += [_event("alloc", A, 2 * MiB + 1)]
    trace += [_event("segment_alloc", C, 30 * MiB), _event("alloc", C, 30 * MiB),
              _event("free_requested", C, 30 * MiB), _event("free_completed", C, 30 * MiB)]

    def block(addr, size, requested, state):
        return {"address": addr, "size": size, "requested_size": requested, "state": state, "frames": []}

    def segment(addr, blocks, kind="large"):
        total = sum(b["size"] for b in blocks)
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        return {"device": 0, "address": addr, "total_size": total, "allocated_size": allocated,
                "active_size": allocated, "requested_size": sum(b["requested_size"] for b in blocks), "stream": 0,
                "segment_type": kind, "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}

    first = [block(A, 3 * MiB, 2 * MiB + 1, "active_allocated"), block(A + 3 * MiB, 5 * MiB, 5 * MiB, "active_allocated"),
             block(A + 8 * MiB, 12 * MiB, 0, "inactive")]
    if extra_segment:
        first[0] = block(A, 3 * MiB, 0, "inactive")
    segments = [segment(A, first),
                segment(B, [block(B, 1024, 1000, "active_allocated"), block(B + 1024, 2 * MiB - 1024, 0, "inactive")],
                        "small"),
                segment(C, [block(C, 30 * MiB, 0, "inactive")])]
    if extra_segment:
        segments.append(segment(D, [block(D, 2 * MiB + 512, 2 * MiB + 1, "active_allocated"),
                                    block(D + 2 * MiB + 512, 18 * MiB - 512, 0, "inactive")]))
    return {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "expandable_segments": False}}


def _write(tmp_path, snapshot, name="snapshot.pickle") -> Path:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(snapshot))
    return path


def test_a_run_the_model_reproduces_matches_event_by_event(tmp_path, capsys):
    path = _write(tmp_path, _recorded_run())
    assert _script().main([str(path)]) == 0
    out = capsys.readouterr().out
    assert f"| peak reserved | {52 * MiB} | {52 * MiB} | 0 |" in out
    assert f"| end allocated | {8 * MiB + 1024} | {8 * MiB + 1024} | 0 |" in out
    # live at the 30 MiB alloc: 5 MiB, 1000 B, 2 MiB + 1 B and 30 MiB
    assert f"| peak requested | {37 * MiB + 1000 + 1} | {37 * MiB + 1000 + 1} | 0 |" in out
    assert "reserved differs after 0 of 7 events" in out


def test_a_run_the_model_does_not_reproduce_is_shown_where_it_parts(tmp_path, capsys):
    path = _write(tmp_path, _recorded_run(extra_segment=True))
    assert _script().main([str(path)]) == 0
    out = capsys.readouterr().out
    # from the 2 MiB + 1 B alloc (trace entry 8) on, the recording holds 20 MiB more than the model
    assert "reserved differs after 3 of 7 events (first at trace entry 8, at most 20.00 MiB)" in out
    assert f"| end reserved | {52 * MiB} | {72 * MiB} | {-20 * MiB} | -20.00 |" in out


def test_a_results_dir_replays_its_snapshots_folder(tmp_path, capsys):
    (tmp_path / "snapshots").mkdir()
    _write(tmp_path / "snapshots", _recorded_run(), "point-1.pickle")
    assert _script().main([str(tmp_path)]) == 0
    assert "point-1.pickle (alloc_conf: default; 7 allocs and frees replayed)" in capsys.readouterr().out


def test_the_requests_csv_counts_each_size_the_run_asked_for_and_names_its_point(tmp_path, capsys):
    import pandas as pd

    (tmp_path / "snapshots").mkdir()
    _write(tmp_path / "snapshots", _recorded_run(), "point-1.pickle")
    pd.DataFrame({"point_id": ["data.batch_size=1"], "snapshot_file": ["/elsewhere/snapshots/point-1.pickle"]}).to_csv(
        tmp_path / "results.csv", index=False)
    out = tmp_path / "requests.csv"
    assert _script().main([str(tmp_path), "--requests-csv", str(out)]) == 0
    table = pd.read_csv(out)
    # the five allocs of the hand-made run, one of each size; frees and segment events are not requests
    assert dict(zip(table["size_bytes"], table["count"])) == {1000: 1, 2 * MiB + 1: 1, 3 * MiB: 1, 5 * MiB: 1,
                                                              30 * MiB: 1}
    assert set(table["point_id"]) == {"data.batch_size=1"} and set(table["snapshot"]) == {"point-1.pickle"}


def test_a_requests_csv_in_a_folder_that_does_not_exist_is_one_line_before_any_replay(tmp_path, capsys):
    path = _write(tmp_path, _recorded_run())
    assert _script().main([str(path), "--requests-csv", str(tmp_path / "missing" / "r.csv")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "its folder does not exist" in err


@pytest.mark.parametrize("content, why", [
    (pickle.dumps([1, 2, 3]), "no 'segments' and 'device_traces' lists"),
    (b"not a pickle at all", "is not a torch.cuda.memory._snapshot() pickle"),
    (pickle.dumps(Path("/etc")), "it holds a pathlib"),  # a class in the pickle is refused, never built
    (pickle.dumps({"segments": [], "device_traces": [[]]}), "has no allocation history"),
])
def test_a_file_that_is_not_a_snapshot_is_one_line(tmp_path, capsys, content, why):
    path = tmp_path / "x.pickle"
    path.write_bytes(content)
    assert _script().main([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0], err
