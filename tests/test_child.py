"""Child processes in a group of their own: a timeout or a Ctrl-C of the sweep ends the whole group."""

import os
import signal
import subprocess
import sys
import time

import pytest

from vlmprobe import child


def alive(pid: int) -> bool:
    """Running, not a zombie (a killed orphan may wait for a reaper that a container does not have)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def started_grandchild(tmp_path) -> list[str]:
    """A shell that starts a long sleep (a grandchild, as torchrun starts ranks) and waits for it."""
    return ["sh", "-c", f"sleep 60 & echo $! > {tmp_path}/pid; wait"]


def grandchild(tmp_path) -> int:
    for _ in range(100):
        if (tmp_path / "pid").exists() and (tmp_path / "pid").read_text().strip():
            return int((tmp_path / "pid").read_text())
        time.sleep(0.05)
    raise AssertionError("the grandchild never started")


def test_a_child_past_its_timeout_is_killed_with_everything_it_started(tmp_path):
    code, _, _ = child.run(started_grandchild(tmp_path), None, None, timeout=1)
    assert code is None
    pid = grandchild(tmp_path)
    time.sleep(0.2)
    assert not alive(pid)


def forked_shell(command, timeout):
    import subprocess

    return child.run_forked(lambda: subprocess.run(command), timeout)


@pytest.mark.parametrize("run", [lambda command, timeout: child.run(command, None, None, timeout), forked_shell],
                         ids=["command", "forked"])
def test_ctrl_c_of_the_sweep_ends_the_childs_whole_group_then_goes_on(tmp_path, run):
    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)  # stands in for the terminal's SIGINT to our group only
    signal.alarm(1)
    try:
        with pytest.raises(KeyboardInterrupt):
            run(started_grandchild(tmp_path), timeout=30)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    pid = grandchild(tmp_path)
    time.sleep(0.2)
    assert not alive(pid)


def test_a_forked_child_gives_back_what_it_printed_and_its_exit_code():
    def fails():
        print("before the failure")
        raise ValueError("the target's own error")

    assert child.run_forked(lambda: print("from the child"), timeout=30) == (0, "from the child\n", "")
    code, stdout, stderr = child.run_forked(fails, timeout=30)
    assert (code, stdout) == (1, "before the failure\n")
    assert stderr.rstrip().endswith("ValueError: the target's own error")



def test_what_the_parent_does_while_waiting_runs_once_in_the_parent_while_the_child_runs(tmp_path):
    """child.while_waiting: the sweep's report imports run on the core a forked child leaves idle; one that
    fails costs the child nothing."""
    ran = []

    def meanwhile():
        ran.append((os.getpid(), (tmp_path / "done").exists()))  # the child has not finished yet

    def broken():
        raise ImportError("no such plotting library")

    child.while_waiting(meanwhile)
    child.while_waiting(broken)
    done = lambda: time.sleep(0.5) or (tmp_path / "done").write_text("")  # noqa: E731
    assert child.run_forked(done, timeout=30)[0] == 0
    assert child.run_forked(done, timeout=30)[0] == 0
    assert ran == [(os.getpid(), False)]

def test_a_forked_child_past_its_timeout_is_killed_with_everything_it_started(tmp_path):
    code, _, _ = forked_shell(started_grandchild(tmp_path), timeout=1)
    assert code is None
    pid = grandchild(tmp_path)
    time.sleep(0.2)
    assert not alive(pid)


def test_a_forked_child_runs_torch_ops_after_the_parent_has_run_them_on_several_threads():
    import torch

    def parallel_op():  # repeat_interleave over more than one grain: a parallel region when threads > 1
        return torch.arange(200_000).repeat_interleave(2).sum().item()

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # GNU OpenMP's pool, which a fork does not copy, exists from here on
    try:
        expected = parallel_op()
        assert child.run_forked(lambda: print(parallel_op()), timeout=30) == (0, f"{expected}\n", "")
    finally:
        torch.set_num_threads(threads)


def test_a_started_fork_reads_its_input_writes_its_streams_and_is_killed_with_its_group():
    def echo():
        import os
        import subprocess
        import sys

        subprocess.Popen(["sleep", "300"])  # in its group: killed with it
        print("env", os.environ.get("VLMPROBE_TEST_ENV"), flush=True)
        for line in sys.stdin:
            print("got", line.strip(), flush=True)
            print("to stderr", file=sys.stderr, flush=True)

    children = child.Children()
    proc = child.start_forked(echo, {"VLMPROBE_TEST_ENV": "given"}, children)
    assert proc.stdout.readline() == "env given\n"  # the environment it was given, not this process's
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "got hello\n" and proc.stderr.readline() == "to stderr\n"
    assert proc.poll() is None and os.getpgid(proc.pid) == proc.pid  # it leads a group of its own
    children.kill()
    assert proc.wait() == -signal.SIGKILL
    deadline = time.monotonic() + 10  # nothing of its group is left once reaped: the sleep was killed with it
    with pytest.raises(ProcessLookupError):
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)
            time.sleep(0.1)


def test_a_started_fork_that_raises_exits_1_with_its_traceback():
    def broken():
        raise RuntimeError("broken on purpose")

    proc = child.start_forked(broken, {})
    assert proc.wait() == 1 and "RuntimeError: broken on purpose" in proc.stderr.read()


CRASHING_FORK = """
import ctypes, faulthandler, json, sys
from vlmprobe import child

def crash():
    print("about to crash", file=sys.stderr, flush=True)
    ctypes.string_at(0)  # a read of address 0: SIGSEGV

faulthandler.enable(file=open(sys.argv[1], "w"))  # as pytest enables it for its own process
proc = child.start_forked(crash, json.loads(sys.argv[2]))
print(json.dumps([proc.wait(), proc.stderr.read()]))
"""


@pytest.mark.parametrize("asked", [False, True], ids=["no dump asked", "PYTHONFAULTHANDLER=1"])
def test_a_crashing_fork_dumps_its_stack_as_a_fresh_interpreter_would_never_into_the_parents_file(tmp_path, asked):
    import json
    import subprocess

    parents = tmp_path / "parents_dump"
    env = {"PYTHONFAULTHANDLER": "1"} if asked else {}
    out = subprocess.run([sys.executable, "-c", CRASHING_FORK, str(parents), json.dumps(env)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    code, stderr = json.loads(out.splitlines()[-1])
    assert code == -signal.SIGSEGV and "about to crash" in stderr
    assert ("Fatal Python error: Segmentation fault" in stderr) == asked
    assert parents.read_text() == ""


@pytest.mark.parametrize("how", ["started", "forked"])
def test_a_child_dies_with_a_parent_killed_with_sigkill(tmp_path, how):
    """A parent killed outright runs no handler (a sweep's SIGKILL, an OOM kill): its child asked the kernel to
    die with it (Linux), so no worker outlives its sweep holding a GPU."""
    if child.PARENT_DEATH_SIGNAL is None:
        pytest.skip("the parent-death signal is Linux's")
    start = ("child.start([sys.executable, '-c', 'import time; time.sleep(60)'], None)" if how == "started" else
             "child.start_forked(lambda: time.sleep(60), dict(os.environ))")
    code = (f"import os, sys, time\nfrom vlmprobe import child\nproc = {start}\n"
            f"open({str(tmp_path / 'pid')!r}, 'w').write(str(proc.pid))\ntime.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    pid = grandchild(tmp_path)
    assert alive(pid)
    parent.kill()
    parent.wait()
    deadline = time.time() + 2
    while time.time() < deadline and alive(pid):
        time.sleep(0.05)
    assert not alive(pid)
