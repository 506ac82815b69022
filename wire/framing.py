"""Length-prefixed framing, the one way messages travel outside gRPC.

A frame is a 4-byte little-endian length and that many bytes of one protobuf message. The
worker's data channel carries ``SubmitRequest`` and ``Completion`` frames, the memory socket one
``MemoryRequest`` and its ``Error`` answer, and the bulk path a ``BulkHeader`` frame followed by
the header's ``payload_bytes`` of raw tensor data. Every length read from a stream is checked
against the reader's limit before anything is allocated for it.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import Message

#: bytes of the length prefix
LENGTH = 4

M = TypeVar("M", bound=Message)


class FrameError(ValueError):
    """A stream does not hold valid frames (too long, or not the message it should be)."""


def encode(message: Message) -> bytes:
    """``message`` as one frame."""
    body = message.SerializeToString()
    return len(body).to_bytes(LENGTH, "little") + body


def body_length(buf: bytes | bytearray | memoryview, start: int, end: int,
                limit: int) -> int | None:
    """The body length of the frame at ``buf[start:end]``; None while its prefix is incomplete.

    FrameError when the prefix declares more than ``limit`` bytes.
    """
    if end - start < LENGTH:
        return None
    length = int.from_bytes(buf[start:start + LENGTH], "little")
    if length > limit:
        raise FrameError(f"a {length}-byte frame, more than the {limit} bytes allowed")
    return length


def decode(cls: type[M], body: bytes) -> M:
    """Parse one frame body as a ``cls``; FrameError if it is not one."""
    try:
        return cls.FromString(body)
    except Exception as exc:  # protobuf's DecodeError, or a bad enum/utf-8 value
        raise FrameError(f"undecodable {cls.__name__} ({exc})") from None


class FrameReader:
    """Splits a byte stream into frame bodies, each at most ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The bodies of the frames ``data`` completes (FrameError on a frame past the limit)."""
        buf = self._buf
        buf += data
        bodies = []
        start = 0
        while True:
            length = body_length(buf, start, len(buf), self.limit)
            if length is None or len(buf) - start - LENGTH < length:
                break
            bodies.append(bytes(buf[start + LENGTH:start + LENGTH + length]))
            start += LENGTH + length
        del buf[:start]
        return bodies

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._buf)
