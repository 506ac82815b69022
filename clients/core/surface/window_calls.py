"""The calls of the one-sided window ops (BlueFog's vocabulary), AD-PSGD's exchange and WAGMA's
group allreduce (:class:`WindowCalls`), and the windows a client created (:class:`WindowTable`).
:class:`decent.core.Client`'s window methods call them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from decent.core.requests.calls import op_call
from decent.core.requests.connection import Connection
from decent.core.requests.handles import Handle
from decent.core.surface.args import WeightsArg, op_args, rank_weights
from decent.core.surface.op_calls import OpCalls
from decent_wire.errors import DecentError
from decent_wire.protocol import GROUP_RULES
from decent_wire.v1 import decent_pb2 as pb

T = TypeVar("T")

@dataclass(frozen=True)
class WindowState:
    """A window as this rank's daemon holds it (:meth:`WindowOps.win_info`)."""

    step: int  #: the own copy's step
    versions: dict[int, int]  #: per writer: writes since win_update last read its buffer
    steps: dict[int, int]  #: per writer: the writer's step of what its buffer holds
    served: int  #: peers' gets answered from the own copy
    max_staleness: int  #: most steps a buffer win_update read lagged the own copy
    p: float = 1.0  #: the associated p of the own copy


@dataclass
class WindowTable(Generic[T]):
    """The windows this client created: the tensor ``win_update`` writes into, and how often
    each took part in a group allreduce (the count picks the butterfly group)."""

    tensors: dict[str, T] = field(default_factory=dict)
    group_rounds: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tensor(self, name: str) -> T:
        """The tensor of window ``name``; ValueError if this client did not create it."""
        try:
            return self.tensors[name]
        except KeyError:
            raise ValueError(f"window '{name}' was not created by this client "
                             f"(windows: {sorted(self.tensors)})") from None

    def next_group_round(self, name: str) -> int:
        """Count one more group allreduce of window ``name`` (from 1)."""
        with self.lock:
            r = self.group_rounds[name] = self.group_rounds.get(name, 0) + 1
            return r


