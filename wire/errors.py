"""The one error type that carries a wire error code, raised on both sides of the wire."""

from __future__ import annotations

from decent_wire.v1 import decent_pb2 as pb


class DecentError(RuntimeError):
    """A request failed. ``code`` is a ``decent.v1.ErrorCode`` value, ``code_name`` its name;
    ``message`` names the tensor, the ranks and what went wrong."""

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

    def to_pb(self) -> pb.Error:
        """The wire form."""
        return pb.Error(code=self.code, message=self.message)

    @classmethod
    def from_pb(cls, error: pb.Error) -> DecentError:
        """Build from the wire form."""
        return cls(int(error.code), error.message)
