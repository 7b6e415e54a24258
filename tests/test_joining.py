"""Catching up with a swarm on the in-process transport: the weights a joiner takes, and the reference."""

import torch

from swarm.config import ModelConfig
from swarm.model import MoETransformer
from swarm.net.expert_tensors import dense_tensors, expert_tensors
from swarm.net.group_layout import DENSE, GroupSpec, pack
from swarm.net.joining import catch_up
from swarm.net.local_transport import LocalNetwork
from swarm.net.records import Heartbeat

MODEL = ModelConfig(
    vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_experts=4, expert_hidden=8, max_seq_len=256
)
DENSE_SPEC = GroupSpec("t_dense", (DENSE,))


def _swarm_peer(net: LocalNetwork, ref: str | int | None) -> MoETransformer:
    """Peer "a", holding experts 0 and 1, serving its dense weights (with a reference id) and its experts."""
    model = MoETransformer(MODEL, [0, 1])
    model.init_weights(7)
    transport, dense = net.transport("a"), dense_tensors(model)
    meta = {"items": [DENSE], "step": 10} | ({} if ref is None else {"ref": ref})
    transport.open("t_dense", dense).serve(list(pack(DENSE_SPEC, {DENSE: dense}, {DENSE: 1.0})), meta)
    copies = [t.half() for e in (0, 1) for t in expert_tensors(model, e)]
    meta = {"items": ["expert0", "expert1"], "steps": [10, 10], "final": [False, False]}
    transport.open_server("t_experts").serve(copies, meta)
    return model


def test_a_joiner_takes_the_served_weights_and_the_reference_they_are():
    net = LocalNetwork()
    theirs = _swarm_peer(net, "5f3a-ref")
    mine = MoETransformer(MODEL, [2, 3])
    mine.init_weights(7)
    with torch.no_grad():
        for p in mine.parameters():
            p.add_(1.0)  # anything but theirs
    caught = catch_up(net.transport("b"), "t", mine, {"a": Heartbeat(experts=[0, 1], step=10)}, timeout=2.0)
    assert caught.dense and caught.experts == 2
    ref_id, ref = caught.reference
    assert ref_id == "5f3a-ref"
    for got, want, r in zip(dense_tensors(mine), dense_tensors(theirs), ref, strict=True):
        assert torch.equal(got, want) and torch.equal(r, want)
    for e in (0, 1):
        for got, want in zip(expert_tensors(mine, e), expert_tensors(theirs, e), strict=True):
            assert torch.equal(got, want.half().float())


def test_a_reference_id_that_is_not_a_short_string_is_not_taken():
    for ref in (None, "", 12, "x" * 500):
        net = LocalNetwork()
        _swarm_peer(net, ref)
        mine = MoETransformer(MODEL, [2, 3])
        caught = catch_up(net.transport("b"), "t", mine, {"a": Heartbeat(experts=[0, 1], step=10)}, 2.0)
        assert caught.dense and caught.reference is None, ref
