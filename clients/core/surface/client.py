"""The framework-agnostic client: the op surface every adapter shares (torch, TensorFlow, numpy).

Each op method builds the op's typed arguments and hands the tensor to the
:class:`~decent.core.requests.submitter.Submitter`, which places it in the shared-memory arena and
sends a small request without waiting; the caller gets a
:class:`~decent.core.requests.handles.Handle`. One background thread reads the daemon's completion
stream and wakes the handles; ``Handle.wait()`` blocks on an event, it never polls. Adapters supply
a :class:`~decent.core.memory.codec.TensorCodec`."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

import numpy as np

from decent.core.memory.arena import ClientArena
from decent.core.memory.codec import TensorCodec
from decent.core.memory.regions import RegionTable
from decent.core.memory.registrar import Registrar
from decent.core.requests.calls import OpCall, neighbor_call
from decent.core.requests.connection import Connection, default_address
from decent.core.requests.fusion import settings_from_env
from decent.core.requests.handles import Handle
from decent.core.requests.submitter import Submitter
from decent.core.surface.args import WeightsArg, op_args, rank_weights
from decent.core.surface.hierarchy_ops import HierarchicalOps
from decent.core.surface.horovod_compression import Compressor, Transform
from decent.core.surface.membership import View
from decent.core.surface.rejoin import REJOIN_PREFIX
from decent.core.surface.topology_ops import TopologyOps
from decent.core.surface.window_ops import WindowOps, WindowTable
from decent_wire import dtypes
from decent_wire.errors import DecentError
from decent_wire.protocol import COMPRESSORS
from decent_wire.v1 import decent_pb2 as pb

T = TypeVar("T")

#: where a worker finds its local rank: decentrun's, torchrun's, SLURM's, Open MPI's
LOCAL_RANK_VARS = ("DECENT_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _rank_list(ranks: list[int] | None) -> pb.RankList | None:
    return None if ranks is None else pb.RankList(ranks=ranks)


#: the wire dtype of each numpy dtype the wire has
DTYPE_OF = {v: k for k, v in dtypes.STORAGE.items() if k != pb.BFLOAT16}


class Client(WindowOps[T], TopologyOps[T], HierarchicalOps[T], Generic[T]):
    """A worker's connection to its daemon. Thread-safe; one per process is typical."""

    def __init__(
        self,
        codec: TensorCodec[T],
        address: str | None = None,
        connect_timeout: float = 120.0,
        job: str | None = None,
        fusion_threshold: int | None = None,
        cycle_time: float | None = None,
        register: bool | None = None,
        local_rank: int | None = None,
    ) -> None:
        """Register with the daemon at ``address`` ($DECENT_DAEMON by default) as its worker
        ``local_rank`` (default: :data:`LOCAL_RANK_VARS`, else the lowest free one).

        ``fusion_threshold`` (bytes, 0: off) and ``cycle_time`` (seconds) tune the fusion of
        asynchronous requests ($DECENT_FUSION_THRESHOLD / $DECENT_CYCLE_TIME in ms; else 64 MiB
        and 1 ms). ``register`` (default on; $DECENT_REGISTER=0: off) lets in-place ops hand a
        tensor of 64 KiB or more in shared memory (torch: ``share_memory_()``) to the daemon
        once, after which they copy nothing (:mod:`decent.core.memory.regions`).
        """
        env_threshold, env_cycle = settings_from_env()
        self.codec = codec
        #: ops of different jobs never match; decentrun sets $DECENT_JOB fresh for each launch
        self.job = os.environ.get("DECENT_JOB", "") if job is None else job
        self.address = address or default_address()
        #: the links to the daemon (registration, data channel, memory socket)
        self.connection = Connection(self.address, codec.framework, self.job, connect_timeout,
                                     local_rank if local_rank is not None else _env_int(
                                         *LOCAL_RANK_VARS))
        reg = self.connection.registration
        self.worker_id = reg.worker_id
        #: this worker among all (BlueFog's names): ``machine_rank * local_size + local_rank``
        self.rank, self.size = reg.rank, reg.size
        #: this worker among its daemon's (pick a GPU by it), and how many that daemon serves
        self.local_rank, self.local_size = reg.local_rank, reg.local_size
        #: this worker's daemon (node) among the daemons, and how many there are
        self.machine_rank, self.machine_size = reg.machine_rank, reg.machine_size
        self.cluster_id = reg.cluster_id
        #: the workers' topology, and the daemons' (hierarchical ops), at step 0
        self.topology, self.machine_topology = reg.topology, reg.machine_topology
        self.default_timeout = reg.default_timeout
        self.ring_threshold = reg.ring_threshold
        if register is None:
            register = os.environ.get("DECENT_REGISTER", "1") not in ("0", "false", "no")
        self._registrar = Registrar(codec, self.connection, reg.worker_id,
                                    register and bool(reg.memory_socket))
        self.arena = ClientArena(self.connection.arena_fd(), reg.arena_bytes)
        codec.attach(self.arena)
        self._submitter = Submitter(
            codec, self.arena, self._registrar, self.connection.send,
            env_threshold if fusion_threshold is None else fusion_threshold,
            env_cycle if cycle_time is None else cycle_time, reg.default_timeout)
        try:
            self.connection.start(self._submitter.finish, self._submitter.connection_lost)
        except BaseException:
            self.arena.close()
            raise
        self._window_table: WindowTable[T] = WindowTable()
        self._prefixes: dict[str, itertools.count[int]] = {}
        self._check_rank()

    def _check_rank(self) -> None:
        """DecentError (and the registration undone) when $DECENT_RANK names another rank than
        the daemon gave: the worker was started against the wrong daemon or local rank."""
        want = _env_int("DECENT_RANK")
        if want is None or want == self.rank:
            return
        self.close()
        raise DecentError(pb.INVALID_ARGUMENT, f"$DECENT_RANK is {want}, but daemon "
                          f"{self.machine_rank} of {self.machine_size} made this worker rank "
                          f"{self.rank} (local rank {self.local_rank} of {self.local_size}): "
                          "start worker r on daemon r // workers_per_node with local rank "
                          "r % workers_per_node")

    @property
    def regions(self) -> RegionTable:
        """The worker memory registered with the daemon."""
        return self._registrar.regions

    def _call(self, call: OpCall, tensor: T | None, name: str | None, timeout: float | None,
              **options: Any) -> Handle[T]:
        if self.connection.joining and not (name or "").startswith(REJOIN_PREFIX):
            self.connection.join()  # the first op of training: peers include this rank now
        return self._submitter.submit(call, tensor, name, timeout, **options)

    # ------------------------------------------------------------------ neighbor ops

    def neighbor_allreduce_async(
        self, tensor: T, name: str | None = None, self_weight: float | None = None,
        src_weights: Mapping[int, float] | None = None, dst_weights: WeightsArg = None,
        timeout: float | None = None, *, fuse: bool = True,
    ) -> Handle[T]:
        """Start ``self_weight*x + sum_j src_weights[j] * d_j * x_j``; returns at once.

        No weights: the topology's at this step. ``dst_weights`` (dict or list of ranks) makes the
        call dynamic: it sends to exactly those ranks and receives from the ``src_weights`` keys.
        Requests with the same weights are fused (``fuse=False``: sent alone).
        """
        return self._neighbor_allreduce(tensor, None, name, self_weight, src_weights,
                                        dst_weights, timeout, fuse)

    def _neighbor_allreduce(self, tensor: T, into: T | None, name: str | None,
                            self_weight: float | None, src_weights: WeightsArg,
                            dst_weights: WeightsArg, timeout: float | None,
                            fuse: bool) -> Handle[T]:
        srcs, dsts = rank_weights(src_weights), rank_weights(dst_weights)
        args = op_args(name, pb.NeighborAllreduce, self_weight=self_weight, src_weights=srcs,
                       dst_weights=dsts)
        return self._call(neighbor_call(args, self_weight, srcs, dsts), tensor, name, timeout,
                          into=into, fuse=fuse)

    def neighbor_allreduce(self, tensor: T, **kwargs: Any) -> T:
        """Blocking :meth:`neighbor_allreduce_async`."""
        return self.neighbor_allreduce_async(tensor, fuse=False, **kwargs).wait()

    def neighbor_allreduce_async_(
        self, tensor: T, name: str | None = None, self_weight: float | None = None,
        src_weights: Mapping[int, float] | None = None, dst_weights: WeightsArg = None,
        timeout: float | None = None, *, fuse: bool = True,
    ) -> Handle[T]:
        """In-place :meth:`neighbor_allreduce_async`: ``wait()`` writes the result into
        ``tensor`` and returns it (no new tensor is allocated). A tensor in shared memory
        (torch: ``share_memory_()``) is registered with the daemon and never copied; leave it
        alone until the handle is waited for."""
        return self._neighbor_allreduce(tensor, tensor, name, self_weight, src_weights,
                                        dst_weights, timeout, fuse)

    def neighbor_allreduce_(self, tensor: T, **kwargs: Any) -> T:
        """Blocking in-place :meth:`neighbor_allreduce_async`."""
        return self.neighbor_allreduce_async_(tensor, fuse=False, **kwargs).wait()

    def compressed_neighbor_allreduce_async(
        self, tensor: T, compressor: str, ratio: float | None = None, name: str | None = None,
        self_weight: float | None = None, src_weights: Mapping[int, float] | None = None,
        dst_weights: WeightsArg = None, timeout: float | None = None,
    ) -> Handle[T]:
        """Start a neighbor_allreduce of ``Q(x)``, the tensor compressed by ``compressor``.

        ``compressor``: ``"topk"`` (with ``ratio``, the fraction of entries kept), ``"sign"`` or
        ``"int8"``. The daemon compresses, sends only the compressed bytes and decodes what
        arrives. The result has shape ``[2, *shape]``: row 0 is
        ``self_weight * Q(x) + sum_j src_weights[j] * d_j * Q(x_j)`` (weights as in
        :meth:`neighbor_allreduce_async`), row 1 is ``Q(x)`` exactly as the neighbors decoded it::

            mixed, own = client.compressed_neighbor_allreduce(t, "topk", ratio=0.01)
        """
        kind = COMPRESSORS.get(compressor)
        if kind is None:
            raise ValueError(f"tensor '{name}': unknown compressor {compressor!r}; known: "
                             f"{', '.join(sorted(COMPRESSORS))}")
        if kind == pb.TOPK and ratio is None:
            raise ValueError(f"tensor '{name}': compressor 'topk' needs a ratio (0 < ratio <= 1)")
        args = op_args(name, pb.CompressedNeighborAllreduce, self_weight=self_weight,
                       src_weights=rank_weights(src_weights),
                       dst_weights=rank_weights(dst_weights),
                       compression=pb.Compression(kind=kind, ratio=float(ratio or 0.0)))
        return self._call(OpCall("compressed_neighbor_allreduce", args), tensor, name, timeout,
                          out_factor=2)

    def compressed_neighbor_allreduce(self, tensor: T, compressor: str, **kwargs: Any) -> T:
        """Blocking :meth:`compressed_neighbor_allreduce_async`."""
        return self.compressed_neighbor_allreduce_async(tensor, compressor, **kwargs).wait()

    def neighbor_allgather_async(
        self, tensor: T, name: str | None = None, src_ranks: Iterable[int] | None = None,
        dst_ranks: Iterable[int] | None = None, timeout: float | None = None,
        concat: bool = False,
    ) -> Handle[T]:
        """Start gathering the in-neighbors' tensors, stacked on a new leading dim (rank order).

        ``concat=True`` concatenates them on the first dimension instead (BlueFog's layout), in
        the order of ``src_ranks`` (default: the in-neighbors, ascending); their first
        dimensions may differ, and are exchanged first (a small blocking exchange).
        """
        srcs = None if src_ranks is None else list(dict.fromkeys(int(r) for r in src_ranks))
        dsts = None if dst_ranks is None else sorted({int(r) for r in dst_ranks})
        if concat:
            return self._concat_neighbors(tensor, name, srcs, dsts, timeout)
        if srcs is not None:
            factor = len(srcs)
        else:  # the output holds one tensor per in-neighbor at the step this call will use
            factor = len(self.topology_at(name or "neighbor_allgather.unnamed").in_neighbors)
        args = op_args(name, pb.NeighborAllgather, src_ranks=_rank_list(srcs),
                       dst_ranks=_rank_list(dsts))
        return self._call(OpCall("neighbor_allgather", args), tensor, name, timeout,
                          out_factor=factor)

    def _concat_neighbors(self, tensor: T, name: str | None, srcs: list[int] | None,
                          dsts: list[int] | None, timeout: float | None) -> Handle[T]:
        name = name or "neighbor_allgather.unnamed"
        dtype, shape = self._submitter.describe(tensor, name)
        if not shape:
            raise ValueError(f"tensor '{name}': concatenating needs at least one dimension")
        first = self.tensor([shape[0]])
        got = self.neighbor_allgather_async(first, name=f"{name}.sizes", src_ranks=srcs,
                                            dst_ranks=dsts, timeout=timeout)
        rows = dict(zip(got.src_ranks, self.values(got.wait()).reshape(-1), strict=True))
        order = srcs if srcs is not None else sorted(rows)
        sizes = [int(rows[j]) for j in order]
        args = op_args(name, pb.NeighborAllgather, src_ranks=_rank_list(srcs),
                       dst_ranks=_rank_list(dsts), concat=True, sizes=sizes)
        return self._call(OpCall("neighbor_allgather", args), tensor, name, timeout,
                          out_bytes=sum(sizes) * dtypes.nbytes(dtype, shape[1:]))

    def neighbor_allgather(self, tensor: T, **kwargs: Any) -> T:
        """Blocking :meth:`neighbor_allgather_async`."""
        return self.neighbor_allgather_async(tensor, **kwargs).wait()

    # ------------------------------------------------------------------ collectives

    def allgather_async(self, tensor: T, name: str | None = None,
                        timeout: float | None = None) -> Handle[T]:
        """Start gathering every rank's tensor, concatenated on the first dimension in rank
        order (Horovod's ``allgather``); first dimensions may differ (exchanged first, blocking)."""
        name = name or "allgather.unnamed"
        dtype, shape = self._submitter.describe(tensor, name)
        if not shape:
            raise ValueError(f"tensor '{name}': allgather needs at least one dimension")
        first = self.tensor([shape[0]])
        sizes_op = OpCall("allgather", pb.Allgather(sizes=[1] * self.size))
        rows = self.values(self._call(sizes_op, first, f"{name}.sizes", timeout,
                                      out_factor=self.size).wait())
        sizes = [int(r) for r in rows]
        return self._call(OpCall("allgather", pb.Allgather(sizes=sizes)), tensor, name, timeout,
                          out_bytes=sum(sizes) * dtypes.nbytes(dtype, shape[1:]))

    def allgather(self, tensor: T, **kwargs: Any) -> T:
        """Blocking :meth:`allgather_async`."""
        return self.allgather_async(tensor, **kwargs).wait()

    def name_prefix(self, kind: str) -> str:
        """``decent.<kind><n>`` for the n-th object of ``kind`` (an optimizer wrapper) this
        client made: the same on every rank that makes its objects in the same order."""
        return f"decent.{kind}{next(self._prefixes.setdefault(kind, itertools.count()))}"

    def tensor(self, values: Any, like: T | None = None) -> T:
        """A tensor of this client's framework holding ``values`` (a numpy array or a list of
        numbers; on ``like``'s device)."""
        array = np.ascontiguousarray(values)
        dtype = DTYPE_OF.get(array.dtype)
        if dtype is None:
            raise TypeError(f"no wire dtype for numpy {array.dtype}")
        return self.codec.read(array.view(np.uint8).reshape(-1).data, dtype, array.shape, like)

    def values(self, tensor: T) -> np.ndarray:
        """The values of a tensor of this client's framework, as a numpy array (a copy)."""
        dtype, shape = self.codec.describe(tensor)
        raw = bytearray(dtypes.nbytes(dtype, shape))
        if raw:
            self.codec.write(tensor, memoryview(raw))
        return np.frombuffer(raw, dtypes.STORAGE[dtype]).reshape(shape)

    def assign(self, target: T, value: T) -> T:
        """Copy ``value`` into ``target`` (same dtype and shape); returns ``target``."""
        dtype, shape = self.codec.describe(value)
        raw = bytearray(dtypes.nbytes(dtype, shape))
        if raw:
            self.codec.write(value, memoryview(raw))
        return self.codec.read_into(memoryview(raw), target)

    def allreduce_async(self, tensor: T, op: str = "average", name: str | None = None,
                        timeout: float | None = None, *, fuse: bool = True,
                        average: bool | None = None, compression: Compressor | None = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0
                        ) -> Handle[T]:
        """Start an average (or ``op="sum"``) over all ranks.

        Tensors below the daemon's ring threshold are fused (up to that many bytes per bucket:
        a fused allreduce is a direct exchange); larger ones run alone as a ring. Horovod's
        arguments work too: ``average`` (True: average, False: sum), ``compression`` (applied
        before the reduction and undone after), ``prescale_factor`` and ``postscale_factor``
        (multiplied in before and after).
        """
        return self._allreduce(tensor, None, self._reduce_op(op, average), name, timeout, fuse,
                               Transform(compression, prescale_factor, postscale_factor))

    @staticmethod
    def _reduce_op(op: str, average: bool | None) -> str:
        if average is not None:
            return "average" if average else "sum"
        if op not in ("average", "sum"):
            raise ValueError(f"allreduce op must be 'average' or 'sum', not {op!r}")
        return op

    def _allreduce(self, tensor: T, into: T | None, op: str, name: str | None,
                   timeout: float | None, fuse: bool, transform: Transform | None = None
                   ) -> Handle[T]:
        args = pb.Allreduce(reduce_op=pb.AVERAGE if op == "average" else pb.SUM)
        if transform is not None and transform.active:
            sent, context = transform.before(tensor)
            handle = self._call(OpCall("allreduce", args), sent, name, timeout, fuse=False)
            done = handle.then(lambda r: transform.after(r, context))
            return done if into is None else done.then(lambda r: self.assign(into, r))
        small = fuse and self._nbytes(tensor) < self.ring_threshold
        return self._call(OpCall("allreduce", args), tensor, name, timeout, into=into,
                          fuse=small, fuse_limit=self.ring_threshold)

    def allreduce(self, tensor: T, **kwargs: Any) -> T:
        """Blocking :meth:`allreduce_async`."""
        return self.allreduce_async(tensor, fuse=False, **kwargs).wait()

    def allreduce_async_(self, tensor: T, op: str = "average", name: str | None = None,
                         timeout: float | None = None, *, fuse: bool = True,
                         average: bool | None = None, compression: Compressor | None = None,
                         prescale_factor: float = 1.0, postscale_factor: float = 1.0
                         ) -> Handle[T]:
        """In-place :meth:`allreduce_async` (the result is written into ``tensor``)."""
        return self._allreduce(tensor, tensor, self._reduce_op(op, average), name, timeout,
                               fuse, Transform(compression, prescale_factor, postscale_factor))

    def allreduce_(self, tensor: T, **kwargs: Any) -> T:
        """Blocking in-place :meth:`allreduce_async`."""
        return self.allreduce_async_(tensor, fuse=False, **kwargs).wait()

    def broadcast_async(self, tensor: T, root: int = 0, name: str | None = None,
                        timeout: float | None = None, *, fuse: bool = True,
                        root_rank: int | None = None) -> Handle[T]:
        """Start copying ``root``'s tensor to every rank (fused with other broadcasts);
        ``root_rank`` is Horovod's name for ``root``."""
        return self._broadcast(tensor, None, root if root_rank is None else root_rank, name,
                               timeout, fuse)

    def _broadcast(self, tensor: T, into: T | None, root: int, name: str | None,
                   timeout: float | None, fuse: bool) -> Handle[T]:
        args = op_args(name, pb.Broadcast, root=root)
        return self._call(OpCall("broadcast", args), tensor, name, timeout, into=into,
                          fuse=fuse)

    def broadcast(self, tensor: T, *args: Any, **kwargs: Any) -> T:
        """Blocking :meth:`broadcast_async`."""
        return self.broadcast_async(tensor, *args, fuse=False, **kwargs).wait()

    def broadcast_async_(self, tensor: T, root: int = 0, name: str | None = None,
                         timeout: float | None = None, *, fuse: bool = True,
                         root_rank: int | None = None) -> Handle[T]:
        """In-place :meth:`broadcast_async` (root's tensor is written into ``tensor``)."""
        return self._broadcast(tensor, tensor, root if root_rank is None else root_rank, name,
                               timeout, fuse)

    def broadcast_(self, tensor: T, *args: Any, **kwargs: Any) -> T:
        """Blocking in-place :meth:`broadcast_async`."""
        return self.broadcast_async_(tensor, *args, fuse=False, **kwargs).wait()

    def barrier(self, name: str | None = None, timeout: float | None = None) -> None:
        """Return once every rank has reached a barrier of the same name and round."""
        self._submitter.flush()
        self._registrar.release_dead()
        self._call(OpCall("barrier", pb.Barrier()), None, name, timeout).join()

    def _nbytes(self, tensor: T) -> int:
        try:
            return dtypes.nbytes(*self.codec.describe(tensor))
        except TypeError:
            return 0  # the submission reports it with the tensor's name

    # ------------------------------------------------------------------ memory and fusion

    def shared(self, tensor: T) -> T:
        """A copy of ``tensor`` that lives in the shared-memory arena (CPU only): ops take it
        without a copy, in-place ops write their result straight into it (as into
        ``model.share_memory()`` tensors). Its arena space is freed when the last tensor using
        it is gone. Do not modify it until an asynchronous op on it is waited for."""
        return self._submitter.shared(tensor)

    def shared_or_none(self, tensor: T) -> T | None:
        """:meth:`shared`, or None when that would leave less than half the arena free."""
        return self._submitter.shared_if_room(tensor)

    def flush(self) -> None:
        """Send every request still waiting in a fusion bucket now."""
        self._submitter.flush()

    def fused(self) -> AbstractContextManager[None]:
        """A block whose requests fuse by size only (as Horovod's grouped ops): the cycle timer
        does not split them while it lasts, and what is left goes out when it ends."""
        return self._submitter.fused()

    # ------------------------------------------------------------------ queries

    def topology_at(self, name: str | None = None) -> pb.TopologyInfo:
        """Neighbors and weights at the step the next call of op ``name`` will use."""
        return self.connection.topology(name or "",
                                        self._submitter.round_of(name) if name else 0)

    def _in_neighbors(self) -> list[int]:
        return self.in_neighbors()

    def _out_neighbors(self) -> list[int]:
        return self.out_neighbors()

    def in_neighbors(self, name: str | None = None) -> list[int]:
        """Ranks this worker receives from (at the next step of ``name``)."""
        return list(self.topology_at(name).in_neighbors)

    def out_neighbors(self, name: str | None = None) -> list[int]:
        """Ranks this worker sends to (at the next step of ``name``)."""
        return list(self.topology_at(name).out_neighbors)

    def status(self) -> pb.StatusReply:
        """The daemon's counters and peer health, and this worker's results (worker_results_*)."""
        return self._submitter.results.reported(self.connection.status())

    def membership(self) -> View:
        """The live ranks and the view's epoch, as this worker's daemon sees them now."""
        return View.of(self.connection.status())

    @property
    def view_epoch(self) -> int:
        """The daemon's membership epoch as of the last completed op (cheap: no call)."""
        return self._submitter.view_epoch

    @property
    def rejoining(self) -> bool:
        """Whether this worker joins a running job (its daemon restarted or came late)."""
        return self.connection.registration.rejoining

    def close(self) -> None:
        """Disconnect; the daemon fails this worker's in-flight ops and frees its arena.
        Returns once the daemon has dropped this worker (or after 5 s without an answer): a
        job started right after finds the daemon's history of this one forgotten (once the
        ops still in flight, cancelled first, have ended)."""
        if self._submitter.closed:
            return
        self._submitter.close()
        self.connection.close(patience=5)
        self.arena.close()

    def __enter__(self) -> Client[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Client", "Handle", "TensorCodec", "default_address"]
