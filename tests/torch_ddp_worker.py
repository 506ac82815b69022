"""One rank of tests/test_torch_ddp.py: DistributedDataParallel (and FSDP2,
``tests/torch_fsdp_worker.py``) over the ``decent`` backend against the same training over
gloo, in this process (a gloo group beside the default one).

- 50 SGD steps of a small MLP: the parameters must equal gloo's (bit for bit with 2 ranks,
  whose sums have one order; within float32 summation-order tolerance with more);
- torch's own comm hooks, unchanged: fp16 compression and PowerSGD, the same against gloo;
- the overlap: each step's times (``time.monotonic_ns() // 1000``, the timeline's clock) when
  backward began and when its last gradient was computed go to ``$DDP_STAMPS`` (rank 0), for the
  test to find bucket allreduces queued between them in the daemon's timeline.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_fsdp_worker import fsdp_matches_gloo

import decent.torch  # noqa: F401  (registers the backend)

STEPS = 50


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)  # every rank and both runs start from the same parameters
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 4))


def train(group: Any, hook: Any = None, state: Any = None,
          stamps: list[tuple[int, int]] | None = None, bucket_mb: float = 0.02,
          steps: int = STEPS) -> list[torch.Tensor]:
    """``STEPS`` steps of DDP over ``group`` (several buckets, unless ``bucket_mb`` holds
    the model); the parameters at the end."""
    net = model()
    layer = net[0]
    assert isinstance(layer, torch.nn.Linear)
    first = layer.weight  # its gradient is the last one backward computes
    ddp = DDP(net, process_group=group, bucket_cap_mb=bucket_mb)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    last: list[int] = []
    handle = first.register_hook(lambda g: last.append(time.monotonic_ns() // 1000))
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randn(16, 4, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        began = time.monotonic_ns() // 1000
        loss.backward()
        if stamps is not None:
            stamps.append((began, last[-1]))
        opt.step()
    handle.remove()
    return [p.detach().clone() for p in net.parameters()]


def compare(what: str, ours: list[torch.Tensor], theirs: list[torch.Tensor],
            exact: bool) -> None:
    worst = max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))
    print(f"{what}: largest difference from gloo {worst:.3g}", flush=True)
    if exact:
        assert worst == 0.0, f"{what}: {worst}"
    else:
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def main() -> None:
    dist.init_process_group("decent")
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    exact = size == 2
    stamps: list[tuple[int, int]] = []
    compare("DDP", train(None, stamps=stamps), train(gloo), exact)
    compare("DDP with fp16_compress_hook", train(None, default_hooks.fp16_compress_hook),
            train(gloo, default_hooks.fp16_compress_hook), exact)

    def power(group: Any) -> powerSGD_hook.PowerSGDState:
        return powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                           start_powerSGD_iter=5, random_seed=7)
    # one bucket: over gloo, with several, PowerSGD's callbacks and the next bucket's hook
    # start collectives from two threads, in an order that differs between the ranks (gloo
    # then fails on a size mismatch)
    compare("DDP with PowerSGD", train(None, powerSGD_hook.powerSGD_hook, power(None),
                                       bucket_mb=25),
            train(gloo, powerSGD_hook.powerSGD_hook, power(gloo), bucket_mb=25), exact)
    # decent runs callbacks in the ops' order (decent.torch.distributed.work): several buckets work
    several = train(None, powerSGD_hook.powerSGD_hook, power(None), steps=20)
    assert all(bool(torch.isfinite(p).all()) for p in several)
    fsdp_matches_gloo(gloo)  # FSDP2 on the same processes (tests/torch_fsdp_worker.py)
    if rank == 0 and os.environ.get("DDP_STAMPS"):
        with open(os.environ["DDP_STAMPS"], "w") as f:
            json.dump(stamps, f)
    dist.destroy_process_group()
    print("ok", rank, flush=True)


if __name__ == "__main__":
    main()
