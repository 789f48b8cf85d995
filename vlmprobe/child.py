"""A child process in a process group of its own: a timeout, or a Ctrl-C of the sweep, ends it whole.

Workers and launched jobs start their own session so that killing the group reaches every process they
started (torchrun's ranks, a worker's threads). The other side of that: the terminal's Ctrl-C reaches only
the sweep's group, so the sweep ends the child's group itself before the interruption goes on. Children
started from other threads (launcher=pool) cannot see the Ctrl-C, which reaches the main thread only: they
are registered in a `Children`, whose kill() the main thread calls.

A child is a command (`run`, `start`), or a function run in a copy of this process (`run_forked`: what this
process has imported, it need not import again).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading


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
    """`command` with pipes for stdin, stdout and stderr (text), in a session of its own; registered in
    `children` when given (the caller discards it there once it has ended)."""
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    if children is not None:
        children.add(proc)
    return proc


def run_forked(target, timeout: float | None) -> tuple[int | None, str, str]:
    """run() for `target()` in a child forked from this process (multiprocessing's fork context), in a session of
    its own as `start` gives a command: (exit code: 1 if it raised, with the traceback on stderr; None if it
    outlived `timeout` and was killed with its group; stdout; stderr)."""
    import multiprocessing
    import tempfile

    files = [tempfile.TemporaryFile("w+") for _ in range(2)]  # stdout, stderr: no pipe to fill up
    ready, grouped = multiprocessing.Pipe(duplex=False)
    proc = multiprocessing.get_context("fork").Process(target=_in_own_session, args=(target, files, grouped))
    proc.start()
    grouped.close()
    try:
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


def _in_own_session(target, files, grouped) -> None:
    os.setsid()
    grouped.send(True)
    grouped.close()
    for fd, file in zip((1, 2), files):
        os.dup2(file.fileno(), fd)
    # new stream objects: a thread of the parent may have held the old ones' locks when it forked
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    if "torch" in sys.modules:
        # GNU OpenMP's threads do not survive a fork: a parallel region in the child would wait for the parent's
        # pool forever (seen: repeat_interleave in a ZeRO-3 rank's child, once the parent had run one). With one
        # thread torch runs every op inline, as DataLoader's forked workers do
        sys.modules["torch"].set_num_threads(1)
    target()


def kill_group(proc) -> None:
    """End the group `proc` leads (a Popen from start(), or run_forked's multiprocessing Process)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
