"""Downloads of non-local experts on the in-process transport: what travels while a holder is not fresh."""

import threading
import time

import torch

from swarm.net.expert_download import HOLD_S, ExpertDownloads
from swarm.net.expert_server import ExpertServer
from swarm.net.local_transport import Fault, LocalNetwork
from swarm.net.served_steps import Fresh, served_steps
from swarm.sync.codecs import codec_named


def _holder(net: LocalNetwork) -> ExpertServer:
    return ExpertServer(net.transport("b").open_server("t_experts"))


def _int8_holder(net: LocalNetwork, codec) -> ExpertServer:
    """b serving its copies and, int8-encoded, their changes."""
    b = net.transport("b")
    return ExpertServer(b.open_server("t_experts"), b.open_server("t_expert_deltas", codec), codec)


def _moved(net: LocalNetwork) -> list[int]:
    return [values for who, peer, name, values in net.fetched if (who, peer, name) == ("a", "b", "t_experts")]


def test_asks_for_a_fresh_copy_move_metadata_until_the_copy_is_fresh():
    """Once the holder has shown an older copy, each ask is held for up to ``HOLD_S`` (1 s): the first held
    ask ends with metadata only, the next brings the copy once the holder serves it (1.6 s after the first
    ask)."""
    net = LocalNetwork()
    server, downloads = _holder(net), ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    mine = {3: [torch.full((8, 4), 0.6)]}
    server.update({"expert3": [torch.full((8, 4), 0.5)]}, step=90, final=False)  # last round's copy
    threading.Timer(1.6, server.update, ({"expert3": [torch.full((8, 4), 0.75)]}, 100, False)).start()
    got, rejected, failures = downloads.fetch({3: [("b", 100)]}, mine, 100, False, time.monotonic() + 5)
    assert rejected == failures == [] and got[3][0].tolist() == [[0.75] * 4] * 8
    polls = _moved(net)
    assert len(polls) >= 2 and polls[:-1] == [0] * (len(polls) - 1) and polls[-1] == 32, polls
    assert downloads.received == 32 * 2  # fp16, once
    assert (
        downloads.waited_s >= HOLD_S
    )  # the round record's downloads_waited_s: the first ask's hold, and more


def test_a_copy_that_is_served_while_we_ask_comes_in_that_ask():
    """The holder's fresh copy comes 0.3 s after our first ask (its round started a step after ours). That
    ask finds last round's copy; the next is held until the new one is served and brings it (polling from
    0.05 s, twice as long each time, the copy came with the third or fourth ask; every 0.5 s, at 0.5 s)."""
    net = LocalNetwork()
    server, downloads = _holder(net), ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    mine = {3: [torch.full((8, 4), 0.6)]}
    server.update({"expert3": [torch.full((8, 4), 0.5)]}, step=90, final=False)
    threading.Timer(0.3, server.update, ({"expert3": [torch.full((8, 4), 0.75)]}, 100, False)).start()
    got, rejected, failures = downloads.fetch({3: [("b", 100)]}, mine, 100, False, time.monotonic() + 5)
    assert rejected == failures == [] and got[3][0].tolist() == [[0.75] * 4] * 8
    polls = _moved(net)
    assert polls[-1] == 32 and polls[:-1] in ([], [0]), polls
    assert downloads.waited_s < HOLD_S  # held until the copy was served, not to the end of the hold


def test_a_holder_that_answers_held_asks_at_once_is_polled_not_asked_without_pause():
    """A holder that never holds an ask (an older version, or one that will not) is asked on the poll's
    schedule, from 0.05 s to every 0.5 s: about 7 asks in 2.5 s, not one after another."""
    net = LocalNetwork(faults=[Fault("unheld", peer="b")])
    server, downloads = _holder(net), ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    server.update({"expert3": [torch.full((8, 4), 0.5)]}, step=90, final=False)  # never fresh for step 100
    mine = {3: [torch.full((8, 4), 0.6)]}
    got, _, failures = downloads.fetch({3: [("b", 100)]}, mine, 100, False, time.monotonic() + 3.0)
    assert got == {} and len(failures) == 1 and "no fresh copy" in failures[0], failures
    assert 3 <= len(_moved(net)) <= 12 and set(_moved(net)) == {0}, _moved(net)


