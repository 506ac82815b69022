"""Module-level shortcuts (``decent.torch.neighbor_allreduce(t)``, ...) over a default client.

Each framework module makes one :class:`DefaultClient` and exports its methods under the same
names: ``init()`` creates the client, the op functions call it, ``shutdown()`` closes it. The
ops are written once here, for every adapter.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

import networkx as nx

from decent.core.requests.handles import Handle
from decent.core.surface.client import Client
from decent.core.surface.topology_ops import infer_peers
from decent.core.surface.window_ops import WindowState
from decent_wire.v1 import decent_pb2 as pb

T = TypeVar("T")
C = TypeVar("C", bound=Client[Any])


#: the names a framework module exports from its :class:`DefaultClient` (``decent.torch``,
#: ``decent.tf``), for their ``__all__``
SHORTCUTS = (
    "init", "shutdown", "rank", "size", "local_rank", "local_size", "allgather_async",
    "allgather", "set_topology", "load_topology", "is_topo_weighted", "in_neighbor_ranks",
    "out_neighbor_ranks", "InferDestinationFromSourceRanks", "InferSourceFromDestinationRanks",
    "window_names", "win_associated_p", "win_mutex",
    "neighbor_allreduce_async", "neighbor_allreduce", "neighbor_allreduce_async_",
    "neighbor_allreduce_", "compressed_neighbor_allreduce_async", "compressed_neighbor_allreduce",
    "neighbor_allgather_async", "neighbor_allgather", "allreduce_async", "allreduce",
    "allreduce_async_", "allreduce_", "broadcast_async", "broadcast", "broadcast_async_",
    "broadcast_", "barrier", "flush", "fused", "in_neighbors", "out_neighbors", "win_create",
    "win_put_async", "win_put", "win_accumulate_async", "win_accumulate", "win_get_async",
    "win_get", "win_update", "win_publish", "win_free", "win_info", "win_versions",
    "win_exchange_async", "win_exchange", "win_add", "group_allreduce_async", "group_allreduce",
    "machine_rank", "machine_size", "hierarchical_neighbor_allreduce_async",
    "hierarchical_neighbor_allreduce", "hierarchical_neighbor_allreduce_async_",
    "hierarchical_neighbor_allreduce_",
)


class DefaultClient(Generic[T, C]):
    """The default client (a ``C`` of tensors ``T``) of a framework module (``decent.torch``,
    ``decent.tf``)."""

    def __init__(self, module: str, connect: Callable[[str | None], C]) -> None:
        self.module = module
        self._connect = connect
        self.client: C | None = None
        #: the handles of asynchronous ops by name (weakly: a result is not kept alive here)
        self._in_flight: dict[str, weakref.ref[Handle[Any]]] = {}

    def init(self, address: str | None = None) -> C:
        """Create (once) the default client the module-level functions use, and return it."""
        if self.client is None:
            self.client = self._connect(address)
        return self.client

    def _guarded(self, start: Callable[..., Handle[T]], tensor: T, *args: Any,
                 **kwargs: Any) -> Handle[T]:
        """``start(tensor, ...)``, refused while an op of the same ``name`` is in flight."""
        name = kwargs.get("name")
        self._refuse_duplicate(start.__name__, name)
        handle = start(tensor, *args, **kwargs)
        if name is not None:
            self._in_flight[name] = weakref.ref(handle)
        return handle

    def _refuse_duplicate(self, op: str, name: str | None) -> None:
        """Horovod's rule for its API (this module used as ``hvd``): ValueError while an op of
        ``name`` is in flight (a ``Client`` queues it as the name's next round instead)."""
        if name is None:
            return
        ref = self._in_flight.get(name)
        handle = ref() if ref is not None else None
        if handle is None or handle.done():
            self._in_flight.pop(name, None)
            return
        raise ValueError(f"{op} '{name}': an op of this name is still in flight on rank "
                         f"{self.get().rank}; wait for it first (Horovod allows one op per name "
                         "at a time; decent.core.Client runs it as the name's next round)")

    def get(self) -> C:
        """The default client; RuntimeError before ``init()``."""
        if self.client is None:
            raise RuntimeError(f"{self.module} is not initialized: call {self.module}.init() "
                               "first")
        return self.client

    def shutdown(self) -> None:
        """Close the default client."""
        if self.client is not None:
            self.client.close()
            self.client = None

    def rank(self) -> int:
        """This worker's rank."""
        return self.get().rank

    def size(self) -> int:
        """Number of workers."""
        return self.get().size

    def local_rank(self) -> int:
        """This worker's rank among the workers of its node."""
        return self.get().local_rank

    def local_size(self) -> int:
        """Number of workers on this node."""
        return self.get().local_size

    def machine_rank(self) -> int:
        """This worker's daemon (node) among the daemons."""
        return self.get().machine_rank

    def machine_size(self) -> int:
        """How many daemons (nodes) there are."""
        return self.get().machine_size

    def hierarchical_neighbor_allreduce_async(self, tensor: T, **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.hierarchical_neighbor_allreduce_async`."""
        return self._guarded(self.get().hierarchical_neighbor_allreduce_async, tensor, **kwargs)

    def hierarchical_neighbor_allreduce(self, tensor: T, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.hierarchical_neighbor_allreduce`."""
        self._refuse_duplicate("hierarchical_neighbor_allreduce", kwargs.get("name"))
        return self.get().hierarchical_neighbor_allreduce(tensor, **kwargs)

    def hierarchical_neighbor_allreduce_async_(self, tensor: T, **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.hierarchical_neighbor_allreduce_async_`."""
        return self._guarded(self.get().hierarchical_neighbor_allreduce_async_, tensor, **kwargs)

    def hierarchical_neighbor_allreduce_(self, tensor: T, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.hierarchical_neighbor_allreduce_`."""
        self._refuse_duplicate("hierarchical_neighbor_allreduce_", kwargs.get("name"))
        return self.get().hierarchical_neighbor_allreduce_(tensor, **kwargs)

    # ------------------------------------------------------------------ topology

    def set_topology(self, topology: Any = None, is_weighted: bool = False) -> bool:
        """See :meth:`decent.core.Client.set_topology`."""
        return self.get().set_topology(topology, is_weighted)

    def load_topology(self) -> nx.DiGraph:
        """See :meth:`decent.core.Client.load_topology`."""
        return self.get().load_topology()

    def is_topo_weighted(self) -> bool:
        """See :meth:`decent.core.Client.is_topo_weighted`."""
        return self.get().is_topo_weighted()

    def in_neighbor_ranks(self) -> list[int]:
        """See :meth:`decent.core.Client.in_neighbor_ranks`."""
        return self.get().in_neighbor_ranks()

    def out_neighbor_ranks(self) -> list[int]:
        """See :meth:`decent.core.Client.out_neighbor_ranks`."""
        return self.get().out_neighbor_ranks()

    def InferDestinationFromSourceRanks(
            self, src_ranks: Sequence[int], construct_adjacency_matrix: bool = False) -> Any:
        """BlueFog's helper: the ranks that list this rank as a source (collective)."""
        return infer_peers(self.get(), src_ranks, "src", construct_adjacency_matrix)

    def InferSourceFromDestinationRanks(
            self, dst_ranks: Sequence[int], construct_adjacency_matrix: bool = False) -> Any:
        """BlueFog's helper: the ranks that list this rank as a destination (collective)."""
        return infer_peers(self.get(), dst_ranks, "dst", construct_adjacency_matrix)

    # ------------------------------------------------------------------ ops

    def neighbor_allreduce_async(self, tensor: T, *args: Any, **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.neighbor_allreduce_async`."""
        return self._guarded(self.get().neighbor_allreduce_async, tensor, *args, **kwargs)

    def neighbor_allreduce(self, tensor: T, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.neighbor_allreduce`."""
        self._refuse_duplicate("neighbor_allreduce", kwargs.get("name"))
        return self.get().neighbor_allreduce(tensor, **kwargs)

    def neighbor_allreduce_async_(self, tensor: T, *args: Any, **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.neighbor_allreduce_async_`."""
        return self._guarded(self.get().neighbor_allreduce_async_, tensor, *args, **kwargs)

    def neighbor_allreduce_(self, tensor: T, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.neighbor_allreduce_`."""
        self._refuse_duplicate("neighbor_allreduce_", kwargs.get("name"))
        return self.get().neighbor_allreduce_(tensor, **kwargs)

    def compressed_neighbor_allreduce_async(self, tensor: T, compressor: str, *args: Any,
                                            **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.compressed_neighbor_allreduce_async`."""
        return self._guarded(self.get().compressed_neighbor_allreduce_async, tensor, compressor,
                             *args, **kwargs)

    def compressed_neighbor_allreduce(self, tensor: T, compressor: str, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.compressed_neighbor_allreduce`."""
        self._refuse_duplicate("compressed_neighbor_allreduce", kwargs.get("name"))
        return self.get().compressed_neighbor_allreduce(tensor, compressor, **kwargs)

    def neighbor_allgather_async(self, tensor: T, *args: Any, **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.neighbor_allgather_async`."""
        return self._guarded(self.get().neighbor_allgather_async, tensor, *args, **kwargs)

    def neighbor_allgather(self, tensor: T, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.neighbor_allgather`."""
        self._refuse_duplicate("neighbor_allgather", kwargs.get("name"))
        return self.get().neighbor_allgather(tensor, **kwargs)

    def allgather_async(self, tensor: T, *args: Any, **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.allgather_async`."""
        return self._guarded(self.get().allgather_async, tensor, *args, **kwargs)

    def allgather(self, tensor: T, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.allgather`."""
        self._refuse_duplicate("allgather", kwargs.get("name"))
        return self.get().allgather(tensor, **kwargs)

    def allreduce_async(self, tensor: T, *args: Any, **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.allreduce_async`."""
        return self._guarded(self.get().allreduce_async, tensor, *args, **kwargs)

    def allreduce(self, tensor: T, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.allreduce`."""
        self._refuse_duplicate("allreduce", kwargs.get("name"))
        return self.get().allreduce(tensor, **kwargs)

    def allreduce_async_(self, tensor: T, *args: Any, **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.allreduce_async_`."""
        return self._guarded(self.get().allreduce_async_, tensor, *args, **kwargs)

    def allreduce_(self, tensor: T, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.allreduce_`."""
        self._refuse_duplicate("allreduce_", kwargs.get("name"))
        return self.get().allreduce_(tensor, **kwargs)

    def broadcast_async(self, tensor: T, *args: Any, **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.broadcast_async`."""
        return self._guarded(self.get().broadcast_async, tensor, *args, **kwargs)

    def broadcast(self, tensor: T, *args: Any, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.broadcast`."""
        self._refuse_duplicate("broadcast", kwargs.get("name"))
        return self.get().broadcast(tensor, *args, **kwargs)

    def broadcast_async_(self, tensor: T, *args: Any, **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.broadcast_async_`."""
        return self._guarded(self.get().broadcast_async_, tensor, *args, **kwargs)

    def broadcast_(self, tensor: T, *args: Any, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.broadcast_`."""
        self._refuse_duplicate("broadcast_", kwargs.get("name"))
        return self.get().broadcast_(tensor, *args, **kwargs)

    def barrier(self, name: str | None = None, timeout: float | None = None) -> None:
        """See :meth:`decent.core.Client.barrier`."""
        self.get().barrier(name=name, timeout=timeout)

    def flush(self) -> None:
        """See :meth:`decent.core.Client.flush`."""
        self.get().flush()

    def fused(self) -> AbstractContextManager[None]:
        """See :meth:`decent.core.Client.fused`."""
        return self.get().fused()

    def in_neighbors(self, name: str | None = None) -> list[int]:
        """See :meth:`decent.core.Client.in_neighbors`."""
        return self.get().in_neighbors(name)

    def out_neighbors(self, name: str | None = None) -> list[int]:
        """See :meth:`decent.core.Client.out_neighbors`."""
        return self.get().out_neighbors(name)

    def status(self) -> pb.StatusReply:
        """See :meth:`decent.core.Client.status`."""
        return self.get().status()

    # ------------------------------------------------------------------ windows

    def win_create(self, tensor: T, name: str, zero_init: bool = False) -> bool:
        """See :meth:`decent.core.Client.win_create`."""
        return self.get().win_create(tensor, name, zero_init)

    def win_put_async(self, tensor: T, name: str, *args: Any, **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.win_put_async`."""
        return self.get().win_put_async(tensor, name, *args, **kwargs)

    def win_put(self, tensor: T, name: str, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.win_put`."""
        return self.get().win_put(tensor, name, **kwargs)

    def win_accumulate_async(self, tensor: T, name: str, *args: Any,
                             **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.win_accumulate_async`."""
        return self.get().win_accumulate_async(tensor, name, *args, **kwargs)

    def win_accumulate(self, tensor: T, name: str, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.win_accumulate`."""
        return self.get().win_accumulate(tensor, name, **kwargs)

    def win_get_async(self, name: str, *args: Any, **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.win_get_async`."""
        return self.get().win_get_async(name, *args, **kwargs)

    def win_get(self, name: str, **kwargs: Any) -> None:
        """See :meth:`decent.core.Client.win_get`."""
        self.get().win_get(name, **kwargs)

    def win_update(self, name: str, *args: Any, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.win_update`."""
        return self.get().win_update(name, *args, **kwargs)

    def win_publish(self, tensor: T, name: str, step: int = 0) -> None:
        """See :meth:`decent.core.Client.win_publish`."""
        self.get().win_publish(tensor, name, step)

    def win_free(self, name: str) -> None:
        """See :meth:`decent.core.Client.win_free`."""
        self.get().win_free(name)

    def win_exchange_async(self, tensor: T, name: str, peer: int, *args: Any,
                           **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.win_exchange_async`."""
        return self.get().win_exchange_async(tensor, name, peer, *args, **kwargs)

    def win_exchange(self, tensor: T, name: str, peer: int, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.win_exchange`."""
        return self.get().win_exchange(tensor, name, peer, **kwargs)

    def win_add(self, tensor: T, name: str, *args: Any, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.win_add`."""
        return self.get().win_add(tensor, name, *args, **kwargs)

    def group_allreduce_async(self, tensor: T, name: str, group_size: int, *args: Any,
                              **kwargs: Any) -> Handle[T]:
        """See :meth:`decent.core.Client.group_allreduce_async`."""
        return self.get().group_allreduce_async(tensor, name, group_size, *args, **kwargs)

    def group_allreduce(self, tensor: T, name: str, group_size: int, **kwargs: Any) -> T:
        """See :meth:`decent.core.Client.group_allreduce`."""
        return self.get().group_allreduce(tensor, name, group_size, **kwargs)

    def win_info(self, name: str) -> WindowState:
        """See :meth:`decent.core.Client.win_info`."""
        return self.get().win_info(name)

    def win_versions(self, name: str) -> dict[int, int]:
        """See :meth:`decent.core.Client.win_versions`."""
        return self.get().win_versions(name)

    def window_names(self) -> list[str]:
        """See :meth:`decent.core.Client.window_names`."""
        return self.get().window_names()

    def win_associated_p(self, name: str) -> float:
        """See :meth:`decent.core.Client.win_associated_p`."""
        return self.get().win_associated_p(name)

    def win_mutex(self, name: str, for_self: bool = False,
                  ranks: Iterable[int] | None = None) -> AbstractContextManager[None]:
        """See :meth:`decent.core.Client.win_mutex`."""
        return self.get().win_mutex(name, for_self, ranks)
