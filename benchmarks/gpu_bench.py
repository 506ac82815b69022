"""decent's CUDA path on a GPU, as ratios measured in one run between 2 daemons.

Run under the local launcher, one node per rank (it starts the daemons)::

    decentrun -np 2 --nodes 2 -- python benchmarks/gpu_bench.py --json OUT.json

Both ranks use the same GPU when the machine has one (``cuda:LOCAL_RANK`` modulo the devices).
Three measurements, each against its limit or its baseline in the same processes:

* **staging bandwidth**: decent's device-to-host staging (``Staging.to_host`` into the pinned
  arena, in chunks, on a side stream) and host-to-device copy back (``Staging.to_device``)
  against a plain ``copy_`` between a CUDA tensor and pinned host memory (the limit), 64 MiB;
* **64 MiB neighbor_allreduce of a CUDA tensor** (out of place, the README's call) against
  gloo's ``all_reduce`` of the same CUDA tensor (target: <= 1.0x);
* **a training step with decent's communication overlapped**: a small CNN's forward, backward
  and SGD step on the GPU, alone, and with a D-SGD ``DecentralizedOptimizer`` around the SGD
  (its parameter averaging overlapped with the next step's compute): the ratio is the cost
  of the communication left on the step.

Timing: CUDA events for GPU-side copies, wall clock (with the result read) for the ops; median
of ``--repeats`` after ``--warmup``, the slower rank's. Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import decent.torch as dt
from decent.torch.cuda import Staging

MIB = 1 << 20


def median_ms(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median wall time of ``fn`` in ms (the GPU drained after each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def staging(nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of decent's staging each way, and of a plain pinned copy_ (the limit)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    src = torch.randn(nbytes // 4, device=dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    back = torch.empty_like(src)
    stage = Staging()
    gb = nbytes / 1e9

    def plain_d2h() -> None:
        pinned.copy_(src.view(torch.uint8), non_blocking=True)

    def staged_d2h() -> None:
        stage.to_host(src, pinned)[-1][0].synchronize()

    def plain_h2d() -> None:
        back.view(torch.uint8).copy_(pinned, non_blocking=True)

    def staged_h2d() -> None:
        stage.to_device(pinned.view(torch.float32).view(back.shape), back).synchronize()

    out = {name: gb / (median_ms(fn, repeats, 3) / 1e3) for name, fn in
           [("plain_d2h_gbs", plain_d2h), ("staged_d2h_gbs", staged_d2h),
            ("plain_h2d_gbs", plain_h2d), ("staged_h2d_gbs", staged_h2d)]}
    out["d2h_ratio"] = out["staged_d2h_gbs"] / out["plain_d2h_gbs"]
    out["h2d_ratio"] = out["staged_h2d_gbs"] / out["plain_h2d_gbs"]
    return out


def _gloo(client: dt.TorchClient) -> None:
    """Join a gloo group on loopback, its port agreed through decent."""
    port = 0
    if client.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    got = client.broadcast(torch.tensor([port], dtype=torch.int64), root=0, name="gpu.port")
    dist.init_process_group("gloo", rank=client.rank, world_size=client.size,
                            init_method=f"tcp://127.0.0.1:{int(got[0])}",
                            timeout=datetime.timedelta(seconds=300))


def allreduce_vs_gloo(client: dt.TorchClient, nbytes: int, repeats: int) -> dict[str, float]:
    """64 MiB neighbor_allreduce of a CUDA tensor against gloo's all_reduce of it."""
    dev = client.device
    x = (torch.arange(nbytes // 4, device=dev) % 1024 + client.rank + 1).float()
    want = (torch.arange(nbytes // 4, device=dev) % 1024 + 1.5).float()
    got = client.neighbor_allreduce(x, name="gpu.nar")
    exact = bool(torch.equal(got, want))
    g = x.clone()

    def gloo() -> None:
        dist.all_reduce(g)

    def decent() -> None:
        client.neighbor_allreduce(x, name="gpu.nar")

    client.barrier(name="gpu.sync1")
    dist.barrier()
    t_gloo = median_ms(gloo, repeats, 2)
    client.barrier(name="gpu.sync2")
    t_decent = median_ms(decent, repeats, 2)
    return {"gloo_ms": t_gloo, "decent_ms": t_decent, "ratio": t_decent / t_gloo,
            "exact": float(exact)}


def training_step(client: dt.TorchClient, repeats: int) -> dict[str, float]:
    """A CNN step alone, with D-SGD around its optimizer, and the step's communication alone
    (one neighbor_allreduce of as many values as the model has): with full overlap the step
    takes the longer of the two, with none their sum."""
    dev = client.device
    torch.manual_seed(0)

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
            torch.nn.Linear(64 * 32 * 32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)

    data = torch.randn(512, 3, 32, 32, device=dev)
    target = torch.randint(0, 10, (512,), device=dev)

    def stepper(opt: Any, net: torch.nn.Module) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(data), target).backward()
            opt.step()
        return step

    alone_net = model()
    alone = stepper(torch.optim.SGD(alone_net.parameters(), lr=0.01), alone_net)
    net = model()
    wrapped = dt.DecentralizedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), net,
                                        algorithm="dsgd", client=client)
    decent = stepper(wrapped, net)
    params = sum(p.numel() for p in net.parameters())
    flat = torch.zeros(params, device=dev)
    t_alone = median_ms(alone, repeats, 3)
    client.barrier(name="gpu.step")
    t_comm = median_ms(lambda: client.neighbor_allreduce(flat, name="gpu.comm"), repeats, 2)
    client.barrier(name="gpu.step2")
    t_decent = median_ms(decent, repeats, 3)
    wrapped.close()
    hidden = (t_alone + t_comm - t_decent) / min(t_alone, t_comm)
    return {"params": float(params), "alone_ms": t_alone, "comm_ms": t_comm,
            "with_decent_ms": t_decent, "ratio": t_decent / t_alone,
            "overlap": max(0.0, min(1.0, hidden))}


def main() -> int:
    """Run the three measurements; rank 0 writes ``--json``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    client = dt.init()
    torch.cuda.set_device(client.device)
    _gloo(client)
    result: dict[str, object] = {"gpu": torch.cuda.get_device_name(client.device),
                                 "torch": torch.__version__, "ranks": client.size,
                                 "load": os.getloadavg()}
    result["staging_64mib"] = staging(64 * MIB, args.repeats)
    result["neighbor_allreduce_64mib"] = allreduce_vs_gloo(client, 64 * MIB, args.repeats)
    result["training_step"] = training_step(client, args.repeats)
    if client.rank == 0:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
    dist.destroy_process_group()
    dt.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
