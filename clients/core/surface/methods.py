"""The client's op methods, generated from the op table (``decent_wire.ops``) by
``scripts/gen_surface.py``: do not edit by hand (``tests/test_op_table.py`` fails when this file
is stale). Each op's arguments and docstring come from its call in
:mod:`decent.core.surface.op_calls` or :mod:`decent.core.surface.window_calls`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from inspect import signature
from typing import Any, Generic, TypeVar

from decent.core.requests.handles import Handle
from decent.core.surface.args import WeightsArg
from decent.core.surface.horovod_compression import Compressor
from decent_wire.ops import BY_NAME, OpDecl, Returns

T = TypeVar("T")

#: one op's call: its arguments by name (the tensor too) to a handle
Builder = Callable[..., Handle[Any]]


class OpMethods(Generic[T]):
    """Every op's methods, dispatched to the op's call (``builders``, by op name)."""

    def __init__(self, builders: Mapping[str, Builder]) -> None:
        self._builders = dict(builders)
        #: what a blocking call adds to its op's arguments: it is sent alone (never fused)
        self._alone = {
            name: {"fuse": False} if "fuse" in signature(b).parameters else {}
            for name, b in builders.items()
        }

    def _start(self, op: OpDecl, kwargs: dict[str, Any]) -> Handle[T]:
        """Start op ``op`` with ``kwargs``; its handle."""
        handle: Handle[T] = self._builders[op.name](**kwargs)
        return handle

    def _blocking(self, op: OpDecl, kwargs: dict[str, Any]) -> Any:
        """Run op ``op`` with ``kwargs`` to its end: its result, None or True, as the op
        returns (adapters override this to make it differentiable or stage it in a graph)."""
        handle = self._start(op, kwargs)
        if op.returns is Returns.RESULT:
            return handle.wait()
        handle.join()
        return True if op.returns is Returns.TRUE else None

    def _plain(self, name: str, tensor: T, /, **kwargs: Any) -> Any:
        """The blocking op named ``name`` on ``tensor`` without the adapters' hooks (no
        gradients, no graph staging): what a backward pass runs."""
        decl = BY_NAME[name]
        return OpMethods._blocking(self, decl, {"tensor": tensor, **self._alone[name], **kwargs})

    def neighbor_allreduce_async(
        self,
        tensor: T,
        name: str | None = None,
        self_weight: float | None = None,
        src_weights: Mapping[int, float] | None = None,
        dst_weights: WeightsArg = None,
        timeout: float | None = None,
        *,
        fuse: bool = True,
    ) -> Handle[T]:
        """Start ``self_weight*x + sum_j src_weights[j] * d_j * x_j``; returns at once.

        No weights: the topology's at this step (uniform ``1/(in-degree+1)`` unless the
        topology defines others). ``d_j`` is the weight rank ``j`` sent with (its
        ``dst_weights`` entry for this rank, 1 when not given). ``dst_weights`` (dict or list
        of ranks) makes the call dynamic: it sends to exactly those ranks and receives from the
        ``src_weights`` keys. Requests with the same weights are fused (``fuse=False``: sent
        alone). In place, a tensor in shared memory (torch: ``share_memory_()``) is
        registered with the daemon and never copied; leave it alone until the handle is
        waited for.
        """
        return self._start(
            BY_NAME["neighbor_allreduce"],
            {
                "tensor": tensor,
                "name": name,
                "self_weight": self_weight,
                "src_weights": src_weights,
                "dst_weights": dst_weights,
                "timeout": timeout,
                "fuse": fuse,
                "into": None,
            },
        )

    def neighbor_allreduce(
        self,
        tensor: T,
        name: str | None = None,
        self_weight: float | None = None,
        src_weights: Mapping[int, float] | None = None,
        dst_weights: WeightsArg = None,
        timeout: float | None = None,
    ) -> T:
        """Blocking :meth:`neighbor_allreduce_async`."""
        return self._blocking(
            BY_NAME["neighbor_allreduce"],
            {
                "tensor": tensor,
                "name": name,
                "self_weight": self_weight,
                "src_weights": src_weights,
                "dst_weights": dst_weights,
                "timeout": timeout,
                "into": None,
                "fuse": False,
            },
        )

    def neighbor_allreduce_async_(
        self,
        tensor: T,
        name: str | None = None,
        self_weight: float | None = None,
        src_weights: Mapping[int, float] | None = None,
        dst_weights: WeightsArg = None,
        timeout: float | None = None,
        *,
        fuse: bool = True,
    ) -> Handle[T]:
        """In-place :meth:`neighbor_allreduce_async`: ``wait()`` writes the result into
        ``tensor`` and returns it (no new tensor is allocated). Leave ``tensor`` alone
        until the handle is waited for.
        """
        return self._start(
            BY_NAME["neighbor_allreduce"],
            {
                "tensor": tensor,
                "name": name,
                "self_weight": self_weight,
                "src_weights": src_weights,
                "dst_weights": dst_weights,
                "timeout": timeout,
                "fuse": fuse,
                "into": tensor,
            },
        )

    def neighbor_allreduce_(
        self,
        tensor: T,
        name: str | None = None,
        self_weight: float | None = None,
        src_weights: Mapping[int, float] | None = None,
        dst_weights: WeightsArg = None,
        timeout: float | None = None,
    ) -> T:
        """Blocking in-place :meth:`neighbor_allreduce_async`."""
        return self._blocking(
            BY_NAME["neighbor_allreduce"],
            {
                "tensor": tensor,
                "name": name,
                "self_weight": self_weight,
                "src_weights": src_weights,
                "dst_weights": dst_weights,
                "timeout": timeout,
                "into": tensor,
                "fuse": False,
            },
        )

    def compressed_neighbor_allreduce_async(
        self,
        tensor: T,
        compressor: str,
        ratio: float | None = None,
        name: str | None = None,
        self_weight: float | None = None,
        src_weights: Mapping[int, float] | None = None,
        dst_weights: WeightsArg = None,
        timeout: float | None = None,
    ) -> Handle[T]:
        """Start a neighbor_allreduce of ``Q(x)``, the tensor compressed by ``compressor``.

        ``compressor``: ``"topk"`` (with ``ratio``, the fraction of entries kept),
        ``"sign"``, ``"int8"`` or ``"int4"``. The daemon compresses, sends only the compressed
        bytes and decodes what arrives. The result has shape ``[2, *shape]``: row 0 is
        ``self_weight * Q(x) + sum_j src_weights[j] * d_j * Q(x_j)`` (weights as in
        ``neighbor_allreduce``), row 1 is ``Q(x)`` exactly as the neighbors decoded it::

            mixed, own = client.compressed_neighbor_allreduce(t, "topk", ratio=0.01)
        """
        return self._start(
            BY_NAME["compressed_neighbor_allreduce"],
            {
                "tensor": tensor,
                "compressor": compressor,
                "ratio": ratio,
                "name": name,
                "self_weight": self_weight,
                "src_weights": src_weights,
                "dst_weights": dst_weights,
                "timeout": timeout,
            },
        )

    def compressed_neighbor_allreduce(
        self,
        tensor: T,
        compressor: str,
        ratio: float | None = None,
        name: str | None = None,
        self_weight: float | None = None,
        src_weights: Mapping[int, float] | None = None,
        dst_weights: WeightsArg = None,
        timeout: float | None = None,
    ) -> T:
        """Blocking :meth:`compressed_neighbor_allreduce_async`."""
        return self._blocking(
            BY_NAME["compressed_neighbor_allreduce"],
            {
                "tensor": tensor,
                "compressor": compressor,
                "ratio": ratio,
                "name": name,
                "self_weight": self_weight,
                "src_weights": src_weights,
                "dst_weights": dst_weights,
                "timeout": timeout,
            },
        )

    def neighbor_allgather_async(
        self,
        tensor: T,
        name: str | None = None,
        src_ranks: Iterable[int] | None = None,
        dst_ranks: Iterable[int] | None = None,
        timeout: float | None = None,
        concat: bool = False,
    ) -> Handle[T]:
        """Start gathering the in-neighbors' tensors, stacked on a new leading dim (rank order).

        ``concat=True`` concatenates them on the first dimension instead (BlueFog's layout), in
        the order of ``src_ranks`` (default: the in-neighbors, ascending); their first
        dimensions may differ, and are exchanged first (a small blocking exchange).
        """
        return self._start(
            BY_NAME["neighbor_allgather"],
            {
                "tensor": tensor,
                "name": name,
                "src_ranks": src_ranks,
                "dst_ranks": dst_ranks,
                "timeout": timeout,
                "concat": concat,
            },
        )

    def neighbor_allgather(
        self,
        tensor: T,
        name: str | None = None,
        src_ranks: Iterable[int] | None = None,
        dst_ranks: Iterable[int] | None = None,
        timeout: float | None = None,
        concat: bool = False,
    ) -> T:
        """Blocking :meth:`neighbor_allgather_async`."""
        return self._blocking(
            BY_NAME["neighbor_allgather"],
            {
                "tensor": tensor,
                "name": name,
                "src_ranks": src_ranks,
                "dst_ranks": dst_ranks,
                "timeout": timeout,
                "concat": concat,
            },
        )

    def hierarchical_neighbor_allreduce_async(
        self,
        tensor: T,
        name: str | None = None,
        self_weight: float | None = None,
        src_machine_weights: Mapping[int, float] | None = None,
        dst_machine_weights: WeightsArg = None,
        timeout: float | None = None,
    ) -> Handle[T]:
        """Start ``self_weight * mean_I + sum_J src_machine_weights[J] * mean_J`` over the
        machines (keys: machine ranks; ``mean_J`` is the average over machine ``J``'s
        workers); returns at once. No weights: the machine topology's.
        ``dst_machine_weights`` makes the call dynamic, as ``dst_weights`` does for
        ``neighbor_allreduce``. Every worker of every machine calls it; the daemon averages its
        workers in shared memory and sends one copy per neighbor machine.
        """
        return self._start(
            BY_NAME["hierarchical_neighbor_allreduce"],
            {
                "tensor": tensor,
                "name": name,
                "self_weight": self_weight,
                "src_machine_weights": src_machine_weights,
                "dst_machine_weights": dst_machine_weights,
                "timeout": timeout,
                "into": None,
            },
        )

    def hierarchical_neighbor_allreduce(
        self,
        tensor: T,
        name: str | None = None,
        self_weight: float | None = None,
        src_machine_weights: Mapping[int, float] | None = None,
        dst_machine_weights: WeightsArg = None,
        timeout: float | None = None,
    ) -> T:
        """Blocking :meth:`hierarchical_neighbor_allreduce_async`."""
        return self._blocking(
            BY_NAME["hierarchical_neighbor_allreduce"],
            {
                "tensor": tensor,
                "name": name,
                "self_weight": self_weight,
                "src_machine_weights": src_machine_weights,
                "dst_machine_weights": dst_machine_weights,
                "timeout": timeout,
                "into": None,
            },
        )

    def hierarchical_neighbor_allreduce_async_(
        self,
        tensor: T,
        name: str | None = None,
        self_weight: float | None = None,
        src_machine_weights: Mapping[int, float] | None = None,
        dst_machine_weights: WeightsArg = None,
        timeout: float | None = None,
    ) -> Handle[T]:
        """In-place :meth:`hierarchical_neighbor_allreduce_async`: ``wait()`` writes the result into
        ``tensor`` and returns it (no new tensor is allocated). Leave ``tensor`` alone
        until the handle is waited for.
        """
        return self._start(
            BY_NAME["hierarchical_neighbor_allreduce"],
            {
                "tensor": tensor,
                "name": name,
                "self_weight": self_weight,
                "src_machine_weights": src_machine_weights,
                "dst_machine_weights": dst_machine_weights,
                "timeout": timeout,
                "into": tensor,
            },
        )

    def hierarchical_neighbor_allreduce_(
        self,
        tensor: T,
        name: str | None = None,
        self_weight: float | None = None,
        src_machine_weights: Mapping[int, float] | None = None,
        dst_machine_weights: WeightsArg = None,
        timeout: float | None = None,
    ) -> T:
        """Blocking in-place :meth:`hierarchical_neighbor_allreduce_async`."""
        return self._blocking(
            BY_NAME["hierarchical_neighbor_allreduce"],
            {
                "tensor": tensor,
                "name": name,
                "self_weight": self_weight,
                "src_machine_weights": src_machine_weights,
                "dst_machine_weights": dst_machine_weights,
                "timeout": timeout,
                "into": tensor,
            },
        )

    def allreduce_async(
        self,
        tensor: T,
        op: str = "average",
        name: str | None = None,
        timeout: float | None = None,
        *,
        fuse: bool = True,
        average: bool | None = None,
        compression: Compressor | None = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
    ) -> Handle[T]:
        """Start an average (or ``op="sum"``) over all ranks, bit-identical on every rank.

        Tensors below the daemon's ring threshold are fused (up to that many bytes per bucket:
        a fused allreduce is a direct exchange); larger ones run alone as a ring. Horovod's
        arguments work too: ``average`` (True: average, False: sum), ``compression`` (applied
        before the reduction and undone after), ``prescale_factor`` and ``postscale_factor``
        (multiplied in before and after).
        """
        return self._start(
            BY_NAME["allreduce"],
            {
                "tensor": tensor,
                "op": op,
                "name": name,
                "timeout": timeout,
                "fuse": fuse,
                "average": average,
                "compression": compression,
                "prescale_factor": prescale_factor,
                "postscale_factor": postscale_factor,
                "into": None,
            },
        )

    def allreduce(
        self,
        tensor: T,
        op: str = "average",
        name: str | None = None,
        timeout: float | None = None,
        *,
        average: bool | None = None,
        compression: Compressor | None = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
    ) -> T:
        """Blocking :meth:`allreduce_async`."""
        return self._blocking(
            BY_NAME["allreduce"],
            {
                "tensor": tensor,
                "op": op,
                "name": name,
                "timeout": timeout,
                "average": average,
                "compression": compression,
                "prescale_factor": prescale_factor,
                "postscale_factor": postscale_factor,
                "into": None,
                "fuse": False,
            },
        )

    def allreduce_async_(
        self,
        tensor: T,
        op: str = "average",
        name: str | None = None,
        timeout: float | None = None,
        *,
        fuse: bool = True,
        average: bool | None = None,
        compression: Compressor | None = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
    ) -> Handle[T]:
        """In-place :meth:`allreduce_async`: ``wait()`` writes the result into
        ``tensor`` and returns it (no new tensor is allocated). Leave ``tensor`` alone
        until the handle is waited for.
        """
        return self._start(
            BY_NAME["allreduce"],
            {
                "tensor": tensor,
                "op": op,
                "name": name,
                "timeout": timeout,
                "fuse": fuse,
                "average": average,
                "compression": compression,
                "prescale_factor": prescale_factor,
                "postscale_factor": postscale_factor,
                "into": tensor,
            },
        )

    def allreduce_(
        self,
        tensor: T,
        op: str = "average",
        name: str | None = None,
        timeout: float | None = None,
        *,
        average: bool | None = None,
        compression: Compressor | None = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
    ) -> T:
        """Blocking in-place :meth:`allreduce_async`."""
        return self._blocking(
            BY_NAME["allreduce"],
            {
                "tensor": tensor,
                "op": op,
                "name": name,
                "timeout": timeout,
                "average": average,
                "compression": compression,
                "prescale_factor": prescale_factor,
                "postscale_factor": postscale_factor,
                "into": tensor,
                "fuse": False,
            },
        )

    def allgather_async(
        self, tensor: T, name: str | None = None, timeout: float | None = None
    ) -> Handle[T]:
        """Start gathering every rank's tensor, concatenated on the first dimension in rank
        order (Horovod's ``allgather``); first dimensions may differ (exchanged first,
        blocking).
        """
        return self._start(
            BY_NAME["allgather"], {"tensor": tensor, "name": name, "timeout": timeout}
        )

    def allgather(self, tensor: T, name: str | None = None, timeout: float | None = None) -> T:
        """Blocking :meth:`allgather_async`."""
        return self._blocking(
            BY_NAME["allgather"], {"tensor": tensor, "name": name, "timeout": timeout}
        )

    def broadcast_async(
        self,
        tensor: T,
        root: int = 0,
        name: str | None = None,
        timeout: float | None = None,
        *,
        fuse: bool = True,
        root_rank: int | None = None,
    ) -> Handle[T]:
        """Start copying ``root``'s tensor to every rank (fused with other broadcasts);
        ``root_rank`` is Horovod's name for ``root``.
        """
        return self._start(
            BY_NAME["broadcast"],
            {
                "tensor": tensor,
                "root": root,
                "name": name,
                "timeout": timeout,
                "fuse": fuse,
                "root_rank": root_rank,
                "into": None,
            },
        )

    def broadcast(
        self,
        tensor: T,
        root: int = 0,
        name: str | None = None,
        timeout: float | None = None,
        *,
        root_rank: int | None = None,
    ) -> T:
        """Blocking :meth:`broadcast_async`."""
        return self._blocking(
            BY_NAME["broadcast"],
            {
                "tensor": tensor,
                "root": root,
                "name": name,
                "timeout": timeout,
                "root_rank": root_rank,
                "into": None,
                "fuse": False,
            },
        )

    def broadcast_async_(
        self,
        tensor: T,
        root: int = 0,
        name: str | None = None,
        timeout: float | None = None,
        *,
        fuse: bool = True,
        root_rank: int | None = None,
    ) -> Handle[T]:
        """In-place :meth:`broadcast_async`: ``wait()`` writes the result into
        ``tensor`` and returns it (no new tensor is allocated). Leave ``tensor`` alone
        until the handle is waited for.
        """
        return self._start(
            BY_NAME["broadcast"],
            {
                "tensor": tensor,
                "root": root,
                "name": name,
                "timeout": timeout,
                "fuse": fuse,
                "root_rank": root_rank,
                "into": tensor,
            },
        )

    def broadcast_(
        self,
        tensor: T,
        root: int = 0,
        name: str | None = None,
        timeout: float | None = None,
        *,
        root_rank: int | None = None,
    ) -> T:
        """Blocking in-place :meth:`broadcast_async`."""
        return self._blocking(
            BY_NAME["broadcast"],
            {
                "tensor": tensor,
                "root": root,
                "name": name,
                "timeout": timeout,
                "root_rank": root_rank,
                "into": tensor,
                "fuse": False,
            },
        )

    def alltoall_async(
        self,
        tensor: T,
        splits: Sequence[int] | None = None,
        name: str | None = None,
        timeout: float | None = None,
    ) -> Handle[T]:
        """Start sending ``splits[j]`` first-dimension rows to each rank ``j`` (in rank order;
        None: equal shares) and receiving the rows every rank sends this one, concatenated in
        rank order (Horovod's ``alltoall``; the splits are exchanged first, blocking).
        """
        return self._start(
            BY_NAME["alltoall"],
            {"tensor": tensor, "splits": splits, "name": name, "timeout": timeout},
        )

    def alltoall(
        self,
        tensor: T,
        splits: Sequence[int] | None = None,
        name: str | None = None,
        timeout: float | None = None,
    ) -> T:
        """Blocking :meth:`alltoall_async`."""
        return self._blocking(
            BY_NAME["alltoall"],
            {"tensor": tensor, "splits": splits, "name": name, "timeout": timeout},
        )

    def barrier(self, name: str | None = None, timeout: float | None = None) -> None:
        """Return once every rank has reached a barrier of the same name and round."""
        self._blocking(BY_NAME["barrier"], {"name": name, "timeout": timeout})

    def win_create(self, tensor: T, name: str, zero_init: bool = False) -> bool:
        """Create window ``name`` holding ``tensor`` (BlueFog's ``win_create``).

        The daemon keeps a copy (the *own copy*, what peers' :meth:`win_get` read) and one
        buffer per in-neighbor of a static topology, starting as a copy of ``tensor`` (zeros with
        ``zero_init``); other ranks get a buffer when they first write. Local: no other rank
        needs to take part, and ranks may create windows in any order. :meth:`win_update` writes
        its result into ``tensor``.
        """
        return self._blocking(
            BY_NAME["win_create"], {"tensor": tensor, "name": name, "zero_init": zero_init}
        )

    def win_put_async(
        self,
        tensor: T,
        name: str,
        dst_weights: WeightsArg = None,
        step: int = 0,
        timeout: float | None = None,
        self_weight: float | None = None,
        require_mutex: bool = False,
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
        return self._start(
            BY_NAME["win_put"],
            {
                "tensor": tensor,
                "name": name,
                "dst_weights": dst_weights,
                "step": step,
                "timeout": timeout,
                "self_weight": self_weight,
                "require_mutex": require_mutex,
            },
        )

    def win_put(
        self,
        tensor: T,
        name: str,
        dst_weights: WeightsArg = None,
        step: int = 0,
        timeout: float | None = None,
        self_weight: float | None = None,
        require_mutex: bool = False,
    ) -> T:
        """Blocking :meth:`win_put_async`."""
        return self._blocking(
            BY_NAME["win_put"],
            {
                "tensor": tensor,
                "name": name,
                "dst_weights": dst_weights,
                "step": step,
                "timeout": timeout,
                "self_weight": self_weight,
                "require_mutex": require_mutex,
            },
        )

    def win_accumulate_async(
        self,
        tensor: T,
        name: str,
        dst_weights: WeightsArg = None,
        step: int = 0,
        timeout: float | None = None,
        self_weight: float | None = None,
        require_mutex: bool = False,
    ) -> Handle[T]:
        """Like :meth:`win_put`, but each destination *adds* ``d_j * tensor`` (and
        ``d_j * p``) to its buffer for this rank (concurrent writers from several ranks all
        land).
        """
        return self._start(
            BY_NAME["win_accumulate"],
            {
                "tensor": tensor,
                "name": name,
                "dst_weights": dst_weights,
                "step": step,
                "timeout": timeout,
                "self_weight": self_weight,
                "require_mutex": require_mutex,
            },
        )

    def win_accumulate(
        self,
        tensor: T,
        name: str,
        dst_weights: WeightsArg = None,
        step: int = 0,
        timeout: float | None = None,
        self_weight: float | None = None,
        require_mutex: bool = False,
    ) -> T:
        """Blocking :meth:`win_accumulate_async`."""
        return self._blocking(
            BY_NAME["win_accumulate"],
            {
                "tensor": tensor,
                "name": name,
                "dst_weights": dst_weights,
                "step": step,
                "timeout": timeout,
                "self_weight": self_weight,
                "require_mutex": require_mutex,
            },
        )

    def win_get_async(
        self,
        name: str,
        src_weights: WeightsArg = None,
        timeout: float | None = None,
        require_mutex: bool = False,
    ) -> Handle[T]:
        """Fetch ``w_j * (j's own copy)`` into this rank's buffer for each source ``j`` (default:
        the static topology's in-neighbors, weight 1). The sources' daemons answer from their
        last own copy as it is when the request arrives, without waiting for their workers:
        to average the same round everywhere, put a barrier between the gets and the next
        update. ``wait()`` returns an empty tensor once every buffer is filled;
        :meth:`win_update` combines them.
        """
        return self._start(
            BY_NAME["win_get"],
            {
                "name": name,
                "src_weights": src_weights,
                "timeout": timeout,
                "require_mutex": require_mutex,
            },
        )

    def win_get(
        self,
        name: str,
        src_weights: WeightsArg = None,
        timeout: float | None = None,
        require_mutex: bool = False,
    ) -> None:
        """Blocking :meth:`win_get_async`."""
        self._blocking(
            BY_NAME["win_get"],
            {
                "name": name,
                "src_weights": src_weights,
                "timeout": timeout,
                "require_mutex": require_mutex,
            },
        )

    def win_update(
        self,
        name: str,
        self_weight: float | None = None,
        neighbor_weights: Mapping[int, float] | None = None,
        reset: bool = False,
        step: int = 0,
        timeout: float | None = None,
        clone: bool = False,
        require_mutex: bool = False,
        value: T | None = None,
    ) -> T:
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
        return self._blocking(
            BY_NAME["win_update"],
            {
                "name": name,
                "self_weight": self_weight,
                "neighbor_weights": neighbor_weights,
                "reset": reset,
                "step": step,
                "timeout": timeout,
                "clone": clone,
                "require_mutex": require_mutex,
                "value": value,
            },
        )

    def win_publish(self, tensor: T, name: str, step: int = 0) -> None:
        """Make ``tensor`` window ``name``'s own copy (what peers' gets are served from) at
        ``step`` (0: one more than before). Local and cheap: one copy into the daemon.
        """
        self._blocking(BY_NAME["win_publish"], {"tensor": tensor, "name": name, "step": step})

    def win_exchange_async(
        self, tensor: T, name: str, peer: int, step: int = 0, timeout: float | None = None
    ) -> Handle[T]:
        """Atomically average ``tensor`` with ``peer``'s own copy of window ``name``: the peer's
        daemon sets its own copy to ``(own + tensor) / 2`` and answers with it, without its
        worker (AD-PSGD's pairwise averaging). ``wait()`` gives that average, which is also this
        rank's own copy now.
        """
        return self._start(
            BY_NAME["win_exchange"],
            {"tensor": tensor, "name": name, "peer": peer, "step": step, "timeout": timeout},
        )

    def win_exchange(
        self, tensor: T, name: str, peer: int, step: int = 0, timeout: float | None = None
    ) -> T:
        """Blocking :meth:`win_exchange_async`."""
        return self._blocking(
            BY_NAME["win_exchange"],
            {"tensor": tensor, "name": name, "peer": peer, "step": step, "timeout": timeout},
        )

    def win_add(self, tensor: T, name: str, step: int = 0, timeout: float | None = None) -> T:
        """Own copy of window ``name`` += ``tensor``, atomically with peers' exchanges; the new
        own copy is written into ``tensor`` and returned (AD-PSGD: a gradient step applied to
        the current model).
        """
        return self._blocking(
            BY_NAME["win_add"], {"tensor": tensor, "name": name, "step": step, "timeout": timeout}
        )

    def group_allreduce_async(
        self,
        tensor: T,
        name: str,
        group_size: int,
        rule: str = "mean",
        timeout: float | None = None,
    ) -> Handle[T]:
        """Wait-avoiding average over this call's butterfly group of ``group_size`` ranks
        (WAGMA). ``tensor`` becomes window ``name``'s own copy (``win_create`` it on every rank
        first). The first member to arrive triggers the group; members not there yet
        contribute their last own copy, and find the result ready when they call. ``rule``:
        ``"mean"`` (group sum / S) or ``"with-self"`` ((group sum + tensor) / (S + 1), the
        reference code's).
        """
        return self._start(
            BY_NAME["group_allreduce"],
            {
                "tensor": tensor,
                "name": name,
                "group_size": group_size,
                "rule": rule,
                "timeout": timeout,
            },
        )

    def group_allreduce(
        self,
        tensor: T,
        name: str,
        group_size: int,
        rule: str = "mean",
        timeout: float | None = None,
    ) -> T:
        """Blocking :meth:`group_allreduce_async`."""
        return self._blocking(
            BY_NAME["group_allreduce"],
            {
                "tensor": tensor,
                "name": name,
                "group_size": group_size,
                "rule": rule,
                "timeout": timeout,
            },
        )
