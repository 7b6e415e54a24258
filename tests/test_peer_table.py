"""PeerTable (swarm.dashboard.peer_table): peer states from heartbeat age and expiry, growing counters."""

import pytest

from swarm.dashboard.peer_table import PeerTable
from tests.heartbeat_records import _hb

pytestmark = pytest.mark.timeout(240)


def test_peer_states_follow_heartbeat_age_and_expiry():
    table = PeerTable(max_offline=2)
    # A published at 99, B at 95; period 2 s, TTL 3 periods: B is already older than two periods at 100
    beats = {"A": (_hb([0, 1], 99.0, rounds_ok=1), 105.0), "B": (_hb([2], 95.0, rounds_ok=5), 101.0)}
    assert table.observe(beats, now=100.0)
    assert table.statuses(100.0) == {"A": "online", "B": "stale"}
    assert table.statuses(103.0) == {"A": "online", "B": "offline"}  # B's record expired at 101
    assert table.statuses(103.5) == {"A": "stale", "B": "offline"}  # 4.5 s > two periods
    # B's record gone from the next read; A published again, after restarting from zero rounds
    assert table.observe({"A": (_hb([0, 1], 102.0, rounds_ok=0), 108.0)}, now=102.0)
    assert table.statuses(102.0) == {"A": "online", "B": "offline"}
    # an empty read while A's record cannot have expired is a failed read: nothing changes
    assert not table.observe({}, now=104.0)
    assert table.statuses(104.0)["A"] == "online"
    # once its expiry has passed, A is offline even if no read succeeds
    assert table.observe({}, now=109.0)
    assert table.statuses(109.0) == {"A": "offline", "B": "offline"}
    # counters only grow: 1 + 5, then A restarted (0) and counts again from there
    assert table.totals["rounds_ok"] == 6
    assert table.observe({"A": (_hb([0, 1], 110.0, rounds_ok=2), 116.0)}, now=110.0)
    assert table.totals["rounds_ok"] == 8 and table.statuses(110.0)["A"] == "online"  # back online
    for i in range(4):  # offline peers are kept, the most recent max_offline of them
        table.observe({f"C{i}": (_hb([3], 111.0 + i), 117.0 + i)}, now=111.0 + i)
    offline = [pid for pid, s in table.statuses(115.0).items() if s == "offline"]
    assert sorted(offline) == ["C1", "C2"]  # C3 is online; A (gone at 111) and C0 (gone at 112) forgotten
    rows = table.rows(115.0)
    assert [r["status"] for r in rows] == ["online", "offline", "offline"]
    assert rows[0]["peer_id"] == "C3" and rows[0]["short_id"] == "C3" and rows[0]["age_s"] == 1.0
