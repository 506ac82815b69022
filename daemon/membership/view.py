"""Who is alive: each peer daemon's state and incarnation, and the membership view.

A peer is ``up`` while both bulk connections with it work, ``reconnecting`` while a dropped
link is being reopened, and ``down`` once it is declared dead (silent past
``faults.peer_dead_after``, or its link dropped and reopening it was refused). The view is the
set of live daemons and an epoch: a daemon raises its epoch past every epoch it has heard of
whenever its live set changes, and adopts a higher epoch it hears with the same live set, so
the live daemons converge on one (epoch, live set) once detection has settled (docs/faults.md).
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


class PeerState(enum.Enum):
    """Where a peer daemon stands as seen from here."""

    UP = "up"
    RECONNECTING = "reconnecting"
    DOWN = "down"


@dataclass
class Member:
    """One peer daemon."""

    rank: int
    state: PeerState = PeerState.DOWN
    incarnation: int = 0
    since: float = field(default_factory=time.monotonic)
    reason: str = "not connected yet"
    reconnects: int = 0  #: times its link was established after the first
    ever_up: bool = False
    up_incarnation: int = 0  #: the incarnation it had when it last came up
    serving: bool = False  #: it already ran a job when we last reached it
    refusal: str = ""  #: why its last handshake was refused (another cluster, secret, ...)
    declared_down: bool = False  #: we declared it down since it was last up
    peer_declared_down: bool = False  #: it declared us down since it was last up
    #: it and we ran rounds without each other (either counted the other out, or it is a new
    #: process): ops leave it out until it is up, and then each tells the other which rounds
    #: ran without it (the same process) or its rounds are placed afresh (a new one)
    afresh: bool = False
    #: it is a new process (restarted, or late): its rounds are placed afresh, once per return
    placed_afresh: bool = False


#: called with (daemon rank, its new state) on every change
Listener = Callable[[int, PeerState], None]


class Membership:
    """This daemon's view of the cluster: peer states, incarnations, the epoch."""

    def __init__(self, rank: int, size: int, incarnation: int, per_node: int = 1) -> None:
        self.rank = rank
        self.size = size
        self.per_node = per_node
        #: this daemon's start, in ns since the epoch: a restarted daemon's is larger
        self.incarnation = incarnation
        self.members = {r: Member(r) for r in range(size) if r != rank}
        self.epoch = 0
        self._highest_heard = 0
        #: a peer already served a job when we reached it: our workers join a running job
        self.joined_running = False
        #: workers of late daemons that have not registered there yet (left out of ops)
        self.absent: set[int] = set()
        self._listeners: list[Listener] = []

    def listen(self, listener: Listener) -> None:
        """Call ``listener`` on every state change."""
        self._listeners.append(listener)

    # ------------------------------------------------------------------ queries

    def state(self, machine: int) -> PeerState:
        """Daemon ``machine``'s state (this daemon is always up)."""
        member = self.members.get(machine)
        return PeerState.UP if member is None else member.state

    def is_up(self, machine: int) -> bool:
        """Whether daemon ``machine`` is up."""
        return self.state(machine) is PeerState.UP

    def live_daemons(self) -> list[int]:
        """The live daemon ranks, this one included, ascending."""
        return sorted([self.rank, *(r for r, m in self.members.items()
                                    if m.state is PeerState.UP)])

    def worker_gone(self, worker: int) -> bool:
        """Whether worker ``worker``'s daemon is down or it has not joined yet."""
        return self.state(worker // self.per_node) is PeerState.DOWN or worker in self.absent

    def live_workers(self) -> list[int]:
        """The worker ranks of the live daemons, ascending."""
        return [d * self.per_node + k for d in self.live_daemons() for k in range(self.per_node)]

    def has_quorum(self) -> bool:
        """Whether the live daemons are a strict majority of the cluster (two sides of a
        partition cannot both have one)."""
        return 2 * len(self.live_daemons()) > self.size

    def digest(self) -> str:
        """A short digest of the live set and their incarnations: daemons that disagree on
        who is live (or on a restart) have different digests."""
        text = ",".join(f"{r}:{self.incarnation if r == self.rank else self.members[r].incarnation}"
                        for r in self.live_daemons())
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ changes

    def set_state(self, machine: int, state: PeerState, reason: str = "",
                  incarnation: int | None = None) -> bool:
        """Daemon ``machine`` is now ``state``; whether the live set changed."""
        member = self.members.get(machine)
        if member is None:
            return False
        before = member.state
        if incarnation is not None:
            member.incarnation = incarnation
        if state is before:
            return False
        if state is PeerState.UP:
            member.reconnects += member.ever_up
            member.ever_up = True
        member.state, member.since = state, time.monotonic()
        if reason:
            member.reason = reason
        live_changed = (before is PeerState.UP) != (state is PeerState.UP)
        if live_changed:
            self.epoch = max(self.epoch, self._highest_heard) + 1
        for listener in list(self._listeners):
            listener(machine, state)
        return live_changed

    def heard(self, epoch: int, live: Iterable[int]) -> bool:
        """A live peer's view: adopt its epoch when it is higher and the live sets agree;
        whether ours changed."""
        self._highest_heard = max(self._highest_heard, epoch)
        if epoch > self.epoch and sorted(live) == self.live_daemons():
            self.epoch = epoch
            return True
        return False

    def incarnation_of(self, machine: int) -> int:
        """The last incarnation heard of daemon ``machine`` (0: none yet)."""
        if machine == self.rank:
            return self.incarnation
        member = self.members.get(machine)
        return 0 if member is None else member.incarnation
