"""DistributedDataParallel over torch.distributed's ``decent`` backend (issue 43): the same
parameters as over gloo after 50 steps, with and without torch's comm hooks, and gradient
buckets reduced while backward runs, seen in the daemon's timeline
(``tests/torch_ddp_worker.py`` is each rank's script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import Cluster, free_ports
from decentd.service.timeline import trace_path
from decentd.tools.timeline_plot import read_events

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("torch_ddp_worker.py")


def run_ranks(c: Cluster, script: Path, n: int, env: dict[str, str] | None = None
              ) -> list[str]:
    """``script`` as ranks 0..n-1 of a torch.distributed job on ``c``'s daemons (one worker
    each); their outputs, once all succeeded."""
    port = free_ports(1)[0]
    procs = [subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=dict(os.environ, **(env or {}), DECENT_DAEMON=f"unix://{c.sockets[r]}",
                 RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port)), text=True) for r in range(n)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"ok {r}" in out, out[-3000:]
    return outs


def test_ddp_trains_as_over_gloo_and_reduces_buckets_during_backward(tmp_path: Path) -> None:
    base = tmp_path / "trace.json"
    c = Cluster(2, "ring", "--set", f"timeline.path={base}")
    try:
        stamps_file = tmp_path / "stamps.json"
        outs = run_ranks(c, WORKER, 2, {"DDP_STAMPS": str(stamps_file)})
        print(*[line for line in outs[0].splitlines() if "difference" in line], sep="\n")
    finally:
        c.stop()  # the timeline is whole once the daemons stopped
    stamps = json.loads(stamps_file.read_text())
    events = read_events(trace_path(str(base), 0))
    queued = [e["ts"] for e in events if e["ph"] == "X" and e["name"] == "queued" and
              e["args"]["op"] == "allreduce"]
    # a bucket's allreduce started after backward began and before its last gradient existed,
    # at every step from the second on (DDP makes its buckets after its first step: that one
    # reduces the model as one bucket, after backward)
    overlapped = [i for i, (began, last) in enumerate(stamps)
                  if any(began <= q < last for q in queued)]
    assert overlapped == list(range(1, 50)), overlapped
