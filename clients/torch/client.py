"""The torch client: :class:`decent.core.Client` with the torch codec, and this process's default
client (the one ``decent.torch``'s module-level functions use)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from decent.core import Client
from decent.core.surface import adjoints
from decent.core.surface.default_client import DefaultClient
from decent.torch.autograd import differentiable, tracked
from decent.torch.codec import TorchCodec


class TorchClient(Client[torch.Tensor]):
    """:class:`decent.core.Client` for torch tensors; the blocking out-of-place collectives of a
    tensor that requires grad are differentiable (:mod:`decent.torch.autograd`)."""

    def allreduce(self, tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Blocking allreduce; its gradient is the allreduce of the gradients."""
        if not tracked(tensor):
            return super().allreduce(tensor, **kwargs)
        return differentiable(tensor, lambda x: super(TorchClient, self).allreduce(x, **kwargs),
                              adjoints.allreduce(kwargs), self._plain)

    def broadcast(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Blocking broadcast; its gradient is the sum of the gradients, on the root."""
        if not tracked(tensor):
            return super().broadcast(tensor, *args, **kwargs)
        root = int(args[0]) if args else int(kwargs.get("root_rank", kwargs.get("root", 0)))
        return differentiable(
            tensor, lambda x: super(TorchClient, self).broadcast(x, *args, **kwargs),
            adjoints.broadcast(self.rank, root, kwargs), self._plain)

    def allgather(self, tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Blocking allgather; its gradient is this rank's rows of the summed gradients."""
        if not tracked(tensor):
            return super().allgather(tensor, **kwargs)
        out = super().allgather(tensor.detach(), **kwargs)
        sizes = [int(v) for v in self.values(super().allgather(
            torch.tensor([tensor.shape[0]]), name=f"{kwargs.get('name') or 'allgather'}.rows"))]
        return differentiable(tensor, lambda _x: out,
                              adjoints.allgather(*adjoints.own_rows(sizes, self.rank), kwargs),
                              self._plain)

    def neighbor_allreduce(self, tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Blocking neighbor_allreduce; its gradient is the same op with W transposed."""
        if not tracked(tensor):
            return super().neighbor_allreduce(tensor, **kwargs)
        plan = adjoints.neighbor_plan(self, kwargs)
        return differentiable(
            tensor, lambda x: super(TorchClient, self).neighbor_allreduce(x, **kwargs),
            adjoints.neighbor_allreduce(*plan, kwargs), self._plain)

    def _plain(self, op: str) -> Callable[..., torch.Tensor]:
        """The blocking op ``op`` without gradients (a backward pass's)."""
        plain: Callable[..., torch.Tensor] = getattr(super(), op)
        return plain


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
    return TorchClient(TorchCodec(), address, connect_timeout, job, fusion_threshold,
                       cycle_time, register, local_rank)


#: the default client of ``decent.torch``: ``init()`` creates it
default_client: DefaultClient[torch.Tensor, TorchClient] = DefaultClient("decent.torch",
                                                                      connect)