def test_a_holder_behind_us_is_taken_as_it_is_and_a_final_copy_is_awaited_after_one_whole_answer():
    net = LocalNetwork()
    server, downloads = _holder(net), ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    mine = {3: [torch.full((8, 4), 0.6)]}
    server.update({"expert3": [torch.full((8, 4), 0.5)]}, step=90, final=False)
    got, _, failures = downloads.fetch({3: [("b", 90)]}, mine, 100, False, time.monotonic() + 5)
    assert failures == [] and got[3][0].tolist() == [[0.5] * 4] * 8 and _moved(net) == [32]
    # after the last round: the first answer comes whole (kept if the holder never settles), then metadata
    # only until the copy is final
    threading.Timer(1.2, server.update, ({"expert3": [torch.full((8, 4), 0.375)]}, 100, True)).start()
    got, _, failures = downloads.fetch({3: [("b", 100)]}, mine, 100, True, time.monotonic() + 5)
    polls = _moved(net)[1:]
    assert failures == [] and got[3][0].tolist() == [[0.375] * 4] * 8
    assert polls[0] == 32 and polls[-1] == 32 and set(polls[1:-1]) == {0} and len(polls) >= 3, polls
    # a holder that never settles: the newest copy it served, and the failure said
    server.update({"expert3": [torch.full((8, 4), 0.4375)]}, step=110, final=False)
    got, _, failures = downloads.fetch({3: [("b", 110)]}, mine, 110, True, time.monotonic() + 1.5)
    assert got[3][0].tolist() == [[0.4375] * 4] * 8
    assert len(failures) == 1 and "no final copy before the deadline" in failures[0], failures


def test_from_a_holder_behind_us_only_a_copy_newer_than_ours_travels_and_it_is_waited_for_briefly():
    """Rounds on the wall clock start together, but a holder behind us in steps serves its new copy only
    once its own round starts: until then it serves the copy we took last round, which must not travel
    again (with a lossy codec it would travel whole, as it fits no change)."""
    net = LocalNetwork()
    server, downloads = _holder(net), ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    mine = {3: [torch.full((8, 4), 0.5)]}
    server.update({"expert3": [torch.full((8, 4), 0.5)]}, step=90, final=False)  # the copy we hold
    threading.Timer(1.2, server.update, ({"expert3": [torch.full((8, 4), 0.75)]}, 95, False)).start()
    got, _, failures = downloads.fetch({3: [("b", 95)]}, mine, 100, False, time.monotonic() + 8, {3: 90})
    assert failures == [] and got[3][0].tolist() == [[0.75] * 4] * 8 and downloads.steps == {3: 95}
    polls = _moved(net)
    assert len(polls) >= 2 and set(polls[:-1]) == {0} and polls[-1] == 32, polls
    # a holder that does not move on: nothing travels, nothing is taken, and the wait ends well before
    # the deadline
    t0 = time.monotonic()
    got, _, failures = downloads.fetch({3: [("b", 95)]}, mine, 100, False, time.monotonic() + 20, {3: 95})
    assert got == {} and failures == [] and set(_moved(net)[len(polls) :]) == {0}
    assert time.monotonic() - t0 < 8


def test_a_lagged_refresh_takes_the_staged_copies_once_published_as_changes_and_waits_no_longer_than_the_groups():
    """``sync.lagged_refresh``: a holder stages what its round agreed and serves it from its next refresh
    round's start. Before that, a holder even ahead of us in steps serves only the copy we hold: nothing
    travels, and we stop asking once our groups are done (not after ``BEHIND_PATIENCE_S``). Once published,
    the staged copy comes at once, as the int8 change against the copy we hold."""
    net, codec = LocalNetwork(codec=codec_named("int8")), codec_named("int8")
    server = _int8_holder(net, codec)
    downloads = ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0, ("t_expert_deltas", codec))
    first = [torch.linspace(-1, 1, 512).reshape(16, 32)]
    server.update({"expert3": first}, step=90, final=False)
    got, _, _ = downloads.fetch({3: [("b", 90)]}, {3: first}, 90, False, time.monotonic() + 5)
    mine = {3: [t.float() for t in got[3]]}  # the copy we hold, as it came (fp16)
    agreed = [first[0] + 0.01 * torch.linspace(0, 1, 512).reshape(16, 32)]
    server.stage({"expert3": agreed}, step=100)
    assert server.staged() == {"expert3"} and served_steps(net.served["b", "t_experts"].meta) == {
        "expert3": (90, False)
    }
    groups_done, t0 = threading.Event(), time.monotonic()
    threading.Timer(0.3, groups_done.set).start()
    got, _, failures = downloads.fetch({3: [("b", 110)]}, mine, 110, False, t0 + 20, {3: 90}, groups_done)
    assert got == {} and failures == [] and time.monotonic() - t0 < 1.0
    before = len(net.fetched)
    server.publish_staged()  # the holder's next refresh round starts
    assert server.staged() == set()
    got, _, failures = downloads.fetch({3: [("b", 110)]}, mine, 110, False, time.monotonic() + 5, {3: 90},
                                       threading.Event())  # fmt: skip
    assert failures == [] and downloads.steps == {3: 100}
    assert (got[3][0].float() - agreed[0]).abs().max() <= 0.01 / 127 + 1e-3  # the int8 step, fp16
    moved = [(name, values) for _, peer, name, values in net.fetched[before:] if peer == "b" and values]
    assert moved == [("t_expert_deltas", 512)], moved  # the change, not a whole copy
    # a copy served now supersedes one staged earlier
    server.stage({"expert3": first}, step=120)
    server.update({"expert3": agreed}, step=130, final=False)
    assert server.staged() == set()


