"""A point that needs a fresh process, forked from the sweep (vlmprobe.run.workers.call_worker): the spawned
worker's row, a fresh process per point, the spawned worker wherever a fork could not give the same."""

import atexit
import os
import signal
import sys
import threading
import time

import pytest

from test_child import alive, grandchild, started_grandchild
from vlmprobe import child
from vlmprobe.point import worker
from vlmprobe.run import workers
from vlmprobe.run.sweep import run_point

TINY = ["model=nanovlm_tiny", "data.lm_max_length=32", "measure.backend=cpu", "measure.isolate=true"]
TIMES = ("step_time_s",)  # a row's only column that differs between two runs of one point


@pytest.fixture(autouse=True)
def torch_read_no_allocator_settings(monkeypatch):
    """As if this process had started without PYTORCH_ALLOC_CONF (the cpu backend's rows do not depend on it)."""
    monkeypatch.setattr(workers, "TORCH_ALLOCATOR_SETTINGS", (None, None))


def forbid_spawning(monkeypatch) -> None:
    def spawned(*args, **kwargs):
        raise AssertionError("a worker was spawned where a fork was expected")

    monkeypatch.setattr(child, "run", spawned)


@pytest.fixture
def no_spawning(monkeypatch):
    """Any spawned worker fails the test: what runs is a fork."""
    forbid_spawning(monkeypatch)


def spawned_only(monkeypatch, calls: list):
    """call_worker spawns a stand-in that records its environment and prints a row; any fork fails the test."""
    def forked(*args, **kwargs):
        raise AssertionError("a worker was forked where it must be spawned")

    def spawned(command, stdin, env, timeout, children=None):
        calls.append(command)
        return 0, worker.ROW_PREFIX + '{"status": "ok"}\n', ""

    monkeypatch.setattr(child, "run_as_command", forked)
    monkeypatch.setattr(child, "run", spawned)


@pytest.mark.slow
def test_a_forked_point_gives_the_spawned_workers_row_byte_for_byte(point, monkeypatch):
    # ~10 s: one spawned worker imports torch, transformers and the model code
    config = point(TINY + ["data.batch_size=2"])
    with monkeypatch.context() as forking:
        forbid_spawning(forking)
        forked = run_point(config)
    monkeypatch.setattr(child, "FORKS", False)
    spawned = run_point(config)
    assert forked["status"] == spawned["status"] == "ok"
    assert forked.keys() == spawned.keys()
    figures = [k for k in spawned if k.endswith("_bytes")]
    assert len(figures) >= 8 and all(isinstance(spawned[k], int) for k in ("peak_allocated_bytes",
                                                                            "peak_reserved_bytes"))
    assert {k: forked[k] for k in figures} == {k: spawned[k] for k in figures}
    assert {k: v for k, v in forked.items() if k not in TIMES} == {k: v for k, v in spawned.items() if k not in TIMES}


def test_each_forked_point_runs_in_a_fresh_process_whose_allocator_starts_empty(point, monkeypatch, no_spawning):
    measure = worker.measure

    def measure_and_say_where(request):  # in the child: what it was given by its parent, then the point
        inherited = getattr(worker, "LEFT_BY_A_POINT", None)
        worker.LEFT_BY_A_POINT = os.getpid()  # state a point leaves behind in its process
        return {**measure(request), "pid": os.getpid(), "parent": os.getppid(), "inherited": inherited}

    monkeypatch.setattr(worker, "measure", measure_and_say_where)
    config = point(TINY)
    first, second = run_point(config), run_point(config)
    assert first["status"] == second["status"] == "ok"
    assert first["parent"] == second["parent"] == os.getpid()
    assert len({first["pid"], second["pid"], os.getpid()}) == 3
    assert first["inherited"] is second["inherited"] is None  # nothing of the first point's process in the second
    assert second["peak_allocated_bytes"] == first["peak_allocated_bytes"] > 0
    assert second["peak_reserved_bytes"] == first["peak_reserved_bytes"] > 0
    assert not hasattr(worker, "LEFT_BY_A_POINT")


@pytest.mark.parametrize("spec,status,says", [
    ("RaisingSpec", "error", "RuntimeError: broken on purpose"),
    ("CrashingSpec", "crash", "worker killed by signal 11; stderr tail: about to crash"),
    ("DyingAtExitSpec", "ok", "worker killed by signal 11 after printing its row"),
], ids=["raises", "killed by a signal", "dies at exit"])
def test_a_forked_point_that_fails_is_the_row_a_spawned_worker_gives(point, no_spawning, spec, status, says):
    # the rows tests/test_worker.py asks of a spawned worker (faulty_models is imported here already)
    row = run_point(point(TINY + [f"model._target_=faulty_models.{spec}"]))
    assert row["status"] == status
    assert says in (row.get("error") or row.get("notes") or "")


