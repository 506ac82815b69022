"""One rank of tests/test_torch_backend.py: torch.distributed over the ``decent`` backend, each
result checked against gloo's on the same inputs (a gloo group beside it), in this process."""

from __future__ import annotations

import torch
import torch.distributed as dist

import decent.torch  # noqa: F401  (registers the backend)


def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype or not torch.equal(got, want):
        raise AssertionError(f"{what}: decent gave {got}, gloo {want}")


def main() -> None:
    dist.init_process_group("decent")
    rank, size = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "decent", dist.get_backend()
    gloo = dist.new_group(backend="gloo")
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        base = (torch.arange(12).reshape(3, 4) * (rank + 1)).to(dtype)
        ours, theirs = base.clone(), base.clone()
        dist.all_reduce(ours)
        dist.all_reduce(theirs, group=gloo)
        check(f"all_reduce SUM {dtype}", ours, theirs)
        # a non-contiguous input: gloo is given a contiguous copy (given the view itself, it
        # reduces the view's first elements of the underlying memory instead: wrong values)
        strided, plain = base.clone(), base.clone()
        dist.all_reduce(strided[:, ::2])
        columns = plain[:, ::2].contiguous()
        dist.all_reduce(columns, group=gloo)
        plain[:, ::2] = columns
        check(f"all_reduce of a strided view {dtype}", strided, plain)
        ours, theirs = base.clone(), base.clone()
        dist.broadcast(ours, src=1)
        dist.broadcast(theirs, src=1, group=gloo)
        check(f"broadcast {dtype}", ours, theirs)
        ours_list = [torch.empty_like(base) for _ in range(size)]
        theirs_list = [torch.empty_like(base) for _ in range(size)]
        dist.all_gather(ours_list, base)
        dist.all_gather(theirs_list, base, group=gloo)
        for i in range(size):
            check(f"all_gather {dtype} [{i}]", ours_list[i], theirs_list[i])
        ours = torch.empty(size * 3, 4, dtype=dtype)
        theirs = torch.empty(size * 3, 4, dtype=dtype)
        dist.all_gather_into_tensor(ours, base)
        dist.all_gather_into_tensor(theirs, base, group=gloo)
        check(f"all_gather_into_tensor {dtype}", ours, theirs)
    x = torch.full((5,), float(rank + 1))
    want = x.clone()
    dist.all_reduce(want, group=gloo)
    ours = x.clone()
    dist.all_reduce(ours, op=dist.ReduceOp.AVG)
    check("all_reduce AVG", ours, want / size)
    work = dist.all_reduce(x, async_op=True)  # completes without a wait: DDP chains on it
    doubled = work.get_future().then(lambda f: f.value()[0] * 2).wait()
    check("async all_reduce's future", doubled, want * 2)
    assert work.is_completed() and work.wait()
    check("async all_reduce in place", x, want)
    dist.barrier()
    try:
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX)
    except NotImplementedError as exc:
        assert "SUM and AVG" in str(exc), exc
    else:
        raise AssertionError("MAX ran")
    try:  # shapes that differ between the ranks: decent's message, torch's error type
        dist.all_reduce(torch.ones(2 + rank))
    except dist.DistBackendError as exc:
        print("mismatch:", exc, flush=True)
        assert "MISMATCH" in str(exc) and f"[{2 + rank}]" in str(exc), exc
    else:
        raise AssertionError("all_reduce of different shapes ran")
    dist.destroy_process_group()
    print("ok", rank, flush=True)


if __name__ == "__main__":
    main()
