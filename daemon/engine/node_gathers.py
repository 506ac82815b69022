"""A node-level collective's pieces on one daemon: the local workers' requests, gathered per
tensor (:class:`Gather`), and a launch of the ready gathers among the daemons (:class:`Launch`),
segment by segment (:func:`segment_bounds`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb
from decentd.keys import OpKey
from decentd.ops.api import OpContext, PartSpec

#: staged tensors run among the daemons in segments of at most this many bytes
SEGMENT_BYTES = 1 << 20


class Worker(Protocol):
    """What a gather needs of a local worker's session."""

    rank: int
    local_rank: int
    job: str
    gone: bool

    def complete(self, completion: pb.Completion) -> None:
        """Send a completion to the worker."""


@dataclass(eq=False)
class Request:
    """One worker's request of a node-level op (its parts' names job-qualified, no owner)."""

    session: Worker
    request_id: int
    op: int
    args: Any
    parts: list[PartSpec]
    timeout: float
    left: int = -1  #: parts not resolved yet
    error: DecentError | None = None
    covered: list[int] = field(default_factory=list)  #: the worker ranks its result covers
    #: why this worker's part cannot run (told to the other ranks in the agreement)
    refused: DecentError | None = None

    def __post_init__(self) -> None:
        self.left = len(self.parts)


@dataclass(eq=False)
class Staged:
    """A node's tensor of one gather, in a pooled buffer."""

    part: PartSpec
    buf: np.ndarray  #: the pool's buffer (given back when the op ends)


@dataclass(eq=False)
class Launch:
    """The ready gathers of one request, running among the daemons segment by segment."""

    req: Request
    gathers: list[Gather]
    staged: list[Staged]
    segments: int  #: segment count (the longest gather's)
    left: int = -1  #: segments not ended yet
    error: DecentError | None = None
    contexts: list[OpContext] = field(default_factory=list)
    group: list[int] | None = None  #: the daemons its segments ran among
    #: its agreement (decentd.ops.agreement) has not ended: results wait for the verdict
    agreeing: bool = False
    verdict: DecentError | None = None  #: the agreement's verdict against it

    def __post_init__(self) -> None:
        self.left = self.segments


def segment_bounds(elements: int, itemsize: int) -> list[tuple[int, int]]:
    """The element ranges a staged tensor of ``elements`` runs in (one range when it is small;
    at least one, empty for an empty tensor)."""
    step = max(1, SEGMENT_BYTES // itemsize)
    return [(lo, min(lo + step, elements)) for lo in range(0, elements, step)] or [(0, 0)]


@dataclass(eq=False)
class Gather:
    """One tensor ``(name, round)`` of a node-level op, from each local worker."""

    key: OpKey
    members: dict[int, tuple[Request, PartSpec]] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None
    launched: OpContext | None = None
