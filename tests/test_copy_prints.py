"""Prints of weight copies: fixed positions, what they estimate, and which copies they doubt."""

import numpy as np
import torch

from swarm.sync.copy_prints import (
    PRINT_VALUES,
    copy_doubt,
    copy_print,
    median_print,
    print_bytes,
    print_from_bytes,
)


def _copy(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 32, generator=g), torch.randn(32, 48, generator=g), torch.randn(100, generator=g)]


def test_prints_take_the_same_positions_on_every_peer_and_any_device_dtype():
    w = _copy(0)
    p = copy_print(w)
    assert p.shape == (PRINT_VALUES,) and p.dtype == torch.float32
    assert torch.equal(p, copy_print([t.clone() for t in w]))  # positions follow the shapes only
    assert torch.allclose(copy_print([t.bfloat16() for t in w]), p, rtol=1e-2, atol=1e-2)
    values = set(torch.cat([t.reshape(-1) for t in w]).tolist())
    assert set(p.tolist()) <= values  # values of the copy itself, spread over its tensors
    assert all(any(v in set(t.reshape(-1).tolist()) for v in p.tolist()) for t in w)


def test_a_print_estimates_the_copies_norms_and_distances():
    a = _copy(1)
    b = [t + 0.3 * torch.randn_like(t) for t in a]
    full = (
        sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True)) ** 0.5
        / sum(float(x.pow(2).sum()) for x in a) ** 0.5
    )
    pa, pb = copy_print(a), copy_print(b)
    est = float((pa - pb).norm() / pa.norm())
    assert abs(est - full) < 0.1 * full, (est, full)


def test_honest_later_copies_pass_and_negated_zeroed_scaled_or_foreign_ones_do_not():
    w = _copy(2)
    later = [t + 0.4 * torch.randn_like(t) for t in w]  # a round or two of training later
    assert copy_doubt(later, w) == "" and copy_doubt([copy_print(later)], [copy_print(w)]) == ""
    assert copy_doubt([1.8 * t for t in w], w) == ""  # norms grow while an expert trains
    assert "norm" in copy_doubt([torch.zeros_like(t) for t in w], w)
    assert "norm" in copy_doubt([3 * t for t in w], w) and "norm" in copy_doubt([100 * t for t in w], w)
    assert "points away" in copy_doubt([-t for t in w], w)
    assert "points away" in copy_doubt([copy_print([-t for t in later])], [copy_print(w)])
    assert copy_doubt(w, [torch.zeros_like(t) for t in w]) == ""  # nothing to compare with


def test_prints_travel_as_fp16_bytes_and_malformed_ones_are_refused():
    p = copy_print(_copy(3))
    back = print_from_bytes(print_bytes(p))
    assert torch.allclose(back, p, rtol=1e-3, atol=1e-3)
    nan = np.full(PRINT_VALUES, np.nan, dtype=np.float16).tobytes()
    for bad in (b"", print_bytes(p)[:-2], nan, "text", None, 12, [1.0] * PRINT_VALUES):
        assert print_from_bytes(bad) is None


def test_the_median_print_ignores_one_outlier_of_three():
    p = copy_print(_copy(4))
    med = median_print([p, p + 0.01, -100 * p])
    assert torch.allclose(med, p, atol=0.011)
    assert torch.allclose(median_print([p, p + 1.0]), p + 0.5)


def test_the_norm_bound_is_what_adamw_steps_at_the_learning_rate_could_do_within_a_floor_and_a_cap():
    from swarm.sync.copy_prints import MAX_NORM_FACTOR, NORM_FACTOR, norm_factor, rms

    assert (
        norm_factor(None, 3e-3, 0.02)
        == norm_factor(0, 3e-3, 0.02)
        == norm_factor(400, None, 0.02)
        == NORM_FACTOR
    )
    assert norm_factor(10, 3e-3, 0.1) == NORM_FACTOR  # 1.3: within the floor
    assert abs(norm_factor(100, 1e-3, 0.05) - 3.0) < 1e-9  # 100 steps of at most 1e-3 on values of RMS 0.05
    assert norm_factor(400, 3e-3, 0.02) == MAX_NORM_FACTOR  # near the initialisation: the cap
    assert abs(rms([torch.full((4, 4), 3.0), torch.full((2,), -3.0)]) - 3.0) < 1e-6
    a = [torch.ones(64)]
    assert (
        "norm" in copy_doubt([3 * a[0]], a)
        and copy_doubt([3 * a[0]], a, factor=norm_factor(400, 0.01, 1.0)) == ""
    )
