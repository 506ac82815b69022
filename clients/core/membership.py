"""The membership view a worker's daemon holds: which ranks are live, and its epoch."""

from __future__ import annotations

from dataclasses import dataclass

from decent_wire.v1 import decent_pb2 as pb


@dataclass(frozen=True)
class View:
    """``epoch`` rises with every change of the live set; ``ranks`` are the live worker ranks
    and ``daemons`` the live daemon ranks, ascending."""

    epoch: int
    ranks: tuple[int, ...]
    daemons: tuple[int, ...]

    @classmethod
    def of(cls, reply: pb.StatusReply) -> View:
        """The view in a daemon's status."""
        return cls(int(reply.view_epoch), tuple(int(r) for r in reply.live_ranks),
                   tuple(int(r) for r in reply.live_daemons))
