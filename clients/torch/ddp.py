"""DDP's decentralized mode: a ``DistributedDataParallel`` model over the ``decent`` backend
trains with one of decent's decentralized algorithms instead of the global gradient average,
one call away::

    model = DistributedDataParallel(net)                  # over init_process_group("decent")
    optimizer = decentralize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             algorithm="dsgd", topology="exponential")
    ...
    loss.backward(); optimizer.step()                     # as before

:func:`decentralize` registers :func:`local_gradients_hook` (DDP then reduces nothing: each
rank keeps its own gradient) and returns a :class:`~decent.torch.optim.DecentralizedOptimizer`
around the optimizer, over the process group's own decent client: its ``step()`` runs the
algorithm's update. With ``algorithm="dsgd"`` and plain SGD that is adapt-then-combine D-SGD,
``x_i' = sum_j w_ij (x_j - lr g_j)``, ``w`` the topology's weights (the exponential graph:
``i -> i + 2^k``, ``w = 1/(log2 n + 1)``), one neighbor averaging of the parameters per step
instead of an allreduce of the gradients.
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
                 algorithm: str = "dsgd", topology: Any = "exponential",
                 **options: Any) -> DecentralizedOptimizer:
    """``model`` (DDP over the ``decent`` backend) trained with ``algorithm`` on ``topology``
    instead of DDP's gradient average: the optimizer to step (``options``: the
    :class:`~decent.torch.optim.DecentralizedOptimizer`'s)."""
    group = model.process_group
    model.register_comm_hook(None, local_gradients_hook)
    return DecentralizedOptimizer(optimizer, model.module, algorithm, client=client_of(group),
                                  topology=topology, **options)
