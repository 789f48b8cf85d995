"""Ctrl-C, remembered: a library can catch the KeyboardInterrupt it raises mid-call and fail with another
error (a half-imported module, a RecursionError), which would then read as bad input or a failed point.
While `watching()`, SIGINT raises KeyboardInterrupt as usual and is also recorded, so the command can tell an
interruption from what it caused: no row is written after it, and it ends as an interruption."""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading

__all__ = ["deferred", "received", "watching"]

_received = False
REDELIVER_S = 0.01  # after a Ctrl-C that a callback swallowed: time for the hook to return first


def received() -> bool:
    return _received


def _on_sigint(signum, frame):
    global _received
    _received = True
    raise KeyboardInterrupt


def _unraisable(previous):
    """sys.unraisablehook while watching: a KeyboardInterrupt raised inside a finalizer or a weakref callback
    (one of importlib's module-lock callbacks, say), where Python cannot pass an exception on and would print
    "Exception ignored in ..." with a traceback, is delivered again as SIGINT to the main thread, a moment
    later from another thread (delivered at once, the handler would raise it inside this hook): the handler then
    raises it in the code the callback interrupted. Anything else goes to the hook before."""
    def hook(unraisable):
        if _received and isinstance(unraisable.exc_value, KeyboardInterrupt):
            threading.Timer(REDELIVER_S, _thread.interrupt_main, (signal.SIGINT,)).start()
            return
        previous(unraisable)

    return hook


@contextlib.contextmanager
def deferred():
    """While watching, a Ctrl-C inside the block is recorded and raised when the block ends, not where it struck.
    For the first imports of native libraries. torch's C++ initialisation calls back into Python, and a
    KeyboardInterrupt raised in such a call makes the C++ runtime abort (pybind11::error_already_set, SIGABRT;
    1 of 174 Ctrl-Cs at random start-up moments on 2026-11-25, none of 350 with the import deferred). One raised
    inside pandas' import leaves its extension modules half made, and the next read of a CSV crashes (SIGSEGV in
    pandas' parser, from the interrupted line's count of the rows kept: 1 of 4 runs of tests/test_faults.py in a
    fresh virtual environment, where the first imports compile their bytecode). The imports take a second or two,
    so the interruption waits that long at most."""
    if signal.getsignal(signal.SIGINT) is not _on_sigint:  # not watching, or not the main thread
        yield
        return
    struck = []

    def record(signum, frame):
        global _received
        _received = True
        struck.append(signum)

    signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, _on_sigint)
    if struck:
        raise KeyboardInterrupt


@contextlib.contextmanager
def watching():
    global _received
    _received = False
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    previous, previous_hook = signal.signal(signal.SIGINT, _on_sigint), sys.unraisablehook
    sys.unraisablehook = _unraisable(previous_hook)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
