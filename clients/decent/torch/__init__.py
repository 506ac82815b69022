"""PyTorch client of decent.

    import decent.torch as dt
    client = dt.connect()                      # $DECENT_DAEMON, else the default socket
    h = client.neighbor_allreduce_async(t)     # returns at once
    t_avg = h.wait()                           # same shape, dtype and device as t

Module-level shortcuts (``dt.init()``, ``dt.neighbor_allreduce_async(t)``, ...) use one default
client per process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from decent.core import Client, DecentError, Handle
from decent.core.algorithms import ALGORITHMS, AlgorithmError
from decent.torch.codec import TorchCodec
from decent.torch.optim import (
    DecentralizedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
    consensus,
)

__all__ = [
    "ALGORITHMS",
    "AlgorithmError",
    "Client",
    "DecentError",
    "DecentralizedOptimizer",
    "Handle",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "compressed_neighbor_allreduce",
    "compressed_neighbor_allreduce_async",
    "connect",
    "consensus",
    "flush",
    "group_allreduce",
    "group_allreduce_async",
    "in_neighbors",
    "init",
    "neighbor_allgather",
    "neighbor_allgather_async",
    "neighbor_allreduce",
    "neighbor_allreduce_",
    "neighbor_allreduce_async",
    "neighbor_allreduce_async_",
    "out_neighbors",
    "rank",
    "shutdown",
    "size",
    "win_accumulate",
    "win_accumulate_async",
    "win_add",
    "win_create",
    "win_exchange",
    "win_exchange_async",
    "win_free",
    "win_get",
    "win_get_async",
    "win_info",
    "win_publish",
    "win_put",
    "win_put_async",
    "win_update",
    "win_versions",
]

TorchClient = Client[torch.Tensor]
_default: TorchClient | None = None


def connect(address: str | None = None, connect_timeout: float = 120.0,
            job: str | None = None, fusion_threshold: int | None = None,
            cycle_time: float | None = None, register: bool | None = None) -> TorchClient:
    """A new client of the local daemon (address: $DECENT_DAEMON, else the default socket).

    ``job`` (default $DECENT_JOB) keeps jobs sharing long-lived daemons apart;
    ``fusion_threshold`` (bytes, 0: off) and ``cycle_time`` (seconds) tune tensor fusion;
    ``register=False`` (or $DECENT_REGISTER=0) keeps in-place ops copying tensors instead of
    moving them into shared memory registered with the daemon.
    """
    return Client(TorchCodec(), address, connect_timeout, job, fusion_threshold, cycle_time,
                  register)


def init(address: str | None = None) -> TorchClient:
    """Create (once) the default client the module-level functions use, and return it."""
    global _default
    if _default is None:
        _default = connect(address)
    return _default


def _client() -> TorchClient:
    if _default is None:
        raise RuntimeError("decent.torch is not initialized: call decent.torch.init() first")
    return _default


def shutdown() -> None:
    """Close the default client."""
    global _default
    if _default is not None:
        _default.close()
        _default = None


def rank() -> int:
    """This worker's rank."""
    return _client().rank


def size() -> int:
    """Number of workers."""
    return _client().size


def neighbor_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    self_weight: float | None = None,
    src_weights: Mapping[int, float] | None = None,
    dst_weights: Mapping[int, float] | Iterable[int] | None = None,
    timeout: float | None = None,
) -> Handle[torch.Tensor]:
    """See :meth:`decent.core.Client.neighbor_allreduce_async`."""
    return _client().neighbor_allreduce_async(
        tensor, name=name, self_weight=self_weight, src_weights=src_weights,
        dst_weights=dst_weights, timeout=timeout,
    )


