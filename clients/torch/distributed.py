"""torch.distributed's ``decent`` backend: a script switches from gloo with one changed string.

    import decent.torch  # registers the backend
    dist.init_process_group("decent")          # RANK, WORLD_SIZE, MASTER_ADDR/PORT as for gloo
    dist.all_reduce(t)                         # through this node's daemon

Each rank's process group is a client of its node's daemon (``$DECENT_DAEMON``, else the
default socket; the local rank from ``$LOCAL_RANK``, which torchrun and decentrun set), so the
collectives run on decent's data path, with its security, faults handling and metrics; torch's
own store is only used by torch itself. The ranks of the process group must be the clients'
ranks (the daemons number the workers node by node, as torchrun and decentrun do).

Covered so far (issue 43 goes on): ``all_reduce`` with SUM and AVG, ``broadcast``,
``all_gather``, ``all_gather_into_tensor`` and ``barrier``, blocking and with
``async_op=True``; the Work objects' ``wait()``, ``is_completed()`` and ``get_future()``. Each
op's inputs may be non-contiguous (a contiguous copy is sent, the result copied back). A
collective the backend does not run yet, another reduce op, or a subgroup raises
NotImplementedError naming it; a failed op raises ``torch.distributed.DistBackendError`` with
decent's message.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# torch's stubs give ProcessGroup's methods other overloads than a Python process group
# implements (torch's own multi-threaded one does the same)
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, BroadcastOptions

from decent.core import DecentError, Handle
from decent.torch.client import TorchClient, connect

#: the backend's name in ``init_process_group``
BACKEND = "decent"

#: torch's reduce ops that decent's allreduce runs, and its name for each
REDUCE_OPS = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "average"))

#: an op's ending: wait for it, copy its result where torch wants it, give its outputs
Ending = Callable[[], list[torch.Tensor]]


def reduce_name(op: Any) -> str:
    """decent's name of torch's reduce op ``op``; NotImplementedError for the others."""
    for torch_op, name in REDUCE_OPS:
        if op == torch_op:
            return name
    raise NotImplementedError(f"the decent backend reduces with SUM and AVG only, not {op}")


class DecentWork(dist.Work):
    """An op of the process group: done when its future is (the op's error, raised by
    ``wait()``, is a ``DistBackendError`` with decent's message)."""

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        super().__init__()
        self.future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the op ends (the op's own timeout, the process group's, bounds it);
        True, or its error."""
        del timeout  # every op already carries the process group's timeout
        self.future.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the op ended (successfully or not)."""
        return self.future.done()

    def get_future(self) -> torch.futures.Future[Any]:
        """The op's outputs, once it ends."""
        return self.future


class Completer:
    """Ends the ops of one process group on a thread of its own, in the order they were
    started, and completes each op's future: a Work completes without anyone waiting on it
    (DDP's hooks chain on ``get_future()``)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Ending, torch.futures.Future[Any]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name="decent-process-group",
                                        daemon=True)
        self._thread.start()

    def submit(self, ending: Ending) -> dist.Work:
        """A Work completed with ``ending()``'s outputs (or failed with its error)."""
        future: torch.futures.Future[Any] = torch.futures.Future()
        self._queue.put((ending, future))
        return DecentWork(future)

    def close(self) -> None:
        """End the ops submitted so far, then the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            ending, future = item
            try:
                future.set_result(ending())
            except DecentError as exc:
                future.set_exception(dist.DistBackendError(str(exc)))
            except Exception as exc:  # a bug here fails that op, not the thread
                future.set_exception(exc)


def _single(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    """The one tensor of a per-device list (one device per process)."""
    if len(tensors) != 1:
        raise NotImplementedError(f"the decent backend's {what} takes one tensor per process, "
                                  f"not {len(tensors)}")
    return tensors[0]


def _copied_back(handle: Handle[torch.Tensor], into: torch.Tensor) -> Ending:
    """The ending of an op whose result goes into ``into``."""
    def end() -> list[torch.Tensor]:
        into.copy_(handle.wait())
        return [into]
    return end


class DecentProcessGroup(dist.ProcessGroup):
    """One rank's process group over its client of the node's daemon."""

    def __init__(self, client: TorchClient, rank: int, size: int, timeout: timedelta) -> None:
        if (client.rank, client.size) != (rank, size):
            raise ValueError(
                f"torch.distributed says rank {rank} of {size}, but this process's decent "
                f"client is rank {client.rank} of {client.size} (its daemon numbers the workers "
                "node by node: set RANK and WORLD_SIZE as decentrun or torchrun do, with "
                "LOCAL_RANK the rank on the node)")
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.client = client
        self.timeout = timeout.total_seconds()
        self._completer = Completer()

    def getBackendName(self) -> str:
        """``decent``."""
        return BACKEND

    def allreduce(  # type: ignore[override]
            self, tensors: list[torch.Tensor], opts: AllreduceOptions | None = None
    ) -> dist.Work:
        """``all_reduce``: SUM or AVG over every rank, in place."""
        t = _single(tensors, "all_reduce")
        op = reduce_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        handle = self.client.allreduce_async(t.contiguous(), op=op, timeout=self.timeout)
        return self._completer.submit(_copied_back(handle, t))

    def broadcast(  # type: ignore[override]
            self, tensors: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> dist.Work:
        """``broadcast`` from ``opts.rootRank``, in place."""
        t = _single(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        handle = self.client.broadcast_async(t.contiguous(), root=root, timeout=self.timeout)
        return self._completer.submit(_copied_back(handle, t))

    def allgather(  # type: ignore[override]
            self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
            opts: AllgatherOptions | None = None) -> dist.Work:
        """``all_gather``: every rank's tensor, in rank order, into ``output_tensors[0]``."""
        t = _single(input_tensors, "all_gather")
        outputs = _single(output_tensors, "all_gather")  # type: ignore[arg-type]
        if len(outputs) != self.size():
            raise ValueError(f"all_gather of a tensor of shape {list(t.shape)}: "
                             f"{len(outputs)} outputs for {self.size()} ranks")
        handle = self.client.allgather_async(t.contiguous(), timeout=self.timeout)

        def end() -> list[torch.Tensor]:
            got = handle.wait().reshape(self.size(), *t.shape)
            for out, part in zip(outputs, got, strict=True):
                out.copy_(part)
            return list(outputs)
        return self._completer.submit(end)

    def all_gather_single(self, output: torch.Tensor, input_tensor: torch.Tensor,
                          opts: AllgatherOptions | None = None) -> dist.Work:
        """``all_gather_into_tensor``: every rank's tensor, in rank order, into ``output``."""
        if output.numel() != input_tensor.numel() * self.size():
            raise ValueError(f"all_gather_into_tensor: an output of shape {list(output.shape)} "
                             f"for {self.size()} tensors of shape {list(input_tensor.shape)}")
        handle = self.client.allgather_async(input_tensor.contiguous(), timeout=self.timeout)

        def end() -> list[torch.Tensor]:
            output.copy_(handle.wait().reshape(output.shape))
            return [output]
        return self._completer.submit(end)

    def barrier(  # type: ignore[override]
            self, opts: dist.BarrierOptions | None = None) -> dist.Work:
        """``barrier``: every rank has reached it."""
        handle = self.client.calls.barrier(timeout=self.timeout)

        def end() -> list[torch.Tensor]:
            handle.join()
            return []
        return self._completer.submit(end)

    def shutdown(self) -> None:
        """End the ops started, and close the client (``destroy_process_group``)."""
        self._completer.close()
        self.client.close()


def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> DecentProcessGroup:
    """torch's creator of a ``decent`` process group: a client of this node's daemon."""
    del store  # decent's daemons know their peers: no rendezvous through torch's store
    return DecentProcessGroup(connect(), rank, size, timeout)


def register() -> None:
    """Make ``"decent"`` a backend of torch.distributed (for CPU tensors; once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:  # torch keeps no public list
        dist.Backend.register_backend(BACKEND, create, devices=["cpu"])
