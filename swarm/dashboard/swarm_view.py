"""What the dashboard knows about a swarm: it polls the heartbeat records and builds the state it serves.

    dht = start_dht([maddr], client_mode=True)            # a DHT client: it reads, it publishes nothing
    view = SwarmView(dht, ViewConfig(run_id="demo", n_experts=16))
    view.start()                                           # a background thread reads every poll_s seconds
    view.state()                                           # the dict behind the page, /api/state and /metrics
    view.stop()

Only the DHT's records are used (``swarm.net.records``): what the page shows is what any peer of the swarm
could read. Times are DHT times, which in hivemind are the wall clock (``get_dht_time = time.time``), so
the dashboard dates records with ``time.time()`` without importing hivemind here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.dashboard.history import History
from swarm.dashboard.peer_table import ONLINE, STALE, PeerTable

if TYPE_CHECKING:
    from swarm.net.records import Heartbeat

TRAINING_STATES = ("joining", "training", "finishing")  # "done" peers serve but no longer learn


@dataclass
class ViewConfig:
    """What to watch and how often. ``n_experts=None``: taken from the highest expert index seen."""

    run_id: str = "demo"
    n_experts: int | None = None
    poll_s: float = 2.0  # between DHT reads; also the page's refresh period
    read_timeout_s: float = 5.0  # a DHT read that takes longer counts as failed
    history_samples: int = 900  # 30 minutes of charts at poll_s = 2
    max_offline: int = 64  # offline peers kept in the table
    default_period_s: float = 5.0  # heartbeat period assumed for records that do not carry one

    def __post_init__(self) -> None:
        if not self.run_id or "." in self.run_id:
            raise ValueError("run_id must be non-empty and contain no '.'")
        if self.n_experts is not None and self.n_experts < 1:
            raise ValueError("n_experts must be >= 1")
        if not self.poll_s > 0 or not self.read_timeout_s > 0:
            raise ValueError("poll_s and read_timeout_s must be > 0")
        if self.history_samples < 2 or self.max_offline < 0:
            raise ValueError("history_samples must be >= 2 (a line needs two points), max_offline >= 0")

    @classmethod
    def from_config_file(cls, path: str | Path, run_id: str | None = None, **kw: Any) -> ViewConfig:
        """The run id and expert count of a run config (raises swarm.config.ConfigError). With another
        ``run_id`` than the config's, the expert count is not taken from it (it may be another model)."""
        from swarm.config import load_config

        cfg = load_config(path)
        if run_id is None or run_id == cfg.run_id:
            return cls(run_id=cfg.run_id, n_experts=cfg.model.n_experts, **kw)
        return cls(run_id=run_id, **kw)


class SwarmView:
    """Polls ``<run_id>_peers`` and answers ``state()``. Thread-safe: HTTP threads read while it polls."""

    def __init__(self, dht: Any, cfg: ViewConfig) -> None:
        self.dht, self.cfg = dht, cfg
        self.table = PeerTable(max_offline=cfg.max_offline, default_period_s=cfg.default_period_s)
        self.history = History(cfg.history_samples)
        self.started_at = time.time()
        self.last_read: float | None = None  # when the last successful read ended
        self.reads_ok = self.reads_failed = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- polling ------------------------------------------------------------------------------------------
    def poll_once(self) -> bool:
        """One DHT read merged into the table and the history. False when the read failed."""
        # imported here: swarm.net loads hivemind, which takes seconds; a command line with bad input
        # should fail at once, and the page's logic needs no network
        from swarm.net.records import read_heartbeats

        beats = read_heartbeats(self.dht, self.cfg.run_id, timeout=self.cfg.read_timeout_s)
        return self.ingest(beats, time.time())

    def ingest(self, beats: dict[str, tuple[Heartbeat, float]], now: float) -> bool:
        """Merge one read (``read_heartbeats``' answer, taken at DHT time ``now``) and add a history sample."""
        with self._lock:
            ok = self.table.observe(beats, now)
            self.reads_ok += ok
            self.reads_failed += not ok
            if ok:
                self.last_read = now
            statuses = self.table.statuses(now)
            training = {
                pid: (e.hb.loss, e.hb.tokens_per_s)
                for pid, e in self.table.peers.items()
                if statuses[pid] == ONLINE and e.hb.state in TRAINING_STATES
            }
            self.history.add(now, training)
        return ok

    def start(self) -> SwarmView:
        self.poll_once()  # the first page already shows the swarm
        self._thread = threading.Thread(target=self._loop, name="dashboard-poll", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.poll_once()
                self.last_error = None
            except Exception as e:  # a dying DHT process: keep serving what was read, say why on the page
                with self._lock:
                    self.reads_failed += 1
                    self.last_error = f"{type(e).__name__}: {e}"[:200]
            self._stop.wait(max(0.2, self.cfg.poll_s - (time.monotonic() - t0)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.read_timeout_s + 5)

    # -- the state ----------------------------------------------------------------------------------------
    def state(self, now: float | None = None) -> dict[str, Any]:
        """Everything the page shows, as JSON-ready values. Peer states are computed at ``now``."""
        now = time.time() if now is None else now
        with self._lock:
            peers = self.table.rows(now)
            totals = dict(self.table.totals)
            history = self.history.to_dict([p["peer_id"] for p in peers])
            reads = {
                "ok": self.reads_ok,
                "failed": self.reads_failed,
                "last": self.last_read,
                "error": self.last_error,
            }
        live = [p for p in peers if p["status"] in (ONLINE, STALE)]
        online = [p for p in peers if p["status"] == ONLINE]
        seen = [e for p in peers for e in p["experts"]]
        n_experts = self.cfg.n_experts or (max(seen) + 1 if seen else 0)
        experts = []
        for e in range(n_experts):
            holders = [p for p in live if e in p["experts"]]
            experts.append(
                {
                    "expert": e,
                    "holders": [p["peer_id"] for p in holders],
                    "online_holders": sum(p["status"] == ONLINE for p in holders),
                }
            )
        counts = [len(x["holders"]) for x in experts]
        rounds = [p["last_round"] for p in peers if p["last_round"] is not None and p["last_round"] >= 0]
        summary = {
            "peers_online": len(online),
            "peers_stale": len(live) - len(online),
            "peers_offline": len(peers) - len(live),
            "tokens_per_s": sum(p["tokens_per_s"] or 0.0 for p in online if p["state"] in TRAINING_STATES),
            "tokens": totals["tokens"],
            "rounds": max(rounds) + 1 if rounds else 0,  # rounds are numbered from 0 by every peer
            "rounds_ok": totals["rounds_ok"],
            "rounds_failed": totals["rounds_failed"],
            "bytes_sent": totals["bytes_sent"],
            "bytes_recv": totals["bytes_recv"],
            "experts_covered": sum(c > 0 for c in counts),
            "n_experts": n_experts,
            "n_experts_known": self.cfg.n_experts is not None,
            "uncovered": [x["expert"] for x in experts if not x["holders"]],
            "replication": {
                "min": min(counts) if counts else 0,
                "mean": sum(counts) / len(counts) if counts else 0.0,
                "max": max(counts) if counts else 0,
            },
        }
        return {
            "run_id": self.cfg.run_id,
            "now": now,
            "started_at": self.started_at,
            "poll_s": self.cfg.poll_s,
            "reads": reads,
            "summary": summary,
            "peers": peers,
            "experts": experts,
            "history": history,
        }
