"""The TensorFlow client against the torch client on the same op and tensor, in one run.

    .venv/bin/decentrun -np 2 --nodes 2 -- .venv/bin/python benchmarks/tf_vs_torch.py \\
        [--mbytes 64] [--repeats 15] [--json benchmarks/results/tf_vs_torch.json]

Every rank opens a torch client and a TensorFlow client (a job of its own beside the torch one)
on its daemon and times ``neighbor_allreduce(x)`` (out of place, blocking) on the same values:
a torch tensor and a ``tf.Tensor``, interleaved call by call after a barrier, ``--repeats``
times after warm-up. Results are checked exactly. Rank 0 writes the medians, their ratio, JSON
and a bar chart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.netns_dsgd import decent_source  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
WARMUP = 3


def timed(fn: Any) -> tuple[float, Any]:
    """Seconds one call of ``fn`` took, and its result."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    """Time both clients; rank 0 reports."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbytes", type=float, default=64.0, help="tensor size in MiB")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path, default=RESULTS / "tf_vs_torch.json")
    a = ap.parse_args(argv)
    import numpy as np
    import tensorflow as tf
    import torch

    import decent.tf as dtf
    import decent.torch as dt

    torch.set_num_threads(1)
    tc = dt.connect()
    tfc = dtf.connect(job=os.environ.get("DECENT_JOB", "bench") + ".tf")
    n = int(a.mbytes * (1 << 20)) // 4
    values = np.arange(n, dtype=np.float32) % 1000 + tc.rank
    x_torch, x_tf = torch.from_numpy(values.copy()), tf.constant(values)
    want = np.arange(n, dtype=np.float32) % 1000 + 0.5
    times: dict[str, list[float]] = {"torch": [], "tf": []}
    exact = True
    for k in range(WARMUP + a.repeats):
        tc.barrier(name="tvt.b")
        dt_torch, out_t = timed(lambda: tc.neighbor_allreduce(x_torch, name="tvt.torch"))
        tc.barrier(name="tvt.b2")
        dt_tf, out_f = timed(lambda: tfc.neighbor_allreduce(x_tf, name="tvt.tf"))
        exact &= bool(np.array_equal(out_t.numpy(), want) and np.array_equal(out_f.numpy(), want))
        del out_t, out_f
        if k >= WARMUP:
            times["torch"].append(dt_torch)
            times["tf"].append(dt_tf)
    rank = tc.rank
    tfc.close()
    tc.close()
    if rank != 0:
        return 0 if exact else 1
    med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    res = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "decent_source": decent_source(), "mbytes": a.mbytes, "repeats": a.repeats,
           "exact": exact, "torch_ms": med["torch"], "tf_ms": med["tf"],
           "ratio": med["tf"] / med["torch"]}
    report(res, a.json)
    return 0 if exact else 1


def report(res: dict[str, Any], path: Path) -> None:
    """Console line, JSON and a bar chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    print(f"{res['mbytes']:g} MiB neighbor_allreduce: torch {res['torch_ms']:.1f} ms, "
          f"TensorFlow {res['tf_ms']:.1f} ms: {res['ratio']:.2f}x; exact {res['exact']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(["torch", "TensorFlow"], [res["torch_ms"], res["tf_ms"]])
    ax.set_ylabel("ms per call (median)")
    ax.set_title(f"{res['mbytes']:g} MiB neighbor_allreduce, 2 ranks")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    sys.exit(main())
