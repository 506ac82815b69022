"""One rank of tests/test_torch_backend.py: torch.distributed over the ``decent`` backend, each
result checked against gloo's on the same inputs (a gloo group beside it), in this process.

The inputs are integers (in every dtype), so sums are exact in any order: every result must
equal gloo's bit for bit, however many ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch_ddp_decentralized import decentralized_mode_follows_the_recursion

import decent.torch  # noqa: F401  (registers the backend)

#: every dtype decent carries
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.int16, torch.int8, torch.uint8)
#: every reduce op the backend runs
OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN,
       dist.ReduceOp.MAX)


def check(what: str, got: Any, want: Any) -> None:
    if isinstance(got, list):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            check(f"{what}[{i}]", g, w)
        return
    if got.dtype != want.dtype or not torch.equal(got, want):
        raise AssertionError(f"{what}: decent gave {got}, gloo {want}")


#: dtypes gloo does not reduce: its reference runs on int32 copies, cast back (exact: the
#: values are small integers, and a wrapping product wraps the same either way)
WIDENED = {torch.int16: torch.int32}


def cast(x: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return x
    return [cast(v, dtype) for v in x] if isinstance(x, list) else x.to(dtype)


def both(what: str, make: Callable[[], Any], run: Callable[[Any, Any], Any],
         gloo: Any, group: Any = None) -> None:
    """``run(inputs, group)`` over decent and over gloo on inputs from ``make()``; the results
    (what ``run`` returns) must be equal."""
    ours = run(make(), group)
    inputs = make()
    dtype = (inputs[0] if isinstance(inputs, list) else inputs).dtype
    theirs = cast(run(cast(inputs, WIDENED.get(dtype)), gloo), dtype if dtype in WIDENED
                  else None)
    check(what, ours, theirs)


def base(rank: int, dtype: torch.dtype, rows: int = 3) -> torch.Tensor:
    """Small integers that differ per rank (products stay exact in every dtype)."""
    return ((torch.arange(rows * 4).reshape(rows, 4) % 3) + rank + 1).to(dtype)


def collectives(rank: int, size: int, dtype: torch.dtype, gloo: Any, group: Any = None) -> None:
    """Every collective over ``group`` (None: the default) vs. gloo's group ``gloo``."""
    n = size if group is None else dist.get_world_size(group)
    me = rank if group is None else dist.get_group_rank(group, rank)

    def all_reduce(op: Any) -> Callable[[Any, Any], Any]:
        def run(t: torch.Tensor, g: Any) -> torch.Tensor:
            dist.all_reduce(t, op=op, group=g)
            return t
        return run

    for op in OPS:
        if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
            continue  # gloo refuses AVG: decent's integer average rounds half up (docs)
        if op == dist.ReduceOp.AVG:  # gloo has no AVG: its SUM divided by the ranks
            t = base(rank, dtype)
            dist.all_reduce(t, op=op, group=group)
            want = base(rank, dtype)
            dist.all_reduce(want, group=gloo)
            check(f"all_reduce AVG {dtype}", t, (want.double() / n).to(dtype))
            continue
        both(f"all_reduce {op} {dtype}", lambda: base(rank, dtype), all_reduce(op), gloo, group)
    # a strided view: gloo is given a contiguous copy (given the view itself, it reduces the
    # first elements of the underlying memory instead: wrong values)
    strided, plain = base(rank, dtype), base(rank, dtype)
    dist.all_reduce(strided[:, ::2], group=group)
    columns = plain[:, ::2].contiguous().to(WIDENED.get(dtype, dtype))
    dist.all_reduce(columns, group=gloo)
    plain[:, ::2] = columns
    check(f"all_reduce of a strided view {dtype}", strided, plain)
    root = n - 1

    def broadcast(t: torch.Tensor, g: Any) -> torch.Tensor:
        dist.broadcast(t, group_src=root, group=g)
        return t
    both(f"broadcast {dtype}", lambda: base(rank, dtype), broadcast, gloo, group)
    reduce_op = dist.ReduceOp.MAX if dtype in (torch.int8, torch.uint8) else dist.ReduceOp.SUM

    def reduce(t: torch.Tensor, g: Any) -> torch.Tensor:
        dist.reduce(t, group_dst=root, op=reduce_op, group=g)
        return t if me == root else torch.zeros(0, dtype=t.dtype)
    both(f"reduce {dtype}", lambda: base(rank, dtype), reduce, gloo, group)

    def all_gather(t: torch.Tensor, g: Any) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(out, t, group=g)
        return out
    both(f"all_gather {dtype}", lambda: base(rank, dtype), all_gather, gloo, group)

    def all_gather_into(t: torch.Tensor, g: Any) -> torch.Tensor:
        out = torch.empty(n * 3, 4, dtype=t.dtype)
        dist.all_gather_into_tensor(out, t, group=g)
        return out
    both(f"all_gather_into_tensor {dtype}", lambda: base(rank, dtype), all_gather_into, gloo,
         group)

    def reduce_scatter(ts: list[torch.Tensor], g: Any) -> torch.Tensor:
        out = torch.empty_like(ts[0])
        dist.reduce_scatter(out, ts, op=reduce_op, group=g)
        return out
    both(f"reduce_scatter {dtype}", lambda: [base(rank + i, dtype) for i in range(n)],
         reduce_scatter, gloo, group)

    def reduce_scatter_tensor(t: torch.Tensor, g: Any) -> torch.Tensor:
        out = torch.empty(2, 4, dtype=t.dtype)
        dist.reduce_scatter_tensor(out, t, op=reduce_op, group=g)
        return out
    both(f"reduce_scatter_tensor {dtype}", lambda: base(rank, dtype, 2 * n),
         reduce_scatter_tensor, gloo, group)

    def gather(t: torch.Tensor, g: Any) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(n)] if me == root else None
        dist.gather(t, out, group_dst=root, group=g)
        return out or []
    both(f"gather {dtype}", lambda: base(rank, dtype), gather, gloo, group)

    def scatter(ts: list[torch.Tensor], g: Any) -> torch.Tensor:
        out = torch.empty_like(ts[0])
        dist.scatter(out, ts if me == root else None, group_src=root, group=g)
        return out
    both(f"scatter {dtype}", lambda: [base(rank + i, dtype) for i in range(n)], scatter,
         gloo, group)

    def all_to_all(ts: list[torch.Tensor], g: Any) -> list[torch.Tensor]:
        out = [torch.empty(2, 4, dtype=ts[0].dtype) for _ in range(n)]  # gloo: equal shapes
        dist.all_to_all(out, ts, group=g)
        return out
    both(f"all_to_all {dtype}", lambda: [base(rank + 10 * i, dtype, 2) for i in range(n)],
         all_to_all, gloo, group)
    splits_in = [1 + i for i in range(n)]  # rows to rank i: 1 + i
    splits_out = [1 + me] * n

    def all_to_all_single(t: torch.Tensor, g: Any) -> torch.Tensor:
        out = torch.empty(sum(splits_out), 4, dtype=t.dtype)
        dist.all_to_all_single(out, t, splits_out, splits_in, group=g)
        return out
    both(f"all_to_all_single {dtype}", lambda: base(rank, dtype, sum(splits_in)),
         all_to_all_single, gloo, group)


