"""A heartbeat record as a training peer publishes it, for the dashboard's tests."""

from swarm.net.records import Heartbeat


def _hb(experts, sent_at, period=2.0, **kw) -> Heartbeat:
    return Heartbeat(experts=experts, state="training", period_s=period, sent_at=sent_at, **kw)
