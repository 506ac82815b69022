"""Compressors of compressed gossip (CHOCO-SGD): what a daemon sends instead of the tensor.

A compressor turns a tensor ``x`` into a small payload; :func:`decode` turns a payload back into
``Q(x)``, the tensor every receiver sees. The sender decodes its own payload too, so its idea of
what the neighbors received is bit for bit theirs. Payloads start with a fixed header (kind,
element count, k, scale) so a receiver can tell a peer that compressed differently.

* ``topk`` (``ratio``): the ``k = ceil(ratio * n)`` entries of largest magnitude, sent as
  ascending uint32 indices and their values (storage dtype, exact); ``8 ratio`` of the bytes of
  a float32 tensor.
* ``sign``: ``mean(|x|) * sign(x)`` (``x >= 0`` counts as +), one bit per entry; 1/32 of float32.
* ``int8``: ``scale * rint(x / scale)`` with ``scale = max|x| / 127``, one byte per entry; 1/4 of
  float32.
* ``int4``: ``scale * rint(x / scale)`` with ``scale = max|x| / 7``, levels -7..7, two entries
  per byte (the low nibble first, two's complement); 1/8 of float32.

All are deterministic (no random rounding), so a run can be replayed exactly.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from decent_wire import dtypes, numerics
from decent_wire.protocol import COMPRESSORS
from decent_wire.v1 import decent_pb2 as pb

_HEADER = struct.Struct("<IIQQd")  # kind, reserved, elements, k, scale
HEADER_BYTES = _HEADER.size

NAMES: dict[int, str] = {kind: name for name, kind in COMPRESSORS.items()}
#: dtypes a compressor accepts (it works on magnitudes and signs of real numbers)
FLOATS = frozenset({pb.FLOAT16, pb.BFLOAT16, pb.FLOAT32, pb.FLOAT64})


class CompressionError(ValueError):
    """A compressor cannot be used as asked, or a payload is not what it should be."""


def describe(kind: int, ratio: float) -> str:
    """``topk(ratio=0.01)`` / ``sign`` for messages."""
    name = NAMES.get(kind, f"compressor {kind}")
    return f"{name}(ratio={ratio:g})" if kind == pb.TOPK else name


def validate(kind: int, ratio: float, dtype: int, numel: int) -> None:
    """Raise CompressionError unless ``kind``/``ratio`` can compress this tensor."""
    if kind not in NAMES:
        raise CompressionError(f"unknown compressor {kind}; known: "
                               f"{', '.join(sorted(COMPRESSORS))}")
    if dtype not in FLOATS:
        raise CompressionError(f"{NAMES[kind]} compresses floating-point tensors, not "
                               f"{dtypes.dtype_name(dtype)}")
    if kind == pb.TOPK:
        if not (math.isfinite(ratio) and 0.0 < ratio <= 1.0):
            raise CompressionError(f"topk needs 0 < ratio <= 1, got {ratio}")
        if numel >= 1 << 32:
            raise CompressionError(f"topk indexes at most 2^32 - 1 elements, the tensor has "
                                   f"{numel}")
    elif ratio != 0.0:
        raise CompressionError(f"{NAMES[kind]} takes no ratio (got {ratio}); ratio is topk's")


def topk_count(ratio: float, numel: int) -> int:
    """Entries topk keeps: ``ceil(ratio * n)``, at least one of a non-empty tensor."""
    return min(numel, max(1, math.ceil(ratio * numel))) if numel else 0



def encode(kind: int, ratio: float, x: np.ndarray, dtype: int) -> bytes:
    """The payload of ``x`` (flat, storage dtype)."""
    n = int(x.size)
    values = numerics.to_compute(x, dtype)
    if kind == pb.TOPK:
        k = topk_count(ratio, n)
        mag = np.abs(values)
        idx = (np.arange(n) if k == n else np.argpartition(mag, n - k)[n - k:]) if k else \
            np.empty(0, np.int64)
        idx = np.sort(idx).astype(np.uint32)
        return _HEADER.pack(kind, 0, n, k, 0.0) + idx.tobytes() + x[idx].tobytes()
    if kind == pb.SIGN:
        scale = float(np.abs(values, dtype=np.float64).mean()) if n else 0.0
        bits = np.packbits(values >= 0, bitorder="little")
        return _HEADER.pack(kind, 0, n, 0, scale) + bits.tobytes()
    levels = 7 if kind == pb.QINT4 else 127
    peak = float(np.abs(values).max()) if n else 0.0
    scale = peak / levels
    q = np.zeros(n, np.int8) if scale == 0.0 else \
        np.clip(np.rint(values / values.dtype.type(scale)), -levels, levels).astype(np.int8)
    body = pack_nibbles(q) if kind == pb.QINT4 else q
    return _HEADER.pack(kind, 0, n, 0, scale) + body.tobytes()


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """int8 values in -8..7, two per byte: entry 2i in the low nibble of byte i."""
    u = np.zeros(2 * ((q.size + 1) // 2), np.uint8)
    u[:q.size] = q.view(np.uint8) & 0x0F
    return u[0::2] | (u[1::2] << 4)


def unpack_nibbles(body: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` int8 values :func:`pack_nibbles` packed into ``body``."""
    both = np.empty(2 * body.size, np.uint8)
    both[0::2], both[1::2] = body & 0x0F, body >> 4
    signed = both[:n].astype(np.int8)
    signed[signed > 7] -= 16
    return signed


def header(payload: memoryview | bytes) -> tuple[int, int, int, float]:
    """(kind, elements, k, scale) of a payload."""
    if len(payload) < HEADER_BYTES:
        raise CompressionError(f"payload of {len(payload)} bytes has no header")
    kind, _, n, k, scale = _HEADER.unpack_from(payload, 0)
    return int(kind), int(n), int(k), float(scale)


def decode(payload: memoryview | bytes, out: np.ndarray, dtype: int) -> None:
    """Write ``Q(x)`` into ``out`` (flat, storage dtype) from a payload made by :func:`encode`."""
    kind, n, k, scale = header(payload)
    if n != out.size:
        raise CompressionError(f"payload holds {n} elements, the tensor has {out.size}")
    body = np.frombuffer(payload, np.uint8, offset=HEADER_BYTES)
    storage = dtypes.STORAGE[dtype]
    compute = numerics.COMPUTE[dtype]
    if kind == pb.TOPK:
        size = k * (4 + storage.itemsize)
        if body.size != size or k > n:
            raise CompressionError(f"topk payload of {body.size} bytes for k={k}, expected "
                                   f"{size}")
        idx = body[:4 * k].view(np.uint32)
        out[...] = 0
        out[idx] = body[4 * k:].view(storage)
    elif kind == pb.SIGN:
        if body.size != (n + 7) // 8:
            raise CompressionError(f"sign payload of {body.size} bytes for {n} elements")
        plus = np.unpackbits(body, count=n, bitorder="little").astype(bool)
        s = compute.type(scale)
        out[...] = numerics.from_compute(np.where(plus, s, -s).astype(compute), dtype)
    elif kind == pb.QINT8:
        if body.size != n:
            raise CompressionError(f"int8 payload of {body.size} bytes for {n} elements")
        out[...] = numerics.from_compute(body.view(np.int8).astype(compute) * compute.type(scale),
                                       dtype)
    elif kind == pb.QINT4:
        if body.size != (n + 1) // 2:
            raise CompressionError(f"int4 payload of {body.size} bytes for {n} elements")
        out[...] = numerics.from_compute(
            unpack_nibbles(body, n).astype(compute) * compute.type(scale), dtype)
    else:
        raise CompressionError(f"payload of unknown compressor {kind}")
