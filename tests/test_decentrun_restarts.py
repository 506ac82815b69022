"""``decentrun --max-restarts K``: a failed node (worker or daemon) is started again in place,
up to K times over the job; the failure after that tears everything down with its code.

Real processes throughout: the worker scripts synchronise through files they write, never
through fixed sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cluster import DECENTRUN_ARENA

pytestmark = pytest.mark.slow

RUN = [sys.executable, "-m", "decentd.tools.launcher"]

#: a worker script's helpers: ``wait_for(path)`` polls for a file another worker writes, and
#: ``publish(path, text)`` writes one atomically (a reader never sees it half-written)
HELPERS = """
import os, sys, time
def wait_for(path, timeout=60):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {path}")
        time.sleep(0.02)
def publish(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
"""


def write_script(tmp_path: Path, body: str) -> Path:
    """The worker script ``body`` (after :data:`HELPERS`), with ``TMP`` the test's directory."""
    script = tmp_path / "w.py"
    script.write_text(HELPERS + f"TMP = {str(tmp_path)!r}\n" + textwrap.dedent(body))
    return script


def decentrun(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Run decentrun to its end."""
    return subprocess.run([*RUN, *DECENTRUN_ARENA, *args], capture_output=True, text=True,
                          timeout=timeout)


def running(pattern: str) -> list[str]:
    """Pids (besides pgrep's) whose command line contains ``pattern``, zombies excluded."""
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True,
                          text=True).stdout.split()
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def test_failed_worker_restarts_its_node_and_the_job_succeeds(tmp_path: Path) -> None:
    script = write_script(tmp_path, """
        rank, restart = int(os.environ["DECENT_RANK"]), os.environ.get("DECENT_RESTART")
        marker = os.path.join(TMP, "failed-once")
        if rank == 1 and restart is None and not os.path.exists(marker):
            publish(marker, "")
            sys.exit(3)
        import decent.torch as dt
        c = dt.connect()
        print(f"rank={c.rank} restart={restart}", flush=True)
        c.close()
    """)
    proc = decentrun("-np", "2", "--nodes", "2", "--max-restarts", "1", "--", sys.executable,
                     str(script))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "decentrun: rank 1 exited with 3; restarting node 1 (restart 1 of 1)" in proc.stderr
    assert "[1] rank=1 restart=1" in proc.stdout, out
    assert "[0] rank=0 restart=None" in proc.stdout, out  # node 0 ran once, untouched
    assert proc.stderr.count("restarting node") == 1, out


def test_failure_after_the_last_restart_tears_everything_down(tmp_path: Path) -> None:
    script = write_script(tmp_path, """
        rank = int(os.environ["DECENT_RANK"])
        ready = os.path.join(TMP, "rank0")
        if rank == 1:
            wait_for(ready)  # rank 0 is up: the teardown below has a live worker to stop
            sys.exit(3)
        import decent.torch as dt
        c = dt.connect()
        publish(ready, f"{os.getpid()} {os.environ['DECENT_DAEMON']}")
        time.sleep(3600)  # decentrun must stop this (else the run times out)
    """)
    proc = decentrun("-np", "2", "--nodes", "2", "--max-restarts", "1", "--", sys.executable,
                     str(script))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "decentrun: rank 1 exited with 3; restarting node 1 (restart 1 of 1)" in proc.stderr
    assert "decentrun: rank 1 failed (exit 3); no restarts left (1 used of 1)" in proc.stderr
    pid, daemon = (tmp_path / "rank0").read_text().split()
    workdir = os.path.dirname(daemon.removeprefix("unix://"))
    assert running(str(tmp_path)) == [], "a worker is still running"
    assert running(workdir) == [], "a daemon is still running"
    assert not Path(f"/proc/{pid}").exists() or \
        Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert not os.path.exists(workdir)


def test_killed_daemon_restarts_its_node_and_the_job_succeeds(tmp_path: Path) -> None:
    script = write_script(tmp_path, """
        import decent.torch as dt
        rank, restart = int(os.environ["DECENT_RANK"]), os.environ.get("DECENT_RESTART")
        done = os.path.join(TMP, "rank0-done")
        c = dt.connect()
        if rank == 1:
            wait_for(done)  # rank 0's second run, on its restarted daemon
            print(f"rank=1 restart={restart}", flush=True)
            c.close()
            sys.exit(0)
        if restart is None:
            publish(os.path.join(TMP, "daemon0.pid"), str(c.status().pid))
            while True:  # until the test kills our daemon
                c.status()
                time.sleep(0.05)
        print(f"rank=0 restart={restart} daemon={c.status().pid}", flush=True)
        c.close()
        publish(done, "")
    """)
    pid_file = tmp_path / "daemon0.pid"
    killed: list[int] = []

    def kill_daemon() -> None:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid_file.exists():
            killed.append(int(pid_file.read_text()))
            os.kill(killed[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_daemon, daemon=True)
    killer.start()
    proc = decentrun("-np", "2", "--nodes", "2", "--max-restarts", "1", "--", sys.executable,
                     str(script))
    killer.join(timeout=5)
    out = proc.stdout + proc.stderr
    assert killed, out
    assert proc.returncode == 0, out
    # whichever decentrun saw first, the daemon's death or its worker's failure, node 0 restarts
    assert "restarting node 0 (restart 1 of 1)" in proc.stderr, out
    assert proc.stderr.count("restarting node") == 1, out
    assert "[0] rank=0 restart=1 daemon=" in proc.stdout, out
    new_daemon = int(proc.stdout.split("[0] rank=0 restart=1 daemon=")[1].split()[0])
    assert new_daemon != killed[0]
    assert "[1] rank=1 restart=None" in proc.stdout, out
