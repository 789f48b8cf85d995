"""A child process in a process group of its own: a timeout, or a Ctrl-C of the sweep, ends it whole.

Workers and launched jobs start their own session so that killing the group reaches every process they
started (torchrun's ranks, a worker's threads). The other side of that: the terminal's Ctrl-C reaches only
the sweep's group, so the sweep ends the child's group itself before the interruption goes on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def run(command: list[str], stdin: str | None, env: dict | None, timeout: float | None) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of `command`; the exit code is None when it outlived `timeout` seconds
    (it is then killed with its whole group)."""
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
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


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
