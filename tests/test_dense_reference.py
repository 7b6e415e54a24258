"""``dense_reference``: with a lossy codec, a member whose dense reference is not the others' takes theirs."""

import dataclasses

from swarm.config import SyncConfig
from swarm.net.local_transport import Fault
from swarm.net.round_info import REFERENCES_DIFFER
from tests.local_swarm import TIMING, Swarm


def test_a_member_whose_round_was_partial_takes_the_agreed_reference_before_the_next_round():
    """b's result alone differs in round 2 (a partial all-reduce): a and c apply it and move their reference
    on, b cannot. Had b kept its own, every member would drop round 3's dense part (references differ)."""
    peers = {"a": [0, 1], "b": [0, 1], "c": [2, 3]}
    # a group closes as soon as all three are in; the window only bounds a member that comes late (on a
    # loaded CI machine c's thread once came over 0.3 s after the others', and a and b met as a pair)
    timing = dataclasses.replace(TIMING, matchmaking_s=2.0)
    swarm = Swarm(
        peers, faults=[Fault("partial", peer="b", round=2)], sync=SyncConfig(codec="int8"), timing=timing
    )
    spec = {p: swarm.plan(p).groups[0][0] for p in peers}
    for index in (1, 2, 3):
        results = swarm.round({p: swarm.plan(p, index=index) for p in peers})
        refs = {p: swarm.ctx[p].payloads.reference_id(spec[p]) for p in peers}
        dense = {p: [r for r in results[p].record.rejected if r.startswith("dense")] for p in peers}
        if index == 2:
            assert dense["a"] == dense["c"] == [] and "partial round" in dense["b"][0], dense
            assert "took the agreed reference from" in dense["b"][0], dense
        else:
            assert all(d == [] for d in dense.values()), dense
        assert refs["a"] and refs["a"] == refs["b"] == refs["c"], refs
    assert not any(REFERENCES_DIFFER in r for p in peers for r in results[p].record.rejected)
