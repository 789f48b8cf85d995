"""A built wheel, installed without the checkout, carries conf/ and runs the main job's command."""

import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow  # builds a wheel and a virtual environment: ~1 min
def test_a_wheel_installed_in_a_fresh_venv_finds_its_configs_and_runs(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(REPO)], check=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], check=True)
    where = subprocess.run([python, "-c", "import vlmprobe.paths as p; print(p.CONF)"], capture_output=True, text=True,
                           cwd=tmp_path, check=True).stdout.strip()
    assert where.startswith(str(tmp_path / "venv")) and where.endswith("vlmprobe/conf")
    run = subprocess.run([tmp_path / "venv" / "bin" / "vlmprobe", "+sweep=smoke", "measure.backend=estimate",
                          f"results_dir={tmp_path / 'results'}"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "data.batch_size=2,data.lm_max_length=64: needs " in run.stdout
