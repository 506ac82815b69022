"""A worker cannot pull memory from under its daemon (issue 24, "local workers").

The arena is a sealed memfd the worker cannot shrink or grow. Shared memory a worker registered
(a ``share_memory_()`` tensor) it can shrink: the daemon then reads zeros where the pages were
(its SIGBUS guard, ``decentd.workers.sigbus``), fails that worker's ops, and serves everyone else.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import decent.torch as dt
from cluster import Cluster
from decent.core import Client, DecentError
from decent.core.requests.connection import Connection
from decent_wire.v1 import decent_pb2 as pb

pytestmark = pytest.mark.slow

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: floats of a tensor large enough to be registered (64 KiB and more) and to be sent only once
#: its receiver asks (RTS/CTS: past the 2 MiB eager window), into the op's memory
N = 1 << 20


def test_a_worker_cannot_resize_its_arena_or_take_it_twice() -> None:
    c = Cluster(1, "ring")
    try:
        conn = Connection(f"unix://{c.sockets[0]}", "test", "arena", 30)
        fd = conn.arena_fd()
        try:
            size = os.fstat(fd).st_size
            assert size == conn.registration.arena_bytes
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
            for other in (0, size // 2, 2 * size):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, other)
            with pytest.raises(DecentError) as again:
                conn.arena_fd()
            assert again.value.code == pb.INVALID_ARGUMENT and "already" in again.value.message
        finally:
            os.close(fd)
            conn.close(5)
        assert c.procs[0].poll() is None
    finally:
        c.stop()


def test_the_sigbus_guard_turns_vanished_pages_into_counted_zeros() -> None:
    # in a process of its own: without the guard the touch would kill it
    script = textwrap.dedent("""
        import mmap, os
        import numpy as np
        from decentd.workers import sigbus
        from decentd.workers.arena import address_of, fault_in
        sigbus.install()
        fd = os.memfd_create("guarded")
        os.ftruncate(fd, 16 * 4096)
        m = mmap.mmap(fd, 16 * 4096)
        a = np.frombuffer(m, np.uint8)
        a[:] = 7
        sigbus.watch(address_of(m), len(m))
        os.ftruncate(fd, 4 * 4096)
        print(int(a.sum()), sigbus.faults(address_of(m)), sigbus.total())
        fault_in([memoryview(m)])
        print(sigbus.faults(address_of(m)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(7 * 4 * 4096), "12", "12", "12"]


@pytest.mark.parametrize("use", ["sends", "receives"])
def test_a_worker_that_shrinks_registered_memory_fails_its_ops_and_nothing_else(use: str) -> None:
    # "sends": the daemon sends from the vanished pages (sendmsg: EFAULT); "receives": a
    # broadcast from rank 1 lands in them (never received straight into it: a receive that hit
    # EFAULT would break the connection to rank 1)
    c = Cluster(2, "ring")
    try:
        c.connect(job="shrink")
        shared = [torch.full((N,), float(r)).share_memory_() for r in range(2)]

        def average(i: int) -> None:
            c.clients[i].neighbor_allreduce_(shared[i], name="shared", timeout=30)

        def after_shrinking(i: int) -> None:
            if use == "sends":
                average(i)
            else:
                c.clients[i].broadcast_(shared[i], root=1, name="bcast", timeout=30)

        c.run(lambda cl: average(cl.rank))
        assert [float(t[0]) for t in shared] == [0.5, 0.5]
        assert c.status(0).registered_bytes >= N * 4  # the daemon maps it
        fd = int(shared[0].untyped_storage()._get_shared_fd())
        os.ftruncate(fd, 0)  # from here on nobody in this process may touch shared[0]

        results = c.run_catching(lambda cl: after_shrinking(cl.rank))
        assert isinstance(results[0], DecentError) and results[0].code == pb.ARENA_ERROR, results
        assert "shrank" in results[0].message
        # rank 1 got zeros where rank 0's tensor was (a broadcast's root keeps its own)
        assert results[1] is None
        assert torch.equal(shared[1], torch.full((N,), 0.25 if use == "sends" else 0.5))
        with pytest.raises(DecentError) as sticky:  # the worker's memory is void: every op
            c.clients[0].allreduce(torch.ones(2), name="after")
        assert sticky.value.code == pb.ARENA_ERROR

        c.clients[0].close()  # connected again, the worker is served as before
        c.clients[0] = dt.connect(f"unix://{c.sockets[0]}", 30, job="shrink", local_rank=0)
        got = c.run(lambda cl: cl.neighbor_allreduce(torch.full((4,), 2.0 * cl.rank),
                                                     name="again", timeout=30))
        assert all(torch.equal(g, torch.ones(4)) for g in got)
        assert all(p.poll() is None for p in c.procs)
        assert "Traceback" not in c.log(0)
    finally:
        c.stop()


def shared_memory_mapped() -> tuple[int, int]:
    """This process's shared memory: mappings of memfds and /dev/shm files, and their resident
    KiB (RssShmem)."""
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if "/memfd:" in line or "/dev/shm/" in line)
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))
    return maps, rss


def test_fifty_clients_in_turn_leave_no_shared_memory_mapped() -> None:
    """Each client's arena is unmapped when it closes. Every new client counts its rounds from
    0 again, a late peer to the other daemon: before, a frame of its whose header came before
    the op that placed its rounds, and its payload after, stayed parked, and within 50 clients
    a neighbor_allreduce hung (3 of 3 runs)."""
    c = Cluster(2, "ring")
    big = torch.ones(1 << 18)  # registered (64 KiB and more), sent eagerly (1 MiB)

    def ops(cl: Client[Any]) -> None:  # results dropped at once
        cl.allreduce(big, name="a")
        cl.neighbor_allreduce(big, name="n")
        cl.broadcast(torch.ones(1000), 0, name="b")
        cl.allgather(torch.ones(10), name="g")

    try:
        before = shared_memory_mapped()
        for _ in range(50):
            c.connect()
            mapped = shared_memory_mapped()  # each client's arena, while it runs
            c.run(ops)
            c.disconnect()
        assert mapped[0] > before[0]
        assert shared_memory_mapped() == before
    finally:
        c.kill()


def test_workers_of_many_jobs_hold_at_most_max_arenas() -> None:
    """Before, twelve workers of twelve jobs took 3 GB of arenas from one daemon unbounded: past
    ``memory.max_arenas`` a worker is refused, naming the jobs, until another closes."""
    c = Cluster(1, "ring", "--set", "memory.max_arenas=2")
    try:
        held = [dt.connect(f"unix://{c.sockets[0]}", 30, job=f"job{i}") for i in range(2)]
        with pytest.raises(DecentError) as refused:
            dt.connect(f"unix://{c.sockets[0]}", 30, job="job2")
        assert refused.value.code == pb.RESOURCE_EXHAUSTED
        assert "memory.max_arenas=2; jobs 'job0' (1), 'job1' (1)" in str(refused.value)
        assert c.status(0).workers == 2
        held.pop().close()
        third = dt.connect(f"unix://{c.sockets[0]}", 30, job="job2")
        assert float(third.allreduce(torch.ones(3), name="x")[0]) == 1.0
        for cl in (*held, third):
            cl.close()
    finally:
        c.stop()
