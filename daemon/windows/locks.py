"""Window mutexes (BlueFog's ``win_mutex``): one lock per (window, slot) on each daemon.

Slot ``s`` of a window on rank ``r`` guards ``s``'s writes into ``r``'s buffer for ``s``: rank
``s`` takes it remotely (``for_self=False``), rank ``r`` takes its own (``for_self=True``), so
the two never touch that buffer at once. The locks are advisory: only code that takes them is
kept apart. A request waits in line while the slot is held; the holder releases it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from decent_wire.v1 import decent_pb2 as pb
from decentd.concurrency import TaskSet
from decentd.keys import part
from decentd.mailbox.arrivals import Arrival
from decentd.net.links import Links

log = logging.getLogger("decentd.windows")

#: message tags of a lock exchange: the request, and the grant or release
REQUEST, REPLY = 0, 1
#: lock requests held or waiting at once, over all slots
LOCK_MEMORY = 1 << 14

#: who holds or waits for a slot: (the rank, the wire name of its request)
Holder = tuple[int, str]


@dataclass
class _Slot:
    holder: Holder | None = None
    line: collections.deque[tuple[Holder, Callable[[], None]]] = field(
        default_factory=collections.deque)


class WindowLocks:
    """The mutex slots of every window on this daemon."""

    def __init__(self) -> None:
        self._slots: dict[tuple[str, int], _Slot] = {}
        self.requests = 0  #: held or waiting, over all slots

    def drop(self, gone: Callable[[Holder], bool]) -> None:
        """The holders ``gone`` tells are unreachable: what they hold or wait for is given
        to the next in line."""
        for (name, slot), state in list(self._slots.items()):
            holders = [w[0] for w in state.line] + ([state.holder] if state.holder else [])
            for holder in dict.fromkeys(h for h in holders if gone(h)):  # the line first
                self.release(name, slot, holder)

    def acquire(self, name: str, slot: int, holder: Holder,
                granted: Callable[[], None]) -> None:
        """Take slot ``slot`` of window ``name`` for ``holder``: ``granted()`` runs once it is
        ``holder``'s (at once when it is free)."""
        state = self._slots.setdefault((name, slot), _Slot())
        self.requests += 1
        if state.holder is None:
            state.holder = holder
            granted()
        else:
            state.line.append((holder, granted))

    async def acquire_local(self, name: str, slot: int, holder: Holder) -> None:
        """:meth:`acquire` for this daemon's own worker: returns once the slot is its."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def granted() -> None:
            if not fut.done():
                fut.set_result(None)

        self.acquire(name, slot, holder, granted)
        try:
            await fut
        except asyncio.CancelledError:
            self.release(name, slot, holder)  # granted meanwhile, or still in line
            raise

    def release(self, name: str, slot: int, holder: Holder) -> bool:
        """``holder`` lets slot ``slot`` go (or leaves its line); the next in line gets it.
        False when ``holder`` neither held it nor waited for it."""
        state = self._slots.get((name, slot))
        if state is None:
            return False
        if state.holder != holder:
            before = len(state.line)
            state.line = collections.deque(w for w in state.line if w[0] != holder)
            self.requests -= before - len(state.line)
            return len(state.line) != before
        state.holder = None
        self.requests -= 1
        if state.line:
            state.holder, granted = state.line.popleft()
            granted()
        else:
            del self._slots[(name, slot)]
        return True

    @property
    def waiting(self) -> int:
        """Requests waiting in line, over all slots."""
        return sum(len(s.line) for s in self._slots.values())


class LockService:
    """Peers' lock and unlock requests for slots on this daemon, answered when granted."""

    def __init__(self, locks: WindowLocks, links: Links) -> None:
        self._locks = locks
        self._links = links
        self._tasks = TaskSet()

    def on_lock(self, src: int, name: str, round_: int, arrival: Arrival) -> None:
        """``src`` wants its slot (``arrival.step``) of window ``name``: answered once it is
        granted (refused past :data:`LOCK_MEMORY` requests)."""
        arrival.release()
        if self._locks.requests >= LOCK_MEMORY:
            self._links.outbox.send_abort(src, [(name, round_)], pb.Error(
                code=pb.RESOURCE_EXHAUSTED, message=f"rank {src} asks for a window lock past the "
                f"{LOCK_MEMORY} lock requests kept at once"))
            return
        self._locks.acquire(name, int(arrival.step), (src, name),
                            lambda: self._tasks.spawn(self._answer(src, name, round_)))

    def on_unlock(self, src: int, name: str, round_: int, arrival: Arrival) -> None:
        """``src`` lets its slot go (or gives up waiting): answered at once."""
        arrival.release()
        self._locks.release(name, int(arrival.step), (src, name))
        self._tasks.spawn(self._answer(src, name, round_))

    def peer_lost(self, gone: Callable[[int, str], bool]) -> None:
        """The ranks ``gone`` tells are unreachable: their locks are released."""
        self._locks.drop(lambda holder: gone(*holder))

    async def _answer(self, dst: int, name: str, round_: int) -> None:
        reply = part(name, round_, REPLY, pb.WIN_REPLY, pb.FLOAT32, (0,), 0)
        try:
            await self._links.outbox.send_parts(dst, [reply], [memoryview(b"")])
        except Exception as exc:  # the requester is gone: its op fails there by itself
            log.info("window lock answer to rank %d not sent: %s", dst, exc)
