"""Horovod's broadcasts of a model's tensors and of an optimizer's state from one rank to all
(``broadcast_parameters``, ``broadcast_optimizer_state``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from decent.core import Client
from decent.core.training.algorithms import AlgorithmError
from decent.torch import state as state_format
from decent.torch.client import default_client


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root: int = 0, client: Client[torch.Tensor] | None = None,
                         root_rank: int | None = None) -> None:
    """Overwrite every tensor (``model.state_dict()`` or ``named_parameters()``) with ``root``'s
    (``root_rank``: Horovod's name), in place."""
    client = client if client is not None else default_client.init()
    root = root if root_rank is None else root_rank
    items = sorted(params.items() if isinstance(params, Mapping) else params)
    handles = [client.broadcast_async_(t.data if isinstance(t, torch.nn.Parameter) else t,
                                       root=root, name=f"decent.bcast.{name}")
               for name, t in items]
    for h in handles:
        h.wait()


def broadcast_optimizer_state(optimizer: Any, root: int = 0,
                              client: Client[torch.Tensor] | None = None,
                              root_rank: int | None = None) -> None:
    """Give every rank ``root``'s optimizer state (momentum buffers, steps, the algorithm's
    state and counters), whatever state the others had.

    The state travels as tensors and plain values (:mod:`decent.torch.state`), never as a pickle:
    a peer can send wrong numbers, not code. ``optimizer``: a torch optimizer or a wrapper
    (``DecentralizedOptimizer``, ``DistributedOptimizer``); ``root_rank``: Horovod's name.
    """
    client = client if client is not None else default_client.init()
    root = root if root_rank is None else root_rank
    tensors: list[torch.Tensor] = []
    meta = b""
    if client.rank == root:
        meta, tensors = state_format.encode(optimizer.state_dict())
    announced = _broadcast_bytes(client, meta, root)
    if client.rank == root:
        for i, t in enumerate(tensors):
            client.broadcast(t, root=root, name=f"decent.optstate.{i}")
        return
    try:
        state = state_format.decode(announced, lambda i, wire: client.broadcast_(
            wire, root=root, name=f"decent.optstate.{i}"))
    except (ValueError, KeyError, TypeError) as exc:
        raise AlgorithmError(f"rank {root} sent an optimizer state this rank cannot read: "
                             f"{exc}") from None
    optimizer.load_state_dict(state)


#: the largest state description a rank accepts from the root (the tensors travel apart)
MAX_STATE_META = 256 << 20


def _broadcast_bytes(client: Client[torch.Tensor], data: bytes, root: int) -> bytes:
    """``root``'s ``data`` on every rank."""
    size = int(client.broadcast(torch.tensor([len(data)], dtype=torch.int64), root=root,
                                name="decent.optstate.size")[0])
    if not 0 <= size <= MAX_STATE_META:
        raise AlgorithmError(f"rank {root} announced an optimizer state description of "
                             f"{size} bytes (at most {MAX_STATE_META})")
    blob = torch.zeros(size, dtype=torch.uint8)
    if client.rank == root and size:
        blob[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    got = client.broadcast(blob, root=root, name="decent.optstate")
    return bytes(got.numpy().tobytes())
