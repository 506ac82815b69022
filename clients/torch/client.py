"""The torch client: :class:`decent.core.Client` with the torch codec, and this process's default
client (the one ``decent.torch``'s module-level functions use)."""

from __future__ import annotations

import torch

from decent.core import Client
from decent.core.shortcuts import DefaultClient
from decent.torch.codec import TorchCodec

TorchClient = Client[torch.Tensor]


def connect(address: str | None = None, connect_timeout: float = 120.0,
            job: str | None = None, fusion_threshold: int | None = None,
            cycle_time: float | None = None, register: bool | None = None,
            local_rank: int | None = None) -> TorchClient:
    """A new client of the local daemon (address: $DECENT_DAEMON, else the default socket).

    ``job`` (default $DECENT_JOB) keeps jobs sharing long-lived daemons apart;
    ``fusion_threshold`` (bytes, 0: off) and ``cycle_time`` (seconds) tune tensor fusion;
    ``register=False`` (or $DECENT_REGISTER=0) keeps in-place ops copying tensors instead of
    moving them into shared memory registered with the daemon. ``local_rank``: this worker
    among its daemon's (default: $DECENT_LOCAL_RANK, $LOCAL_RANK, $SLURM_LOCALID, else the
    lowest free one).
    """
    return Client(TorchCodec(), address, connect_timeout, job, fusion_threshold, cycle_time,
                  register, local_rank)


#: the default client of ``decent.torch``: ``init()`` creates it
default_client: DefaultClient[torch.Tensor, TorchClient] = DefaultClient("decent.torch",
                                                                      connect)
