"""How averaged tensors travel: a codec per run (``sync.codec``), as pure tensor math.

    codec = codec_named("int8")
    received = codec.roundtrip(t)        # exactly what a peer decodes from what we send
    codec.wire_bytes(t.numel())          # bytes on the wire (block scales included)
    codec.tolerance                      # how far members' results may differ and still agree

- ``fp32``: lossless, 4 bytes a value.
- ``fp16``: 2 bytes a value, relative error <= 2^-11 (values clamp to the fp16 range).
- ``int8``: blockwise absmax: each block of ``BLOCK`` values travels as int8 codes plus one fp32 scale
  (absmax / 127), 1.0625 bytes a value; the error of a value is at most half its block's scale.
- ``int4``: the same with codes in -7..7 (scale absmax / 7), two to a byte: 0.5625 bytes a value, an
  error up to 18 times int8's. With error feedback (the change since the agreed state travels, and what a
  round dropped is sent again with the next) it suits the dense all-reduce's outer gradients.

Tensors of at most ``EXACT_MAX`` values (the per-item weights of a group, norms' gains in tiny models)
travel exactly whatever the codec: the round compares the weights that come back with those the members
claimed, which a lossy weight would fail. The transport's encoder (``swarm.net.hivemind_codecs``) calls
the same functions, so ``roundtrip`` is bit for bit what the wire does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 64
EXACT_MAX = 256
FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class Codec:
    """A codec: its name, wire cost, and how far apart members' results may be after a round with it."""

    name: str
    bits: float  # per value on the wire
    tolerance: float  # relative tolerance of the round digests (``round_consensus``)
    code_bits: int = 0  # a blockwise codec's bits per value's code (its scales aside); 0: not blockwise

    @property
    def lossless(self) -> bool:
        return self.name == "fp32"

    @property
    def levels(self) -> int:
        """A blockwise codec's largest code: a block's absmax travels as it."""
        return 2 ** (self.code_bits - 1) - 1

    def wire_bytes(self, numel: int) -> int:
        if numel <= EXACT_MAX:
            return 4 * numel
        if self.code_bits:
            return math.ceil(numel * self.code_bits / 8) + 4 * math.ceil(numel / BLOCK)
        return int(numel * self.bits / 8)

    def roundtrip(self, t: torch.Tensor) -> torch.Tensor:
        """What a receiver decodes (fp32) from ``t`` sent with this codec."""
        t = t.detach().float()
        if self.lossless or t.numel() <= EXACT_MAX:
            return t.clone()
        if self.name == "fp16":
            return t.clamp(-FP16_MAX, FP16_MAX).half().float()
        codes, scales = blockwise_encode(t, self.levels)
        return blockwise_decode(codes, scales, t.shape)


# members of an fp32 group end with the same values up to the order of additions; a lossy codec adds the
# error of the averaged delta each member gets back (hivemind sends each member mean - its own part, encoded)
CODECS = {
    "fp32": Codec("fp32", 32.0, 1e-4),
    "fp16": Codec("fp16", 16.0, 1e-3),
    "int8": Codec("int8", 8.0 + 32.0 / BLOCK, 2e-2, code_bits=8),
    "int4": Codec("int4", 4.0 + 32.0 / BLOCK, 1e-1, code_bits=4),
}


def codec_named(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODECS)}") from None


def blockwise_encode(t: torch.Tensor, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes in -levels..levels of every value, fp32 scale per block of ``BLOCK``) of a float tensor."""
    # one temporary of the tensor's size, rounded and clamped in place (the all-reduce encodes every part
    # it sends on the averager's CPU: fewer passes over memory are a shorter round)
    flat = t.detach().reshape(-1).float()
    n, pad = flat.numel(), -flat.numel() % BLOCK
    blocks = (torch.nn.functional.pad(flat, (0, pad)) if pad else flat).view(-1, BLOCK)
    amax = blocks.abs().amax(dim=1)
    # divided by a tensor, not a Python number: CUDA multiplies by a scalar divisor's reciprocal (on an H100,
    # other bits than the CPU's for x / 127.0), and the codes must not depend on where they are computed
    scales = amax.div_(torch.full_like(amax, levels))
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.div(blocks, safe[:, None]).round_().clamp_(-levels, levels).to(torch.int8)
    return codes.view(-1)[:n], scales


def blockwise_decode(
    codes: torch.Tensor, scales: torch.Tensor, shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    n, pad = codes.numel(), -codes.numel() % BLOCK
    blocks = (torch.nn.functional.pad(codes, (0, pad)) if pad else codes).reshape(-1, BLOCK)
    out = torch.empty(blocks.shape, dtype=torch.float32, device=codes.device)
    torch.mul(blocks, scales[:, None], out=out)  # int8 times fp32 into fp32: no float copy of the codes
    return out.view(-1)[:n].reshape(shape)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes (int8 tensor, -7..7) two to a byte: value i in the low half of byte i // 2 when i is even."""
    flat = codes.reshape(-1).to(torch.uint8).add_(8)  # 1..15
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_full((1,), 8)])
    pairs = flat.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` int4 codes (int8 tensor) that ``pack_nibbles`` packed."""
    pairs = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:n]
    return pairs.to(torch.int8).sub_(8)
