"""DDP's decentralized mode: a ``DistributedDataParallel`` model over the ``decent`` backend
trains with one of decent's decentralized algorithms instead of the global gradient average,
one call away::

    model = DistributedDataParallel(net)                  # over init_process_group("decent")
    optimizer = decentralize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             topology="exponential")
    ...
    loss.backward(); optimizer.step()                     # as before

:func:`decentralize` turns DDP's gradient reduction off (as ``no_sync()`` does, for good: each
rank keeps its own gradient, and backward copies nothing into DDP's buckets; as under
``no_sync()``, DDP no longer broadcasts rank 0's buffers, such as BatchNorm's statistics, at each
forward: each rank keeps its own, as BlueFog's optimizers do; with ``static_graph=True`` DDP keeps
its reducer, which then only copies each gradient in and out) and returns a
:class:`~decent.torch.optim.DecentralizedOptimizer` around the optimizer, over the process
group's own decent client: its ``step()`` runs the algorithm's update. By default that is
combine-then-adapt D-SGD (``"dsgd-cta"``, D-PSGD), ``x_i' = sum_j w_ij x_j - lr g_i(x_i)``: as
DDP overlaps its allreduce with backward, the neighbor averaging of the parameters runs while
the gradient is computed (started by a forward pre-hook, from the parameters themselves).
``algorithm="dsgd"`` is adapt-then-combine, ``x_i' = sum_j w_ij (x_j - lr g_j)``, whose
averaging follows the step. ``w`` is the topology's (the exponential graph: ``i -> i + 2^k``,
``w = 1/(log2 n + 1)``): one neighbor averaging of the parameters per step instead of an
allreduce of the gradients.
"""

# no ``from __future__ import annotations``: DDP checks the hook's annotations as objects
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from decent.torch.distributed import client_of
from decent.torch.optim import DecentralizedOptimizer


def local_gradients_hook(state: object, bucket: dist.GradBucket
                         ) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that reduces nothing: the bucket keeps this rank's own gradients."""
    del state
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def decentralize(model: DistributedDataParallel, optimizer: torch.optim.Optimizer,
                 algorithm: str = "dsgd-cta", topology: Any = "exponential",
                 **options: Any) -> DecentralizedOptimizer:
    """``model`` (DDP over the ``decent`` backend) trained with ``algorithm`` on ``topology``
    instead of DDP's gradient average: the optimizer to step (``options``: the
    :class:`~decent.torch.optim.DecentralizedOptimizer`'s)."""
    group = model.process_group
    model.register_comm_hook(None, local_gradients_hook)
    # as under ``no_sync()``, for good: backward leaves each gradient where autograd puts it,
    # with no copy into DDP's buckets and back (the hook above covers a caller who turns it on,
    # and a static graph, whose reducer expects every backward)
    if not getattr(model, "static_graph", False):
        model.require_backward_grad_sync = False
    return DecentralizedOptimizer(optimizer, model.module, algorithm, client=client_of(group),
                                  topology=topology, **options)
