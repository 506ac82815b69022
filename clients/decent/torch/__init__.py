"""PyTorch client of decent.

    import decent.torch as dt
    client = dt.connect()                      # $DECENT_DAEMON, else the default socket
    h = client.neighbor_allreduce_async(t)     # returns at once
    t_avg = h.wait()                           # same shape, dtype and device as t

Module-level shortcuts (``dt.init()``, ``dt.neighbor_allreduce_async(t)``, ...) use one default
client per process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from decent.core import Client, DecentError, Handle
from decent.core.algorithms import ALGORITHMS, AlgorithmError
from decent.core.shortcuts import DefaultClient, default_client_method
from decent.torch.codec import TorchCodec
from decent.torch.flat import flatten_parameters
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
    "flatten_parameters",
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


_holder = DefaultClient("decent.torch", connect)
init, shutdown, rank, size, _client = (_holder.init, _holder.shutdown, _holder.rank,
                                       _holder.size, _holder.get)


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


# one-sided window ops (BlueFog's vocabulary)
win_create = default_client_method(_client, "win_create")
win_put_async = default_client_method(_client, "win_put_async")
win_put = default_client_method(_client, "win_put")
win_accumulate_async = default_client_method(_client, "win_accumulate_async")
win_accumulate = default_client_method(_client, "win_accumulate")
win_get_async = default_client_method(_client, "win_get_async")
win_get = default_client_method(_client, "win_get")
win_update = default_client_method(_client, "win_update")
win_publish = default_client_method(_client, "win_publish")
win_free = default_client_method(_client, "win_free")
win_info = default_client_method(_client, "win_info")
win_versions = default_client_method(_client, "win_versions")
win_exchange_async = default_client_method(_client, "win_exchange_async")
win_exchange = default_client_method(_client, "win_exchange")
win_add = default_client_method(_client, "win_add")
group_allreduce_async = default_client_method(_client, "group_allreduce_async")
group_allreduce = default_client_method(_client, "group_allreduce")
