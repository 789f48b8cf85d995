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
import time
import traceback


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


class Forked:
    """`target()` in a child forked from this process, in a session of its own (as `start` gives a command),
    its stdout and stderr in files; `pid` and `returncode` as on a Popen, for kill_group and Children."""

    def __init__(self, target):
        import tempfile

        self.returncode = None
        self._files = [tempfile.TemporaryFile("w+") for _ in range(2)]
        ready, grouped = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            code = 1
            try:
                os.setsid()
                os.close(grouped)  # its own group now: kill_group reaches it from here on
                for fd, file in zip((1, 2), self._files):
                    os.dup2(file.fileno(), fd)
                # new stream objects: a thread of the parent may have held the old ones' locks when it forked
                sys.stdout = open(1, "w", closefd=False)
                sys.stderr = open(2, "w", closefd=False)
                target()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                with contextlib.suppress(BaseException):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)  # not the parent's atexit handlers, nor its buffered files' flushes
        os.close(grouped)
        os.read(ready, 1)  # returns once the child has closed its end: it leads its own group
        os.close(ready)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None while the child still runs after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif deadline is not None and time.monotonic() > deadline:
                return None
            else:
                time.sleep(0.05)
        return self.returncode

    def outputs(self) -> tuple[str, str]:
        """What the child wrote to its stdout and stderr (read once it has ended)."""
        texts = []
        for file in self._files:
            file.seek(0)
            texts.append(file.read())
            file.close()
        return texts[0], texts[1]


def run_forked(target, timeout: float | None) -> tuple[int | None, str, str]:
    """run() for `target()` in a child forked from this process: (exit code: 1 if it raised, None if it outlived
    `timeout` and was killed with its group; stdout; stderr)."""
    proc = Forked(target)
    try:
        code = proc.wait(timeout)
        if code is None:
            kill_group(proc)
            proc.wait()
        return (code, *proc.outputs())
    except BaseException:  # Ctrl-C in the sweep, as in run()
        kill_group(proc)
        proc.wait()
        raise


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