def test_a_first_copy_comes_as_a_change_when_ours_is_the_holders_base_and_whole_otherwise():
    """Every peer starts from the same initialisation, so a holder's first change is taken against the very
    copy a downloader holds: the first refresh travels as a change too (int8: about half an fp16 copy). A
    downloader whose copy differs gets no change (our copy's hash goes with the ask, so only metadata
    travels), and the whole copy instead."""
    net, codec = LocalNetwork(codec=codec_named("int8")), codec_named("int8")
    server = _int8_holder(net, codec)
    init = [torch.linspace(-1, 1, 512).reshape(16, 32)]
    server.update({"expert3": init}, step=0, final=False)  # as a peer starts
    trained = [init[0] + 0.01 * torch.cos(torch.arange(512.0)).reshape(16, 32)]
    server.update({"expert3": trained}, step=10, final=False)
    for me, mine, travelled in (("a", init, "t_expert_deltas"), ("c", [init[0] + 0.5], "t_experts")):
        downloads = ExpertDownloads(net.transport(me), "t_experts", 5.0, 4.0, ("t_expert_deltas", codec))
        got, _, failures = downloads.fetch({3: [("b", 10)]}, {3: mine}, 10, False, time.monotonic() + 5)
        assert failures == [] and downloads.steps == {3: 10}, me
        assert (got[3][0].float() - trained[0]).abs().max() <= 0.02 / 127 + 2e-3, me
        moved = [(name, values) for who, _, name, values in net.fetched if who == me and values]
        assert moved == [(travelled, 512)], (me, moved)


def test_fresh_reads_served_metadata_and_refuses_what_is_malformed():
    meta = {"items": ["expert1", "expert3"], "steps": [100, 90], "final": [False, True]}
    assert Fresh(("expert1",), 100, final=False)(meta)
    assert not Fresh(("expert1", "expert3"), 100, final=False)(meta)
    assert Fresh(("expert1", "expert3"), None, final=False)(meta)
    assert Fresh(("expert3",), None, final=True)(meta) and not Fresh(("expert1",), None, final=True)(meta)
    assert not Fresh(("expert2",), None, final=False)(meta)
    for bad in ({}, {"items": "expert1", "steps": [1], "final": [0]}, {"items": ["expert1"], "steps": ["x"]}):
        assert not Fresh(("expert1",), None, final=False)(bad)


def test_a_zeroed_negated_or_scaled_copy_is_refused_and_the_next_holder_asked():
    net = LocalNetwork()
    downloads = ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    g = torch.Generator().manual_seed(0)
    mine = {e: [torch.randn(8, 4, generator=g)] for e in range(4)}
    later = {e: [mine[e][0] + 0.05 * torch.randn(8, 4, generator=g)] for e in range(4)}
    for poison in (torch.zeros_like, torch.neg, lambda t: 3 * t):
        rogue, honest = ExpertServer(net.transport("r").open_server("t_experts")), _holder(net)
        rogue.update({f"expert{e}": [poison(later[e][0])] for e in (0, 1)}, step=100, final=False)
        honest.update({f"expert{e}": later[e] for e in range(4)}, step=90, final=False)
        holders = {0: [("r", 100), ("b", 90)], 1: [("r", 100)], 2: [("b", 90)], 3: [("b", 90)]}
        got, rejected, _ = downloads.fetch(holders, mine, 100, False, time.monotonic() + 5)
        assert sorted(got) == [0, 2, 3] and len(rejected) == 2, rejected  # expert 1 has no other holder
        assert all(r.startswith(("expert0 from r", "expert1 from r")) for r in rejected)
        assert torch.allclose(got[0][0].float(), later[0][0], atol=1e-2)


