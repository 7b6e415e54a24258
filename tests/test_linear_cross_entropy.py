"""The chunked LM head + cross-entropy equals the plain one: loss and gradients, with vocabulary padding."""

import pytest
import torch
import torch.nn.functional as F

from swarm.model.linear_cross_entropy import linear_cross_entropy


def _inputs(n=37, d=16, vocab=50, padded=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen, requires_grad=True)
    w = torch.randn(padded, d, generator=gen)
    w[vocab:] = 0  # the model keeps padding rows at zero
    w.requires_grad_(True)
    t = torch.randint(0, vocab, (n,), generator=gen)
    return h, w, t


@pytest.mark.parametrize("chunk", [0, 1, 8, 37, 100])
def test_loss_and_gradients_equal_plain_cross_entropy(chunk):
    h, w, t = _inputs()
    loss = linear_cross_entropy(h, w, t, vocab_size=50, chunk_tokens=chunk)
    (loss * 3.0).backward()  # a scaled loss: the backward must scale the stored gradients
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy((h @ w.t())[:, :50], t)
    (ref * 3.0).backward()
    assert abs(loss.item() - ref.item()) < 1e-6 * ref.item()
    assert (gh - h.grad).abs().max().item() < 1e-6
    assert (gw - w.grad).abs().max().item() < 1e-6
    assert gw[50:].abs().max().item() == 0  # padding rows never learn


def test_padding_logits_never_win_even_when_large():
    h, w, t = _inputs()
    with torch.no_grad():
        w[50:] = 100.0  # padding rows that would dominate any softmax they took part in
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t, vocab_size=50, chunk_tokens=8)
    assert abs(loss.item() - F.cross_entropy((h @ w.t())[:, :50], t).item()) < 1e-5


def test_no_grad_path_matches_grad_path():
    h, w, t = _inputs()
    with torch.no_grad():
        a = linear_cross_entropy(h, w, t, vocab_size=50, chunk_tokens=5)
    b = linear_cross_entropy(h, w, t, vocab_size=50, chunk_tokens=5)
    assert abs(a.item() - b.item()) < 1e-6


def test_bf16_autocast_is_close_to_fp32():
    h, w, t = _inputs(n=64, d=32)
    ref = F.cross_entropy((h @ w.t())[:, :50], t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, t, vocab_size=50, chunk_tokens=16)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) / ref.item() < 2e-2


def test_ignored_targets_are_left_out_like_cross_entropy():
    h, w, t = _inputs()
    t[::3] = -100
    loss = linear_cross_entropy(h, w, t, vocab_size=50, chunk_tokens=8)
    loss.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy((h @ w.t())[:, :50], t)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-6 * ref.item()
    assert (gh - h.grad).abs().max().item() < 1e-6 and (gw - w.grad).abs().max().item() < 1e-6
    assert gh[::3].abs().max().item() == 0
    with torch.no_grad():
        assert abs(linear_cross_entropy(h, w, t, 50, 8).item() - ref.item()) < 1e-6 * ref.item()
