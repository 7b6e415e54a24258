"""The gate a round's downloads wait behind (``downloads_after_matchmaking``): pure, sub-second."""

import time

from swarm.net.round_downloads import Gate


def test_a_gate_opens_when_its_condition_holds_or_at_its_bound_whichever_comes_first():
    t0 = time.monotonic()
    Gate(lambda: time.monotonic() - t0 > 0.1, not_after=t0 + 5.0, poll=0.01).wait()
    assert 0.1 <= time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    gate = Gate(lambda: False, not_after=t0 + 0.2, poll=0.01)
    gate.wait()
    assert 0.2 <= gate.opened_at - t0 < 1.0


def test_a_condition_that_cannot_be_read_holds_nothing_up():
    def broken():
        raise RuntimeError("stage unreadable")

    t0 = time.monotonic()
    Gate(broken, not_after=t0 + 5.0).wait()
    assert time.monotonic() - t0 < 0.5
