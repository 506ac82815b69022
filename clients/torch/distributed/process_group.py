"""torch.distributed's ``decent`` backend: a script switches from gloo with one changed string.

    import decent.torch  # registers the backend
    dist.init_process_group("decent")          # RANK, WORLD_SIZE, MASTER_ADDR/PORT as for gloo
    dist.all_reduce(t)                         # through this node's daemon

Each rank's process groups share one client of its node's daemon (``$DECENT_DAEMON``, else the
default socket; the local rank from ``$LOCAL_RANK``, which torchrun and decentrun set), so the
collectives run on decent's data path, with its security, fault handling and metrics; torch's
own store is only used by torch itself. The ranks of the default group must be the clients'
ranks (the daemons number the workers node by node, as torchrun and decentrun do).

Every collective of ``torch.distributed`` runs, blocking and with ``async_op=True``:
``all_reduce`` (SUM, AVG, PRODUCT, MIN, MAX), ``broadcast``, ``reduce``, ``all_gather``,
``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``, ``gather``,
``scatter``, ``all_to_all``, ``all_to_all_single``, ``barrier``, ``send``/``recv``/``isend``/
``irecv`` and ``batch_isend_irecv``. Over the default group they are the daemon's collectives
(``allreduce``, ``broadcast``, ``allgather``, ``barrier``, and ``alltoall`` for the rest, each
agreed among the ranks first); over a group of ``new_group`` and for point-to-point they are
the daemon's ``sendrecv`` exchanges among the group's members only, under names of their own
(two groups never mix). Inputs may be non-contiguous (a contiguous copy is sent, the result
copied back). A failed op raises ``torch.distributed.DistBackendError`` with decent's message.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# torch's stubs give ProcessGroup's methods other overloads than a Python process group
# implements (torch's own multi-threaded one does the same)
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from decent.core import Handle
from decent.torch.client import TorchClient, connect
from decent.torch.distributed.endings import (
    Resharer,
    copied_back,
    flattened,
    single,
    split_into,
    waited,
    whole,
)
from decent.torch.distributed.work import Completer, DecentWork, Ending

#: the store key under which rank 0 gives the default group's decent job
JOB_KEY = "decent/job"

#: the backend's name in ``init_process_group``
BACKEND = "decent"

#: torch's reduce ops that decent runs, and its name for each
REDUCE_OPS = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "average"),
              (dist.ReduceOp.PRODUCT, "product"), (dist.ReduceOp.MIN, "min"),
              (dist.ReduceOp.MAX, "max"))

__all__ = ["BACKEND", "DecentProcessGroup", "DecentWork", "client_of", "create", "register"]


def reduce_name(op: Any) -> str:
    """decent's name of torch's reduce op ``op``; NotImplementedError for the others."""
    for torch_op, name in REDUCE_OPS:
        if op == torch_op:
            return name
    raise NotImplementedError(f"the decent backend reduces with SUM, AVG, PRODUCT, MIN and MAX, "
                              f"not {op}")


class SharedClient:
    """The one client of this process's process groups (a second client would be a second
    worker of the daemon): made by the first group, closed with the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: TorchClient | None = None
        self._users = 0
        self._generation = 0  #: default groups made so far

    def take(self, job: Callable[[int], str]) -> tuple[TorchClient, bool]:
        """The client (connected now, in job ``job(generation)``, if no group holds it), and
        whether it is new (the default group, made first, takes it new)."""
        with self._lock:
            new = self._client is None
            if self._client is None:
                self._client = connect(job=job(self._generation))
                self._generation += 1
            self._users += 1
            return self._client, new

    def give_back(self) -> None:
        """A group is done with it; the last closes it."""
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._client is not None:
                self._client.close()
                self._client = None


#: the client every process group of this process uses
SHARED = SharedClient()