class WindowCalls(Generic[T]):
    """The window ops' calls, over :meth:`OpCalls.call`, and the windows they created."""

    def __init__(self, calls: OpCalls[T], connection: Connection) -> None:
        self.calls = calls
        self.connection = connection
        self.table: WindowTable[T] = WindowTable()

    def _call(self, field_name: str, args: Any, tensor: T | None, name: str,
              timeout: float | None, into: T | None = None) -> Handle[T]:
        return self.calls.call(op_call(field_name, args), tensor, name, timeout, into=into)

    def win_create(self, tensor: T, name: str, zero_init: bool = False) -> Handle[T]:
        """Create window ``name`` holding ``tensor`` (BlueFog's ``win_create``).

        The daemon keeps a copy (the *own copy*, what peers' :meth:`win_get` read) and one
        buffer per in-neighbor of a static topology, starting as a copy of ``tensor`` (zeros with
        ``zero_init``); other ranks get a buffer when they first write. Local: no other rank
        needs to take part, and ranks may create windows in any order. :meth:`win_update` writes
        its result into ``tensor``.
        """
        if name in self.table.tensors:
            raise ValueError(f"window '{name}' already exists in this client (win_free it first)")
        handle = self._call("win_create", pb.WinCreate(zero_init=zero_init), tensor, name, None)
        handle.wait()
        self.table.tensors[name] = tensor
        return handle

    def win_put(self, tensor: T, name: str, dst_weights: WeightsArg = None,
                      step: int = 0, timeout: float | None = None,
                      self_weight: float | None = None, require_mutex: bool = False
                      ) -> Handle[T]:
        """Write ``d_j * tensor`` into window ``name``'s buffer for this rank on each
        destination ``j`` (default: the static topology's out-neighbors, weight 1), replacing
        what was there, and make ``tensor`` the own copy. The destinations' workers do nothing:
        their daemons apply the write. ``wait()`` returns once every destination applied it and
        gives ``tensor``'s value back. ``step``: the worker's step of ``tensor`` (0: one more
        than the own copy's).

        The associated p (:meth:`win_associated_p`) travels with the write, times ``d_j``.
        ``self_weight`` (BlueFog's): afterwards the own copy, p and ``tensor`` itself are
        scaled by it. ``require_mutex``: the destinations' mutexes for this rank are held
        during the write (:meth:`win_mutex`; the call then returns once it is done).
        """
        return self._win_write("win_put", tensor, name, dst_weights, step, timeout, self_weight,
                               require_mutex)

    def _win_write(self, field_name: str, tensor: T, name: str, dst_weights: WeightsArg,
                   step: int, timeout: float | None, self_weight: float | None,
                   require_mutex: bool) -> Handle[T]:
        self.table.tensor(name)
        args = op_args(name, pb.WinWrite, dst_weights=rank_weights(dst_weights), step=step,
                       self_weight=self_weight)
        into = tensor if self_weight is not None else None
        if not require_mutex:
            return self._call(field_name, args, tensor, name, timeout, into=into)
        ranks = self._write_targets(name, dst_weights)
        with self.win_mutex(name, ranks=ranks):
            handle = self._call(field_name, args, tensor, name, timeout, into=into)
            handle.wait()  # the result too: with self_weight, tensor is scaled in place
        return handle

    def _write_targets(self, name: str, weights: WeightsArg) -> list[int]:
        """The ranks a window op reaches: those named, else the topology's out-neighbors."""
        given = rank_weights(weights)
        return sorted(given) if given is not None else self._out_neighbors()

    def _out_neighbors(self) -> list[int]:
        return list(self.connection.topology("", 0).out_neighbors)

    def _in_neighbors(self) -> list[int]:
        return list(self.connection.topology("", 0).in_neighbors)

    def win_accumulate(self, tensor: T, name: str, dst_weights: WeightsArg = None,
                             step: int = 0, timeout: float | None = None,
                             self_weight: float | None = None, require_mutex: bool = False
                             ) -> Handle[T]:
        """Like :meth:`win_put`, but each destination *adds* ``d_j * tensor`` (and
        ``d_j * p``) to its buffer for this rank (concurrent writers from several ranks all
        land)."""
        return self._win_write("win_accumulate", tensor, name, dst_weights, step, timeout,
                               self_weight, require_mutex)

    def win_get(self, name: str, src_weights: WeightsArg = None,
                      timeout: float | None = None, require_mutex: bool = False) -> Handle[T]:
        """Fetch ``w_j * (j's own copy)`` into this rank's buffer for each source ``j`` (default:
        the static topology's in-neighbors, weight 1). The sources' daemons answer from their
        last own copy as it is when the request arrives, without waiting for their workers:
        to average the same round everywhere, put a barrier between the gets and the next
        update. ``wait()`` returns an empty tensor once every buffer is filled;
        :meth:`win_update` combines them."""
        self.table.tensor(name)
        args = op_args(name, pb.WinGet, src_weights=rank_weights(src_weights))
        if not require_mutex:
            return self._call("win_get", args, None, name, timeout)
        given = rank_weights(src_weights)
        ranks = sorted(given) if given is not None else self._in_neighbors()
        with self.win_mutex(name, ranks=ranks):
            handle = self._call("win_get", args, None, name, timeout)
            handle.join()
        return handle

    def win_update(self, name: str, self_weight: float | None = None,
                   neighbor_weights: Mapping[int, float] | None = None, reset: bool = False,
                   step: int = 0, timeout: float | None = None, clone: bool = False,
                   require_mutex: bool = False, value: T | None = None) -> Handle[T]:
        """``self_weight * t + sum_j neighbor_weights[j] * buffer[j]``, where ``t`` is the
        tensor given to :meth:`win_create` (its current value): written into ``t``, returned,
        and made the own copy. Defaults: the static topology's weights. The buffers read get
        version 0 again, and with ``reset`` they are zeroed (for accumulate-style use). The
        associated p becomes the same combination of the buffers' p's.

        ``clone`` (BlueFog's): the result is a new tensor, and ``t`` and the own copy stay as
        they were. ``require_mutex``: this rank's own mutex slots of the neighbors are held
        during the update (:meth:`win_mutex` with ``for_self=True``). ``value``: combine this
        tensor instead of ``t`` (same dtype and shape).
        """
        tensor = self.table.tensor(name) if value is None else value
        args = op_args(name, pb.WinUpdate, self_weight=self_weight,
                       src_weights=rank_weights(neighbor_weights), reset=reset, step=step,
                       clone=clone)
        into = None if clone else tensor
        if not require_mutex:
            return self._call("win_update", args, tensor, name, timeout, into=into)
        given = rank_weights(neighbor_weights)
        ranks = sorted(given) if given is not None else self._in_neighbors()
        with self.win_mutex(name, for_self=True, ranks=ranks):
            return self._call("win_update", args, tensor, name, timeout, into=into)

    def win_publish(self, tensor: T, name: str, step: int = 0) -> Handle[T]:
        """Make ``tensor`` window ``name``'s own copy (what peers' gets are served from) at
        ``step`` (0: one more than before). Local and cheap: one copy into the daemon."""
        self.table.tensor(name)
        return self._call("win_publish", pb.WinPublish(step=step), tensor, name, None)

    def win_free(self, name: str | None = None) -> bool:
        """Free window ``name`` here (None: every window of this client); True, as BlueFog.
        Local, as :meth:`win_create` is (BlueFog's are collective): a peer's later
        ``win_get`` or write fails with NOT_FOUND, so call ``barrier()`` first where peers may
        still read or write it."""
        names = [name] if name is not None else self.window_names()
        for each in names:
            self.table.tensor(each)
        for each in names:
            self.table.tensor(each)
            self._call("win_free", pb.WinFree(), None, each, None).join()
            del self.table.tensors[each]
            self.table.group_rounds.pop(each, None)
        return True

    def window_names(self) -> list[str]:
        """The windows this client created and has not freed, in creation order (BlueFog's
        ``get_current_created_window_names``)."""
        return list(self.table.tensors)

    def win_associated_p(self, name: str) -> float:
        """Window ``name``'s associated p (push-sum weight) as this rank's daemon holds it: 1
        at creation; writes carry it times their weight, ``self_weight`` scales it, and
        :meth:`win_update` combines it like the tensor."""
        return self.win_info(name).p

    @contextlib.contextmanager
    def win_mutex(self, name: str, for_self: bool = False,
                  ranks: Iterable[int] | None = None) -> Iterator[None]:
        """Hold window ``name``'s mutex for the block (BlueFog's ``win_mutex``).

        The slot of this rank at each of ``ranks`` (default: the out-neighbors) guards this
        rank's writes into their buffer for it; with ``for_self``, this rank's own slots of
        ``ranks`` guard their buffers here against its own reads. Slots are taken in rank
        order (no two ranks deadlock) and released at the end of the block; the locks are
        advisory: only code that takes them waits.
        """
        chosen = sorted({int(r) for r in ranks}) if ranks is not None else self._out_neighbors()
        lock = pb.WinLock(ranks=chosen, for_self=for_self)
        self._call("win_lock", lock, None, name, None).join()
        try:
            yield
        finally:
            self._call("win_unlock", lock, None, name, None).join()

    def win_exchange(self, tensor: T, name: str, peer: int, step: int = 0,
                           timeout: float | None = None) -> Handle[T]:
        """Atomically average ``tensor`` with ``peer``'s own copy of window ``name``: the peer's
        daemon sets its own copy to ``(own + tensor) / 2`` and answers with it, without its
        worker (AD-PSGD's pairwise averaging). ``wait()`` gives that average, which is also this
        rank's own copy now."""
        self.table.tensor(name)
        return self._call("win_exchange", pb.WinExchange(peer=int(peer), step=step), tensor,
                          name, timeout)

    def win_add(self, tensor: T, name: str, step: int = 0, timeout: float | None = None
                ) -> Handle[T]:
        """Own copy of window ``name`` += ``tensor``, atomically with peers' exchanges; the new
        own copy is written into ``tensor`` and returned (AD-PSGD: a gradient step applied to
        the current model)."""
        self.table.tensor(name)
        return self._call("win_add", pb.WinAdd(step=step), tensor, name, timeout, into=tensor)

    def group_allreduce(self, tensor: T, name: str, group_size: int,
                              rule: str = "mean", timeout: float | None = None) -> Handle[T]:
        """Wait-avoiding average over this call's butterfly group of ``group_size`` ranks
        (WAGMA). ``tensor`` becomes window ``name``'s own copy (``win_create`` it on every rank
        first). The first member to arrive triggers the group; members not there yet
        contribute their last own copy, and find the result ready when they call. ``rule``:
        ``"mean"`` (group sum / S) or ``"with-self"`` ((group sum + tensor) / (S + 1), the
        reference code's)."""
        self.table.tensor(name)
        if rule not in GROUP_RULES:
            raise ValueError(f"tensor '{name}': rule must be one of {sorted(GROUP_RULES)}, "
                             f"not {rule!r}")
        args = pb.GroupAllreduce(group_size=int(group_size), rule=GROUP_RULES[rule],
                                 group_round=self.table.next_group_round(name))
        return self._call("group_allreduce", args, tensor, name, timeout)

    def win_info(self, name: str) -> WindowState:
        """What this rank's daemon holds for window ``name``: versions, steps, staleness."""
        info = self.connection.window(name)
        if info.error.code:
            raise DecentError(info.error.code, info.error.message)
        return WindowState(step=int(info.step), versions=dict(info.versions),
                           steps=dict(info.steps), served=int(info.served),
                           max_staleness=int(info.max_staleness), p=float(info.p))

    def win_versions(self, name: str) -> dict[int, int]:
        """Per writer rank: writes into its buffer since :meth:`win_update` last read it."""
        return self.win_info(name).versions
