"""Errors that carry an explicit wire error code."""

from __future__ import annotations

from decentd.wire import pb


class OpError(Exception):
    """A request failed: ``code`` is a ``decent.v1.ErrorCode``, ``message`` names the cause."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def to_pb(self) -> pb.Error:
        """The wire form of this error."""
        return pb.Error(code=self.code, message=self.message)

    def __str__(self) -> str:
        return f"{pb.ErrorCode.Name(self.code)}: {self.message}"


class StartupError(Exception):
    """The daemon cannot start (bad config, peers missing past the start timeout, ...)."""
