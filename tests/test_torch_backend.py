"""torch.distributed's ``decent`` backend with real daemons (issue 43, first part): two ranks,
each a process of its own as torch.distributed wants, run every covered collective, blocking
and asynchronous, over decent and over gloo on the same inputs, and compare them bit for bit
(:mod:`decent.torch.distributed`; the ranks' script: ``tests/torch_backend_worker.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import DECENTRUN_ARENA, Cluster, torch_ranks

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("torch_backend_worker.py")
FAULTS = Path(__file__).with_name("torch_backend_faults.py")
DECENTRUN = [sys.executable, "-m", "decentd.tools.launcher"]


def test_collectives_over_the_decent_backend_equal_gloos() -> None:
    """Every collective against gloo, groups, point to point, and DDP's decentralized mode
    against numpy's D-SGD recursion (``tests/torch_ddp_decentralized.py``)."""
    c = Cluster(2, "ring")
    try:
        for r, (code, out) in enumerate(torch_ranks(c, str(WORKER), 2)):
            assert code == 0 and f"ok {r}" in out, out[-3000:]
    finally:
        c.stop()


def test_decentrun_gives_init_process_group_all_it_needs() -> None:
    """Under ``decentrun`` (4 workers on 2 daemons: collectives that span both levels) the
    script needs nothing set by hand: decentrun sets torch's store address too."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([*DECENTRUN, "-np", "4", "--nodes", "2", *DECENTRUN_ARENA, "--",
                           sys.executable, str(WORKER)], capture_output=True, text=True,
                          env=env, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for r in range(4):
        assert f"[{r}] ok {r}" in proc.stdout, proc.stdout[-3000:]


def test_timeouts_lost_ranks_and_a_second_init() -> None:
    """``timeout=`` of ``init_process_group`` ends an op another rank never joins; a rank
    that left fails the collectives that need it (well within the timeout); the process group
    can be destroyed and made again (``tests/torch_backend_faults.py``)."""
    c = Cluster(2, "ring")
    try:
        (code0, out0), (code1, out1) = torch_ranks(c, str(FAULTS), 2, timeout=120)
        assert code0 == 0 and "ok 0" in out0, out0[-3000:]
        assert code1 == 0 and "again 1" in out1, out1[-3000:]
    finally:
        c.stop()