@pytest.mark.parametrize("how", ["timeout", "children.kill", "Ctrl-C"])
def test_a_forked_worker_is_killed_with_everything_it_started(tmp_path, how):
    # the timeout's kill, launcher=pool's Ctrl-C (Children.kill from the main thread while a pool thread waits)
    # and the sweep's own Ctrl-C each end the child's whole group
    children = child.Children()

    def hang():
        import subprocess

        return subprocess.run(started_grandchild(tmp_path)).returncode

    if how == "timeout":
        assert child.run_as_command(hang, "", dict(os.environ), 1, children)[0] is None
    elif how == "children.kill":
        threading.Timer(1, children.kill).start()
        assert child.run_as_command(hang, "", dict(os.environ), 30, children)[0] == -signal.SIGKILL
    else:
        def interrupt(*_):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)  # stands in for the terminal's SIGINT
        signal.alarm(1)
        try:
            with pytest.raises(KeyboardInterrupt):
                child.run_as_command(hang, "", dict(os.environ), 30, children)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
    pid = grandchild(tmp_path)
    time.sleep(0.2)
    assert not alive(pid) and not children._running


def test_a_forked_worker_has_its_own_environment_input_and_exit_handling_as_a_command_would():
    parents_handler_ran = []
    atexit.register(parents_handler_ran.append, "in the child")  # the parent's: the child must not run it

    def command():
        print(os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("PYTORCH_ALLOC_CONF"), sys.stdin.read())
        print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
              signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        atexit.register(lambda: print("the child's own exit handler", file=sys.stderr))
        return 7

    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # as vlmprobe.interrupt sets it in the sweep
    try:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "5", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
        code, stdout, stderr = child.run_as_command(command, '{"request": 1}', env, 30)
    finally:
        signal.signal(signal.SIGTERM, previous)
        atexit.unregister(parents_handler_ran.append)
    assert (code, stdout) == (7, '5 expandable_segments:True {"request": 1}\nTrue True\n')
    assert stderr == "the child's own exit handler\n"
    assert "PYTORCH_ALLOC_CONF" not in os.environ or os.environ["PYTORCH_ALLOC_CONF"] != "expandable_segments:True"


@pytest.mark.parametrize("why", ["no fork", "pool thread", "CUDA initialised", "CUDA driver started",
                                 "other allocator settings"])
def test_a_point_is_spawned_as_before_wherever_a_fork_could_not_give_the_same(monkeypatch, why):
    calls = []
    spawned_only(monkeypatch, calls)
    env = workers.worker_env({"measure": {"alloc_conf": None}})
    assert workers.fork_refusal(env) is None  # here: a fork would do
    if why == "no fork":
        monkeypatch.setattr(child, "FORKS", False)
    elif why == "CUDA initialised":
        monkeypatch.setattr(workers.torch.cuda, "is_initialized", lambda: True)
    elif why == "CUDA driver started":  # torch.cuda.is_available ran cuInit: the driver answers a device count
        monkeypatch.setattr(workers, "cuda_driver", lambda: StandInDriver(answer=0))
    elif why == "other allocator settings":
        env = workers.worker_env({"measure": {"alloc_conf": "expandable_segments:True"}})
    rows, refusals = [], []

    def call():
        refusals.append(workers.fork_refusal(env))
        rows.append(workers.call_worker({"describe": "estimate"}, env, 10))

    if why == "pool thread":
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
    else:
        call()
    assert rows == [{"status": "ok"}] and calls == [[sys.executable, "-m", "vlmprobe.point.worker"]]
    assert refusals[0] is not None


class StandInDriver:
    """The CUDA driver's answer to cuDeviceGetCount (0: CUDA_SUCCESS, cuInit has run; 3: not initialised)."""

    def __init__(self, answer: int):
        self.answer = answer

    def cuDeviceGetCount(self, count):
        return self.answer


@pytest.mark.parametrize("driver,started", [(None, False), (StandInDriver(3), False), (StandInDriver(0), True),
                                            (StandInDriver(100), True), (object(), True)],
                         ids=["not loaded", "loaded, no cuInit", "cuInit ran", "cuInit failed", "cannot say"])
def test_cuda_counts_as_started_once_the_driver_answers_or_cannot_say(monkeypatch, driver, started):
    monkeypatch.setattr(workers, "cuda_driver", lambda: driver)
    assert workers.cuda_started() is started


def test_the_driver_is_looked_up_among_loaded_libraries_only(monkeypatch):
    monkeypatch.setattr(workers, "CUDA_DRIVER", "libc.so.6")  # loaded in every Python process here
    assert workers.cuda_driver() is not None
    monkeypatch.setattr(workers, "CUDA_DRIVER", "libvlmprobe_not_a_library.so.1")
    assert workers.cuda_driver() is None
