"""Sending a training state to a rank that joined late, and taking it there (torch).

The state is the parameters plus the optimizer's state dict (the wrapped optimizer's and the
algorithm's: momentum, trackers, step counters), as tensors and plain values
(:mod:`decent.torch.state`), never a pickle. It travels one way with dynamic neighbor gathers:
its description's size, the description (JSON), then each tensor.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch

from decent.core.algorithms import AlgorithmError
from decent.core.rejoin import META_NAME, READY_NAME, SIZE_NAME, TENSOR_NAME
from decent.torch import state as state_format
from decent.torch.client import TorchClient

log = logging.getLogger("decent.rejoin")

#: the largest state description a joining rank accepts (the tensors travel apart)
MAX_META = 256 << 20


def snapshot(params: Sequence[torch.Tensor], optimizer_state: dict[str, Any]
             ) -> tuple[bytes, list[torch.Tensor]]:
    """The state as a JSON description and its tensors (copies: training goes on)."""
    meta, wire = state_format.encode({"params": [p.detach() for p in params],
                                      "optimizer": optimizer_state})
    return meta, [t.clone() for t in wire]


def send(client: TorchClient, to: int, meta: bytes, tensors: list[torch.Tensor]) -> None:
    """Send a :func:`snapshot` to rank ``to`` (it runs :func:`receive`)."""
    def one_way(t: torch.Tensor, name: str) -> None:
        client.neighbor_allgather(t, name=name, src_ranks=[], dst_ranks=[to])

    one_way(torch.tensor([len(meta)], dtype=torch.int64), SIZE_NAME)
    one_way(torch.frombuffer(bytearray(meta), dtype=torch.uint8), META_NAME)
    for i, t in enumerate(tensors):
        one_way(t, f"{TENSOR_NAME}{i}")


#: (joining rank, where the training thread puts the snapshot for it)
Wanted = tuple[int, queue.Queue[tuple[bytes, list[torch.Tensor]]]]


def serve_in_background(client: TorchClient, to: int, wanted: queue.Queue[Wanted],
                        patience: float) -> threading.Thread:
    """On a thread of its own (the sender's training goes on): wait until rank ``to`` is
    ready to take the state, ask the training thread for a snapshot at its next step
    boundary (``wanted``), and send it; the state is then at most a step old. A failure is
    logged: the joining rank times out and starts from its own state."""
    def run() -> None:
        try:
            client.neighbor_allgather(torch.zeros(1), name=READY_NAME, src_ranks=[to],
                                      dst_ranks=[])
            box: queue.Queue[tuple[bytes, list[torch.Tensor]]] = queue.Queue(1)
            wanted.put((to, box))
            send(client, to, *box.get(timeout=patience))
        except Exception as exc:  # the joining rank died again, or timed out
            log.warning("sending the training state to rank %d failed: %s", to, exc)

    thread = threading.Thread(target=run, name=f"decent-rejoin-{to}", daemon=True)
    thread.start()
    return thread


def receive(client: TorchClient, src: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The parameters and optimizer state dict rank ``src`` sends (checked before use)."""
    def one_way(t: torch.Tensor, name: str) -> torch.Tensor:
        return client.neighbor_allgather(t, name=name, src_ranks=[src], dst_ranks=[])[0]

    # ready: the donor snapshots its state at its next step from now, not when it saw us come
    client.neighbor_allgather(torch.ones(1), name=READY_NAME, src_ranks=[], dst_ranks=[src])
    size = int(one_way(torch.zeros(1, dtype=torch.int64), SIZE_NAME)[0])
    if not 0 <= size <= MAX_META:
        raise AlgorithmError(f"rank {src} announced a state description of {size} bytes (at "
                             f"most {MAX_META})")
    meta = bytes(one_way(torch.zeros(size, dtype=torch.uint8), META_NAME).numpy().tobytes())
    try:
        state = state_format.decode(meta, lambda i, wire: one_way(wire, f"{TENSOR_NAME}{i}"))
        params, optimizer_state = state["params"], state["optimizer"]
        if not isinstance(params, list) or not isinstance(optimizer_state, dict):
            raise state_format.StateFormatError("no params list or optimizer state")
    except (ValueError, KeyError, TypeError) as exc:
        raise AlgorithmError(f"rank {src} sent a training state this rank cannot read: "
                             f"{exc}") from None
    return params, optimizer_state
