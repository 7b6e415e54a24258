"""What a holder serves: fp16 copies and, with a lossy codec, the chain of changes between them."""

import torch

from swarm.net.expert_server import ExpertServer, copy_hash
from swarm.net.local_transport import LocalNetwork
from swarm.sync.codecs import codec_named


def _server(net: LocalNetwork, holder: str, codec) -> ExpertServer:
    t = net.transport(holder)
    return ExpertServer(t.open_server("t_experts"), t.open_server("t_expert_deltas", codec), codec)


def _values(seed: int) -> list[torch.Tensor]:
    """An expert's tensors whose blocks span magnitudes from 1e-6 to 10 (one tensor under ``EXACT_MAX``)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-6, 1, 64 * 40)[torch.randperm(64 * 40, generator=g)].view(40, 64)
    return [
        torch.randn(40, 64, generator=g) * scale,
        torch.randn(64, 8, generator=g),
        torch.randn(3, generator=g),
    ]


def _served(net: LocalNetwork, holder: str, name: str):
    served = net.served[(holder, name)]
    return served.meta, served.tensors


def test_each_change_names_the_copy_it_extends_and_makes_it_exactly():
    """Three updates: a whole copy, then two changes. Each change's ``base`` is the hash of the copy served
    before it and its ``hash`` that of the copy served with it, which is the base plus the change as it
    arrives (decoded from int8), rounded to fp16, bit for bit."""
    net, codec = LocalNetwork(), codec_named("int8")
    server = _server(net, "b", codec)
    before = None
    for step, seed in [(0, 0), (10, 1), (20, 2)]:
        values = [v * (1 + 0.01 * step) + 0.001 * step for v in _values(seed)]
        server.update({"expert2": values}, step, final=False)
        _, copy = _served(net, "b", "t_experts")
        if before is None:
            assert [c.dtype for c in copy] == [torch.float16] * 3
        else:
            meta, change = _served(net, "b", "t_expert_deltas")
            assert meta["items"] == ["expert2"] and meta["steps"] == [step]
            assert meta["base"] == [copy_hash(before)] and meta["hash"] == [copy_hash(copy)]
            rebuilt = [(b.float() + c).half() for b, c in zip(before, change, strict=True)]
            assert all(torch.equal(r, c) for r, c in zip(rebuilt, copy, strict=True))
            # the codec's error is that of one change, not accumulated: the copy is fp16-close to the value
            err = max(
                ((c.float() - v).abs().max() / v.abs().max()).item()
                for c, v in zip(copy, values, strict=True)
            )
            assert 0 < err < 0.02
        before = [c.clone() for c in copy]


def test_a_whole_copy_after_a_change_is_the_base_of_the_next():
    """A final (whole) copy replaces the chain: the next change is taken against it, by its own hash."""
    net, codec = LocalNetwork(), codec_named("int8")
    server = _server(net, "b", codec)
    server.update({"expert0": _values(0)}, 0, final=False)
    server.update({"expert0": _values(1)}, 1, final=False)
    server.update({"expert0": _values(2)}, 2, final=True)
    _, whole = _served(net, "b", "t_experts")
    assert torch.equal(whole[0], _values(2)[0].half())
    server.update({"expert0": _values(3)}, 3, final=False)
    meta, _ = _served(net, "b", "t_expert_deltas")
    assert meta["base"] == [copy_hash(whole)] and meta["steps"] == [3]
