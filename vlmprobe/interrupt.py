"""Ctrl-C, remembered: a library can catch the KeyboardInterrupt it raises mid-call and fail with another
error (a half-imported module, a RecursionError), which would then read as bad input or a failed point.
While `watching()`, SIGINT raises KeyboardInterrupt as usual and is also recorded, so the command can tell an
interruption from what it caused: no row is written after it, and it ends as an interruption."""

from __future__ import annotations

import contextlib
import signal
import threading

_received = False


def received() -> bool:
    return _received


def _on_sigint(signum, frame):
    global _received
    _received = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def watching():
    global _received
    _received = False
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
