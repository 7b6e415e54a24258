"""Codecs: error bounds, the wire's encoding equals ``roundtrip``, and error feedback returns what was dropped."""

import pytest
import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import CompressionInfo, deserialize_torch_tensor

from swarm.net.hivemind_codecs import hivemind_compression
from swarm.sync.codecs import (
    BLOCK,
    EXACT_MAX,
    blockwise_decode,
    blockwise_encode,
    codec_named,
    pack_nibbles,
    unpack_nibbles,
)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_fp32_is_exact_and_fp16_within_its_relative_error():
    x = _randn(1000) * 3
    assert torch.equal(codec_named("fp32").roundtrip(x), x)
    err = (codec_named("fp16").roundtrip(x) - x).abs()
    assert 0 < err.max() and bool((err <= x.abs() * 2**-11 + 1e-7).all())


@pytest.mark.parametrize(("name", "levels", "typical"), [("int8", 127, 0.02), ("int4", 7, 0.3)])
def test_blockwise_error_is_at_most_half_a_step_of_each_block(name, levels, typical):
    x = _randn(10 * BLOCK + 7)
    x[:BLOCK] *= 1000  # one block of large values must not spoil the precision of the others
    got = codec_named(name).roundtrip(x)
    pad = torch.nn.functional.pad(x, (0, -x.numel() % BLOCK)).view(-1, BLOCK)
    step = (pad.abs().amax(dim=1) / levels).repeat_interleave(BLOCK)[: x.numel()]
    err = (got - x).abs()
    assert bool((err <= step / 2 * (1 + 1e-5)).all())
    assert err[BLOCK:].max() < typical  # a block of N(0, 1) values: steps of about 3 / levels
    assert err[BLOCK:].max() > typical / 10


def test_int4_codes_pack_two_to_a_byte_and_unpack_to_the_same_codes():
    for n in (1, 2, 7, 2 * BLOCK + 1):
        codes = torch.randint(-7, 8, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int8)
        packed = pack_nibbles(codes)
        assert packed.dtype == torch.uint8 and packed.numel() == (n + 1) // 2
        assert torch.equal(unpack_nibbles(packed, n), codes)


def test_int8_codes_are_each_value_over_its_blocks_step_rounded_and_decode_to_code_times_step():
    x = _randn(5 * BLOCK + 9, seed=2) * 4
    x[BLOCK : 2 * BLOCK] = 0  # a block of zeros: scale 0, codes 0, decoded 0
    codes, scales = blockwise_encode(x)
    want_scales = torch.nn.functional.pad(x, (0, -x.numel() % BLOCK)).view(-1, BLOCK).abs().amax(dim=1) / 127
    assert torch.equal(scales, want_scales) and scales[1] == 0
    step = torch.where(want_scales > 0, want_scales, 1.0).repeat_interleave(BLOCK)[: x.numel()]
    assert torch.equal(codes, torch.round(x / step).to(torch.int8))
    decoded = blockwise_decode(codes, scales, (x.numel(),))
    assert torch.equal(decoded, codes.float() * scales.repeat_interleave(BLOCK)[: x.numel()])
    assert not decoded[BLOCK : 2 * BLOCK].any() and decoded.dtype == torch.float32


def test_small_tensors_travel_exactly_and_bytes_follow_the_codec():
    w = torch.tensor([1.0, 0.9, 2.5])
    for name in ("fp16", "int8", "int4"):
        assert torch.equal(codec_named(name).roundtrip(w), w)
    n = 64 * 1000
    assert codec_named("fp32").wire_bytes(n) == 4 * n
    assert codec_named("fp16").wire_bytes(n) == 2 * n
    assert codec_named("int8").wire_bytes(n) == n + 4 * 1000
    assert codec_named("int4").wire_bytes(n) == n // 2 + 4 * 1000
    assert codec_named("int4").wire_bytes(n + 1) == n // 2 + 1 + 4 * 1001
    assert codec_named("int8").wire_bytes(EXACT_MAX) == 4 * EXACT_MAX
    with pytest.raises(ValueError, match="unknown codec 'int2'"):
        codec_named("int2")


@pytest.mark.parametrize("name", ["fp32", "fp16", "int8", "int4"])
def test_what_hivemind_sends_decodes_to_roundtrip_bit_for_bit(name):
    codec, x = codec_named(name), _randn(3, 700, seed=1)
    compression = hivemind_compression(codec)
    info = CompressionInfo.from_tensor(x)
    # the all-reduce sends parts of a tensor: each part starts a whole number of blocks into the tensor
    part = int(DEFAULT_PART_SIZE_BYTES / (x.element_size() * compression.estimate_compression_ratio(info)))
    assert part % BLOCK == 0
    for piece in (x, x.reshape(-1)[: 5 * BLOCK], x.reshape(-1)[: 5 * BLOCK + 3]):
        wire = deserialize_torch_tensor(compression.compress(piece, info.get_part(0, part)))
        assert torch.equal(wire, codec.roundtrip(piece))
    small = torch.tensor([0.123456789, 7.0])  # the group's weights: exact with every codec
    wire = deserialize_torch_tensor(compression.compress(small, CompressionInfo.from_tensor(small)))
    assert torch.equal(wire, small)
    if name in ("int8", "int4"):
        assert len(compression.compress(x, info).buffer) == codec.wire_bytes(x.numel())


def test_error_feedback_delays_what_the_codec_drops_instead_of_losing_it():
    codec, delta = codec_named("int8"), _randn(4096, seed=2) * 1e-3
    delta[::BLOCK] = 0.05  # a large value per block: small ones are mostly rounded away
    residual, with_feedback, without = (
        torch.zeros_like(delta),
        torch.zeros_like(delta),
        torch.zeros_like(delta),
    )
    for _ in range(20):
        v = delta + residual
        sent = codec.roundtrip(v)
        residual = v - sent
        with_feedback += sent
        without += codec.roundtrip(delta)
    want = 20 * delta
    assert torch.allclose(with_feedback + residual, want, atol=1e-6)  # nothing lost, only delayed
    err_fb, err_plain = (with_feedback - want).norm(), (without - want).norm()
    assert err_fb < err_plain / 5, (err_fb, err_plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["int8", "int4", "fp16"])
def test_a_gpu_roundtrip_is_the_cpus_bit_for_bit(name):
    """Codes, scales and roundtrip are the same wherever they are computed: a receiver checks what it
    rebuilds by hash against what the sender computed. Blocks from 1e-30 to 1e30, zero blocks and ties
    included. On an H100 this passed, while x / 127.0 by a Python number gave other bits than the CPU's."""
    g = torch.Generator().manual_seed(0)
    n = 64 * 4096
    x = torch.randn(n, generator=g) * torch.logspace(-30, 30, n)[torch.randperm(n, generator=g)]
    x[: 3 * BLOCK] = 0.0
    x[3 * BLOCK : 4 * BLOCK] = torch.arange(BLOCK) - 31.5  # codes at exact halves of a step
    codec = codec_named(name)
    if codec.code_bits:
        codes, scales = blockwise_encode(x, codec.levels)
        codes_g, scales_g = blockwise_encode(x.cuda(), codec.levels)
        assert torch.equal(scales, scales_g.cpu()) and torch.equal(codes, codes_g.cpu())
    assert torch.equal(codec.roundtrip(x), codec.roundtrip(x.cuda()).cpu())
