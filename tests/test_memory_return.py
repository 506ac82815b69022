"""The daemon gives memory back after a burst (issue 45, "memory that comes back").

Receive buffers idle for ``memory.pool_idle_seconds`` are freed, oldest first, down to
``memory.pool_floor_bytes``; blocks of a MiB or more are mappings of their own, so the freed
pages leave the process (its RssAnon falls), not only the pool's books.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cluster import Cluster, until
from decent.core import Client
from decentd.net.buffers import MAPPED_BLOCK, BufferPool, size_class

MiB = 1 << 20


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_idle_buffers_past_the_floor_are_freed_oldest_first() -> None:
    clock = Clock()
    pool = BufferPool(limit=64 * MiB, floor=5 * MiB, idle_seconds=2.0, clock=clock)
    a, b, c = pool.get(4 * MiB), pool.get(3 * MiB - 5), pool.get(2 * MiB)
    assert (a.size, b.size, c.size) == (4 * MiB, 3 * MiB - 5, 2 * MiB)
    assert pool.in_use_bytes == 9 * MiB and pool.allocated == 3
    pool.put(a)                      # idle since 100
    clock.now = 101.0
    pool.put(b)                      # idle since 101
    pool.put(c)
    assert (pool.idle_bytes, pool.in_use_bytes) == (9 * MiB, 0)
    clock.now = 101.9
    assert pool.trim() == 0          # nothing idle for 2 s yet
    clock.now = 102.5
    assert pool.trim() == 4 * MiB    # only the 4 MiB block is 2 s idle
    assert pool.idle_bytes == 5 * MiB
    clock.now = 200.0
    assert pool.trim() == 0          # at the floor: the rest is kept for the next step
    again = pool.get(3 * MiB - 5)
    assert pool.allocated == 3 and again.size == 3 * MiB - 5
    pool.put(again)
    assert pool.get(4 * MiB).size == 4 * MiB and pool.allocated == 4  # freed: made anew


def test_the_pool_keeps_no_more_than_its_limit_and_ignores_foreign_buffers() -> None:
    pool = BufferPool(limit=3 * MiB, floor=0, idle_seconds=1.0)
    assert pool.floor == 0
    x, y = pool.get(2 * MiB), pool.get(2 * MiB)
    pool.put(x)
    pool.put(y)  # would pass the limit: dropped
    assert (pool.idle_bytes, pool.in_use_bytes) == (2 * MiB, 0)
    pool.put(x)  # twice: the second return is not counted again
    pool.put(torch.zeros(16).numpy().view("uint8"))
    assert (pool.idle_bytes, pool.in_use_bytes) == (2 * MiB, 0)
    assert size_class(MAPPED_BLOCK + 1) == 2 * MiB and size_class(3000) == 4096


def resident(pid: int) -> dict[str, int]:
    """``pid``'s VmRSS, RssAnon, RssFile and RssShmem in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) << 10 for k, _, v in (line.partition(":") for line in f)
                if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}


@pytest.mark.slow
def test_a_daemon_gives_its_receive_buffers_back_after_a_burst() -> None:
    floor = 4 * MiB
    c = Cluster(2, "ring", "--set", f"memory.pool_floor_bytes={floor}",
                "--set", "memory.pool_idle_seconds=0.5")
    sizes = [3, 5, 7, 9, 11, 13]  # MiB of float32: ring chunks of distinct size classes

    def burst(cl: Client[Any]) -> list[float]:
        return [float(cl.allreduce(torch.full((n * MiB // 4,), cl.rank + 1.0),
                                   name=f"burst{n}")[-1]) for n in sizes]

    try:
        c.connect()
        assert c.run(burst) == [[1.5] * len(sizes)] * 2
        statuses = [c.status(i) for i in range(2)]
        held = [s.pool_bytes for s in statuses]
        anon = [resident(s.pid)["RssAnon"] for s in statuses]
        assert all(h >= 20 * MiB for h in held), held  # the burst's buffers, kept idle
        until(lambda: all(c.status(i).pool_bytes <= floor for i in range(2)),
              "the pools to shrink to their floor")
        for i, s in enumerate(statuses):
            freed = held[i] - c.status(i).pool_bytes
            assert anon[i] - resident(s.pid)["RssAnon"] >= freed * 3 // 4, (i, freed, anon[i])
        assert c.run(burst) == [[1.5] * len(sizes)] * 2  # buffers made again as needed
    finally:
        c.stop()


@pytest.mark.slow
def test_an_idle_daemon_with_one_worker_stays_under_150_mib() -> None:
    """Its arena (256 MiB by default) is reserved but none of its pages is resident before the
    worker uses it; what the daemon itself holds stays under 150 MiB."""
    c = Cluster(1, "ring", "--set", f"memory.arena_bytes={256 * MiB}")
    try:
        (cl,) = c.connect()
        assert float(cl.allreduce(torch.ones(1024), name="x")[0]) == 1.0
        mem = resident(c.status(0).pid)
        assert mem["VmRSS"] < 150 * MiB, mem
        assert mem["RssShmem"] < 1 * MiB, mem  # the arena: touched only where used
    finally:
        c.stop()
