"""Round digests as members compare them: another member's digest may be anything."""

import math

import pytest
import torch

from swarm.net.round_consensus import digests_agree, group_key


@pytest.mark.parametrize("bad", [math.nan, math.inf, "1.0", None, True])
def test_a_digest_with_a_value_that_is_not_a_finite_number_agrees_with_nothing(bad):
    mine = [4.0, 1.0, 2.0, -0.5]
    assert digests_agree(mine, list(mine))
    assert not digests_agree(mine, [bad, 1.0, 2.0, -0.5]) and not digests_agree(mine, [4.0, 1.0, 2.0, bad])


def test_the_group_key_is_the_same_for_every_member_whatever_the_members_sent():
    a = {"peer-a": {"step": 1, 2: "a key that is not text"}, "peer-b": {"step": 2, "ref": None}}
    b = {"peer-b": {"ref": None, "step": 2}, "peer-a": {2: "a key that is not text", "step": 1}}
    assert group_key("r", "g", a) == group_key("r", "g", b) != group_key("r", "g", {"peer-a": {"step": 1}})


def test_a_dissent_with_a_member_missing_fails_after_the_grace_period_not_the_deadline():
    """A member dropped out mid-round: the two left differ (its share is untouched in both) and its digest
    never comes. No majority can form unless it sides with us: give it the grace period, not the round."""
    import time

    from swarm.net.local_transport import LocalNetwork
    from swarm.net.round_consensus import StoreDigests, await_digests, publish_digest

    net = LocalNetwork()
    mine, theirs = [1.0, 2.0, 3.0, 4.0], [1.0, 2.5, 3.0, 4.0]
    assert publish_digest(net.store("b"), "k", "b", theirs, 1.0)
    t0 = time.monotonic()
    ok, why = await_digests(
        StoreDigests(net.store("a"), "a"), "k", "a", ["a", "b", "c"], mine, timeout=20.0, grace=0.5
    )
    assert not ok and "differs from" in why and time.monotonic() - t0 < 3.0
    # the same with c agreeing with us: a majority of two applies
    assert publish_digest(net.store("c"), "k", "c", mine, 1.0)
    ok, why = await_digests(
        StoreDigests(net.store("a"), "a"), "k", "a", ["a", "b", "c"], mine, timeout=20.0, grace=0.5
    )
    assert ok and "1 differ" in why


class _Flaky:
    """A store whose first ``fails`` writes are refused (a DHT store that no node acknowledged)."""

    def __init__(self, store, fails):
        self.store, self.fails, self.tries = store, fails, 0

    def put(self, *args, **kwargs):
        self.tries += 1
        return self.tries > self.fails and self.store.put(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_digest_whose_store_failed_is_stored_again_while_the_round_has_time():
    """One member's digest that does not land costs every member the round (and, with a lossy codec, the
    next one: the member that missed it keeps an older reference): a refused store is tried again."""
    import time

    from swarm.net.local_transport import LocalNetwork
    from swarm.net.round_consensus import StoreDigests, await_digests, publish_digest

    net, mine = LocalNetwork(), [1.0, 2.0, 3.0, 4.0]
    flaky = _Flaky(net.store("b"), fails=2)
    assert publish_digest(flaky, "k", "b", mine, timeout=5.0) and flaky.tries == 3
    assert publish_digest(net.store("a"), "k", "a", mine, 1.0)
    assert await_digests(StoreDigests(net.store("a"), "a"), "k", "a", ["a", "b"], mine, timeout=5.0) == (
        True,
        "",
    )
    # a store that never takes it: refused within the timeout, not retried past it
    broken, t0 = _Flaky(net.store("c"), fails=10**6), time.monotonic()
    assert not publish_digest(broken, "k2", "c", mine, timeout=1.0)
    assert time.monotonic() - t0 < 1.5 and broken.tries >= 2


def test_a_digest_is_each_segments_sum_of_magnitudes_and_its_sum_under_the_repeated_sign_pattern():
    """The same numbers as a float64 copy gives, to float32's rounding within a row of the pattern."""
    from swarm.net.round_consensus import SEGMENTS, SIGN_PERIOD, _signs, abs_sums, digest

    torch.manual_seed(0)
    tensors = [
        torch.randn(3 * SIGN_PERIOD * SEGMENTS + 100_003),
        torch.randn(17, 5).t(),  # not contiguous
        torch.randn(1000, 37)[::3],  # strided rows
        torch.randn(SEGMENTS - 3),  # fewer values than segments: some are empty
        torch.randn(0),
    ]
    want, scale = [], []
    for t in tensors:
        for seg in t.reshape(-1).double().tensor_split(SEGMENTS):
            signs = _signs().double().repeat(seg.numel() // SIGN_PERIOD + 1)[: seg.numel()]
            want += [float(seg.abs().sum()), float((seg * signs).sum())]
            scale += [float(seg.abs().sum())] * 2
    got = digest(tensors)
    assert len(got) == 2 * SEGMENTS * len(tensors)
    assert all(abs(g - w) <= 1e-6 * s + 1e-9 for g, w, s in zip(got, want, scale, strict=True))
    assert got[0::2] == pytest.approx(want[0::2], rel=1e-12)
    assert abs_sums(tensors) == got[0::2]


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_lossy_groups_members_agree_within_the_codecs_tolerance_but_not_with_a_part_left_unaveraged(name):
    """Four members' results after a lossy all-reduce (each gets mean - own back encoded) differ by the
    codec's error, which the codec's tolerance admits; a member whose quarter of the tensor kept its own
    values (a partial round) is refused. Tensors of the sizes of a small model's router and attention."""
    from swarm.net.round_consensus import abs_sums, digest
    from swarm.sync.codecs import codec_named

    codec = codec_named(name)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        sent = [[torch.randn(4096, generator=g), torch.randn(256, 256, generator=g)] for _ in range(4)]
        mean = [torch.stack([codec.roundtrip(s[i]) for s in sent]).mean(0) for i in range(2)]
        results = [[o + codec.roundtrip(m - o) for m, o in zip(mean, s, strict=True)] for s in sent]
        floor = abs_sums(sent[0])
        for other in results[1:]:
            assert digests_agree(digest(results[0]), digest(other), codec.tolerance, floor)
        partial = [t.clone() for t in results[1]]
        partial[0][:1024], partial[1][:64] = sent[1][0][:1024], sent[1][1][:64]
        assert not digests_agree(digest(results[0]), digest(partial), codec.tolerance, floor)
