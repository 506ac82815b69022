"""torch.distributed's ``decent`` backend (``dist.init_process_group("decent")``).

- :mod:`.process_group`: :class:`DecentProcessGroup`, every collective of torch.distributed
  over the node's daemon, the creator torch calls, and :func:`register`;
- :mod:`.work`: the Work objects and the thread that ends a group's ops in order (callbacks
  chained on their futures run there);
- :mod:`.endings`: how each op's result reaches the tensors torch gave, and the move of DDP's
  reused buckets into shared memory.
"""

from __future__ import annotations

from decent.torch.distributed.process_group import (
    BACKEND,
    DecentProcessGroup,
    client_of,
    create,
    register,
)
from decent.torch.distributed.work import DecentWork

__all__ = ["BACKEND", "DecentProcessGroup", "DecentWork", "client_of", "create", "register"]
