"""The run's codec as hivemind compression: what the averagers' all-reduce sends.

    compression = hivemind_compression(codec_named("int8"))     # for HivemindGroup(compression=...)

A received tensor part is decoded by the compression type written in its message, from hivemind's table of
types, so the int8 codec is registered in that table under ``BLOCKWISE_8BIT`` (hivemind's own needs
bitsandbytes, which the swarm does not use) and int4 under ``UNIFORM_8BIT`` when this module is imported,
before any averager process is forked. Tensors of at most ``EXACT_MAX`` values travel as fp32 (type
``NONE``) with every codec, as ``Codec.roundtrip`` assumes. The encoding is ``swarm.sync.codecs``'s, in
torch only (hivemind's 8-bit quantizers fail under numpy 2, NOTES.md).
"""

from __future__ import annotations

import numpy as np
import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    serialization,
)
from hivemind.proto import runtime_pb2

from swarm.sync.codecs import (
    BLOCK,
    CODECS,
    EXACT_MAX,
    Codec,
    blockwise_decode,
    blockwise_encode,
    pack_nibbles,
    unpack_nibbles,
)

_EXACT = NoCompression()


def _numel(info: CompressionInfo) -> int:
    return int(np.prod(info.descriptor.size)) if info.descriptor is not None else 0


class _SmallExact(CompressionBase):
    """Sends tensors of at most EXACT_MAX values (by the whole tensor's size) exactly."""

    inner: CompressionBase

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        if _numel(info) <= EXACT_MAX or tensor.numel() == 0:
            return _EXACT.compress(tensor, info, allow_inplace)
        return self.inner.compress(tensor, info, allow_inplace)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self.inner.extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.inner.estimate_compression_ratio(info)


class Fp16Codec(_SmallExact):
    compression_type = runtime_pb2.CompressionType.FLOAT16
    inner = Float16Compression()


class _Blockwise(CompressionBase):
    """A blockwise codec's codes (int8 as they are, int4 two to a byte) plus an fp32 absmax scale per block:
    buffer = scales, then codes."""

    codec: Codec  # ``swarm.sync.codecs``'s

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        codes, scales = blockwise_encode(tensor, self.codec.levels)
        body = codes if self.codec.code_bits == 8 else pack_nibbles(codes)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=scales.numpy().tobytes() + body.numpy().tobytes(),
            size=tensor.shape,
            dtype="float32",
            requires_grad=False,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        n, bits = int(np.prod(shape)), self.codec.code_bits
        n_scales = -(-n // BLOCK)
        buf = serialized_tensor.buffer
        if len(buf) != 4 * n_scales + -(-n * bits // 8):
            raise ValueError(f"{self.codec.name} tensor of {len(buf)} bytes for shape {shape}")
        scales = torch.from_numpy(np.frombuffer(buf, dtype=np.float32, count=n_scales).copy())
        body = np.frombuffer(buf, dtype=np.int8 if bits == 8 else np.uint8, offset=4 * n_scales).copy()
        codes = torch.from_numpy(body) if bits == 8 else unpack_nibbles(torch.from_numpy(body), n)
        return blockwise_decode(codes, scales, shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # used only to size the all-reduce's parts: a quarter of fp32 makes every part a whole number of
        # blocks (and of bytes) from its tensor's start, so the wire's blocks are those ``Codec.roundtrip``
        # computes
        return 0.25


class Int8Blockwise(_Blockwise):
    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT
    codec = CODECS["int8"]


class Int4Blockwise(_Blockwise):
    """Sent as hivemind's ``UNIFORM_8BIT`` type, which the swarm does not otherwise use."""

    compression_type = runtime_pb2.CompressionType.UNIFORM_8BIT
    codec = CODECS["int4"]


class Int8Codec(_SmallExact):
    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT
    inner = Int8Blockwise()


class Int4Codec(_SmallExact):
    compression_type = runtime_pb2.CompressionType.UNIFORM_8BIT
    inner = Int4Blockwise()


serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = Int8Blockwise()
serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = Int4Blockwise()


def hivemind_compression(codec: Codec) -> CompressionBase:
    return {"fp32": NoCompression, "fp16": Fp16Codec, "int8": Int8Codec, "int4": Int4Codec}[codec.name]()