def point_to_point(rank: int, size: int, gloo: Any) -> None:
    """send/recv, isend/irecv and batch_isend_irecv around the ring, vs. gloo."""
    right, left = (rank + 1) % size, (rank - 1) % size

    def ring(t: torch.Tensor, g: Any) -> torch.Tensor:
        got = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, right, g), dist.P2POp(dist.irecv, got, left, g)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return got
    both("batch_isend_irecv", lambda: base(rank, torch.float32), ring, gloo)

    def blocking(t: torch.Tensor, g: Any) -> torch.Tensor:
        got = torch.empty_like(t)
        if rank % 2 == 0:
            dist.send(t, right, group=g, tag=7)
            dist.recv(got, left, group=g, tag=7)
        else:
            dist.recv(got, left, group=g, tag=7)
            dist.send(t, right, group=g, tag=7)
        return got
    both("send/recv", lambda: base(rank, torch.int64), blocking, gloo)


def main() -> None:
    dist.init_process_group("decent")
    rank, size = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "decent", dist.get_backend()
    gloo = dist.new_group(backend="gloo")
    # every dtype on 2 ranks; on more (4 workers on 2 daemons: the node-level paths), one of
    # each kind (a float, a 16-bit float, an integer)
    for dtype in DTYPES if size == 2 else (torch.float32, torch.bfloat16, torch.int64):
        collectives(rank, size, dtype, gloo)
    point_to_point(rank, size, gloo)
    # two groups: the even ranks and the odd ones, run at once without mixing (each with its
    # gloo twin); with 2 ranks, each group is one rank
    evens, odds = list(range(0, size, 2)), list(range(1, size, 2))
    ours = [dist.new_group(evens), dist.new_group(odds)]
    theirs = [dist.new_group(evens, backend="gloo"), dist.new_group(odds, backend="gloo")]
    mine = rank % 2
    for dtype in (torch.float32, torch.int32):
        collectives(rank, size, dtype, theirs[mine], ours[mine])
    asyncs()
    half = max(1, size // 2)  # new_subgroups: consecutive ranks, half of them each
    sub, _ = dist.new_subgroups(group_size=half)
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x, group=sub)
    first = rank - rank % half
    check("new_subgroups all_reduce", x, torch.tensor([float(sum(range(first + 1, first + half
                                                                      + 1)))]))
    x = torch.full((5,), float(rank + 1))
    want = x.clone()
    dist.all_reduce(want, group=gloo)
    work = dist.all_reduce(x, async_op=True)  # completes without a wait: DDP chains on it
    doubled = work.get_future().then(lambda f: f.value()[0] * 2).wait()
    check("async all_reduce's future", doubled, want * 2)
    assert work.is_completed() and work.wait()
    check("async all_reduce in place", x, want)
    dist.barrier()
    dist.barrier(group=ours[mine])
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND)
    except NotImplementedError as exc:
        assert "SUM, AVG, PRODUCT, MIN and MAX" in str(exc), exc
    else:
        raise AssertionError("BAND ran")
    try:  # shapes that differ between the ranks: decent's message, torch's error type
        dist.all_reduce(torch.ones(2 + rank))
    except dist.DistBackendError as exc:
        print("mismatch:", exc, flush=True)
        assert "MISMATCH" in str(exc) and f"[{2 + rank}]" in str(exc), exc
    else:
        raise AssertionError("all_reduce of different shapes ran")
    try:  # an all_to_all whose splits disagree: every rank fails it, naming the rows
        out = torch.empty(1 + rank, dtype=torch.float32)
        dist.all_to_all_single(out, torch.ones(size), [1 + rank] + [0] * (size - 1),
                               [1] * size)
    except dist.DistBackendError as exc:
        print("splits:", exc, flush=True)
        assert "MISMATCH" in str(exc) and "rows" in str(exc), exc
    else:
        raise AssertionError("all_to_all_single with splits that disagree ran")
    decentralized_mode_follows_the_recursion()  # DDP's decentralized mode
    dist.destroy_process_group()
    print("ok", rank, flush=True)


def asyncs() -> None:
    """Collectives started together with ``async_op=True`` end in any order of waiting."""
    rank, size = dist.get_rank(), dist.get_world_size()
    a, b = torch.full((3,), float(rank)), torch.full((2, 2), rank + 1, dtype=torch.int64)
    outs = [torch.empty(2, 2, dtype=torch.int64) for _ in range(size)]
    works = [dist.all_reduce(a, op=dist.ReduceOp.MAX, async_op=True),
             dist.all_gather(outs, b, async_op=True),
             dist.reduce_scatter_tensor(torch.empty(1), torch.ones(size), async_op=True)]
    for work in reversed(works):
        work.wait()
    check("async MAX", a, torch.full((3,), float(size - 1)))
    check("async all_gather", outs, [torch.full((2, 2), r + 1, dtype=torch.int64)
                                     for r in range(size)])


if __name__ == "__main__":
    main()
