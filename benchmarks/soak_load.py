"""Load held: 8 local workers do 4 KiB ``neighbor_allreduce`` ops as fast as they can, then 64 MiB
ones, and the daemons must not grow (``make soak``'s second part).

    .venv/bin/decentrun -np 8 --nodes 2 -- .venv/bin/python benchmarks/soak_load.py \\
        [--small-s 300] [--large-s 60] [--large-mib 64] [--json benchmarks/results/soak_load.json]

Each worker runs out-of-place ``neighbor_allreduce(x)`` on a plain float32 tensor (the path users
call) in rounds of ops; after each round an ``allreduce`` of rank 0's stop flag ends the phase on
every rank together once ``--small-s`` (``--large-s``) seconds have passed. Measured per phase:
ops per second over all workers, p50 and p99 latency (the median of the ranks' p50s, the worst of
their p99s), and each daemon's RSS, open descriptors and CPU seconds per second, sampled by its
local rank 0 after the phase's first round (warm), every ``--sample-s`` seconds and at its
end; *flat* when from the phase's middle to its end RSS grows by at most 10% and descriptors by
at most 4. Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import Progress

import decent.torch as dt


def phases(a: argparse.Namespace) -> list[tuple[str, int, int, float]]:
    """(phase, float32 elements, ops per round, seconds): 4 KiB, then ``--large-mib`` MiB."""
    return [("4 KiB", 1024, 200, a.small_s),
            (f"{a.large_mib} MiB", a.large_mib << 18, 2, a.large_s)]


def daemon_sample(client: Any) -> list[float]:
    """[pid, RSS MB, descriptors, CPU seconds, time] of this worker's daemon (zeros when this
    is not its local rank 0)."""
    if client.local_rank != 0:
        return [0.0] * 5
    st = client.status()
    with open(f"/proc/{st.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return [float(st.pid), st.rss_bytes / 2**20, float(len(os.listdir(f"/proc/{st.pid}/fd"))),
            cpu, time.time()]


def gathered(client: Any, row: list[float]) -> np.ndarray:
    """Every rank's ``row``, in rank order."""
    return client.values(client.allgather(torch.tensor([row], dtype=torch.float64)))


def phase(client: Any, name: str, numel: int, per_round: int, seconds: float,
          sample_s: float, progress: Progress | None) -> dict[str, Any]:
    """One phase on every rank; rank 0's summary."""
    x = torch.ones(numel)
    lat: list[float] = []
    task = progress.add_task(name, total=seconds) if progress else None
    start = deadline = next_sample = 0.0
    samples: list[np.ndarray] = []
    while True:
        for _ in range(per_round):
            t = time.perf_counter()
            client.neighbor_allreduce(x)
            lat.append(time.perf_counter() - t)
        if not samples:  # after a warm round
            start = time.time()
            deadline, next_sample, lat = start + seconds, start, []
        now = time.time() if client.rank == 0 else 0.0
        # rank 0 decides for every rank: stop, or take a sample of the daemons now
        flag = torch.tensor([float(now >= deadline), float(now >= next_sample)])
        stop, sample = (v > 0 for v in client.values(client.allreduce(flag, op="sum")))
        if sample or stop:
            samples.append(gathered(client, daemon_sample(client)))
            next_sample += sample_s
        if progress is not None and task is not None:
            progress.update(task, completed=min(seconds, time.time() - start))
        if stop:
            break
    elapsed = time.time() - start
    first, mid, last = samples[0], samples[len(samples) // 2], samples[-1]
    mine = [len(lat), 1e3 * float(np.percentile(lat, 50)), 1e3 * float(np.percentile(lat, 99))]
    ranks = gathered(client, mine)
    daemons = [{"pid": int(a[0]), "rss_mb": [round(a[1], 1), round(m[1], 1), round(b[1], 1)],
                "fds": [int(a[2]), int(m[2]), int(b[2])],
                "cpu_per_s": (b[3] - a[3]) / max(b[4] - a[4], 1e-9),
                "rss_series": [[round(s[d][4] - a[4], 1), round(s[d][1], 1)] for s in samples],
                "flat": bool(b[1] <= 1.1 * m[1] and b[2] <= m[2] + 4)}
               for d, (a, m, b) in enumerate(zip(first, mid, last, strict=True)) if a[0] > 0]
    return {"name": name, "bytes": 4 * numel, "seconds": elapsed,
            "ops_per_s": float(ranks[:, 0].sum()) / elapsed,
            "p50_ms": statistics.median(ranks[:, 1]), "p99_ms": float(ranks[:, 2].max()),
            "daemons": daemons}


def main() -> int:
    """Both phases; rank 0 prints and writes the JSON."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--small-s", type=float, default=300.0, help="seconds of 4 KiB ops (300)")
    p.add_argument("--large-s", type=float, default=60.0, help="seconds of large ops (60)")
    p.add_argument("--large-mib", type=int, default=64, help="MiB of a large op (64)")
    p.add_argument("--sample-s", type=float, default=30.0,
                   help="seconds between samples of the daemons (30)")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/soak_load.json"))
    a = p.parse_args()
    torch.set_num_threads(1)
    client = dt.connect()
    with Progress(disable=client.rank != 0) as progress:
        out = [phase(client, name, numel, per_round, seconds, a.sample_s,
                     progress if client.rank == 0 else None)
               for name, numel, per_round, seconds in phases(a)]
    if client.rank == 0:
        res = {"workers": client.size, "phases": out}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res, indent=1))
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