def test_a_copy_many_steps_newer_may_have_grown_more_than_one_a_round_newer():
    """On GPU peers an expert's norm grew 2-3x between copies 400-1200 steps apart: such a copy is taken
    where AdamW at the peers' learning rate could have grown it that much (values of RMS 1, lr 1e-2: 600
    steps allow 7x), while the same growth between copies 10 steps apart is refused."""
    net = LocalNetwork()
    downloads = ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    mine = {e: [torch.randn(16, 8, generator=g)] for e in range(2)}
    grown = {e: [5 * mine[e][0] + 0.5 * torch.randn(16, 8, generator=g)] for e in range(2)}  # 5x the norm
    server = _holder(net)
    server.update({f"expert{e}": grown[e] for e in range(2)}, step=110, final=False)
    holders = {e: [("b", 110)] for e in range(2)}
    got, rejected, _ = downloads.fetch(holders, mine, 110, False, time.monotonic() + 5, {0: 100, 1: 100})
    assert got == {} and len(rejected) == 2, rejected  # 10 steps apart: too far (distance, then norm)
    server.update({f"expert{e}": grown[e] for e in range(2)}, step=700, final=False)
    got, rejected, _ = downloads.fetch(holders, mine, 700, False, time.monotonic() + 5, {0: 100, 1: 100})
    assert rejected == [] and sorted(got) == [0, 1] and downloads.steps == {0: 700, 1: 700}
    assert torch.allclose(got[0][0].float(), grown[0][0], atol=1e-2)
    # the next copy is judged against the one just taken: 5x again within 10 steps is refused
    server.update({f"expert{e}": [5 * got[e][0].float()] for e in range(2)}, step=710, final=False)
    got2, rejected, _ = downloads.fetch(holders, got, 710, False, time.monotonic() + 5)
    assert got2 == {} and len(rejected) == 2, rejected


def test_an_expert_still_at_its_initialisation_is_judged_by_the_swarms_print():
    from swarm.sync.copy_prints import copy_print

    net = LocalNetwork()
    downloads = ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    init = {3: [torch.full((8, 4), 0.5)]}
    trained = [torch.linspace(-1.0, 2.0, 32).reshape(8, 4)]  # far from the initialisation: no change of it
    downloads.judge_by_prints({3: (copy_print(trained), None)})
    server = _holder(net)
    server.update({"expert3": [-trained[0]]}, step=100, final=False)
    got, rejected, _ = downloads.fetch({3: [("b", 100)]}, init, 100, False, time.monotonic() + 5)
    assert got == {} and "points away" in rejected[0]
    server.update({"expert3": trained}, step=110, final=False)
    got, rejected, _ = downloads.fetch({3: [("b", 110)]}, init, 110, False, time.monotonic() + 5)
    assert rejected == [] and torch.allclose(got[3][0].float(), trained[0], atol=1e-2)
    # from now on our copy is the swarm's, and the next copy is judged against it
    server.update({"expert3": [torch.zeros(8, 4)]}, step=120, final=False)
    got, rejected, _ = downloads.fetch({3: [("b", 120)]}, {3: got[3]}, 120, False, time.monotonic() + 5)
    assert got == {} and "norm" in rejected[0]


def test_a_member_that_claims_experts_it_does_not_serve_is_asked_after_those_that_answer():
    net = LocalNetwork()
    downloads = ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    mine = {e: [torch.full((8, 4), 0.5)] for e in range(2)}
    _holder(net).update({f"expert{e}": [torch.full((8, 4), 0.55)] for e in range(2)}, step=90, final=False)
    # two fakes claim both experts at a huge step (the freshest, so asked first) and serve nothing
    holders = {e: [("x", 10**9), ("y", 10**9 - 1), ("b", 90)] for e in range(2)}
    got, _, failures = downloads.fetch(holders, mine, 100, False, time.monotonic() + 8)
    assert sorted(got) == [0, 1] and failures  # the third holder asked served them
    asked = len(net.fetched)
    got, _, failures = downloads.fetch(holders, mine, 100, False, time.monotonic() + 8)
    assert sorted(got) == [0, 1] and failures == []  # the holder that answered is asked first now
    assert {who for _, who, _, _ in net.fetched[asked:]} == {"b"}


