"""Client-side errors, carrying the daemon's explicit error code."""

from __future__ import annotations

from decent.v1 import decent_pb2 as pb


class DecentError(RuntimeError):
    """A request failed. ``code`` is a ``decent.v1.ErrorCode`` value; ``code_name`` its name."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def code_name(self) -> str:
        """``MISMATCH``, ``TIMEOUT``, ..."""
        return str(pb.ErrorCode.Name(self.code))

    def __str__(self) -> str:
        return f"[{self.code_name}] {self.message}"

    @classmethod
    def from_pb(cls, error: pb.Error) -> DecentError:
        """Build from the wire form."""
        return cls(int(error.code), error.message)
