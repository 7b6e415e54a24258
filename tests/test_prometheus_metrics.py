"""The Prometheus text (swarm.dashboard.prometheus_metrics): /metrics says what the view's state says."""

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarm.dashboard.prometheus_metrics import metrics_registry, render
from swarm.dashboard.swarm_view import SwarmView, ViewConfig
from tests.heartbeat_records import _hb

pytestmark = pytest.mark.timeout(240)


def test_prometheus_text_matches_the_state():
    view = SwarmView(dht=None, cfg=ViewConfig(run_id="prom", n_experts=4))
    t = time.time()  # /metrics judges records at the time of the scrape
    beats = {
        "p1": (_hb([0, 1], t, rounds_ok=3, rounds_failed=1, bytes_sent=10, bytes_recv=20), t + 6),
        "p2": (_hb([1], t, tokens_per_s=12.5, loss=2.5, step=7), t + 6),
    }
    view.ingest(beats, now=t)
    text, ctype = render(metrics_registry(view))
    assert ctype.startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
    }
    assert samples[("swarm_peers", (("status", "online"),))] == 2
    assert samples[("swarm_experts_covered", ())] == 2 and samples[("swarm_experts", ())] == 4
    assert samples[("swarm_expert_holders", (("expert", "1"),))] == 2
    assert samples[("swarm_rounds_total", (("result", "ok"),))] == 3
    assert samples[("swarm_rounds_total", (("result", "failed"),))] == 1
    assert samples[("swarm_bytes_total", (("direction", "recv"),))] == 20
    assert samples[("swarm_run_info", (("run_id", "prom"),))] == 1
    assert samples[("swarm_peer_up", (("peer", "p2"),))] == 1
    assert samples[("swarm_peer_tokens_per_second", (("peer", "p2"),))] == 12.5
    assert samples[("swarm_tokens_per_second", ())] == 12.5
