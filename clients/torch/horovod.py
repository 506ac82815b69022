"""What Horovod's torch API users' code expects of ``import decent.torch as hvd``.

``DistributedOptimizer`` averages gradients the way Horovod's does: a hook on each parameter
starts the reduction of its gradient as soon as backward has accumulated it (so the reductions
overlap the rest of backward), and ``step()`` waits for them, then runs the wrapped optimizer.
The reduction is :class:`decent.core.training.algorithms.GradientAllreduce`, the same as
``DecentralizedOptimizer(..., algorithm="gradient-allreduce")``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from decent.core import Client
from decent.core.requests.handles import Handle
from decent.core.training.algorithms import GradientAllreduce
from decent.torch.client import default_client
from decent.torch.optim import average_gradients

#: Horovod's reduction ops (decent's allreduce takes the same names)
Average = "average"
Sum = "sum"
Adasum = "adasum"



class NoneCompressor:
    """No compression (Horovod's ``Compression.none``)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor as it is."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, context: Any) -> torch.Tensor:
        """The tensor as it is."""
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 and come back in their dtype (Horovod's
    ``Compression.fp16``); other tensors travel as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A float16 copy of a floating-point tensor, and its dtype."""
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, context: Any) -> torch.Tensor:
        """The tensor in the dtype it had."""
        return tensor.to(context) if context is not None else tensor


class Compression:
    """Horovod's gradient compressors."""

    none = NoneCompressor()
    fp16 = FP16Compressor()


def _names(optimizer: torch.optim.Optimizer,
           named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> dict[int, str]:
    """A name per parameter (Horovod requires them unique), by ``id``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        return {id(p): f"allreduce.noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError("named_parameters has duplicate names; give every parameter its own")
    by_id = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"named_parameters does not name the optimizer's parameters {missing}")
    return by_id


class GradientAveraging(torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's class by :func:`DistributedOptimizer`: hooks that
    reduce each gradient as soon as backward has accumulated it, and a ``step()`` that waits
    for them first. The object shares the wrapped optimizer's parameter groups, state and hooks.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                 compression: Any, backward_passes_per_step: int, op: str,
                 gradient_predivide_factor: float, client: Client[torch.Tensor] | None) -> None:
        # not the optimizer class's __init__: this object takes over the wrapped one's groups,
        # state and hooks as they are (lr schedulers and checkpoints see one optimizer)
        self.__dict__.update(vars(optimizer))
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got "
                             f"{backward_passes_per_step}")
        self.client = client if client is not None else default_client.init()
        self.algorithm = GradientAllreduce(
            self.client, prefix=self.client.name_prefix("hvd"), op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            compression=None if compression is Compression.none else compression)
        self._names = _names(optimizer, named_parameters)
        self._passes = backward_passes_per_step
        self._left: dict[torch.Tensor, int] = {}
        self._handles: dict[torch.Tensor, Handle[torch.Tensor]] = {}
        self._synchronized = False
        self._skip = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready)
                       for p in self._params() if p.requires_grad]

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _ready(self, p: torch.Tensor) -> None:
        """Backward accumulated ``p``'s gradient: reduce it once enough passes are in."""
        left = self._left.get(p, self._passes) - 1
        if left > 0:
            self._left[p] = left
            return
        if p in self._handles:
            raise RuntimeError("a gradient was computed more than backward_passes_per_step "
                               "times before step(): call step() (or synchronize()) between, "
                               "or raise backward_passes_per_step")
        self._left[p] = 0
        assert p.grad is not None
        (self._handles[p],) = self.algorithm.average_async([p.grad], [self._names[id(p)]])

    def synchronize(self) -> None:
        """Wait for every gradient's reduction (starting those whose hook did not fire: a
        missing gradient counts as zeros) and put the results in the gradients."""
        missing = [p for p in self._params() if p not in self._handles]
        if missing:
            average_gradients(self.algorithm, missing, [self._names[id(p)] for p in missing])
        for p, handle in self._handles.items():
            reduced = handle.wait()
            if p.grad is not None and reduced is not p.grad:
                p.grad.copy_(reduced)
        self._handles.clear()
        self._left.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not synchronize (call :meth:`synchronize` before,
        for example to clip the averaged gradients)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize (unless skipped), then the wrapped optimizer class's step."""
        if self._skip:
            if not self._synchronized:
                warnings.warn("step() inside skip_synchronize() without synchronize(): the "
                              "gradients are local", stacklevel=2)
        else:
            if self._synchronized:  # Horovod's warning, word for word
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure) if closure is not None else super().step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``; an error while reductions are in flight."""
        if self._handles:
            raise RuntimeError("zero_grad() while gradients are being reduced: call step() or "
                               "synchronize() first")
        super().zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Remove the gradient hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def DistributedOptimizer(
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        compression: Any = Compression.none, backward_passes_per_step: int = 1,
        op: str = Average, gradient_predivide_factor: float = 1.0,
        client: Client[torch.Tensor] | None = None, **_ignored: Any) -> GradientAveraging:
    """Horovod's ``hvd.DistributedOptimizer``: ``optimizer``, stepping on gradients averaged
    over every rank.

    As in Horovod the result is an instance of ``optimizer``'s own class (``isinstance``, lr
    schedulers, ``state_dict`` work as before) with :class:`GradientAveraging` mixed in.
    ``backward_passes_per_step``: gradients accumulate locally over that many backward passes
    before they are reduced. ``op``: ``Average`` or ``Sum``. ``gradient_predivide_factor``:
    gradients are divided by it before the sum and multiplied after. ``compression``:
    ``Compression.none`` or ``Compression.fp16``. Horovod's grouping and sparse options are
    accepted and have no effect (decent fuses small reductions by itself).
    """
    cls = type(type(optimizer).__name__, (GradientAveraging, type(optimizer)), {})
    distributed: GradientAveraging = cls(optimizer, named_parameters, compression,
                                         backward_passes_per_step, op,
                                         gradient_predivide_factor, client)
    return distributed


def is_initialized() -> bool:
    """Horovod's ``hvd.is_initialized()``: whether ``init()`` made the default client (and it
    is open)."""
    client = default_client.client
    return client is not None and not client.closed


def cross_rank() -> int:
    """Horovod's ``hvd.cross_rank()``: this worker's node (its daemon) among the nodes."""
    return default_client.get().machine_rank


def cross_size() -> int:
    """Horovod's ``hvd.cross_size()``: the number of nodes (daemons)."""
    return default_client.get().machine_size


def mpi_threads_supported() -> bool:
    """Horovod's ``hvd.mpi_threads_supported()``: False (decent uses no MPI)."""
    return False


def nccl_built() -> bool:
    """Horovod's and BlueFog's ``nccl_built()``: False (decent's GPU path stages tensors
    through host memory; it links no NCCL)."""
    return False


def synchronize(handle: Handle[Any]) -> Any:
    """Horovod's ``hvd.synchronize(handle)``: the handle's result."""
    return handle.wait()


def poll(handle: Handle[Any]) -> bool:
    """Horovod's ``hvd.poll(handle)``: whether the op finished."""
    return handle.done()
