"""Ctrl-C and SIGTERM while an engine runs: raised at once, raised again at the next check."""

from __future__ import annotations

import os
import signal

import pytest
from contextpilot_bench.testbed.stop_signals import StopSignals, Terminated


def test_stop_signals_raise_once_and_again_at_the_next_check() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        # Had that raise been swallowed (a generator's cleanup), the next request raises.
        with pytest.raises(KeyboardInterrupt):
            stop.check()
        os.kill(os.getpid(), signal.SIGINT)  # later signals are only recorded
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    with StopSignals() as stop:
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(Terminated):
            stop.check()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
