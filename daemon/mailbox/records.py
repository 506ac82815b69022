"""The mailbox's records and the interfaces it talks through: the key of one part, what an op
accepts, the :class:`Slot` of one key, the :class:`Outbox` it sends acknowledgements and
clear-to-send through, and the :class:`OpListener` of an open op."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from decent_wire.v1 import decent_pb2 as pb
from decentd.keys import OpKey
from decentd.mailbox.arrivals import Arrival
from decentd.net.flow import MessageId

#: (peer, name, round, tag): one part of one op, from (or to) one peer (a worker rank, or a
#: daemon rank for node-level keys: see :mod:`decentd.keys`)
Key = tuple[int, str, int, int]
#: what an op takes: (op type, dtype, shape)
Accepts = tuple[int, int, tuple[int, ...]]
#: told ``(payload so far, bytes arrived, sender's weight, part)`` while a lone part arrives
Progress = Callable[[np.ndarray, int, float, pb.Part], None]

def accepts_of(part: pb.Part) -> Accepts:
    """What an op must accept to take ``part``."""
    return int(part.op), int(part.meta.dtype), tuple(int(s) for s in part.meta.shape)


def key_of(part: pb.Part) -> Key:
    """The slot key of a part that arrived (its sender is ``part.src``)."""
    return int(part.src), part.name, int(part.round), int(part.tag)


class Outbox(Protocol):
    """What the mailbox asks of the peer links."""

    def send_acks(self, dst: int, keys: list[OpKey], tag: int, arrived: bool) -> None:
        """Tell ``dst`` its parts were matched (``arrived``: only after all of them arrived)."""

    def send_cts(self, dst: int, message_id: int) -> None:
        """Clear daemon ``dst`` to send the payload of its message ``message_id``."""


class OpListener(Protocol):
    """An open op, told what the mailbox learns about it."""

    def aborted(self, src: int, error: pb.Error) -> None:
        """Peer ``src`` failed this op and said why."""

    def stray(self, key: Key, arrival: Arrival) -> None:
        """A part of this op arrived that nothing waits for (yet)."""

    def foreign(self, src: int, op: int) -> None:
        """A part of op ``op`` from ``src`` came under this op's name and round
        (:func:`decentd.keys.op_name`), at another of its keys."""


class Landing(Protocol):
    """A payload being received straight into an op's memory."""

    def cancel(self) -> None:
        """The op ended: the rest of the payload must not land in its memory."""


@dataclass(eq=False, slots=True)
class Slot:
    """Everything about one key."""

    key: Key
    waiter: asyncio.Future[Arrival] | None = None  #: an op waits for this part
    accepts: Accepts | None = None  #: acknowledge when a part with exactly this arrives
    progress: Progress | None = None  #: told how a lone part's payload arrives
    into: tuple[np.ndarray, Accepts] | None = None  #: receive a lone part straight into this
    landing: Landing | None = None  #: a payload is being received into ``into`` right now
    early: Arrival | None = None  #: arrived before anyone asked
    arriving: pb.Part | None = None  #: header read, payload on its way
    acked: bool = False  #: acknowledged before its payload was all here
    message: MessageId | None = None  #: the RTS message that carries it
    ack_waiter: asyncio.Future[None] | None = None  #: our part to the peer awaits its ACK