def neighbor_allreduce(tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Blocking neighbor averaging."""
    return _client().neighbor_allreduce(tensor, **kwargs)


def compressed_neighbor_allreduce_async(tensor: torch.Tensor, compressor: str, **kwargs: Any
                                        ) -> Handle[torch.Tensor]:
    """See :meth:`decent.core.Client.compressed_neighbor_allreduce_async`."""
    return _client().compressed_neighbor_allreduce_async(tensor, compressor, **kwargs)


def compressed_neighbor_allreduce(tensor: torch.Tensor, compressor: str, **kwargs: Any
                                  ) -> torch.Tensor:
    """Blocking compressed neighbor averaging: ``[mixed, own] = result``."""
    return _client().compressed_neighbor_allreduce(tensor, compressor, **kwargs)


def neighbor_allgather_async(tensor: torch.Tensor, **kwargs: Any) -> Handle[torch.Tensor]:
    """See :meth:`decent.core.Client.neighbor_allgather_async`."""
    return _client().neighbor_allgather_async(tensor, **kwargs)


def neighbor_allgather(tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Blocking neighbor allgather."""
    return _client().neighbor_allgather(tensor, **kwargs)


def allreduce_async(tensor: torch.Tensor, op: str = "average", **kwargs: Any
                    ) -> Handle[torch.Tensor]:
    """See :meth:`decent.core.Client.allreduce_async`."""
    return _client().allreduce_async(tensor, op=op, **kwargs)


def allreduce(tensor: torch.Tensor, op: str = "average", **kwargs: Any) -> torch.Tensor:
    """Blocking allreduce."""
    return _client().allreduce(tensor, op=op, **kwargs)


def broadcast_async(tensor: torch.Tensor, root: int = 0, **kwargs: Any) -> Handle[torch.Tensor]:
    """See :meth:`decent.core.Client.broadcast_async`."""
    return _client().broadcast_async(tensor, root=root, **kwargs)


def broadcast(tensor: torch.Tensor, root: int = 0, **kwargs: Any) -> torch.Tensor:
    """Blocking broadcast."""
    return _client().broadcast(tensor, root=root, **kwargs)


def neighbor_allreduce_async_(tensor: torch.Tensor, **kwargs: Any) -> Handle[torch.Tensor]:
    """In-place neighbor averaging: ``wait()`` writes the result into ``tensor``."""
    return _client().neighbor_allreduce_async_(tensor, **kwargs)


def neighbor_allreduce_(tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Blocking in-place neighbor averaging."""
    return _client().neighbor_allreduce_(tensor, **kwargs)


def allreduce_async_(tensor: torch.Tensor, op: str = "average", **kwargs: Any
                     ) -> Handle[torch.Tensor]:
    """In-place allreduce: ``wait()`` writes the result into ``tensor``."""
    return _client().allreduce_async_(tensor, op=op, **kwargs)


def allreduce_(tensor: torch.Tensor, op: str = "average", **kwargs: Any) -> torch.Tensor:
    """Blocking in-place allreduce."""
    return _client().allreduce_(tensor, op=op, **kwargs)


def broadcast_async_(tensor: torch.Tensor, root: int = 0, **kwargs: Any
                     ) -> Handle[torch.Tensor]:
    """In-place broadcast: ``wait()`` writes root's tensor into ``tensor``."""
    return _client().broadcast_async_(tensor, root=root, **kwargs)


def broadcast_(tensor: torch.Tensor, root: int = 0, **kwargs: Any) -> torch.Tensor:
    """Blocking in-place broadcast."""
    return _client().broadcast_(tensor, root=root, **kwargs)


def flush() -> None:
    """Send requests still waiting in fusion buckets now."""
    _client().flush()


def barrier(name: str | None = None, timeout: float | None = None) -> None:
    """Wait for every rank."""
    _client().barrier(name=name, timeout=timeout)


def in_neighbors(name: str | None = None) -> list[int]:
    """Ranks this worker receives from."""
    return _client().in_neighbors(name)


def out_neighbors(name: str | None = None) -> list[int]:
    """Ranks this worker sends to."""
    return _client().out_neighbors(name)


def _default_client_method(method: str) -> Callable[..., Any]:
    """A module-level shortcut for ``Client.<method>`` on the default client."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(_client(), method)(*args, **kwargs)

    call.__name__ = call.__qualname__ = method
    call.__doc__ = f"See :meth:`decent.core.Client.{method}` (on the default client)."
    return call


# one-sided window ops (BlueFog's vocabulary)
win_create = _default_client_method("win_create")
win_put_async = _default_client_method("win_put_async")
win_put = _default_client_method("win_put")
win_accumulate_async = _default_client_method("win_accumulate_async")
win_accumulate = _default_client_method("win_accumulate")
win_get_async = _default_client_method("win_get_async")
win_get = _default_client_method("win_get")
win_update = _default_client_method("win_update")
win_publish = _default_client_method("win_publish")
win_free = _default_client_method("win_free")
win_info = _default_client_method("win_info")
win_versions = _default_client_method("win_versions")
win_exchange_async = _default_client_method("win_exchange_async")
win_exchange = _default_client_method("win_exchange")
win_add = _default_client_method("win_add")
group_allreduce_async = _default_client_method("group_allreduce_async")
group_allreduce = _default_client_method("group_allreduce")
