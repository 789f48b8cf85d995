"""A child process in a process group of its own: a timeout, or a Ctrl-C of the sweep, ends it whole; and on
Linux it dies with the process that started it, even one killed with SIGKILL (no orphan holds a GPU).

Workers and launched jobs start their own session so that killing the group reaches every process they
started (torchrun's ranks, a worker's threads). The other side of that: the terminal's Ctrl-C reaches only
the sweep's group, so the sweep ends the child's group itself before the interruption goes on. Children
started from other threads (launcher=pool) cannot see the Ctrl-C, which reaches the main thread only: they
are registered in a `Children`, whose kill() the main thread calls.

A child is a command (`run`, `start`), or a function run in a copy of this process (`run_forked`, `start_forked`,
`run_as_command`: what this process has imported, it need not import again).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import os
import signal
import subprocess
import sys
import tempfile
import threading

__all__ = ["Children", "FORKS", "die_with_parent", "kill_group", "run", "run_as_command", "run_forked", "start",
           "start_forked", "while_waiting"]


# Where a child may be a fork of this process without exec: Linux. (macOS's system libraries are not safe to use
# in a forked child; Windows has no fork.) Elsewhere a child is a fresh interpreter.
FORKS = sys.platform == "linux"
# Where a child can ask the kernel to be killed when its parent dies (prctl PR_SET_PDEATHSIG, Linux only): a
# worker outliving a sweep killed with SIGKILL would hold its GPU until its point ends. The signal is sent when the
# thread that started the child ends, so children are started by threads that wait for them (or the main thread).
PARENT_DEATH_SIGNAL = signal.SIGKILL if sys.platform == "linux" else None
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Children:
    """The children running now, started from several threads; kill() ends every one of them and, at once,
    any started after it (a thread may be between deciding to start a worker and starting it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self.killed = False

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._running.add(proc)
            if self.killed:
                kill_group(proc)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._running.discard(proc)

    def kill(self) -> None:
        with self._lock:
            self.killed = True
            for proc in self._running:
                if proc.returncode is None:  # not yet reaped: its pid (and group id) is still its own
                    kill_group(proc)


def run(command: list[str], stdin: str | None, env: dict | None, timeout: float | None,
        children: Children | None = None) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of `command`; the exit code is None when it outlived `timeout` seconds
    (it is then killed with its whole group). With `children`, the child is registered there while it runs."""
    proc = start(command, env, children)
    try:
        stdout, stderr = proc.communicate(stdin, timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = proc.communicate()
        return None, stdout, stderr
    except BaseException:  # Ctrl-C (or anything else) in the sweep: the child's group would run on without it
        kill_group(proc)
        proc.wait()
        raise
    finally:
        if children is not None:
            children.discard(proc)


def start(command: list[str], env: dict | None, children: Children | None = None) -> subprocess.Popen:
    """`command` with pipes for stdin, stdout and stderr (text), in a session of its own, dying with this process
    (Linux: `command` is exec'd by `python -m vlmprobe.child`, which asks for it first); registered in `children`
    when given (the caller discards it there once it has ended)."""
    if PARENT_DEATH_SIGNAL:
        command = [sys.executable, "-m", "vlmprobe.child", str(os.getpid()), *command]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    if children is not None:
        children.add(proc)
    return proc


_while_waiting: list = []


def while_waiting(fn) -> None:
    """Call fn() once, the next time this process waits on a child of run_forked or run_as_command: the sweep
    imports what its report needs (the plotting library: ~0.6 s here) on the core the child leaves idle, rather
    than after the last point. It runs after the fork, so the child never copies a half-made module."""
    _while_waiting.append(fn)


def run_forked(target, timeout: float | None) -> tuple[int | None, str, str]:
    """run() for `target()` in a child forked from this process (multiprocessing's fork context), in a session of
    its own as `start` gives a command: (exit code: 1 if it raised, with the traceback on stderr; None if it
    outlived `timeout` and was killed with its group; stdout; stderr)."""
    import multiprocessing
    import tempfile

    files = [tempfile.TemporaryFile("w+") for _ in range(2)]  # stdout, stderr: no pipe to fill up
    ready, grouped = multiprocessing.Pipe(duplex=False)
    proc = multiprocessing.get_context("fork").Process(target=_in_own_session,
                                                       args=(target, files, grouped, os.getpid()))
    _freeze_before_fork()
    proc.start()
    grouped.close()
    try:
        _run_while_waiting()
        with contextlib.suppress(EOFError):  # EOF: it died before saying so
            ready.recv()  # it leads its own group now: kill_group reaches everything it starts
        proc.join(timeout)
        code = proc.exitcode
        if code is None:
            kill_group(proc)
            proc.join()
        outputs = []
        for file in files:
            file.seek(0)
            outputs.append(file.read())
        return code, outputs[0], outputs[1]
    except BaseException:  # Ctrl-C in the sweep, as in run()
        kill_group(proc)
        proc.join()
        raise
    finally:
        ready.close()
        for file in files:
            file.close()


def _run_while_waiting() -> None:
    while _while_waiting:
        with contextlib.suppress(Exception):  # an import that fails fails again where its user says so
            _while_waiting.pop()()


def _freeze_before_fork() -> None:
    """What lives now is never walked by a collection again, here or in a child forked next (gc.freeze, after a
    collection: what is frozen is alive). A collection writes to every object it walks, and each page either
    process writes is copied for it (Python's advice for a fork without exec). Measured: seq_len's first two
    points in a pool of two forked workers took 4.8 s each with the heap walked in the children, 2.3 s without."""
    import gc

    gc.collect()
    gc.freeze()


def _in_own_session(target, files, grouped, parent: int) -> None:
    die_with_parent(parent)
    os.setsid()
    grouped.send(True)
    grouped.close()
    _as_child({1: files[0].fileno(), 2: files[1].fileno()})
    target()


def _as_child(streams: dict[int, int]) -> None:
    """In a forked child: standard stream N on file descriptor streams[N], and torch on one thread."""
    for fd, source in streams.items():
        os.dup2(source, fd)
    # new stream objects: a thread of the parent may have held the old ones' locks when it forked
    if 0 in streams:
        sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    # a crash's dump as a fresh interpreter would write it: to this child's stderr where the environment asks for
    # one, else none; not to the file the parent's faulthandler has (pytest's, whose output it interleaved)
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(file=sys.stderr)
    else:
        faulthandler.disable()
    if "torch" in sys.modules:
        # GNU OpenMP's threads do not survive a fork: a parallel region in the child would wait for the parent's
        # pool forever (seen: repeat_interleave in a ZeRO-3 rank's child, once the parent had run one). With one
        # thread torch runs every op inline, as DataLoader's forked workers do
        sys.modules["torch"].set_num_threads(1)


class Forked:
    """What start() gives of a command, for a function run in a forked child (start_forked): its pid (it leads a
    group of its own), text pipes to its standard streams (None under run_as_command), returncode, poll() and
    wait()."""

    def __init__(self, pid: int, stdin, stdout, stderr):
        self.pid, self.stdin, self.stdout, self.stderr = pid, stdin, stdout, stderr
        self.returncode: int | None = None
        self._waiting = threading.Lock()  # one thread reaps it

    def poll(self) -> int | None:
        if self.returncode is None and self._waiting.acquire(blocking=False):  # else a wait() is reaping it
            try:
                self._reap(os.WNOHANG)
            finally:
                self._waiting.release()
        return self.returncode

    def wait(self) -> int:
        with self._waiting:
            if self.returncode is None:
                self._reap(0)
        return self.returncode

    def _reap(self, flags: int) -> None:
        pid, status = os.waitpid(self.pid, flags)
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)


def start_forked(target, env: dict, children: Children | None = None) -> Forked:
    """start() for `target()` run in a child forked from this process, with `env` as its environment: no
    interpreter to start and nothing to import again. Fork only where no other thread of this process is inside
    torch or an estimate session: the child is a copy of this process as it stands (vlmprobe.run.pool forks its
    workers so). The child ends when target returns (0), raises (1, the traceback on stderr) or exits."""
    ends = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr: (read, write) each
    pid = _fork(target, env, {0: ends[0][0], 1: ends[1][1], 2: ends[2][1]}, [end for pair in ends for end in pair])
    for end in (ends[0][0], ends[1][1], ends[2][1]):
        os.close(end)
    proc = Forked(pid, open(ends[0][1], "w"), open(ends[1][0]), open(ends[2][0]))
    if children is not None:
        children.add(proc)
    return proc


def run_as_command(target, stdin: str, env: dict, timeout: float | None,
                   children: Children | None = None) -> tuple[int | None, str, str]:
    """run() for `target()` (which returns an exit code) run as a command would run it, in a child forked from
    this process (start_forked's): `stdin` on its standard input, `env` as its environment, in a session of its
    own, registered in `children` while it runs. What is not the child's own is dropped first: the parent's exit
    handlers (they end the parent's resources; those registered in the child run when target returns, as an
    interpreter runs them at exit) and its Ctrl-C and SIGTERM handlers (Python's defaults instead). The child ends
    with os._exit: a library's C-level teardown at exit (CUDA's) does not run there. (exit code: target's, 1 if
    it raised, with the traceback on stderr, negative for a signal; None if it outlived `timeout` and was killed
    with its group; stdout; stderr)."""
    files = [tempfile.TemporaryFile("w+") for _ in range(3)]  # stdin, stdout, stderr: no pipe to fill up
    try:
        files[0].write(stdin)
        files[0].flush()
        files[0].seek(0)
        pid = _fork(lambda: _as_command(target), env, {fd: file.fileno() for fd, file in enumerate(files)}, [])
        proc = Forked(pid, None, None, None)
        if children is not None:
            children.add(proc)
        reaper = threading.Thread(target=proc.wait, name="vlmprobe-wait-fork", daemon=True)
        reaper.start()
        try:
            _run_while_waiting()
            reaper.join(timeout)
            if reaper.is_alive():  # not reaped: its pid (and group id) is still its own
                kill_group(proc)
                reaper.join()
                code = None
            else:
                code = proc.returncode
        except BaseException:  # Ctrl-C in the sweep, as in run()
            if proc.returncode is None:
                kill_group(proc)
            reaper.join()
            raise
        finally:
            if children is not None:
                children.discard(proc)
        outputs = []
        for file in files[1:]:
            file.seek(0)
            outputs.append(file.read())
        return code, outputs[0], outputs[1]
    finally:
        for file in files:
            file.close()


def _as_command(target) -> None:
    """In run_as_command's child: target() with a fresh interpreter's exit and signal handling."""
    atexit._clear()  # the parent's exit handlers (CPython's atexit module): not this child's to run
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        code = target()
    finally:
        atexit._run_exitfuncs()  # the ones registered here, as an interpreter runs them at its exit
    raise SystemExit(code)


def _fork(target, env: dict, streams: dict[int, int], inherited: list[int]) -> int:
    """The pid of a child forked from this process that runs `target()` with `env` as its environment and
    standard stream N on file descriptor streams[N], in a session of its own (it leads its group once this
    returns), dying with this process; `inherited`: descriptors the child closes once its streams are set. It
    ends when target returns (0), raises SystemExit (its code), raises anything else (1, the traceback on
    stderr) or is killed."""
    grouped_r, grouped_w = os.pipe()
    _freeze_before_fork()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            die_with_parent(parent)
            os.setsid()
            os.close(grouped_w)  # the parent reads EOF: this child leads its own group now
            os.environ.clear()
            os.environ.update(env)
            _as_child(streams)
            for end in (*inherited, grouped_r):
                os.close(end)
            target()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    os.close(grouped_w)
    with open(grouped_r, "rb") as grouped:
        grouped.read()  # until the child has its own group (or died): kill_group reaches everything it starts
    return pid


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to kill this process when its parent dies (Linux; elsewhere nothing). With `parent` (the
    pid that started it), a parent already gone before the request is caught too: this process then exits."""
    if PARENT_DEATH_SIGNAL is None:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def kill_group(proc) -> None:
    """End the group `proc` leads (a Popen from start(), or run_forked's multiprocessing Process)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":  # start()'s shim: `python -m vlmprobe.child PARENT COMMAND...` asks, then runs COMMAND
    die_with_parent(int(sys.argv[1]))
    os.execvp(sys.argv[2], sys.argv[2:])
