"""The scripts under scripts/ still load against the package as it is now: a script is run by hand, rarely,
so a renamed import (CONF moved from vlmprobe.__main__ once) would otherwise surface only on the GPU day.
Each is loaded as a module (its imports run, its main does not); the shell scripts are parsed by bash -n."""

import os
import subprocess

import pytest

from conftest import REPO, load_script

PYTHON_SCRIPTS = sorted((REPO / "scripts").glob("*.py"))
SHELL_SCRIPTS = sorted((REPO / "scripts").glob("*.sh"))


@pytest.mark.parametrize("path", PYTHON_SCRIPTS, ids=lambda p: p.name)
def test_every_python_script_imports_and_has_a_main(path):
    module = load_script(path.stem)
    assert callable(module.main) and module.__doc__


@pytest.mark.parametrize("path", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_every_shell_script_parses(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_gpu_check_refuses_a_part_it_does_not_have_in_one_line_before_looking_for_a_gpu():
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          env={**os.environ, "VLMPROBE_GPU_CHECK_ONLY": "nightly allocater"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gpu_check: VLMPROBE_GPU_CHECK_ONLY names 'allocater': give some of: cuda_tests nightly recording_cost "
        "allocator grpo dist nanovlm_code"]
