"""The worker client: how the sweep process runs a point in a worker process (vlmprobe.point.worker) and
turns whatever happens there into a row. A worker that raises gives an `error` row, one that dies (signal, other
exit) a `crash` row, one that outlives measure.timeout_s a `timeout` row.

A fresh worker per point (`call_worker`) where the backend needs one (cuda: allocator state must not leak between
points) or measure.isolate=true; otherwise launcher=pool keeps long-lived ones (`ServingWorker`).

A fresh worker is forked from this process (torch, transformers and the model code are imported already: no
interpreter to start) where that gives what `python -m vlmprobe.point.worker` would (`fork_refusal`): on Linux
(child.FORKS), from the main thread (the pool's threads fork nothing: another thread may be inside an import or
a lock the child would need), while CUDA has not started here (a forked child cannot use a CUDA driver its parent
started: torch/cuda/__init__.py 2.13, is_available's "poison fork" note), and with the allocator settings torch
read when this process imported it (its CUDA library reads PYTORCH_ALLOC_CONF as it loads: BackendStaticInitializer
in c10/cuda/CUDACachingAllocator.cpp, read in PyTorch's main-branch source, which the wheel does not ship).
Otherwise, and elsewhere, it is spawned. Known limits: the sweep's own check for a GPU (torch.cuda.is_available)
starts the CUDA driver unless PYTORCH_NVML_BASED_CUDA_CHECK=1, so cuda points are spawned unless that is set; a
forked child runs torch on one CPU thread (vlmprobe.child) and skips C-level teardown at exit (os._exit), where a
spawned one can die in it after its row; not yet run on a GPU.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import queue
import sys
import threading

import torch

from vlmprobe import backends, child
from vlmprobe.point.measure import TAIL
from vlmprobe.point.worker import RAISED, ROW_PREFIX, last_row, run_command, serve
from vlmprobe.states import Status

__all__ = ["CUDA_DRIVER", "ServingWorker", "allocator_settings", "call_worker", "cuda_started", "describe_backend",
           "fork_refusal", "isolated", "worker_env"]


def isolated(config: dict) -> bool:
    choice = config["measure"]["isolate"]
    return backends.get(config["measure"]["backend"]).isolate if choice == "auto" else bool(choice)


# Read by the CUDA allocator when CUDA starts, so they must be in the worker's environment. torch 2.13 reads
# PYTORCH_ALLOC_CONF first and PYTORCH_CUDA_ALLOC_CONF (the older name) only without it: the worker gets
# both, or neither, so that what the row's alloc_conf says is what the allocator runs with.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def worker_env(config: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARS}
    alloc_conf = config["measure"].get("alloc_conf")
    if alloc_conf:
        env.update(dict.fromkeys(ALLOC_CONF_VARS, alloc_conf))
    return env


def allocator_settings(env: dict) -> tuple:
    """What a worker's environment says of its points: their allocator settings (the rest is this process's own
    environment, which importing torch's compiler adds to: TORCHINDUCTOR_CACHE_DIR)."""
    return tuple(env.get(k) for k in ALLOC_CONF_VARS)


# The allocator settings torch read from this process's environment: torch is imported above, and its CUDA
# library parsed them as it loaded; a forked child keeps them whatever its own environment says.
TORCH_ALLOCATOR_SETTINGS = allocator_settings(os.environ)
CUDA_DRIVER = "libcuda.so.1"  # the name the CUDA runtime and torch open the driver by
CUDA_ERROR_NOT_INITIALIZED = 3  # cuda.h: what the driver answers before cuInit


