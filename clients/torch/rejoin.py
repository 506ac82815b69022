"""Sending a training state to a rank that joined late, and taking it there (torch).

The state is the parameters plus the optimizer's state dict (the wrapped optimizer's and the
algorithm's: momentum, trackers, step counters), as tensors and plain values, never a pickle
(:mod:`decent.core.training.transfer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from decent.core.training.algorithms import AlgorithmError
from decent.core.training.transfer import StateLink


def state_of(params: Sequence[torch.Tensor], optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """The state a donor sends: its parameters and its optimizer's state dict."""
    return {"params": [p.detach() for p in params], "optimizer": optimizer_state}


def receive(states: StateLink[torch.Tensor], donors: Sequence[int]
            ) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The parameters and optimizer state dict of ``donors[0]``, taken from ``donors``
    (checked before use)."""
    src = donors[0]
    state = states.receive(donors)
    params = state.get("params") if isinstance(state, dict) else None
    optimizer_state = state.get("optimizer") if isinstance(state, dict) else None
    if not isinstance(params, list) or not isinstance(optimizer_state, dict) or \
            not all(isinstance(p, torch.Tensor) for p in params):
        raise AlgorithmError(f"rank {src} sent a training state this rank cannot read: no "
                             "params list or optimizer state")
    return params, optimizer_state
