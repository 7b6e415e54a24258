"""``GET /metrics``: the swarm's state in Prometheus' text format, from the dashboard's own registry.

    registry = metrics_registry(view)          # a CollectorRegistry of its own (no process-global metrics)
    text, content_type = render(registry)      # what /metrics answers

Every scrape reads one ``view.state()``, so the numbers of one scrape agree with each other and with the
page. Swarm-wide counters (``*_total``) only grow: they add up what each peer's records grew by while the
dashboard watched (see ``peer_table``). Per-peer series carry a ``peer`` label (the full peer id).

    swarm_peers{status="online"} 3.0
    swarm_experts_covered 16.0
    swarm_tokens_per_second 16384.0
    swarm_rounds_total{result="ok"} 42.0
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from swarm.dashboard.peer_table import OFFLINE, ONLINE, STALE


class SwarmCollector(Collector):
    """Builds the metric families from one snapshot of the view at each scrape."""

    def __init__(self, view: Any) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        state = self.view.state()
        s = state["summary"]
        info = InfoMetricFamily("swarm_run", "The run this dashboard watches")
        info.add_metric([], {"run_id": state["run_id"]})
        yield info

        peers = GaugeMetricFamily("swarm_peers", "Peers by status", labels=["status"])
        for status, key in ((ONLINE, "peers_online"), (STALE, "peers_stale"), (OFFLINE, "peers_offline")):
            peers.add_metric([status], s[key])
        yield peers
        yield GaugeMetricFamily("swarm_experts", "Experts of the model (E)", value=s["n_experts"])
        yield GaugeMetricFamily(
            "swarm_experts_covered", "Experts with at least one live holder", value=s["experts_covered"]
        )
        holders = GaugeMetricFamily("swarm_expert_holders", "Live holders of each expert", labels=["expert"])
        for x in state["experts"]:
            holders.add_metric([str(x["expert"])], len(x["holders"]))
        yield holders
        yield GaugeMetricFamily(
            "swarm_tokens_per_second", "Tokens/s summed over online training peers", value=s["tokens_per_s"]
        )
        yield GaugeMetricFamily("swarm_round", "Highest round index reached + 1", value=s["rounds"])
        rounds = CounterMetricFamily("swarm_rounds", "Rounds finished by peers, by result", labels=["result"])
        rounds.add_metric(["ok"], s["rounds_ok"])
        rounds.add_metric(["failed"], s["rounds_failed"])
        yield rounds
        moved = CounterMetricFamily(
            "swarm_bytes", "Bytes moved by rounds, by direction", labels=["direction"]
        )
        moved.add_metric(["sent"], s["bytes_sent"])
        moved.add_metric(["recv"], s["bytes_recv"])
        yield moved
        yield CounterMetricFamily("swarm_tokens", "Tokens trained by the peers", value=s["tokens"])
        yield from self._per_peer(state["peers"])

    def _per_peer(self, rows: list[dict[str, Any]]) -> Iterator[Metric]:
        live = [p for p in rows if p["status"] != OFFLINE]
        up = GaugeMetricFamily("swarm_peer_up", "1 online, 0.5 stale, 0 offline", labels=["peer"])
        for p in rows:
            up.add_metric([p["peer_id"]], {ONLINE: 1.0, STALE: 0.5}.get(p["status"], 0.0))
        yield up
        gauges = (
            ("step", "swarm_peer_step", "Local optimizer step"),
            ("loss", "swarm_peer_loss", "Last training loss"),
            ("tokens_per_s", "swarm_peer_tokens_per_second", "Training throughput"),
            ("age_s", "swarm_peer_heartbeat_age_seconds", "Seconds since the last heartbeat"),
        )
        for key, name, doc in gauges:
            family = GaugeMetricFamily(name, doc, labels=["peer"])
            for p in live:
                if p[key] is not None:
                    family.add_metric([p["peer_id"]], float(p[key]))
            yield family
        counters = (
            ("rounds_ok", "swarm_peer_rounds_ok", "Rounds this peer applied"),
            ("rounds_failed", "swarm_peer_rounds_failed", "Rounds this peer dropped"),
            ("bytes_sent", "swarm_peer_bytes_sent", "Bytes this peer sent in rounds"),
            ("bytes_recv", "swarm_peer_bytes_recv", "Bytes this peer received in rounds"),
        )
        for key, name, doc in counters:
            family = CounterMetricFamily(name, doc, labels=["peer"])
            for p in live:
                family.add_metric([p["peer_id"]], float(p[key] or 0))
            yield family


def metrics_registry(view: Any) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(view))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    return generate_latest(registry), CONTENT_TYPE_LATEST