def client_of(group: dist.ProcessGroup | None = None) -> TorchClient:
    """The decent client under ``group`` (default: the default group), a ``decent`` process
    group: decent's own API (neighbor averaging, the optimizers) over the same connection."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, DecentProcessGroup):
        raise ValueError(f"{pg} is not a process group of the decent backend "
                         "(init_process_group('decent'))")
    return pg.client


class DecentProcessGroup(dist.ProcessGroup):
    """One rank's process group over its client of the node's daemon: the default group
    (``ranks`` every rank) or one of ``new_group`` (``ranks`` its members' global ranks)."""

    def __init__(self, client: TorchClient, rank: int, size: int, timeout: timedelta,
                 ranks: Sequence[int] = (), group_id: str = "0", default: bool = True) -> None:
        self.ranks = list(ranks) or list(range(size))
        #: the default group runs the daemon's collectives over every rank, agreed first
        self.world = default
        if self.ranks[rank] != client.rank or (default and client.size != size):
            raise ValueError(
                f"torch.distributed says rank {self.ranks[rank]} of {size}, but this process's "
                f"decent client is rank {client.rank} of {client.size} (its daemon numbers the "
                "workers node by node: set RANK and WORLD_SIZE as decentrun or torchrun do, "
                "with LOCAL_RANK the rank on the node)")
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.client = client
        self.timeout = timeout.total_seconds()
        #: what qualifies the names of this group's exchanges (two groups never meet)
        self.prefix = f"pg.{group_id}."
        self._group_id = group_id
        self._completer = Completer()
        self._shared = Resharer()

    def getBackendName(self) -> str:
        """``decent``."""
        return BACKEND

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """torch's name of this group (torch keeps it in its own backends only)."""
        return self._group_id

    # ------------------------------------------------------------------ the exchange

    def _name(self, what: str) -> str:
        """The name of this group's op ``what``: ops started by callbacks chained on its ops
        (PowerSGD's) count their rounds apart from the ops the training thread starts, so
        that the two threads' interleaving, which differs from rank to rank, does not."""
        return f"{self.prefix}{'cb.' if self._completer.in_callback() else ''}{what}"

    def _exchange(self, flat: torch.Tensor, send: Sequence[int], recv: Sequence[int],
                  what: str, reduce: str | None = None, pair: bool = False
                  ) -> Handle[torch.Tensor]:
        """The daemon's exchange of ``flat``'s elements: ``send[g]`` to group rank ``g``,
        ``recv[g]`` from it (the default group's collectives are agreed among every rank; a
        subgroup's, and ``pair`` ones, run among the ranks they name only)."""
        full_send, full_recv = [0] * self.client.size, [0] * self.client.size
        for g, r in enumerate(self.ranks):
            full_send[r], full_recv[r] = int(send[g]), int(recv[g])
        return self.client.calls.exchange(flat, full_send, full_recv, reduce,
                                          name=self._name(what), timeout=self.timeout,
                                          pair=pair or not self.world)

    def _allgather(self, t: torch.Tensor) -> Handle[torch.Tensor]:
        """Every member's ``t``, flattened, in rank order (the daemon's allgather over the
        default group, a subgroup's exchange otherwise)."""
        if self.world:
            return self.client.allgather_async(flattened(t), timeout=self.timeout,
                                               name=self._name("allgather"))
        return self._to_all(t, "allgather")

    def _to_all(self, t: torch.Tensor, what: str) -> Handle[torch.Tensor]:
        """Every member gets ``t`` whole from every member (a subgroup's allgather)."""
        n = self.size()
        return self._exchange(flattened(t).repeat(n), [t.numel()] * n, [t.numel()] * n, what)

    # ------------------------------------------------------------------ collectives

    def allreduce(  # type: ignore[override]
            self, tensors: list[torch.Tensor], opts: AllreduceOptions | None = None
    ) -> dist.Work:
        """``all_reduce`` over every member, in place."""
        t = single(tensors, "all_reduce")
        op = reduce_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if self.world and t.is_contiguous():  # in place: no result tensor, no copy back
            self._shared.note(t)
            handle = self.client.allreduce_async_(t, op=op, timeout=self.timeout, fuse=False,
                                                  name=self._name("allreduce"))
            return self._completer.submit(waited(handle, t, self.ranks))
        if self.world:
            handle = self.client.allreduce_async(t.contiguous(), op=op, timeout=self.timeout,
                                                 fuse=False, name=self._name("allreduce"))
        else:
            n = self.size()
            handle = self._exchange(flattened(t).repeat(n), [t.numel()] * n, [t.numel()] * n,
                                    "allreduce", op)
        return self._completer.submit(copied_back(handle, t, self.ranks))

    def broadcast(  # type: ignore[override]
            self, tensors: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> dist.Work:
        """``broadcast`` from group rank ``opts.rootRank``, in place."""
        t = single(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        if self.world and t.is_contiguous():  # in place: no result tensor, no copy back
            handle = self.client.broadcast_async_(t, root=root, timeout=self.timeout,
                                                  fuse=False, name=self._name("broadcast"))
            return self._completer.submit(waited(handle, t, self.ranks))
        if self.world:
            handle = self.client.broadcast_async(t.contiguous(), root=root, timeout=self.timeout,
                                                 fuse=False, name=self._name("broadcast"))
            return self._completer.submit(copied_back(handle, t, self.ranks))
        n, me = self.size(), self.rank()
        send = [t.numel() if me == root else 0] * n
        recv = [t.numel() if g == root else 0 for g in range(n)]
        flat = flattened(t).repeat(n) if me == root else \
            torch.empty(0, dtype=t.dtype, device=t.device)
        handle = self._exchange(flat, send, recv, "broadcast")
        return self._completer.submit(copied_back(handle, t))

    def reduce(  # type: ignore[override]
            self, tensors: list[torch.Tensor], opts: ReduceOptions | None = None
    ) -> dist.Work:
        """``reduce`` to group rank ``opts.rootRank`` (the others' tensors stay as they are)."""
        t = single(tensors, "reduce")
        root = opts.rootRank if opts is not None else 0
        op = reduce_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        n, me = self.size(), self.rank()
        send = [t.numel() if g == root else 0 for g in range(n)]
        recv = [t.numel() if me == root else 0] * n
        handle = self._exchange(flattened(t), send, recv, "reduce", op)
        return self._completer.submit(copied_back(handle, t) if me == root else
                                      split_into(handle, []))

    def allgather(  # type: ignore[override]
            self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
            opts: AllgatherOptions | None = None) -> dist.Work:
        """``all_gather``: every member's tensor, in rank order, into ``output_tensors[0]``."""
        t = single(input_tensors, "all_gather")
        outputs = single(output_tensors, "all_gather")
        if len(outputs) != self.size() or any(o.numel() != t.numel() for o in outputs):
            raise ValueError(f"all_gather of a tensor of shape {list(t.shape)}: outputs of "
                             f"shapes {[list(o.shape) for o in outputs]} for {self.size()} "
                             "ranks")
        return self._completer.submit(split_into(self._allgather(t), outputs))

    def all_gather_single(self, output: torch.Tensor, input_tensor: torch.Tensor,
                          opts: AllgatherOptions | None = None) -> dist.Work:
        """``all_gather_into_tensor``: every member's tensor, in rank order, into ``output``."""
        if output.numel() != input_tensor.numel() * self.size():
            raise ValueError(f"all_gather_into_tensor: an output of shape {list(output.shape)} "
                             f"for {self.size()} tensors of shape {list(input_tensor.shape)}")
        return self._completer.submit(copied_back(self._allgather(input_tensor), output))

    def gather(  # type: ignore[override]
            self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
            opts: GatherOptions | None = None) -> dist.Work:
        """``gather``: every member's tensor, in rank order, into the root's list."""
        t = single(input_tensors, "gather")
        root = opts.rootRank if opts is not None else 0
        n, me = self.size(), self.rank()
        outputs = single(output_tensors, "gather") if me == root else []
        send = [t.numel() if g == root else 0 for g in range(n)]
        recv = [t.numel() if me == root else 0] * n
        handle = self._exchange(flattened(t), send, recv, "gather")
        return self._completer.submit(split_into(handle, outputs))

    def scatter(  # type: ignore[override]
            self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
            opts: ScatterOptions | None = None) -> dist.Work:
        """``scatter``: the root's ``i``-th tensor to group rank ``i``."""
        out = single(output_tensors, "scatter")
        root = opts.rootRank if opts is not None else 0
        n, me = self.size(), self.rank()
        if me == root:
            inputs = single(input_tensors, "scatter")
            flat = torch.cat([flattened(x) for x in inputs])
            send = [x.numel() for x in inputs]
        else:
            flat, send = torch.empty(0, dtype=out.dtype, device=out.device), [0] * n
        recv = [out.numel() if g == root else 0 for g in range(n)]
        handle = self._exchange(flat, send, recv, "scatter")
        return self._completer.submit(copied_back(handle, out))

    def reduce_scatter(  # type: ignore[override]
            self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
            opts: ReduceScatterOptions | None = None) -> dist.Work:
        """``reduce_scatter``: group rank ``i`` gets every member's ``i``-th tensor reduced."""
        out = single(output_tensors, "reduce_scatter")
        inputs = single(input_tensors, "reduce_scatter")
        op = reduce_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        n = self.size()
        handle = self._exchange(torch.cat([flattened(x) for x in inputs]),
                                [x.numel() for x in inputs], [out.numel()] * n,
                                "reduce_scatter", op)
        return self._completer.submit(copied_back(handle, out))

    def reduce_scatter_single(self, output: torch.Tensor, input_tensor: torch.Tensor,
                              opts: ReduceScatterOptions | None = None) -> dist.Work:
        """``reduce_scatter_tensor``: group rank ``i`` gets the ``i``-th of ``size`` equal
        slices of every member's ``input_tensor``, reduced."""
        n = self.size()
        if input_tensor.numel() != output.numel() * n:
            raise ValueError(f"reduce_scatter_tensor: an input of shape "
                             f"{list(input_tensor.shape)} for {n} outputs of shape "
                             f"{list(output.shape)}")
        op = reduce_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        handle = self._exchange(flattened(input_tensor), [output.numel()] * n, [output.numel()] * n,
                                "reduce_scatter", op)
        return self._completer.submit(copied_back(handle, output))

    def alltoall(  # type: ignore[override]
            self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
            opts: AllToAllOptions | None = None) -> dist.Work:
        """``all_to_all``: this rank's ``j``-th tensor to group rank ``j``, whose ``i``-th
        output is rank ``i``'s."""
        handle = self._exchange(torch.cat([flattened(x) for x in input_tensors]),
                                [x.numel() for x in input_tensors],
                                [x.numel() for x in output_tensors], "alltoall")
        return self._completer.submit(split_into(handle, output_tensors))

    def all_to_all_single(  # type: ignore[override]
            self, output: torch.Tensor, input_tensor: torch.Tensor,
            output_split_sizes: list[int], input_split_sizes: list[int],
            opts: AllToAllOptions | None = None) -> dist.Work:
        """``all_to_all_single``: slices of the first dimension (equal, or the split sizes)."""
        n = self.size()
        row_in = input_tensor[0].numel() if input_tensor.dim() and input_tensor.shape[0] else 0
        row_out = output[0].numel() if output.dim() and output.shape[0] else 0
        send = [s * row_in for s in input_split_sizes] or [input_tensor.numel() // n] * n
        recv = [s * row_out for s in output_split_sizes] or [output.numel() // n] * n
        handle = self._exchange(flattened(input_tensor), send, recv, "alltoall")
        return self._completer.submit(copied_back(handle, output))

    def barrier(  # type: ignore[override]
            self, opts: dist.BarrierOptions | None = None) -> dist.Work:
        """``barrier``: every member has reached it."""
        if not self.world:
            handle = self._to_all(torch.zeros(1, dtype=torch.uint8), "barrier")
            return self._completer.submit(split_into(handle, []))
        joined = self.client.calls.barrier(name=self._name("barrier"), timeout=self.timeout)

        def end() -> list[torch.Tensor]:
            joined.join()
            whole(joined, self.ranks)
            return []
        return self._completer.submit(Ending(end, joined))

    # ------------------------------------------------------------------ point to point

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> dist.Work:
        """``send``/``isend`` to group rank ``dstRank``: its ``recv`` with the same tag takes
        it (sends with one tag arrive in order)."""
        t = single(tensors, "send")
        send = [t.numel() if g == dstRank else 0 for g in range(self.size())]
        handle = self._exchange(flattened(t), send, [0] * self.size(),
                                f"p2p.{self.rank()}.{dstRank}.{tag}", pair=True)
        return self._completer.submit(split_into(handle, []))

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> dist.Work:
        """``recv``/``irecv`` from group rank ``srcRank``, into the tensor."""
        t = single(tensors, "recv")
        recv = [t.numel() if g == srcRank else 0 for g in range(self.size())]
        empty = torch.empty(0, dtype=t.dtype, device=t.device)
        handle = self._exchange(empty, [0] * self.size(), recv,
                                f"p2p.{srcRank}.{self.rank()}.{tag}", pair=True)
        return self._completer.submit(copied_back(handle, t))

    def shutdown(self) -> None:
        """End the ops started, and let go of the client (``destroy_process_group``)."""
        self._completer.close()
        SHARED.give_back()


def create(options: Any, backend_options: Any = None) -> DecentProcessGroup:
    """torch's creator of a ``decent`` process group (extended API: the group's global ranks
    come with it): a group over this process's client of its node's daemon."""
    del backend_options  # decent's daemons know their peers: no rendezvous through torch's store
    client, new = SHARED.take(lambda n: job_of(options.store, options.group_rank, n))
    try:
        return DecentProcessGroup(client, options.group_rank, options.group_size,
                                  options.timeout, list(options.global_ranks_in_group),
                                  str(options.group_id), default=new)
    except BaseException:
        SHARED.give_back()
        raise


def job_of(store: dist.Store, rank: int, generation: int) -> str:
    """The decent job of this process's ``generation``-th default group: one of its own
    (drawn by rank 0 and passed on through torch's store, under a key of that generation: the
    store may still hold the last one's), so that a process group made again after
    ``destroy_process_group`` starts afresh, as torch's do: rounds from 0, and no rank counted
    as one that left. Under ``$DECENT_JOB``, within that job's name."""
    key = f"{JOB_KEY}/{generation}"
    if rank == 0:
        store.set(key, f"torch-{uuid.uuid4().hex[:12]}")
    job = store.get(key).decode()
    base = os.environ.get("DECENT_JOB", "")
    return f"{base}.{job}" if base else job


def register() -> None:
    """Make ``"decent"`` a backend of torch.distributed, for CPU and CUDA tensors (staged
    through host memory, as the client stages them); once per process."""
    if BACKEND.upper() not in dist.Backend._plugins:  # torch keeps no public list
        dist.Backend.register_backend(BACKEND, create, extended_api=True,
                                      devices=["cpu", "cuda"])
