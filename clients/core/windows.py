"""The client's one-sided window ops (BlueFog's vocabulary), AD-PSGD's exchange and WAGMA's
group allreduce: a part of :class:`decent.core.Client`'s op surface."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from decent.core.args import WeightsArg, op_args, rank_weights
from decent.core.connection import Connection
from decent.core.handles import Handle
from decent.core.submitter import OpCall
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


class WindowOps(Generic[T]):
    """Window ops over the client's ``_call`` (see :class:`decent.core.Client`)."""

    connection: Connection
    _window_table: WindowTable[T]

    def _call(self, call: OpCall, tensor: T | None, name: str | None, timeout: float | None,
              **options: Any) -> Handle[T]:
        raise NotImplementedError

    def win_create(self, tensor: T, name: str, zero_init: bool = False) -> bool:
        """Create window ``name`` holding ``tensor`` (BlueFog's ``win_create``).

        The daemon keeps a copy (the *own copy*, what peers' :meth:`win_get_async` read) and one
        buffer per in-neighbor of a static topology, starting as a copy of ``tensor`` (zeros with
        ``zero_init``); other ranks get a buffer when they first write. Local: no other rank
        needs to take part, and ranks may create windows in any order. :meth:`win_update` writes
        its result into ``tensor``.
        """
        if name in self._window_table.tensors:
            raise ValueError(f"window '{name}' already exists in this client (win_free it first)")
        self._call(OpCall("win_create", pb.WinCreate(zero_init=zero_init)), tensor, name,
                   None).wait()
        self._window_table.tensors[name] = tensor
        return True

    def win_put_async(self, tensor: T, name: str, dst_weights: WeightsArg = None,
                      step: int = 0, timeout: float | None = None) -> Handle[T]:
        """Write ``d_j * tensor`` into window ``name``'s buffer for this rank on each
        destination ``j`` (default: the static topology's out-neighbors, weight 1), replacing
        what was there, and make ``tensor`` the own copy. The destinations' workers do nothing:
        their daemons apply the write. ``wait()`` returns once every destination applied it and
        gives ``tensor``'s value back. ``step``: the worker's step of ``tensor`` (0: one more
        than the own copy's)."""
        return self._win_write("win_put", tensor, name, dst_weights, step, timeout)

    def _win_write(self, field_name: str, tensor: T, name: str, dst_weights: WeightsArg,
                   step: int, timeout: float | None) -> Handle[T]:
        self._window_table.tensor(name)
        args = op_args(name, pb.WinWrite, dst_weights=rank_weights(dst_weights), step=step)
        return self._call(OpCall(field_name, args), tensor, name, timeout)

    def win_put(self, tensor: T, name: str, **kwargs: Any) -> T:
        """Blocking :meth:`win_put_async`."""
        return self.win_put_async(tensor, name, **kwargs).wait()

    def win_accumulate_async(self, tensor: T, name: str, dst_weights: WeightsArg = None,
                             step: int = 0, timeout: float | None = None) -> Handle[T]:
        """Like :meth:`win_put_async`, but each destination *adds* ``d_j * tensor`` to its
        buffer for this rank (concurrent writers from several ranks all land)."""
        return self._win_write("win_accumulate", tensor, name, dst_weights, step, timeout)

    def win_accumulate(self, tensor: T, name: str, **kwargs: Any) -> T:
        """Blocking :meth:`win_accumulate_async`."""
        return self.win_accumulate_async(tensor, name, **kwargs).wait()

    def win_get_async(self, name: str, src_weights: WeightsArg = None,
                      timeout: float | None = None) -> Handle[T]:
        """Fetch ``w_j * (j's own copy)`` into this rank's buffer for each source ``j`` (default:
        the static topology's in-neighbors, weight 1). The sources' daemons answer from their
        last own copy as it is when the request arrives, without waiting for their workers:
        to average the same round everywhere, put a barrier between the gets and the next
        update. ``wait()`` returns an empty tensor once every buffer is filled;
        :meth:`win_update` combines them."""
        self._window_table.tensor(name)
        args = op_args(name, pb.WinGet, src_weights=rank_weights(src_weights))
        return self._call(OpCall("win_get", args), None, name, timeout)

    def win_get(self, name: str, **kwargs: Any) -> None:
        """Blocking :meth:`win_get_async`."""
        self.win_get_async(name, **kwargs).join()

    def win_update(self, name: str, self_weight: float | None = None,
                   neighbor_weights: Mapping[int, float] | None = None, reset: bool = False,
                   step: int = 0, timeout: float | None = None) -> T:
        """``self_weight * t + sum_j neighbor_weights[j] * buffer[j]``, where ``t`` is the
        tensor given to :meth:`win_create` (its current value): written into ``t``, returned,
        and made the own copy. Defaults: the static topology's weights. The buffers read get
        version 0 again, and with ``reset`` they are zeroed (for accumulate-style use)."""
        tensor = self._window_table.tensor(name)
        args = op_args(name, pb.WinUpdate, self_weight=self_weight,
                       src_weights=rank_weights(neighbor_weights), reset=reset, step=step)
        return self._call(OpCall("win_update", args), tensor, name, timeout,
                          into=tensor).wait()

    def win_publish(self, tensor: T, name: str, step: int = 0) -> None:
        """Make ``tensor`` window ``name``'s own copy (what peers' gets are served from) at
        ``step`` (0: one more than before). Local and cheap: one copy into the daemon."""
        self._window_table.tensor(name)
        self._call(OpCall("win_publish", pb.WinPublish(step=step)), tensor, name, None).wait()

    def win_free(self, name: str) -> None:
        """Free window ``name`` here; later writes to it from peers fail with NOT_FOUND."""
        self._window_table.tensor(name)
        self._call(OpCall("win_free", pb.WinFree()), None, name, None).join()
        del self._window_table.tensors[name]
        self._window_table.group_rounds.pop(name, None)

    def win_exchange_async(self, tensor: T, name: str, peer: int, step: int = 0,
                           timeout: float | None = None) -> Handle[T]:
        """Atomically average ``tensor`` with ``peer``'s own copy of window ``name``: the peer's
        daemon sets its own copy to ``(own + tensor) / 2`` and answers with it, without its
        worker (AD-PSGD's pairwise averaging). ``wait()`` gives that average, which is also this
        rank's own copy now."""
        self._window_table.tensor(name)
        return self._call(OpCall("win_exchange", pb.WinExchange(peer=int(peer), step=step)),
                          tensor, name, timeout)

    def win_exchange(self, tensor: T, name: str, peer: int, **kwargs: Any) -> T:
        """Blocking :meth:`win_exchange_async`."""
        return self.win_exchange_async(tensor, name, peer, **kwargs).wait()

    def win_add(self, tensor: T, name: str, step: int = 0, timeout: float | None = None) -> T:
        """Own copy of window ``name`` += ``tensor``, atomically with peers' exchanges; the new
        own copy is written into ``tensor`` and returned (AD-PSGD: a gradient step applied to
        the current model)."""
        self._window_table.tensor(name)
        return self._call(OpCall("win_add", pb.WinAdd(step=step)), tensor, name, timeout,
                          into=tensor).wait()

    def group_allreduce_async(self, tensor: T, name: str, group_size: int,
                              rule: str = "mean", timeout: float | None = None) -> Handle[T]:
        """Wait-avoiding average over this call's butterfly group of ``group_size`` ranks
        (WAGMA). ``tensor`` becomes window ``name``'s own copy (``win_create`` it on every rank
        first). The first member to arrive triggers the group; members not there yet
        contribute their last own copy, and find the result ready when they call. ``rule``:
        ``"mean"`` (group sum / S) or ``"with-self"`` ((group sum + tensor) / (S + 1), the
        reference code's)."""
        self._window_table.tensor(name)
        if rule not in GROUP_RULES:
            raise ValueError(f"tensor '{name}': rule must be one of {sorted(GROUP_RULES)}, "
                             f"not {rule!r}")
        args = pb.GroupAllreduce(group_size=int(group_size), rule=GROUP_RULES[rule],
                                 group_round=self._window_table.next_group_round(name))
        return self._call(OpCall("group_allreduce", args), tensor, name, timeout)

    def group_allreduce(self, tensor: T, name: str, group_size: int, **kwargs: Any) -> T:
        """Blocking :meth:`group_allreduce_async`."""
        return self.group_allreduce_async(tensor, name, group_size, **kwargs).wait()

    def win_info(self, name: str) -> WindowState:
        """What this rank's daemon holds for window ``name``: versions, steps, staleness."""
        info = self.connection.window(name)
        if info.error.code:
            raise DecentError(info.error.code, info.error.message)
        return WindowState(step=int(info.step), versions=dict(info.versions),
                           steps=dict(info.steps), served=int(info.served),
                           max_staleness=int(info.max_staleness))

    def win_versions(self, name: str) -> dict[int, int]:
        """Per writer rank: writes into its buffer since :meth:`win_update` last read it."""
        return self.win_info(name).versions
