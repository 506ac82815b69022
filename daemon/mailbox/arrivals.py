"""What arrives from peers: a received payload (:class:`Message`) shared by its parts, each an
:class:`Arrival` handed to the op that takes it; released part by part."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(eq=False, slots=True)
class Message:
    """A received payload shared by its parts; ``on_release`` runs when the last is released."""

    src: int
    buf: np.ndarray | None
    refs: int
    credit: int  #: eager bytes to give back to the sender
    on_release: Callable[[Message], None] | None = None
    parts: int = 0  #: eager parts given back with them
    generation: int = 0  #: of the sender's link (``PeerLink.generation``) it came over


@dataclass(eq=False, slots=True)
class Arrival:
    """One part (a tensor) of a message from a peer."""

    src: int
    op: int
    dtype: int
    shape: tuple[int, ...]
    weight: float  #: the sender's dst weight
    data: np.ndarray  #: uint8, exactly this part's bytes
    message: Message | None = None
    released: bool = False
    acked: bool = False  #: the sender was told at header time that this part matched
    step: int = 0  #: window ops: the writer's step
    p: float = 0.0  #: window writes: the writer's associated p times its weight
    topology: str = ""  #: neighbor ops: the name of the topology the sender's op used
    #: a collective that agrees in its own exchange: the sender's description (pb.Agreement)
    agreement: bytes = b""

    def release(self) -> None:
        """Done with the bytes (idempotent): the message is released with its last part."""
        if self.released:
            return
        self.released = True
        msg = self.message
        if msg is None:
            return
        msg.refs -= 1
        if msg.refs == 0 and msg.on_release is not None:
            msg.on_release(msg)
