"""One rank of tests/test_torch_backend.py's fault test: an op another rank never joins times
out after ``init_process_group``'s ``timeout``; ``destroy_process_group`` releases the client
and the process inits again; an op a lost rank cannot join fails with torch's error type, not a
hang. Ranks step together through torch's store (events, no sleeps)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import decent.torch  # noqa: F401  (registers the backend)


def main() -> None:
    dist.init_process_group("decent", timeout=timedelta(seconds=3))
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:  # an all_reduce rank 1 never joins: the group's 3 s timeout ends it
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
        except dist.DistBackendError as exc:
            print(f"timed out after {time.monotonic() - started:.1f}s: {exc}", flush=True)
            assert "TIMEOUT" in str(exc), exc
        else:
            raise AssertionError("an all_reduce that rank 1 never joined completed")
        store.set("timed out", "1")
    else:
        store.wait(["timed out"], timedelta(seconds=60))
    dist.destroy_process_group()  # rounds out of step now: start afresh

    dist.init_process_group("decent", timeout=timedelta(seconds=60))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), 3.0)), t
    print("again", rank, flush=True)
    if rank == 1:
        dist.barrier()
        os._exit(0)  # lost: its daemon tells rank 0's that it left
    dist.barrier()
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except dist.DistBackendError as exc:
        print(f"lost peer after {time.monotonic() - started:.1f}s: {exc}", flush=True)
        assert "PEER_UNAVAILABLE" in str(exc) and "rank 1" in str(exc), exc
    else:
        raise AssertionError("an all_reduce with a lost rank completed")
    dist.destroy_process_group()
    print("ok", rank, flush=True)


if __name__ == "__main__":
    main()
