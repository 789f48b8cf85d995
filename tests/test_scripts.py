"""The scripts under scripts/ still load against the package as it is now: a script is run by hand, rarely,
so a renamed import (CONF moved from vlmprobe.__main__ once) would otherwise surface only on the GPU day.
Each is loaded as a module (its imports run, its main does not); the shell scripts are parsed by bash -n."""

import os
import subprocess
import sys

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
        "gpu_check: VLMPROBE_GPU_CHECK_ONLY names 'allocater': give some of: cuda_tests fork nightly recording_cost "
        "allocator grpo dpo dataset pixtral_mask moe dist nanovlm_code"]


@pytest.mark.parametrize("script, args, line", [
    ("check_one_process", ["--lengths", "abc"],
     "argument --lengths: 'abc' is not allowed: give positive integers, comma-separated"),
    ("check_one_process", ["--batch-sizes", "0,8"],
     "argument --batch-sizes: '0,8' is not allowed: give positive integers, comma-separated"),
    ("check_one_process", ["--device", "none"], "argument --device: invalid choice: 'none'"),
    ("check_one_process", ["--lengths", "10"], "data.lm_max_length=10 is too short for nanovlm_222m"),
    ("check_per_sample", ["--lengths", "abc"],
     "argument --lengths: 'abc' is not allowed: give positive integers, comma-separated"),
    ("check_nanovlm_code", ["--nanovlm-dir", "/no/such/dir"],
     "model.source='/no/such/dir' is not allowed: give a checkout of huggingface/nanoVLM"),
    ("check_nanovlm_code", ["--nanovlm-dir", "x", "--batch-sizes", "8,-1"],
     "argument --batch-sizes: '8,-1' is not allowed: give positive integers, comma-separated"),
    ("check_nanovlm_code", ["--nanovlm-dir", "x", "--backend", "gpu"], "argument --backend: invalid choice: 'gpu'"),
    ("check_nanovlm_code", ["--nanovlm-dir", "x", "--model", "qwen2_vl_2b"],
     "argument --model: invalid choice: 'qwen2_vl_2b'"),
    ("check_nanovlm_code", [], "the following arguments are required: --nanovlm-dir"),
])
def test_a_scripts_bad_value_is_one_line_and_exit_2_before_any_point_runs(script, args, line):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / f"{script}.py"), *args], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (error,) = [text for text in proc.stderr.splitlines() if "error:" in text]
    assert line in error
