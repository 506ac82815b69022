"""DistributedDataParallel and FSDP2 over torch.distributed's ``decent`` backend (issue 43): the
same parameters (losses) as over gloo, with and without torch's comm hooks, gradient buckets
reduced while backward runs (seen in the daemon's timeline), and ``torchrun`` running an
unchanged DDP script against a daemon of 4 workers (``tests/torch_ddp_worker.py`` and
``tests/torch_fsdp_worker.py`` are each rank's scripts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import Cluster, free_ports, torch_ranks
from decentd.service.timeline import trace_path
from decentd.tools.timeline_plot import read_events

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("torch_ddp_worker.py")
EXAMPLE = Path(__file__).parents[1] / "examples" / "ddp_torchrun.py"


def test_ddp_and_fsdp2_train_as_over_gloo_and_buckets_reduce_during_backward(
        tmp_path: Path) -> None:
    """DDP (50 steps; fp16 and PowerSGD hooks) and FSDP2 (a small transformer, 10 losses)
    over decent equal gloo's bit for bit on 2 ranks; the overlap, from the timeline."""
    base = tmp_path / "trace.json"
    c = Cluster(2, "ring", "--set", f"timeline.path={base}")
    try:
        stamps_file = tmp_path / "stamps.json"
        ranks = torch_ranks(c, str(WORKER), 2, {"DDP_STAMPS": str(stamps_file)})
        for r, (code, out) in enumerate(ranks):
            assert code == 0 and f"ok {r}" in out, out[-3000:]
        outs = [out for _, out in ranks]
        print(*[line for line in outs[0].splitlines() if "difference" in line or "losses" in
                line], sep="\n")
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


def test_torchrun_runs_an_unchanged_ddp_script_on_the_nodes_daemon() -> None:
    """``torchrun --nproc-per-node 4`` against a running ``decentd`` of 4 workers: torchrun
    sets RANK, LOCAL_RANK, WORLD_SIZE and MASTER_*; the script only names the backend."""
    c = Cluster(1, "ring", per_node=4)
    try:
        port = free_ports(1)[0]
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
             "--master-port", str(port), str(EXAMPLE), "--epochs", "3"],
            capture_output=True, text=True, timeout=240,
            env=dict(os.environ, DECENT_DAEMON=f"unix://{c.sockets[0]}"))
    finally:
        c.stop()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    accuracy = [float(line.split("accuracy ")[1].split()[0]) for line in proc.stdout.splitlines()
                if "test accuracy" in line]
    assert len(accuracy) == 3 and accuracy[-1] > 0.85, proc.stdout
    assert "over decent" in proc.stdout
    assert "every replica holds the same weights: True" in proc.stdout, proc.stdout
