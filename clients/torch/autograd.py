"""Collectives that autograd differentiates (Horovod's and ``torch.distributed.nn``'s rule):
a blocking out-of-place ``allreduce``, ``broadcast``, ``allgather`` or ``neighbor_allreduce`` of
a tensor that requires grad returns a tensor whose backward pass runs the adjoint collective
(:mod:`decent.core.surface.adjoints`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from decent.core.surface.adjoints import Adjoint

#: runs a blocking op (``allreduce``, ``neighbor_allreduce``) without gradients
PlainOp = Callable[..., torch.Tensor]


class _Collective(torch.autograd.Function):
    """One collective call: forward ``run(x)``, backward its adjoint on the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor],
                adjoint: Adjoint, plain: Callable[[str], PlainOp]) -> torch.Tensor:
        ctx.adjoint, ctx.plain = adjoint, plain
        return run(x.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        adjoint: Adjoint = ctx.adjoint
        out = ctx.plain(adjoint.op)(grad.contiguous(), **adjoint.kwargs)
        return adjoint.keep(out), None, None, None


def tracked(tensor: Any) -> bool:
    """Whether autograd records an op on ``tensor``."""
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def differentiable(x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor],
                   adjoint: Adjoint, plain: Callable[[str], PlainOp]) -> torch.Tensor:
    """``run(x)`` recorded by autograd, with ``adjoint`` as its backward pass (through
    ``plain(op)``, the client's op of that name without gradients)."""
    out: torch.Tensor = _Collective.apply(x, run, adjoint, plain)
    return out
