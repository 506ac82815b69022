"""The daemon's quantizers in process, against their definitions in numpy (``compressors.py``):
every value exact, the payload's size, and a payload of the wrong size refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from compressors import int4, int8
from decent_wire.v1 import decent_pb2 as pb
from decentd.ops.gossip_compressors import (
    HEADER_BYTES,
    CompressionError,
    decode,
    encode,
    pack_nibbles,
    unpack_nibbles,
)

FLOATS = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(0, 67), elements=FLOATS),
       st.sampled_from([(pb.QINT4, int4, 0.5), (pb.QINT8, int8, 1.0)]))
def test_a_payload_decodes_to_the_quantized_tensor(x: np.ndarray,
                                                   kind: tuple[int, object, float]) -> None:
    code, reference, bytes_per_entry = kind
    payload = encode(code, 0.0, x, pb.FLOAT32)
    assert len(payload) == HEADER_BYTES + int(np.ceil(x.size * bytes_per_entry))
    out = np.full(x.size, np.nan, np.float32)
    decode(payload, out, pb.FLOAT32)
    want = reference(x) if x.size else x  # type: ignore[operator]
    np.testing.assert_array_equal(out, want)


@given(st.lists(st.integers(-8, 7), max_size=41))
def test_nibbles_round_trip(values: list[int]) -> None:
    q = np.array(values, np.int8)
    packed = pack_nibbles(q)
    assert packed.size == (q.size + 1) // 2
    np.testing.assert_array_equal(unpack_nibbles(packed, q.size), q)


def test_int4_has_fifteen_levels_and_keeps_the_peak() -> None:
    x = np.array([-7.0, -3.4, -0.5, 0.0, 0.49, 2.6, 7.0], np.float64)
    out = np.empty_like(x)
    decode(encode(pb.QINT4, 0.0, x, pb.FLOAT64), out, pb.FLOAT64)
    np.testing.assert_array_equal(out, [-7, -3, -0, 0, 0, 3, 7])


def test_a_payload_of_the_wrong_size_is_refused() -> None:
    payload = encode(pb.QINT4, 0.0, np.ones(9, np.float32), pb.FLOAT32)
    with pytest.raises(CompressionError, match="int4 payload of 4 bytes for 9 elements"):
        decode(payload[:-1], np.empty(9, np.float32), pb.FLOAT32)
    with pytest.raises(CompressionError, match="payload holds 9 elements, the tensor has 8"):
        decode(payload, np.empty(8, np.float32), pb.FLOAT32)
