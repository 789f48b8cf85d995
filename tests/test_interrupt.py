"""Ctrl-C while vlmprobe.interrupt watches: recorded, and raised where the code can pass it on."""

import signal
import time
import weakref

import pytest

from vlmprobe import interrupt


def test_a_ctrl_c_inside_a_weakref_callback_is_raised_after_it_instead_of_printed(capsys, monkeypatch):
    monkeypatch.setattr(interrupt, "_received", None)  # put back afterwards: the next test saw no Ctrl-C
    class Thing:
        pass

    def callback(_):  # as importlib's module-lock callbacks: an exception here cannot propagate
        signal.raise_signal(signal.SIGINT)
        for _ in range(100):  # the handler runs here, inside the callback
            pass

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), interrupt.watching():
        thing = Thing()
        ref = weakref.ref(thing, callback)
        del thing
        while time.monotonic() < started + 10:  # raised again here, once the callback is over
            assert ref() is None
    assert time.monotonic() < started + 5
    assert interrupt.received()
    assert "Exception ignored" not in capsys.readouterr().err


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_ctrl_c_or_sigterm_inside_a_deferred_block_is_raised_when_the_block_ends(monkeypatch, signum, code):
    monkeypatch.setattr(interrupt, "_received", None)
    ran = []
    with pytest.raises(KeyboardInterrupt), interrupt.watching():
        with interrupt.deferred():  # as torch's first import: the block runs to its end
            signal.raise_signal(signum)
            ran.append("after the signal")
        ran.append("after the block")
    assert ran == ["after the signal"] and interrupt.received()
    assert interrupt.exit_code() == code and interrupt.signal_name() == signal.Signals(signum).name


def test_a_deferred_block_without_a_ctrl_c_or_outside_watching_changes_nothing(monkeypatch):
    monkeypatch.setattr(interrupt, "_received", None)
    with interrupt.watching():
        with interrupt.deferred():
            pass
        assert signal.getsignal(signal.SIGINT) is interrupt._on_signal  # Ctrl-C raises at once again
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN where the runner started in the background
    with interrupt.deferred():  # not watching: the handler stays whatever it was
        assert signal.getsignal(signal.SIGINT) is before
    assert not interrupt.received()
