"""CUDA tensors through real daemons: every op and every algorithm gives on a CUDA tensor exactly
what it gives on the same CPU tensor (float32, float16, bfloat16), staging is ordered by events
(no device or stream synchronize), large tensors go out in chunks, results are ready for the
caller's stream, and the general optimizer path allocates nothing model-sized per step.

Marked ``cuda``: they skip where no GPU is (``scripts/gpu_check.sh`` runs them on one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
from test_optimizers import LargeAllocations

import decent.torch as dt
from conftest import ClusterFactory
from decent.core import Client

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device here (scripts/gpu_check.sh runs these on a GPU)"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
Op = Callable[[Client[torch.Tensor], torch.Tensor, str], Any]


def values(rank: int, dtype: torch.dtype, numel: int = 1000) -> torch.Tensor:
    """Small integers and halves: every sum and average the ops take is exact in ``dtype``."""
    base = torch.arange(numel, dtype=torch.float32) % 16 + rank * 4
    return (base / 2).to(dtype)


def _ops() -> dict[str, Op]:
    """Each op as a call on one rank (``name`` keeps the CUDA and the CPU run apart)."""
    return {
        "neighbor_allreduce": lambda c, t, n: c.neighbor_allreduce(t, name=n),
        "neighbor_allreduce_": lambda c, t, n: c.neighbor_allreduce_(t.clone(), name=n),
        "neighbor_allreduce_async": lambda c, t, n: c.neighbor_allreduce_async(t, name=n).wait(),
        "neighbor_allgather": lambda c, t, n: c.neighbor_allgather(t, name=n),
        "compressed_neighbor_allreduce": lambda c, t, n: c.compressed_neighbor_allreduce(
            t, "sign", name=n),
        "hierarchical_neighbor_allreduce": lambda c, t, n: c.hierarchical_neighbor_allreduce(
            t, name=n),
        "allreduce": lambda c, t, n: c.allreduce(t, name=n),
        "allreduce_sum_": lambda c, t, n: c.allreduce_(t.clone(), op="sum", name=n),
        "allgather": lambda c, t, n: c.allgather(t.reshape(10, -1), name=n),
        "broadcast": lambda c, t, n: c.broadcast(t, root=1, name=n),
        "broadcast_": lambda c, t, n: c.broadcast_(t.clone(), root=1, name=n),
        "windows": _window_round,
    }


def _window_round(c: Client[torch.Tensor], t: torch.Tensor, name: str) -> torch.Tensor:
    """win_create, win_put, win_accumulate, win_get, win_update, win_exchange, win_add and
    group_allreduce on one window; the window's final value."""
    w = t.clone()
    c.win_create(w, name)
    c.barrier(name=f"{name}.b0")
    c.win_put(w * 2, name)
    c.win_accumulate(w, name)
    c.barrier(name=f"{name}.b1")
    c.win_get(name)
    c.barrier(name=f"{name}.b2")
    out = [c.win_update(name).clone()]
    peer = 1 - c.rank
    if c.rank == 0:
        out.append(c.win_exchange(w, name, peer).clone())
    c.barrier(name=f"{name}.b3")
    out.append(c.win_add(torch.ones_like(w), name).clone())
    c.win_publish(w, name)  # every member's own copy is w before the group round: whoever
    c.barrier(name=f"{name}.b5")  # comes first, the group sums the same tensors
    out.append(c.group_allreduce(w, name, 2).clone())
    c.barrier(name=f"{name}.b4")
    c.win_free(name)
    return torch.cat([o.reshape(-1).cpu() for o in out])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("op", sorted(_ops()))
