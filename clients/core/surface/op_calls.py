"""Each op's call, written once: its arguments turned into the op's wire arguments and the
request's options (placement, fusion, the result's size).

:class:`OpCalls` has one method per op of the op table (``decent_wire.ops``) with a surface of
its own; :class:`decent.core.Client`'s methods (generated from the table into
:mod:`decent.core.surface.methods`) call it. An op's in-place forms pass its tensor as ``into``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from decent.core.memory.codec import TensorCodec, tensor_of, values_of
from decent.core.memory.registrar import Registrar
from decent.core.requests.calls import OpCall, neighbor_call, op_call
from decent.core.requests.connection import Connection
from decent.core.requests.handles import Handle
from decent.core.requests.submitter import Submitter
from decent.core.surface.args import WeightsArg, op_args, rank_weights
from decent.core.surface.horovod_compression import Compressor, Transform
from decent.core.surface.rejoin import REJOIN_PREFIX
from decent_wire import dtypes
from decent_wire.numerics import INTEGER
from decent_wire.ops import exchanged_rows
from decent_wire.protocol import COMPRESSORS, REDUCE_OPS
from decent_wire.v1 import decent_pb2 as pb

T = TypeVar("T")


def _rank_list(ranks: list[int] | None) -> pb.RankList | None:
    return None if ranks is None else pb.RankList(ranks=ranks)


def reduce_op(op: str, average: bool | None) -> str:
    """The reduction (a key of ``REDUCE_OPS``: average, sum, min, max, product) from an
    allreduce's ``op`` and Horovod's ``average``."""
    if average is not None:
        return "average" if average else "sum"
    if op not in REDUCE_OPS:
        raise ValueError(f"allreduce op must be one of {', '.join(map(repr, REDUCE_OPS))}, "
                         f"not {op!r}")
    return op


@dataclass(frozen=True)
class Cluster:
    """What a call needs to know of the job: this worker's rank, the number of workers, and
    the allreduce size from which the daemon runs a ring."""

    rank: int
    size: int
    ring_threshold: int


class OpCalls(Generic[T]):
    """The calls of the neighbor ops, the collectives and hierarchical averaging."""

    def __init__(self, codec: TensorCodec[T], submitter: Submitter[T], connection: Connection,
                 registrar: Registrar, cluster: Cluster) -> None:
        self.codec = codec
        self.submitter = submitter
        self.connection = connection
        self.registrar = registrar
        self.cluster = cluster

    def call(self, call: OpCall, tensor: T | None, name: str | None, timeout: float | None,
             **options: Any) -> Handle[T]:
        """Submit one call (``options``: :meth:`Submitter.submit`'s)."""
        self.codec.check_call()
        if self.connection.joining and not (name or "").startswith(REJOIN_PREFIX):
            self.connection.join()  # the first op of training: peers include this rank now
        return self.submitter.submit(call, tensor, name, timeout, **options)

    def in_neighbor_count(self, name: str) -> int:
        """How many in-neighbors the next call of ``name`` has."""
        info = self.connection.topology(name, self.submitter.round_of(name))
        return len(info.in_neighbors)

    # ------------------------------------------------------------------ neighbor ops

    def neighbor_allreduce(
        self, tensor: T, into: T | None = None, name: str | None = None,
        self_weight: float | None = None, src_weights: Mapping[int, float] | None = None,
        dst_weights: WeightsArg = None, timeout: float | None = None, *, fuse: bool = True,
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
        srcs, dsts = rank_weights(src_weights), rank_weights(dst_weights)
        args = op_args(name, pb.NeighborAllreduce, self_weight=self_weight, src_weights=srcs,
                       dst_weights=dsts)
        return self.call(neighbor_call(args, self_weight, srcs, dsts), tensor, name, timeout,
                         into=into, fuse=fuse)

    def compressed_neighbor_allreduce(
        self, tensor: T, compressor: str, ratio: float | None = None, name: str | None = None,
        self_weight: float | None = None, src_weights: Mapping[int, float] | None = None,
        dst_weights: WeightsArg = None, timeout: float | None = None,
    ) -> Handle[T]:
        """Start a neighbor_allreduce of ``Q(x)``, the tensor compressed by ``compressor``.

        ``compressor``: ``"topk"`` (with ``ratio``, the fraction of entries kept),
        ``"sign"``, ``"int8"`` or ``"int4"``. The daemon compresses, sends only the compressed
        bytes and decodes what arrives. The result has shape ``[2, *shape]``: row 0 is
        ``self_weight * Q(x) + sum_j src_weights[j] * d_j * Q(x_j)`` (weights as in
        ``neighbor_allreduce``), row 1 is ``Q(x)`` exactly as the neighbors decoded it::

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
        return self.call(op_call("compressed_neighbor_allreduce", args), tensor, name, timeout)

    def neighbor_allgather(
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
        # the output holds one tensor per in-neighbor at the step this call will use
        sources = len(srcs) if srcs is not None else \
            self.in_neighbor_count(name or "neighbor_allgather.unnamed")
        args = op_args(name, pb.NeighborAllgather, src_ranks=_rank_list(srcs),
                       dst_ranks=_rank_list(dsts))
        return self.call(op_call("neighbor_allgather", args), tensor, name, timeout,
                         sources=sources)

    def _concat_neighbors(self, tensor: T, name: str | None, srcs: list[int] | None,
                          dsts: list[int] | None, timeout: float | None) -> Handle[T]:
        name = name or "neighbor_allgather.unnamed"
        _, shape = self.submitter.describe(tensor, name)
        if not shape:
            raise ValueError(f"tensor '{name}': concatenating needs at least one dimension")
        got = self.neighbor_allgather(tensor_of(self.codec, [shape[0]]), name=f"{name}.sizes",
                                      src_ranks=srcs, dst_ranks=dsts, timeout=timeout)
        counts = values_of(self.codec, got.wait()).reshape(-1)
        rows = dict(zip(got.src_ranks, counts, strict=True))
        sizes = [int(rows[j]) for j in (srcs if srcs is not None else sorted(rows))]
        args = op_args(name, pb.NeighborAllgather, src_ranks=_rank_list(srcs),
                       dst_ranks=_rank_list(dsts), concat=True, sizes=sizes)
        return self.call(op_call("neighbor_allgather", args), tensor, name, timeout, rows=sizes)

    def hierarchical_neighbor_allreduce(
        self, tensor: T, into: T | None = None, name: str | None = None,
        self_weight: float | None = None,
        src_machine_weights: Mapping[int, float] | None = None,
        dst_machine_weights: WeightsArg = None, timeout: float | None = None,
    ) -> Handle[T]:
        """Start ``self_weight * mean_I + sum_J src_machine_weights[J] * mean_J`` over the
        machines (keys: machine ranks; ``mean_J`` is the average over machine ``J``'s
        workers); returns at once. No weights: the machine topology's.
        ``dst_machine_weights`` makes the call dynamic, as ``dst_weights`` does for
        ``neighbor_allreduce``. Every worker of every machine calls it; the daemon averages its
        workers in shared memory and sends one copy per neighbor machine."""
        args = op_args(name, pb.HierarchicalNeighborAllreduce, self_weight=self_weight,
                       src_machine_weights=rank_weights(src_machine_weights),
                       dst_machine_weights=rank_weights(dst_machine_weights))
        return self.call(op_call("hierarchical_neighbor_allreduce", args), tensor, name,
                         timeout, into=into, fuse=True)

    # ------------------------------------------------------------------ collectives

    def allreduce(
        self, tensor: T, into: T | None = None, op: str = "average", name: str | None = None,
        timeout: float | None = None, *, fuse: bool = True, average: bool | None = None,
        compression: Compressor | None = None, prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
    ) -> Handle[T]:
        """Start an average (or ``op="sum"``) over all ranks, bit-identical on every rank.

        Tensors below the daemon's ring threshold are fused (up to that many bytes per bucket:
        a fused allreduce is a direct exchange); larger ones run alone as a ring. Horovod's
        arguments work too: ``average`` (True: average, False: sum), ``compression`` (applied
        before the reduction and undone after), ``prescale_factor`` and ``postscale_factor``
        (multiplied in before and after).
        """
        args = pb.Allreduce(reduce_op=REDUCE_OPS[reduce_op(op, average)])
        transform = Transform(compression, prescale_factor, postscale_factor, self.scaled)
        if transform.active:
            sent, context = transform.before(tensor)
            handle = self.call(op_call("allreduce", args), sent, name, timeout, fuse=False)
            done = handle.then(lambda r: transform.after(r, context))
            return done if into is None else done.then(lambda r: self.assign(into, r))
        threshold = self.cluster.ring_threshold
        small = fuse and self._nbytes(tensor) < threshold
        return self.call(op_call("allreduce", args), tensor, name, timeout, into=into,
                         fuse=small, fuse_limit=threshold)

    def allgather(self, tensor: T, name: str | None = None,
                  timeout: float | None = None) -> Handle[T]:
        """Start gathering every rank's tensor, concatenated on the first dimension in rank
        order (Horovod's ``allgather``); first dimensions may differ (exchanged first,
        blocking)."""
        name = name or "allgather.unnamed"
        _, shape = self.submitter.describe(tensor, name)
        if not shape:
            raise ValueError(f"tensor '{name}': allgather needs at least one dimension")
        size = self.cluster.size
        sizes_op = op_call("allgather", pb.Allgather(sizes=[1] * size))
        first = tensor_of(self.codec, [shape[0]])
        counts = values_of(self.codec, self.call(sizes_op, first, f"{name}.sizes", timeout,
                                                 rows=[1] * size).wait())
        sizes = [int(r) for r in counts]
        return self.call(op_call("allgather", pb.Allgather(sizes=sizes)), tensor, name,
                         timeout, rows=sizes)

    def alltoall(self, tensor: T, splits: Sequence[int] | None = None, name: str | None = None,
                 timeout: float | None = None) -> Handle[T]:
        """Start sending ``splits[j]`` first-dimension rows to each rank ``j`` (in rank order;
        None: equal shares) and receiving the rows every rank sends this one, concatenated in
        rank order (Horovod's ``alltoall``; the splits are exchanged first, blocking)."""
        name = name or "alltoall.unnamed"
        _, shape = self.submitter.describe(tensor, name)
        size = self.cluster.size
        if not shape:
            raise ValueError(f"tensor '{name}': alltoall needs at least one dimension")
        send = [shape[0] // size] * size if splits is None else [int(s) for s in splits]
        if len(send) != size or sum(send) != shape[0] or min(send) < 0:
            raise ValueError(f"tensor '{name}': alltoall splits {send} do not share its "
                             f"{shape[0]} rows among {size} ranks")
        counts = values_of(self.codec, self.call(
            op_call("allgather", pb.Allgather(sizes=[size] * size)),
            tensor_of(self.codec, send), f"{name}.splits", timeout, rows=[size] * size).wait())
        recv = [int(counts[i * size + self.cluster.rank]) for i in range(size)]
        return self.exchange(tensor, send, recv, name=name, timeout=timeout)

    def exchange(self, tensor: T, send_rows: Sequence[int], recv_rows: Sequence[int],
                 reduce: str | None = None, name: str | None = None,
                 timeout: float | None = None, *, pair: bool = False) -> Handle[T]:
        """Start sending ``send_rows[j]`` first-dimension rows to each rank ``j`` and receiving
        ``recv_rows[i]`` rows from each rank ``i``: concatenated in rank order, or combined
        element-wise with ``reduce`` (a key of ``REDUCE_OPS``). Every rank calls it, and the
        ranks agree on it first; ``pair``: only the ranks it sends to or receives from call it
        (send and recv), without an agreement."""
        args = pb.Alltoall(send_rows=list(send_rows), recv_rows=list(recv_rows))
        if reduce is not None:
            args.reduce = REDUCE_OPS[reduce_op(reduce, None)]
        return self.call(op_call("sendrecv" if pair else "alltoall", args), tensor, name,
                         timeout, rows=[exchanged_rows(args)])

    def broadcast(self, tensor: T, into: T | None = None, root: int = 0, name: str | None = None,
                  timeout: float | None = None, *, fuse: bool = True,
                  root_rank: int | None = None) -> Handle[T]:
        """Start copying ``root``'s tensor to every rank (fused with other broadcasts);
        ``root_rank`` is Horovod's name for ``root``."""
        args = op_args(name, pb.Broadcast, root=root if root_rank is None else root_rank)
        return self.call(op_call("broadcast", args), tensor, name, timeout, into=into,
                         fuse=fuse)

    def barrier(self, name: str | None = None, timeout: float | None = None) -> Handle[T]:
        """Return once every rank has reached a barrier of the same name and round."""
        self.submitter.flush()
        self.registrar.release_dead()
        return self.call(op_call("barrier", pb.Barrier()), None, name, timeout)

    # ------------------------------------------------------------------ helpers

    def scaled(self, tensor: T, factor: float) -> T:
        """``tensor * factor`` in ``tensor``'s dtype: an integer tensor stays one, its products
        truncated toward zero (Horovod's scaling of integer tensors)."""
        dtype, _ = self.codec.describe(tensor)
        if dtype not in INTEGER:
            scaled: T = tensor * factor  # type: ignore[operator, assignment]
            return scaled
        values = values_of(self.codec, tensor)
        return tensor_of(self.codec, np.trunc(values * factor).astype(values.dtype), tensor)

    def assign(self, target: T, value: T) -> T:
        """Copy ``value`` into ``target`` (same dtype and shape); returns ``target``."""
        dtype, shape = self.codec.describe(value)
        raw = bytearray(dtypes.nbytes(dtype, shape))
        if raw:
            self.codec.write(value, memoryview(raw))
        return self.codec.read_into(memoryview(raw), target)

    def _nbytes(self, tensor: T) -> int:
        try:
            return dtypes.nbytes(*self.codec.describe(tensor))
        except TypeError:
            return 0  # the submission reports it with the tensor's name
