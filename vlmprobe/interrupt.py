"""Ctrl-C and SIGTERM, remembered: a library can catch the KeyboardInterrupt it raises mid-call and fail with
another error (a half-imported module, a RecursionError), which would then read as bad input or a failed point.
While `watching()`, SIGINT (Ctrl-C) and SIGTERM (what SLURM, Kubernetes and `kill` send first) both raise
KeyboardInterrupt and are recorded, so the command can tell an interruption from what it caused: no row is
written after it, the rows kept are said in one line, and it exits 128 + the signal's number (130, 143)."""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading

__all__ = ["SIGNALS", "deferred", "exit_code", "received", "signal_name", "watching"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)  # the signals that interrupt a command: each ends it as Ctrl-C does
_received: int | None = None  # the signal that interrupted the command, once one has
REDELIVER_S = 0.01  # after a Ctrl-C that a callback swallowed: time for the hook to return first


def received() -> bool:
    return _received is not None


def exit_code() -> int:
    """The exit code of an interrupted command: 128 + the signal's number, as a shell reports a process the
    signal ended (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + (_received or signal.SIGINT)


def signal_name() -> str:
    """The signal that interrupted the command, as `kill -l` names it (SIGINT when none is recorded)."""
    return signal.Signals(_received or signal.SIGINT).name


def _on_signal(signum, frame):
    global _received
    _received = signum
    raise KeyboardInterrupt


def _unraisable(previous):
    """sys.unraisablehook while watching: a KeyboardInterrupt raised inside a finalizer or a weakref callback
    (one of importlib's module-lock callbacks, say), where Python cannot pass an exception on and would print
    "Exception ignored in ..." with a traceback, is delivered again as SIGINT to the main thread, a moment
    later from another thread (delivered at once, the handler would raise it inside this hook): the handler then
    raises it in the code the callback interrupted. Anything else goes to the hook before."""
    def hook(unraisable):
        if _received and isinstance(unraisable.exc_value, KeyboardInterrupt):
            threading.Timer(REDELIVER_S, _thread.interrupt_main, (_received,)).start()
            return
        previous(unraisable)

    return hook


@contextlib.contextmanager
def deferred():
    """While watching, an interruption (Ctrl-C, SIGTERM) inside the block is recorded and raised when the block
    ends, not where it struck. For the first imports of native libraries. torch's C++ initialisation calls back into
    Python, and a KeyboardInterrupt raised in such a call makes the C++ runtime abort (pybind11::error_already_set,
    SIGABRT; 1 of 174 Ctrl-Cs at random start-up moments on 2026-11-25, none of 350 with the import deferred). One
    raised inside pandas' import leaves its extension modules half made, and the next read of a CSV crashes
    (SIGSEGV in pandas' parser, from the interrupted line's count of the rows kept: 1 of 4 runs of
    tests/test_faults.py in a fresh virtual environment, where the first imports compile their bytecode). The
    imports take a second or two, so the interruption waits that long at most."""
    if signal.getsignal(signal.SIGINT) is not _on_signal:  # not watching, or not the main thread
        yield
        return
    struck = []

    def record(signum, frame):
        global _received
        _received = signum
        struck.append(signum)

    for signum in SIGNALS:
        signal.signal(signum, record)
    try:
        yield
    finally:
        for signum in SIGNALS:
            signal.signal(signum, _on_signal)
    if struck:
        raise KeyboardInterrupt


@contextlib.contextmanager
def watching():
    global _received
    _received = None
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    previous, previous_hook = {s: signal.signal(s, _on_signal) for s in SIGNALS}, sys.unraisablehook
    sys.unraisablehook = _unraisable(previous_hook)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sys.unraisablehook = previous_hook
