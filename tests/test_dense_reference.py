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


def test_catching_up_stops_waiting_once_the_answers_so_far_decide():
    """Three partners: two that serve our own reference decide it (the third cannot make another one a
    majority), as do two that serve the same other one; one of each leaves it open."""
    from swarm.net.dense_reference import reference_settled

    assert reference_settled({"p": "old", "q": "old"}, 3, "old")  # the third could only bring 1 of 3
    assert reference_settled({"p": "new", "q": "new"}, 3, "old")  # 2 of 3 have another: take it
    assert not reference_settled({"p": "old", "q": "new"}, 3, "old")  # the third may make "new" 2 of 3
    assert not reference_settled({"p": "old"}, 3, "old")  # two unanswered could both serve "new"
    assert not reference_settled({"p": "new", "q": "x"}, 4, "old")  # 2 of 4 is no majority, yet
    assert reference_settled({"p": "new", "q": "x", "r": "old"}, 4, "old")  # at most 2 of 4 now
    assert reference_settled({"p": "a", "q": "b", "r": "c"}, 3, "old")  # everyone answered
    assert reference_settled({}, 0, "old")  # nobody to ask
    assert not reference_settled({}, 1, "old")
