"""Resume never mixes sweeps and survives a damaged results.csv: a folder whose rows are another sweep's is refused
in one line, damaged rows are set aside (the file as it was kept whole) and their points run again, no damaged
line swallows a new row, one command at a time holds a folder, two sweeps of one second get a folder each, and the
printed resume command parses for any path."""

import datetime
import shlex
import shutil
from pathlib import Path

import filelock
import pandas as pd
import pytest
import yaml

from vlmprobe.cli import main
from vlmprobe.run import command
from vlmprobe.run.resume import LOCK_NAME, interrupted_line, override_value

SMOKE = ["+sweep=smoke", "measure.backend=estimate", "measure.steps=1"]  # 4 points of the tiny nanoVLM


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A smoke sweep run to its end once; each test resumes a copy of it."""
    root = tmp_path_factory.mktemp("finished")
    assert main([*SMOKE, f"results_dir={root}"]) == 0
    (out,) = (root / "smoke").iterdir()
    return out


@pytest.fixture
def copy(finished, tmp_path) -> Path:
    out = tmp_path / "smoke" / finished.name
    shutil.copytree(finished, out)
    return out


def resume(out: Path, capsys) -> tuple[int, list[str]]:
    code = main([*SMOKE, f"resume={out}"])
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_folder_holding_another_sweeps_rows_under_the_same_ids_is_refused(copy, capsys):
    table = pd.read_csv(copy / "results.csv")
    table.loc[1, "model"] = "qwen2_vl_tiny"  # a row of another model, under this sweep's point id
    table.to_csv(copy / "results.csv", index=False)
    before = (copy / "results.csv").read_bytes()
    code, lines = resume(copy, capsys)
    assert code == 2 and len(lines) == 1
    assert lines[0] == (f"vlmprobe: resume={copy} is not allowed: its row for point {table.loc[1, 'point_id']} has "
                        f"model='qwen2_vl_tiny' where this sweep plans 'nanovlm_tiny'; its rows are another sweep's "
                        f"(resume it with the command that made it, or start a new one)")
    assert (copy / "results.csv").read_bytes() == before  # nothing run, nothing written


def test_damaged_rows_are_set_aside_their_points_run_again_and_no_row_is_lost_or_invented(copy, capsys, finished):
    first = pd.read_csv(finished / "results.csv")
    header, *rows = (copy / "results.csv").read_bytes().split(b"\n")[:5]
    bad_bytes = rows[1].replace(b"estimate", b"estim\xff\xfete")  # bytes that are not UTF-8
    forged = rows[2].replace(b",ok,", b",ok,lots,", 1).rsplit(b",", 1)[0]  # a peak that is no number, same fields
    damaged = b"\n".join([header, rows[0], bad_bytes, rows[0], forged, b'x,"a quote left open', b""])
    (copy / "results.csv").write_bytes(damaged)
    code, lines = resume(copy, capsys)
    assert code == 0, lines
    said = [line for line in lines if line.startswith("vlmprobe: resume: results.csv line ")]
    assert [line.split(": ", 3)[2] for line in said] == ["results.csv line 3", "results.csv line 4",
                                                        "results.csv line 5", "results.csv line 6"], said
    assert "not UTF-8" in said[0] and "second row" in said[1] and "not a whole number" in said[2]
    assert "quote left open" in said[3] and all(line.endswith("set aside, its point runs again") for line in said)
    assert (copy / "results.csv.damaged").read_bytes() == damaged  # the file as it was, whole
    table = pd.read_csv(copy / "results.csv")
    assert sorted(table["point_id"]) == sorted(first["point_id"]) and set(table["status"]) == {"ok"}
    same = table.set_index("point_id").loc[first["point_id"], "peak_allocated_bytes"]
    assert same.tolist() == first["peak_allocated_bytes"].tolist()  # rows run again give the same bytes


def test_a_second_command_on_a_folder_in_use_is_refused_before_it_writes(copy, capsys):
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file() and p.name != LOCK_NAME}
    with filelock.FileLock(copy / LOCK_NAME):  # as a sweep still running there holds it
        code, lines = resume(copy, capsys)
    assert code == 2 and lines == [f"vlmprobe: resume={copy} is not allowed: another vlmprobe command is running its "
                                   f"points there now; resume it once that one has ended"]
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file() and p.name != LOCK_NAME} == before


def test_two_sweeps_started_in_the_same_second_get_a_folder_each(tmp_path, monkeypatch):
    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2026, 12, 7, 12, 0, 0)

    monkeypatch.setattr(command.datetime, "datetime", Frozen)
    base = {"resume": None, "results_dir": str(tmp_path), "sweep": {"name": "smoke"}}
    made = [command.results_dir(base, {}) for _ in range(3)]
    assert [p.name for p in made] == ["20261207-120000", "20261207-120000-2", "20261207-120000-3"]
    assert all((p / "config.yaml").is_file() for p in made)


@pytest.mark.parametrize("name", ["with spaces", "naïve, [bracketed]", "it's"])
def test_the_printed_resume_command_parses_for_any_path_and_resumes(finished, tmp_path, capsys, name):
    out = tmp_path / name / "smoke" / finished.name
    shutil.copytree(finished, out)
    line = interrupted_line(SMOKE, out)
    words = shlex.split(line.partition("; resume with: ")[2])
    assert words[:3] == ["python", "-m", "vlmprobe"] and override_value(words[-1]) == str(out)
    assert main(words[3:]) == 0
    assert "resume: 4 of 4 points already have rows" in capsys.readouterr().err


def test_a_full_disk_stops_the_sweep_in_one_line_keeping_every_row_written_and_no_half_file(tmp_path, capsys,
                                                                                        monkeypatch):
    """ENOSPC, injected where rows and reports are written: the third row cannot be written, so the sweep stops
    with one line naming the file and the error (exit 1); the two rows before it are whole on disk, and no half
    file is left behind. Then a report that cannot be written is one line too, its file absent, not half made."""
    import errno

    import csv

    writerow, calls = csv.DictWriter.writerow, []

    def full_after_two(self, row):  # as the disk fills: the third row's write fails
        calls.append(row["point_id"])
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return writerow(self, row)

    monkeypatch.setattr(csv.DictWriter, "writerow", full_after_two)
    code = main([*SMOKE, f"results_dir={tmp_path}"])
    lines = capsys.readouterr().err.strip().splitlines()
    (out,) = (tmp_path / "smoke").iterdir()
    assert code == 1 and lines[-1] == (f"vlmprobe: {out / 'results.csv'} could not be written ([Errno 28] No space "
                                       f"left on device); the rows written before this one are kept in it, and the "
                                       f"sweep stops here")
    assert "Traceback" not in "\n".join(lines)
    assert pd.read_csv(out / "results.csv")["point_id"].tolist() == calls[:2]
    assert not [p.name for p in out.iterdir() if ".partial" in p.name]

    def half_then_full(frame, path, **kwargs):
        Path(path).write_bytes(b"PAR1 half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(csv.DictWriter, "writerow", writerow)
    monkeypatch.setattr(pd.DataFrame, "to_parquet", half_then_full)
    assert main([*SMOKE, f"resume={out}"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert f"vlmprobe: {out / 'results.parquet'} could not be written ([Errno 28] No space left on device); nothing " \
           f"of it was left half written" in lines
    assert not (out / "results.parquet").exists() and (out / "summary.md").is_file()
    assert len(pd.read_csv(out / "results.csv")) == 4


def test_a_folder_made_before_a_key_existed_resumes_while_the_command_leaves_that_key_at_its_default(copy, capsys):
    saved = yaml.safe_load((copy / "config.yaml").read_text())
    del saved["data"]["source"]  # as a vlmprobe before data.source wrote it
    (copy / "config.yaml").write_text(yaml.safe_dump(saved))
    code, lines = resume(copy, capsys)
    assert code == 0, lines
    code = main([*SMOKE, f"resume={copy}", "data.source=shapes.jsonl"])  # the command sets the key: not the same sweep
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "differs in: data.source" in lines[-1], lines
