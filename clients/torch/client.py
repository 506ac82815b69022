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
from decent_wire.ops import OpDecl


class TorchClient(Client[torch.Tensor]):
    """:class:`decent.core.Client` for torch tensors; the blocking out-of-place collectives of a
    tensor that requires grad are differentiable (:mod:`decent.torch.autograd`)."""

    @property
    def device(self) -> torch.device:
        """This worker's device: ``cuda:LOCAL_RANK`` (modulo the devices there are) where CUDA
        is present, one GPU per local worker, else the CPU."""
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", self.local_rank % torch.cuda.device_count())

    def _blocking(self, op: OpDecl, kwargs: dict[str, Any]) -> Any:
        """The blocking form of ``op``; recorded by autograd, with the adjoint collective as
        its backward pass, when the op is differentiable and its tensor requires grad."""
        tensor = kwargs.get("tensor")
        if not op.differentiable or kwargs.get("into") is not None or not tracked(tensor):
            return super()._blocking(op, kwargs)
        assert isinstance(tensor, torch.Tensor)
        if op.name == "allgather":  # its backward needs every rank's row count
            out = super()._blocking(op, {**kwargs, "tensor": tensor.detach()})
            counts = self._plain("allgather", torch.tensor([tensor.shape[0]]),
                                 name=f"{kwargs.get('name') or 'allgather'}.rows")
            rows = [int(v) for v in self.values(counts)]
            return differentiable(tensor, lambda _x: out, adjoints.allgather(
                *adjoints.own_rows(rows, self.rank), kwargs), self._plain_op)
        return differentiable(tensor, lambda x: super(TorchClient, self)._blocking(
            op, {**kwargs, "tensor": x}), adjoints.of(op.name, self, kwargs), self._plain_op)

    def _plain_op(self, op: str) -> Callable[..., torch.Tensor]:
        """The blocking op ``op`` without gradients (a backward pass's)."""
        return lambda tensor, **kwargs: self._plain(op, tensor, **kwargs)


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
    client = TorchClient(TorchCodec(), address, connect_timeout, job, fusion_threshold,
                         cycle_time, register, local_rank)
    default_client.adopt(client)
    return client


#: the default client of ``decent.torch``: ``init()`` creates it
default_client: DefaultClient[torch.Tensor, TorchClient] = DefaultClient("decent.torch",
                                                                      connect)
