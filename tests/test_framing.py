"""The one framing of length-prefixed messages, shared by the daemon and the clients."""

from __future__ import annotations

import pytest

from decent_wire import framing
from decent_wire.v1 import decent_pb2 as pb


def test_frames_split_at_any_byte_boundary() -> None:
    msgs = [pb.Completion(request_id=i, out_nbytes=i * 7) for i in range(1, 6)]
    stream = b"".join(framing.encode(m) for m in msgs)
    for chunk in (1, 3, 7, len(stream)):
        reader = framing.FrameReader(1 << 10)
        bodies = []
        for i in range(0, len(stream), chunk):
            bodies += reader.feed(stream[i:i + chunk])
        assert [framing.decode(pb.Completion, b) for b in bodies] == msgs
        assert reader.pending == 0


def test_a_frame_past_the_limit_is_refused_before_it_is_read() -> None:
    reader = framing.FrameReader(16)
    with pytest.raises(framing.FrameError, match="a 17-byte frame, more than the 16 bytes"):
        reader.feed((17).to_bytes(framing.LENGTH, "little"))  # the body never needs to come
    assert framing.FrameReader(17).feed((17).to_bytes(4, "little") + b"x" * 17) == [b"x" * 17]


def test_a_body_that_is_not_the_message_is_refused() -> None:
    with pytest.raises(framing.FrameError, match="undecodable Completion"):
        framing.decode(pb.Completion, b"\xff" * 8)


def test_the_prefix_is_read_only_once_complete() -> None:
    assert framing.body_length(b"\x05\x00\x00", 0, 3, 10) is None
    assert framing.body_length(b"\x00\x05\x00\x00\x00", 1, 5, 10) == 5