def test_every_op_gives_on_cuda_what_it_gives_on_cpu(cluster: ClusterFactory, op: str,
                                                    dtype: torch.dtype) -> None:
    c = cluster(2)
    run = _ops()[op]

    def work(cl: Client[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.device]:
        x = values(cl.rank, dtype)
        on_cpu = run(cl, x, f"{op}.cpu")
        on_gpu = run(cl, x.cuda(), f"{op}.cuda")
        return on_cpu, on_gpu.cpu(), on_gpu.device

    for on_cpu, on_gpu, device in c.run(work):
        if op != "windows":  # the window test gathers its values on the host itself
            assert device.type == "cuda"
        assert on_gpu.dtype == on_cpu.dtype == dtype or op == "windows"
        assert torch.equal(on_gpu, on_cpu)


def _no_sync(*_: Any, **__: Any) -> None:
    raise AssertionError("a device-wide or stream synchronize on the op path")


@pytest.fixture
def no_device_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """While it lasts, torch.cuda.synchronize and Stream.synchronize fail the test (waiting
    for one's own copy's event is what the staging may do)."""
    monkeypatch.setattr(torch.cuda, "synchronize", _no_sync)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", _no_sync)
    yield


def test_staging_waits_on_events_not_on_the_device(cluster: ClusterFactory,
                                                  no_device_sync: None) -> None:
    c = cluster(2)

    def work(cl: Client[torch.Tensor]) -> torch.Tensor:
        x = values(cl.rank, torch.float32, 1 << 20).cuda()
        y = cl.neighbor_allreduce(x * 1, name="events")  # x * 1: queued on the current stream
        z = cl.neighbor_allreduce_async_(x, name="events.inplace").wait()
        return torch.stack([y, z]).cpu()  # read on the caller's stream: ready by then

    got = c.run(work)
    mean = (values(0, torch.float32, 1 << 20) + values(1, torch.float32, 1 << 20)) / 2
    for result in got:
        assert torch.equal(result[0], mean) and torch.equal(result[1], mean)


def test_large_cuda_tensors_are_sent_while_they_are_staged(cluster: ClusterFactory) -> None:
    """A 24 MiB CUDA tensor goes out as it is staged: its request first (filling), then one
    Fill note per 4 MiB chunk once that chunk is on the host; the daemon sends each as it is
    told (``inputs_streamed``)."""
    c = cluster(2)
    numel = 6 << 20  # 24 MiB of float32: 6 chunks (the test daemons' arenas hold 32 MiB)

    def work(cl: Client[torch.Tensor]) -> tuple[bool, int, list[int]]:
        fills: list[int] = []
        send = cl._submitter._send_request

        def counted(req: Any) -> None:
            if req.WhichOneof("op") == "fill":
                fills.append(int(req.fill.bytes))
            send(req)

        cl._submitter._send_request = counted
        before = cl.status().inputs_streamed
        x = values(cl.rank, torch.float32, numel).cuda()
        y = cl.neighbor_allreduce(x, name="staged")
        streamed = cl.status().inputs_streamed - before
        cl._submitter._send_request = send
        mean = (values(0, torch.float32, numel) + values(1, torch.float32, numel)).cuda() / 2
        return bool(torch.equal(y, mean)), streamed, fills

    for exact, streamed, fills in c.run(work):
        assert exact and streamed == 1
        assert fills == [(k + 1) * (4 << 20) for k in range(6)]


def test_each_local_worker_gets_its_own_device(cluster: ClusterFactory) -> None:
    c = cluster(1, per_node=2)
    count = torch.cuda.device_count()
    devices = c.run(lambda cl: (cl.local_rank, cast(dt.TorchClient, cl).device))
    assert devices == [(r, torch.device("cuda", r % count)) for r in range(2)]


ALGORITHMS = ["dsgd", "allreduce", "pga", "dsgd-cta", "gradient-tracking", "extra",
              "exact-diffusion", "d2", "decentlam", "choco", "push-sum", "win-put", "adpsgd",
              "wagma", "gradient-allreduce"]


def _train(cl: Client[torch.Tensor], algorithm: str, device: str, steps: int = 3,
           watch: bool = False, dtype: torch.dtype = torch.float32
           ) -> tuple[list[torch.Tensor], list[str]]:
    """``steps`` steps of ``algorithm`` on a model on ``device``, with gradients set by hand
    (dyadic values: every update is exact, on the GPU as on the CPU); the final parameters, and
    what the steps from the fourth on made that is model-sized (the first steps fill the pool
    of device tensors results come in: one per result an algorithm keeps alive at once, two
    for gradient tracking's early-started exchanges)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)).to(
        device, dtype)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) % 8 / 4
                    + cl.rank + i)
    opt = dt.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model,
                                    algorithm=algorithm, client=cl, flatten=False,
                                    prefix=f"cuda.{algorithm}.{device}.{dtype}")
    made: list[str] = []
    for k in range(steps):
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, 0.25 * (k + i + cl.rank))
        alloc = LargeAllocations(64 * 10)
        if watch and k >= 3:
            with alloc:
                opt.step()
            made += alloc.made
        else:
            opt.step()
    opt.close()
    return [p.detach().cpu().clone() for p in model.parameters()], made


#: asynchronous by design: what they average depends on when the ranks' calls meet
ASYNCHRONOUS = {"adpsgd", "wagma", "win-put"}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_steps_on_cuda_as_on_cpu(cluster: ClusterFactory, algorithm: str,
                                                 dtype: torch.dtype) -> None:
    """The same steps, on CPU and on CUDA parameters, give the same bits (the asynchronous
    ones: AD-PSGD keeps the ranks' sum exactly, whenever its exchanges meet; WAGMA and win-put
    run and stay finite)."""
    c = cluster(2)
    got = c.run(lambda cl: (_train(cl, algorithm, "cpu", dtype=dtype)[0],
                            _train(cl, algorithm, "cuda", dtype=dtype)[0]))
    if algorithm not in ASYNCHRONOUS:
        for on_cpu, on_gpu in got:
            assert all(torch.equal(a, b) for a, b in zip(on_cpu, on_gpu, strict=True))
        return
    for k in range(len(got[0][0])):
        cpu_sum = sum(run[0][k] for run in got)
        gpu_sum = sum(run[1][k] for run in got)
        assert torch.isfinite(gpu_sum).all()
        if algorithm == "adpsgd":
            assert torch.equal(cpu_sum, gpu_sum)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_general_path_allocates_nothing_model_sized_on_cuda(cluster: ClusterFactory,
                                                               algorithm: str) -> None:
    c = cluster(2)
    for _, made in c.run(lambda cl: _train(cl, algorithm, "cuda", steps=5, watch=True)):
        assert made == [], made


def test_horovods_distributed_optimizer_averages_cuda_gradients(
        cluster: ClusterFactory) -> None:
    c = cluster(2)

    def work(cl: Client[torch.Tensor]) -> torch.Tensor:
        w = torch.nn.Parameter(torch.zeros(1000, device="cuda"))
        opt = dt.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), client=cl,
                                      named_parameters=[("w", w)])
        w.grad = torch.full_like(w, float(cl.rank + 1))
        opt.step()
        return w.detach().cpu()

    for w in c.run(work):
        assert torch.equal(w, torch.full((1000,), -1.5))
