"""Errors of the daemon process itself (requests fail with ``decent_wire.errors.DecentError``)."""

from __future__ import annotations

from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb


class StartupError(Exception):
    """The daemon cannot start (bad config, peers missing past the start timeout, ...)."""


class ConfigError(StartupError):
    """The daemon cannot start with this configuration, however often it tries: ``decentd``
    exits 2 (systemd's ``RestartPreventExitStatus=2`` then stops restarting it)."""


class PeerLost(DecentError):
    """A peer an op exchanges with is gone (its daemon's link dropped, or its worker left):
    under ``faults.on_peer_loss: reweight`` a neighbor op goes on without it."""

    def __init__(self, message: str) -> None:
        super().__init__(pb.PEER_UNAVAILABLE, message)


#: what an agreement's verdict, drawn from the descriptions, fails a collective with (its other
#: failures are the agreement's own: a timeout, a lost peer)
VERDICT_CODES = frozenset({pb.MISMATCH, pb.INVALID_ARGUMENT, pb.ARENA_ERROR})
