"""The daemon's window services: the windows themselves (:mod:`~decentd.windows.store`), WAGMA's
group sums (:mod:`~decentd.windows.groups`) and window mutexes (:mod:`~decentd.windows.locks`).
Peers' one-sided requests go to them by op (:func:`one_sided_handlers`); the worker's window ops
are :mod:`decentd.ops.windows`."""

from __future__ import annotations

from collections.abc import Callable

from decent_wire.v1 import decent_pb2 as pb
from decentd.mailbox import Arrival
from decentd.windows.groups import GroupSums
from decentd.windows.locks import LockService
from decentd.windows.store import WindowStore

#: serves one one-sided request: (sender, wire name, round, the request)
Handler = Callable[[int, str, int, Arrival], None]


def one_sided_handlers(store: WindowStore, groups: GroupSums,
                       locks: LockService) -> dict[int, Handler]:
    """Which service serves each one-sided request."""
    return {pb.WIN_PUT: store.on_message, pb.WIN_ACCUMULATE: store.on_message,
            pb.WIN_GET: store.on_message, pb.WIN_EXCHANGE: store.on_message,
            pb.GROUP_TRIGGER: groups.on_trigger, pb.GROUP_RESULT: groups.on_result,
            pb.WIN_LOCK: locks.on_lock, pb.WIN_UNLOCK: locks.on_unlock}
