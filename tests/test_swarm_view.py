"""SwarmView (swarm.dashboard.swarm_view): coverage, replication and totals, and the bounded History."""

import json

import pytest

from swarm.dashboard.history import History
from swarm.dashboard.swarm_view import SwarmView, ViewConfig
from tests.heartbeat_records import _hb

pytestmark = pytest.mark.timeout(240)


def test_state_coverage_replication_and_bounded_history():
    view = SwarmView(dht=None, cfg=ViewConfig(run_id="t", n_experts=6, history_samples=5))
    for i in range(8):
        t = 1000.0 + 2 * i
        beats = {
            "peer-a": (_hb([0, 1], t, loss=4.0 - 0.1 * i, tokens_per_s=100.0, tokens=1000 * i), t + 6),
            "peer-b": (_hb([1, 2], t, loss=5.0 - 0.1 * i, tokens_per_s=50.0, tokens=500 * i), t + 6),
            "peer-c": (_hb([3], t - 5, tokens_per_s=70.0), t + 1),  # stale: counts as holder, not in tokens/s
        }
        view.ingest(beats, now=t)
    st = view.state(now=1014.0)
    s = st["summary"]
    assert (s["peers_online"], s["peers_stale"], s["peers_offline"]) == (2, 1, 0)
    assert s["tokens_per_s"] == 150.0
    assert s["tokens"] == 7000 + 3500
    assert s["experts_covered"] == 4 and s["uncovered"] == [4, 5] and s["n_experts"] == 6
    assert s["replication"] == {"min": 0, "mean": 5 / 6, "max": 2}
    holders = {x["expert"]: sorted(x["holders"]) for x in st["experts"]}
    assert holders[1] == ["peer-a", "peer-b"] and holders[3] == ["peer-c"] and holders[5] == []
    h = st["history"]
    assert len(h["t"]) == 5 and h["t"][-1] == 1014.0  # the ring buffer keeps the last 5 reads
    assert h["tokens_per_s"] == [150.0] * 5
    assert h["loss"][-1] == pytest.approx((3.3 + 4.3) / 2)
    assert set(h["peers"]) == {"peer-a", "peer-b"}  # peer-c never trained while online
    assert json.loads(json.dumps(st)) == st  # JSON as it is
    with pytest.raises(ValueError):
        History(1)
