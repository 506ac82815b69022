"""The membership view a worker's daemon holds: which ranks are live, and its epoch."""

from __future__ import annotations

from dataclasses import dataclass, field

from decent_wire.v1 import decent_pb2 as pb


@dataclass(frozen=True)
class View:
    """``epoch`` rises with every change of the live set; ``ranks`` are the live worker ranks
    and ``daemons`` the live daemon ranks, ascending. Daemons that agree on the view have equal
    views."""

    epoch: int
    ranks: tuple[int, ...]
    daemons: tuple[int, ...]
    #: each live daemon's incarnation (its start): a restarted daemon has a new one
    incarnations: tuple[tuple[int, int], ...] = ()
    #: daemons that already ran the job when this one reached them (it joined late)
    serving: tuple[int, ...] = field(default=(), compare=False)
    #: the incarnation of every daemon known to this one, live or not (0: never reached)
    known: tuple[tuple[int, int], ...] = field(default=(), compare=False)

    @classmethod
    def of(cls, reply: pb.StatusReply) -> View:
        """The view in a daemon's status."""
        live = {int(r) for r in reply.live_daemons}
        known = {int(p.rank): int(p.incarnation) for p in reply.peers}
        known[int(reply.rank)] = int(reply.incarnation)
        return cls(int(reply.view_epoch), tuple(int(r) for r in reply.live_ranks),
                   tuple(sorted(live)), tuple(sorted((r, known.get(r, 0)) for r in live)),
                   tuple(sorted(int(r) for r in reply.serving_daemons if int(r) in live)),
                   tuple(sorted((r, inc) for r, inc in known.items() if inc)))