def cuda_driver():
    """The CUDA driver library where this process has loaded it, else None (RTLD_NOLOAD: this never loads it)."""
    try:
        return ctypes.CDLL(CUDA_DRIVER, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None


def cuda_started() -> bool:
    """Whether CUDA may have started in this process: torch initialised it, or the driver it loaded answers a
    device count (it answers CUDA_ERROR_NOT_INITIALIZED until cuInit, which torch.cuda.is_available calls without
    torch counting CUDA as initialised). A driver that cannot say counts as started."""
    if torch.cuda.is_initialized():
        return True
    driver = cuda_driver()
    if driver is None:
        return False
    count = ctypes.c_int(0)
    try:
        answer = driver.cuDeviceGetCount(ctypes.byref(count))
    except AttributeError:
        return True
    return answer != CUDA_ERROR_NOT_INITIALIZED


def fork_refusal(env: dict) -> str | None:
    """Why a fresh worker with environment `env` cannot be forked from this process now (module docstring), or
    None where it can. Asked right before each fork: CUDA may start here between two points."""
    if not child.FORKS:
        return "this system's children are fresh interpreters (child.FORKS)"
    if threading.current_thread() is not threading.main_thread():
        return "not the main thread: another thread may hold an import or a lock the child would need"
    if allocator_settings(env) != TORCH_ALLOCATOR_SETTINGS:
        return "its allocator settings differ from those torch read when this process started"
    if cuda_started():
        return "CUDA has started in this process: a forked child could not use it"
    return None


def call_worker(request: dict, env: dict, timeout: float | None, children: child.Children | None = None) -> dict:
    """Run `python -m vlmprobe.point.worker` on one request, in a fork of this process where fork_refusal allows
    (the same program on the same input: the same row), else spawned; its result, or a failed row. `children`:
    where a worker started off the main thread is registered, so that a Ctrl-C can end it (launcher=pool)."""
    if fork_refusal(env) is None:
        code, stdout, stderr = child.run_as_command(lambda: run_command([]), json.dumps(request), env, timeout,
                                                    children)
    else:  # a fresh interpreter, which imports everything again (fork_refusal says why)
        code, stdout, stderr = child.run([sys.executable, "-m", "vlmprobe.point.worker"], json.dumps(request), env,
                                         timeout, children)
    if code is None:
        return {"status": Status.TIMEOUT, "error": f"no result after {timeout} s; stderr tail: {stderr[-TAIL:]}"}
    row = last_row(stdout)
    if row is not None:
        if code != 0:  # died after its row was out (e.g. CUDA teardown at exit): the figures stand
            exit_note = f"worker {_how(code)} after printing its row; stderr tail: {stderr.strip()[-TAIL:]}"
            row["notes"] = "; ".join(n for n in (row.get("notes"), exit_note) if n)
        return row
    return _died(code, stderr)


def _how(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _died(code: int, stderr: str) -> dict:
    """The row of a point whose worker ended with `code` before printing its result."""
    if code == RAISED:
        return {"status": Status.ERROR, "error": stderr.strip()[-TAIL:]}
    return {"status": Status.CRASH, "error": f"worker {_how(code)}; stderr tail: {stderr.strip()[-TAIL:]}"}


class ServingWorker:
    """A process that measures the points it is given one after another (vlmprobe.point.worker.serve; launcher=pool,
    for points that need no fresh process): on Linux a fork of this one (torch, the model code and the backend
    are imported already), elsewhere a fresh `python -m vlmprobe.point.worker --serve` (child.FORKS). A point that
    outlives its timeout, or whose worker dies under it, is the same failed row as under call_worker; that worker
    is then done with (alive() is false). Made only where nothing in this process is inside a point
    (vlmprobe.run.pool)."""

    STDERR_LINES = 400  # lines of stderr kept, for a failed row's tail

    def __init__(self, env: dict, children: child.Children):
        self.env = env
        self._children = children
        self._proc = (child.start_forked(serve, env, children) if child.FORKS else
                      child.start([sys.executable, "-m", "vlmprobe.point.worker", "--serve"], env, children))
        self._rows: queue.Queue = queue.Queue()  # result lines as they come, then None when stdout ends
        self._stderr: collections.deque = collections.deque(maxlen=self.STDERR_LINES)  # (line number, line)
        self._stderr_count = 0
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self._proc.stdout:
            if line.startswith(ROW_PREFIX):
                self._rows.put(line)
        self._rows.put(None)

    def _read_stderr(self) -> None:  # read as it comes: a full pipe would block the worker
        for line in self._proc.stderr:
            self._stderr_count += 1
            self._stderr.append((self._stderr_count, line))

    def alive(self) -> bool:
        return self._proc.poll() is None

    def call(self, request: dict, timeout: float | None) -> dict:
        """The outputs of one point, or its failed row."""
        mark = self._stderr_count
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except OSError:  # it has died: the end of its stdout says so below
            pass
        try:
            line = self._rows.get(timeout=timeout)
        except queue.Empty:
            self.close()
            return {"status": Status.TIMEOUT, "error": f"no result after {timeout} s; stderr tail: {self._tail(mark)}"}
        if line is None:
            code = self._proc.wait()
            self._children.discard(self._proc)
            return _died(code, self._tail(mark))
        return json.loads(line[len(ROW_PREFIX):])

    def _tail(self, mark: int) -> str:
        """What the worker wrote to stderr since line `mark`, as far as it is kept."""
        return "".join(line for number, line in list(self._stderr) if number > mark).strip()[-TAIL:]

    def close(self) -> None:
        """End the worker, killed with its group: it is between points (every row it gave is in), or past its
        point's timeout. (Not at the end of its input: a worker forked after it holds a copy of that pipe.) One
        already ended is only reaped: its pid may be another process's once reaped."""
        if self._proc.poll() is None:
            child.kill_group(self._proc)
        self._proc.wait()
        self._children.discard(self._proc)


def describe_backend(name: str, config: dict) -> dict:
    """Provenance of the backend, read where the points run (a worker, for backends that need isolation)."""
    backend = backends.get(name)
    if not backend.isolate:
        return backend.describe()
    result = call_worker({"describe": name}, worker_env(config), 300)
    return result if "status" not in result else {"backend": name, "describe_error": result.get("error")}
