"""The daemon's window services: the windows themselves (:mod:`~decentd.windows.store`), WAGMA's
group sums (:mod:`~decentd.windows.groups`) and window mutexes (:mod:`~decentd.windows.locks`).
Peers' one-sided requests go to them by op (:func:`one_sided_handlers`); the worker's window ops
are :mod:`decentd.ops.window_ops`."""

from __future__ import annotations

from collections.abc import Callable

from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb
from decentd.mailbox.arrivals import Arrival
from decentd.windows.groups import GroupSums
from decentd.windows.locks import LockService
from decentd.windows.store import WindowStore, check_part, is_one_sided

#: serves one one-sided request: (sender, wire name, round, the request)
Handler = Callable[[int, str, int, Arrival], None]


class OneSided(dict[int, Handler]):
    """Which service serves each one-sided request, and what a peer's window messages pass
    before anything is allocated for them."""

    def __init__(self, store: WindowStore, groups: GroupSums, locks: LockService) -> None:
        super().__init__({
            pb.WIN_PUT: store.on_message, pb.WIN_ACCUMULATE: store.on_message,
            pb.WIN_GET: store.on_message, pb.WIN_EXCHANGE: store.on_message,
            pb.GROUP_TRIGGER: groups.on_trigger, pb.GROUP_RESULT: groups.on_result,
            pb.WIN_LOCK: locks.on_lock, pb.WIN_UNLOCK: locks.on_unlock})
        self._store = store
        self._groups = groups
        self._locks = locks

    @staticmethod
    def serves(part: pb.Part) -> bool:
        """Whether ``part`` is a window request these services answer (not an op's data)."""
        return is_one_sided(part)

    def serve(self, part: pb.Part, arrival: Arrival) -> None:
        """Answer the one-sided request ``part`` with the service of its op."""
        self[int(part.op)](int(part.src), part.name, int(part.round), arrival)

    def check(self, part: pb.Part) -> None:
        """ValueError unless a window message (any other part passes) describes itself
        exactly (:func:`~decentd.windows.store.check_part`)."""
        check_part(part, self._store.size)

    def admit(self, part: pb.Part) -> DecentError | None:
        """Why a window request announced by RTS may not be cleared to send (None: it may)."""
        return self._store.admit(part)

    def peer_lost(self, gone: Callable[[int, str], bool]) -> None:
        """The ranks ``gone`` tells (a rank and a wire name) are unreachable: their parked
        reads are dropped and their window locks released."""
        self._store.peer_lost(gone)
        self._locks.peer_lost(gone)
        self._groups.peer_lost(gone)


def one_sided_handlers(store: WindowStore, groups: GroupSums,
                       locks: LockService) -> OneSided:
    """Which service serves each one-sided request."""
    return OneSided(store, groups, locks)
