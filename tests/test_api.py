"""vlmprobe.api: the command from Python returns its rows as a DataFrame, its folder and exit code; bad input raises
the command's one-line ConfigError."""

import pytest

from vlmprobe.api import run
from vlmprobe.errors import ConfigError


def test_run_returns_the_rows_the_command_wrote(tmp_path):
    result = run(model="nanovlm_tiny", results_dir=str(tmp_path), launcher="local",
                 **{"data.batch_size": 2, "data.lm_max_length": 64, "measure.backend": "estimate"})
    assert result.exit_code == 0 and result.fits
    (row,) = result.table.to_dict("records")
    assert row["backend"] == "estimate" and row["batch_size"] == 2 and row["peak_allocated_bytes"] > 0
    assert (result.out_dir / "results.csv").is_file() and result.out_dir.parent.parent == tmp_path


def test_a_bad_value_raises_the_commands_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.batch_size=0 is not allowed: it must be a positive integer$"):
        run(model="nanovlm_tiny", results_dir=str(tmp_path), **{"data.batch_size": 0, "measure.backend": "estimate"})
