"""Module-level shortcuts (``decent.torch.neighbor_allreduce(t)``, ...) over a default client.

Each framework module has one :class:`DefaultClient` and exports its :meth:`shortcuts`: every
op method of the op table (``decent_wire.ops``), the client's queries and topology and window
methods (:data:`CLIENT_METHODS`), its rank attributes as functions (:data:`CLIENT_ATTRIBUTES`),
BlueFog's peer-inference helpers, and ``init``/``shutdown``. Nothing is forwarded by hand.

The first client a process connects becomes its default (as Horovod's and BlueFog's single
``init``): ``c = dt.connect()`` followed by ``dt.DecentralizedOptimizer(opt, model)`` runs both
on ``c``; ``init()`` connects one only when the process has none.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from decent.core.requests.handles import Handle
from decent.core.surface.adjoints import GRADIENT_RULE
from decent.core.surface.client import Client
from decent.core.surface.topology_ops import infer_peers
from decent_wire.ops import USER_OPS

T = TypeVar("T")
C = TypeVar("C", bound=Client[Any])

#: the client's attributes a module exports as functions (``dt.rank()``)
CLIENT_ATTRIBUTES = ("rank", "size", "local_rank", "local_size", "machine_rank",
                     "machine_size")
#: the client's methods a module exports besides the op methods
CLIENT_METHODS = ("set_topology", "load_topology", "is_topo_weighted", "in_neighbor_ranks",
                  "out_neighbor_ranks", "window_names", "win_associated_p", "win_mutex",
                  "win_free", "win_info", "win_versions", "flush", "fused", "in_neighbors",
                  "out_neighbors", "status")
#: BlueFog's helpers that find which ranks name this one (collective)
INFERENCE = ("InferDestinationFromSourceRanks", "InferSourceFromDestinationRanks")
#: every op method of the op table
OP_METHODS = tuple(name for op in USER_OPS for name in op.methods)
#: every name a framework module exports from its default client
SHORTCUTS = ("init", "shutdown", *CLIENT_ATTRIBUTES, *CLIENT_METHODS, *OP_METHODS, *INFERENCE)


def _guarded(op: Any) -> bool:
    """Whether the ops of ``op``'s methods name tensors Horovod-style: an optional ``name``
    (one op per name at a time); window ops name their window instead."""
    return op.name not in ("barrier",) and not op.name.startswith(("win_", "group_"))


#: the op methods Horovod's one-op-per-name rule applies to
GUARDED = frozenset(name for op in USER_OPS if _guarded(op) for name in op.methods)


class DefaultClient(Generic[T, C]):
    """The default client (a ``C`` of tensors ``T``) of a framework module (``decent.torch``,
    ``decent.tf``)."""

    def __init__(self, module: str, connect: Callable[[str | None], C]) -> None:
        self.module = module
        self._connect = connect
        self.client: C | None = None
        self._lock = threading.RLock()  # init() connects, and connect() adopts
        #: the handles of asynchronous ops by name (weakly: a result is not kept alive here)
        self._in_flight: dict[str, weakref.ref[Handle[Any]]] = {}

    def init(self, address: str | None = None) -> C:
        """The default client the module-level functions use: the first one this process
        connected, else a new one (connected to ``address``)."""
        with self._lock:
            if self.client is None or self.client.closed:
                self.client = self._connect(address)
            return self.client

    def adopt(self, client: C) -> None:
        """Make ``client`` the default unless the process has an open one already (the
        adapters' ``connect()`` calls this for every client it makes)."""
        with self._lock:
            if self.client is None or self.client.closed:
                self.client = client

    def get(self) -> C:
        """The default client; RuntimeError before ``init()``."""
        client = self.client
        if client is None or client.closed:
            raise RuntimeError(f"{self.module} is not initialized: call {self.module}.init() "
                               "first")
        return client

    def shutdown(self) -> None:
        """Close the default client."""
        with self._lock:
            client, self.client = self.client, None
        if client is not None:
            client.close()

    def _refuse_duplicate(self, op: str, name: str | None) -> None:
        """Horovod's rule for its API (this module used as ``hvd``): ValueError while an op of
        ``name`` has not been synchronized (its handle waited for, or dropped), even when it
        has completed (a ``Client`` runs it as the name's next round instead)."""
        if name is None:
            return
        ref = self._in_flight.get(name)
        handle = ref() if ref is not None else None
        if handle is None or handle.pending.waited:
            self._in_flight.pop(name, None)
            return
        raise ValueError(f"{op} '{name}': an op of this name has not been synchronized on rank "
                         f"{self.get().rank}; synchronize (wait for) its handle first (Horovod "
                         "reserves a name until then; decent.core.Client runs it as the name's "
                         "next round)")

    def _method(self, method: str) -> Callable[..., Any]:
        """The module function for the client method ``method``."""
        guarded = method in GUARDED

        def shortcut(*args: Any, **kwargs: Any) -> Any:
            name = kwargs.get("name") if guarded else None
            self._refuse_duplicate(method, name)
            rule = GRADIENT_RULE.set("average")  # Horovod's gradients (adjoints.GRADIENT_RULE)
            try:
                result = getattr(self.get(), method)(*args, **kwargs)
            finally:
                GRADIENT_RULE.reset(rule)
            if name is not None and isinstance(result, Handle):
                self._in_flight[name] = weakref.ref(result)
            return result

        return functools.update_wrapper(shortcut, getattr(Client, method))

    def _attribute(self, attribute: str) -> Callable[[], Any]:
        """The module function returning the client's ``attribute``."""

        def shortcut() -> Any:
            return getattr(self.get(), attribute)

        shortcut.__name__ = shortcut.__qualname__ = attribute
        shortcut.__doc__ = f"The default client's ``{attribute}``."
        return shortcut

    def _inference(self, given: str) -> Callable[..., Any]:
        def shortcut(ranks: Sequence[int], construct_adjacency_matrix: bool = False) -> Any:
            return infer_peers(self.get(), ranks, given, construct_adjacency_matrix)

        shortcut.__doc__ = (f"BlueFog's helper: the ranks that list this rank as a "
                            f"{'source' if given == 'src' else 'destination'} (collective).")
        return shortcut

    def shortcuts(self) -> dict[str, Callable[..., Any]]:
        """Every module-level function, by name (:data:`SHORTCUTS`)."""
        out: dict[str, Callable[..., Any]] = {"init": self.init, "shutdown": self.shutdown}
        out.update({a: self._attribute(a) for a in CLIENT_ATTRIBUTES})
        out.update({m: self._method(m) for m in (*CLIENT_METHODS, *OP_METHODS)})
        out["InferDestinationFromSourceRanks"] = self._inference("src")
        out["InferSourceFromDestinationRanks"] = self._inference("dst")
        return out
