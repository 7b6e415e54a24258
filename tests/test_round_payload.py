"""What a group sends: weights, or the change since the agreed reference plus the codec's last error."""

import torch

from swarm.net.group_layout import GroupSpec, sibling
from swarm.net.round_info import MAX_REFERENCE, RoundInfo
from swarm.net.round_payload import Payloads, rebased_id
from swarm.sync.codecs import codec_named

SPEC = GroupSpec("t_experts_0_1", ("expert0", "expert1"))
SIZES = {"expert0": 1, "expert1": 1}


def _local(seed: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"expert0": [torch.randn(50, 40, generator=g)], "expert1": [torch.randn(50, 40, generator=g)]}


def test_fp32_sends_weights_and_keeps_no_state():
    payloads, local = Payloads(codec_named("fp32")), _local(0)
    sent = payloads.encode(SPEC, local, {"expert0": 2.0, "expert1": 0.5})
    tensors = list(sent.tensors)
    assert sent.reference == "" and sent.residuals is None
    assert torch.equal(tensors[0], local["expert0"][0] * 2.0) and tensors[-1].tolist() == [2.0, 0.5]
    payloads.commit(SPEC, sent, local, "round1")
    assert payloads.reference_id(SPEC) == ""


def test_int8_sends_the_change_since_the_reference_plus_what_it_dropped_last_time():
    codec = codec_named("int8")
    payloads, weights = Payloads(codec), {"expert0": 2.0, "expert1": 1.0}
    first = payloads.encode(SPEC, _local(0), weights)  # no reference yet: the weights
    assert first.reference == ""
    assert torch.equal(first.residuals[0], first.tensors[0] - codec.roundtrip(first.tensors[0]))
    agreed = _local(1)
    payloads.commit(SPEC, first, agreed, "t_digest_abc")
    assert payloads.reference_id(SPEC) == "t_digest_abc"

    moved = {i: [t + 0.01] for i, ts in agreed.items() for t in ts}
    second = payloads.encode(SPEC, moved, weights)
    assert second.reference == "t_digest_abc"
    want = 2.0 * (moved["expert0"][0] - agreed["expert0"][0]) + first.residuals[0]
    assert torch.allclose(second.tensors[0], want, atol=1e-6)
    assert second.tensors[-1].tolist() == [2.0, 1.0]  # the weights: never compensated

    # the group's mean comes back: the reference is added again
    averaged = [t.clone() for t in second.tensors]
    averages, mean_weights = payloads.decode(SPEC, second, averaged, SIZES)
    assert mean_weights == [2.0, 1.0]
    assert torch.allclose(averages["expert1"][0], moved["expert1"][0] + first.residuals[1], atol=1e-5)

    # a round that is not applied keeps the old residual; forgetting drops the reference
    third = payloads.encode(SPEC, moved, weights)
    assert torch.allclose(third.tensors[0], second.tensors[0])
    payloads.keep(["another group"])
    assert payloads.reference_id(SPEC) == "" and payloads.encode(SPEC, moved, weights).reference == ""


def test_a_group_with_items_the_reference_lacks_sends_weights():
    payloads = Payloads(codec_named("fp16"))
    one = GroupSpec("t_experts_0_1", ("expert0",))
    sent = payloads.encode(one, _local(0), {"expert0": 1.0})
    payloads.commit(one, sent, _local(0), "r1")
    assert payloads.reference_id(one) == "r1" and payloads.reference_id(SPEC) == ""


def test_a_round_short_of_its_quorum_keeps_the_reference_and_the_next_change_includes_its_own():
    codec = codec_named("int8")
    payloads, weights = Payloads(codec), {"expert0": 1.0, "expert1": 1.0}
    first = payloads.encode(SPEC, _local(0), weights)
    agreed = _local(1)
    payloads.commit(SPEC, first, agreed, "r1")
    split = payloads.encode(SPEC, {i: [t + 0.01 for t in ts] for i, ts in agreed.items()}, weights)
    applied = {i: [t + 0.02 for t in ts] for i, ts in agreed.items()}  # the split group's result
    payloads.commit(SPEC, split, applied, "r2", moves=False)
    assert payloads.reference_id(SPEC) == "r1" and payloads.held(SPEC) == 1
    # the next change is against r1 (so it carries the split round's change too), plus what the codec
    # dropped from the split round's payload
    later = {i: [t + 0.03 for t in ts] for i, ts in agreed.items()}
    nxt = payloads.encode(SPEC, later, weights)
    assert nxt.reference == "r1"
    assert torch.allclose(
        nxt.tensors[0], later["expert0"][0] - agreed["expert0"][0] + split.residuals[0], atol=1e-6
    )
    payloads.commit(SPEC, nxt, later, "r3")
    assert payloads.reference_id(SPEC) == "r3" and payloads.held(SPEC) == 0


def test_a_rebased_reference_id_names_both_rounds_and_fits_a_round_info_however_long_theirs():
    full, core, later = "f" * MAX_REFERENCE, "c" * MAX_REFERENCE, "d" * MAX_REFERENCE
    once = rebased_id(full, core)
    assert once == rebased_id(full, core) and len(once) <= MAX_REFERENCE
    # a later core round replaces the core part again: the full round it came from stays in the name
    assert rebased_id(once, later) == rebased_id(full, later) != once
    info = RoundInfo(step=1, round=1, last=False, weights=(1.0,), reference=once)
    assert RoundInfo.from_msg(info.to_msg(), 1) == info
    assert sibling(GroupSpec("run_dense", ("dense",))) == GroupSpec("run_core_dense", ("core",))
    assert sibling(GroupSpec("run_core_dense", ("core",))) == GroupSpec("run_dense", ("dense",))