def test_a_final_copy_cut_short_is_asked_for_again_until_it_comes_whole():
    """A copy whose tensors do not split into its items (a stream cut short) is no final copy: the fetch
    keeps asking until the whole one comes, instead of giving up on every expert it was asked for."""
    net = LocalNetwork()
    group = net.transport("b").open_server("t_experts")
    meta = {"items": ["expert1", "expert3"], "steps": [100, 100], "final": [True, True]}
    whole = [torch.full((8, 4), 0.25), torch.full((8, 4), 0.375)]
    group.serve(whole[:1], meta)  # one tensor for two items
    threading.Timer(1.0, group.serve, (whole, meta)).start()
    downloads = ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    mine = {e: [torch.full((8, 4), 0.3)] for e in (1, 3)}
    got, rejected, failures = downloads.fetch({1: [("b", 100)], 3: [("b", 100)]}, mine, 100, True,
                                              time.monotonic() + 5)  # fmt: skip
    assert failures == rejected == [] and got[1][0].tolist() == [[0.25] * 4] * 8
    assert got[3][0].tolist() == [[0.375] * 4] * 8


def test_a_holder_that_stopped_training_is_asked_once_more_and_not_waited_for():
    """A holder in the same round as we are, whose heartbeat then says it stopped training (its last round
    is next, and that round waits for ours): its copy newer than ours is taken at once, without waiting for
    one from our round; one no newer than ours is not taken, and neither is a failure."""
    net = LocalNetwork()
    server, downloads = _holder(net), ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    mine = {3: [torch.full((8, 4), 0.5)]}
    server.update({"expert3": [torch.full((8, 4), 0.75)]}, step=95, final=False)  # not from our round
    stop = threading.Event()
    threading.Timer(0.8, stop.set).start()
    t0 = time.monotonic()
    fetch = (mine, 100, False, t0 + 10, {3: 90}, None, lambda peer: stop.is_set())
    got, _, failures = downloads.fetch({3: [("b", 100)]}, *fetch)
    assert failures == [] and got[3][0].tolist() == [[0.75] * 4] * 8 and downloads.steps == {3: 95}
    assert 0.8 <= time.monotonic() - t0 < 0.8 + HOLD_S + 1.0
    t0 = time.monotonic()
    got, _, failures = downloads.fetch({3: [("b", 100)]}, *fetch[:4], {3: 95}, None, lambda peer: True)
    assert got == {} and failures == [] and time.monotonic() - t0 < 1.0
    # not stopped: it is waited for until the deadline, and that is a failure
    t0 = time.monotonic()
    got, _, failures = downloads.fetch({3: [("b", 100)]}, mine, 100, False, t0 + 3, {3: 95})
    assert got == {} and failures and time.monotonic() - t0 > 2


def test_a_holder_behind_us_is_waited_for_until_the_next_slots_meeting_at_most():
    """With rounds on the wall clock, a holder behind us serves one new copy a slot, at its round's start.
    A round that ran into the next slot took that copy; the next round, asking for a newer one, waited a
    whole slot for it, and so on, round after round. The wait now ends at the next slot's meeting."""
    net = LocalNetwork()
    server, downloads = _holder(net), ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    mine = {3: [torch.full((8, 4), 0.5)]}
    server.update({"expert3": [torch.full((8, 4), 0.5)]}, step=95, final=False)  # the copy we hold
    t0 = time.monotonic()
    got, _, failures = downloads.fetch(
        {3: [("b", 95)]}, mine, 100, False, t0 + 20, {3: 95}, patience_end=t0 + 1.0
    )
    assert got == {} and failures == [] and 1.0 <= time.monotonic() - t0 < 1.0 + HOLD_S, time.monotonic() - t0
    # a holder in our round is not behind us: waited for until the deadline, whatever the slot
    threading.Timer(1.8, server.update, ({"expert3": [torch.full((8, 4), 0.75)]}, 100, False)).start()
    got, _, failures = downloads.fetch(
        {3: [("b", 100)]},
        mine,
        100,
        False,
        time.monotonic() + 20,
        {3: 95},
        patience_end=time.monotonic() + 0.5,
    )
    assert failures == [] and got[3][0].tolist() == [[0.75] * 4] * 8
