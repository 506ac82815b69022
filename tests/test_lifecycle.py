"""Daemon start, configuration errors, clean shutdown, and the decentrun launcher."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from cluster import Cluster, free_ports, until
from decent.core import DecentError
from decent_wire.v1 import decent_pb2 as pb


def decentd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "decentd", *args], capture_output=True,
                          text=True, timeout=timeout)


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("decent")}


def new_shm_names(before: set[str], wait: float = 10.0) -> set[str]:
    """Segments that appeared since ``before`` and are still there after up to ``wait`` s
    (a killed daemon's resource tracker removes what it held a moment after the kill)."""
    deadline = time.monotonic() + wait
    while (left := shm_names() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.slow
@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("topology:\n  kind: rng\n", ["topology.kind", "rng"]),
        ("timeouts:\n  op: -3\n", ["timeouts.op", "-3"]),
        ("bogus_key: 1\n", ["bogus_key", "unknown key"]),
        ("peers: [127.0.0.1:1, 127.0.0.1:2]\nrank: 5\n", ["rank 5", "peers"]),
        ("peers: [not-an-address]\n", ["peers", "not-an-address"]),
        ("memory:\n  arena_bytes: lots\n", ["memory.arena_bytes", "lots"]),
        ("topology: [1, 2\n", ["not valid YAML"]),
        # found by the daemon as it starts, not by the config model: exit 2 all the same
        ("security:\n  worker_group: no-such-group-of-decent\n", ["security.worker_group"]),
        ("topology:\n  weights: {0: {0: 2.0}}\n", ["topology", "row 0 sums to 2"]),
    ],
)
def test_config_errors_name_key_and_value(tmp_path: Path, yaml_text: str,
                                          expected: list[str]) -> None:
    cfg = tmp_path / "node.yaml"
    cfg.write_text(yaml_text)
    proc = decentd("--config", str(cfg))
    assert proc.returncode == 2, proc.stderr
    assert "config error" in proc.stderr
    for word in expected:
        assert word in proc.stderr, (word, proc.stderr)


def test_flags_override_file(tmp_path: Path) -> None:
    from decentd.service.cli import build_parser, overrides_from
    from decentd.service.config import load_config

    cfg = tmp_path / "node.yaml"
    cfg.write_text("topology:\n  kind: ring\ntimeouts:\n  op: 5\n")
    args = build_parser().parse_args(["--config", str(cfg), "--topology", "full",
                                      "--set", "timeouts.op=7.5"])
    conf = load_config(args.config, overrides_from(args))
    assert conf.topology.kind == "full" and conf.timeouts.op == 7.5
    assert load_config(None).topology.kind == "ring"  # defaults need no file


@pytest.mark.slow
def test_missing_peers_named_after_start_timeout() -> None:
    ports = free_ports(3)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    proc = decentd("--rank", "0", "--peers", peers, "--set", "timeouts.start=1.5",
                   "--socket", f"/tmp/decent-test-missing-{os.getpid()}.sock")
    assert proc.returncode == 1
    assert "rank(s) 1 (127.0.0.1:" in proc.stderr and f"2 (127.0.0.1:{ports[2]})" in proc.stderr


@pytest.mark.slow
def test_cluster_id_mismatch_refused(tmp_path: Path) -> None:
    ports = free_ports(2)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "decentd", "--rank", str(i), "--peers", peers,
         "--cluster-id", f"cluster-{i}", "--socket", str(tmp_path / f"{i}.sock"),
         "--set", "timeouts.start=5"],
        stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [1, 1]
    # whichever daemon handshakes first is refused and says why; the other may instead find
    # its peer gone by then, and says which rank is missing
    refused = [err for err in outs if "CLUSTER_MISMATCH" in err]
    assert refused, outs
    assert all("cluster-0" in err and "cluster-1" in err for err in refused)
    assert all("CLUSTER_MISMATCH" in err or "rank(s)" in err for err in outs)


@pytest.mark.slow
def test_daemons_with_different_topologies_refuse_each_other(tmp_path: Path) -> None:
    ports = free_ports(2)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "decentd", "--rank", str(i), "--peers", peers,
         "--topology", kind, "--socket", str(tmp_path / f"{i}.sock"),
         "--set", "timeouts.start=5"],
        stderr=subprocess.PIPE, text=True) for i, kind in enumerate(["ring", "full"])]
    outs = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [1, 1]
    refused = [err for err in outs if "runs another topology" in err]
    assert refused and all("give every daemon the same topology" in err for err in refused), outs


@pytest.mark.slow
def test_close_returns_once_the_daemon_let_the_worker_go() -> None:
    # a job started right after close() must find the daemon without the old worker (its
    # history is forgotten only then): close() waits for the daemon, frozen here for a while
    c = Cluster(2, "ring")
    try:
        c.connect()
        os.kill(c.procs[0].pid, signal.SIGSTOP)
        try:
            closing = threading.Thread(target=c.clients[0].close)
            closing.start()
            closing.join(timeout=0.5)
            assert closing.is_alive(), "close() returned while the daemon could not answer"
        finally:
            os.kill(c.procs[0].pid, signal.SIGCONT)
        closing.join(timeout=30)
        assert not closing.is_alive(), "close() did not return once the daemon ran again"
        assert c.status(0).workers == 0
    finally:
        assert c.stop() == [0, 0]


@pytest.mark.slow
def test_a_result_not_read_before_close_fails_clearly() -> None:
    # the op finished, but its result was still in the arena when the client closed
    c = Cluster(2, "ring")
    try:
        c.connect()
        cl = c.clients[0]
        h = cl.neighbor_allreduce_async(torch.ones(4), name="unread", self_weight=1.0,
                                        src_weights={}, dst_weights=[])
        deadline = time.monotonic() + 30
        while not h.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        cl.close()
        with pytest.raises(DecentError, match=r"'unread'.*closed before its result was read"):
            h.wait(timeout=10)
    finally:
        assert c.stop() == [0, 0]


@pytest.mark.slow
def test_sigterm_fails_in_flight_and_releases_shared_memory() -> None:
    before = shm_names()
    c = Cluster(2, "ring")
    try:
        c.connect()
        pid = c.procs[0].pid
        assert not {n for n in shm_names() - before if f"-{pid}-" in n}, "arena name left linked"
        # rank 1 never joins this op, so it is still in flight when rank 0's daemon is stopped
        h = c.clients[0].neighbor_allreduce_async(torch.zeros(10), name="inflight", timeout=60)
        deadline = time.monotonic() + 30
        while not c.clients[0].status().ops_in_flight and time.monotonic() < deadline:
            time.sleep(0.02)  # the daemon took the op before it is stopped
        c.procs[0].send_signal(signal.SIGTERM)
        with pytest.raises(DecentError) as info:
            h.wait(timeout=30)
        assert info.value.code_name == "SHUTTING_DOWN"
        assert "'inflight'" in info.value.message and "shutting down" in info.value.message
        assert c.procs[0].wait(timeout=30) == 0
        assert not os.path.exists(c.sockets[0])
        # what comes after: the daemon said why it stopped before it closed the channel
        with pytest.raises(DecentError) as after:
            c.clients[0].allreduce(torch.zeros(1), name="after")
        assert after.value.code_name == "SHUTTING_DOWN", after.value
        assert after.value.message == "daemon rank 0 is shutting down (SIGTERM)", after.value
    finally:
        codes = c.stop()
    assert codes == [0, 0]
    assert shm_names() - before == set()


@pytest.mark.slow
@pytest.mark.parametrize("patience", [30.0, None], ids=["timed-wait", "untimed-wait"])
def test_a_killed_daemon_is_not_reported_as_shutting_down(patience: float | None) -> None:
    # SIGKILL: no goodbye on the data channel, so the worker's op says the daemon died; the
    # waiting caller reads the channel itself (a timed wait polls it, an untimed one blocks)
    c = Cluster(2, "ring")
    try:
        c.connect()
        h = c.clients[0].neighbor_allreduce_async(torch.zeros(10), name="inflight", timeout=60)
        until(lambda: c.clients[0].status().ops_in_flight > 0, "the op to be in flight")
        c.procs[0].send_signal(signal.SIGKILL)
        with pytest.raises(DecentError) as info:
            h.wait(timeout=patience)
        assert info.value.code_name == "PEER_UNAVAILABLE", info.value
        assert "without a goodbye (killed or crashed" in info.value.message, info.value
        assert "shutting down" not in info.value.message, info.value
    finally:
        c.kill()
        c.stop()


@pytest.mark.slow
def test_sigkill_of_daemon_leaves_no_shared_memory() -> None:
    before = shm_names()
    c = Cluster(2, "ring")
    try:
        c.connect()
    finally:
        c.kill()
    assert new_shm_names(before) == set()
    c.stop()


RUN = [sys.executable, "-m", "decentd.tools.launcher"]


@pytest.mark.slow
def test_decentrun_runs_workers_with_rank_prefix(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent("""
        import torch, decent.torch as dt
        c = dt.init()
        out = dt.allreduce(torch.tensor([float(c.rank)]), op="sum")
        print(f"rank={c.rank} size={c.size} sum={out.item()}")
        dt.shutdown()
    """))
    proc = subprocess.run([*RUN, "-np", "3", "--topology", "exponential", "--", sys.executable,
                           str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(3):
        assert f"[{r}] rank={r} size=3 sum=3.0" in proc.stdout


@pytest.mark.slow
def test_decentrun_spreads_workers_over_nodes_and_sets_their_environment(
        tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent("""
        import os, torch, decent.torch as dt
        c = dt.init()
        env = [os.environ[k] for k in ("DECENT_RANK", "DECENT_SIZE", "DECENT_LOCAL_RANK",
                                       "DECENT_LOCAL_SIZE", "LOCAL_RANK")]
        total = dt.allreduce(torch.tensor([float(c.rank)]), op="sum").item()
        print(f"env={','.join(env)} rank={c.rank} local={c.local_rank}/{c.local_size} "
              f"machine={c.machine_rank}/{c.machine_size} sum={total} "
              f"job={bool(os.environ['DECENT_JOB'])}")
        dt.shutdown()
    """))
    proc = subprocess.run([*RUN, "-np", "4", "--nodes", "2", "--machine-topology", "ring", "--",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(4):
        line = (f"[{r}] env={r},4,{r % 2},2,{r % 2} rank={r} local={r % 2}/2 "
                f"machine={r // 2}/2 sum=6.0 job=True")
        assert line in proc.stdout, proc.stdout
    refused = subprocess.run([*RUN, "-np", "3", "--nodes", "2", "--", sys.executable, "-c",
                              "pass"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "-np 3 is not divisible by --nodes 2" in refused.stderr


@pytest.mark.slow
def test_decentrun_fails_when_a_worker_fails(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time, decent.torch as dt
        c = dt.init()
        if c.rank == 1:
            sys.exit(3)
        time.sleep(3600)  # the launcher must tear this down (else the run below times out)
    """))
    proc = subprocess.run([*RUN, "-np", "2", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3
    assert "worker 1 exited with code 3" in proc.stderr


def test_client_without_daemon_says_so_quickly(tmp_path: Path) -> None:
    import decent.torch as dt

    # it gives up after its 1 s connect timeout, not the default 120 s
    with pytest.raises(DecentError, match=r"no decentd socket at .*nope\.sock after 1s"):
        dt.connect(f"unix://{tmp_path}/nope.sock", connect_timeout=1)


def test_rank_auto_from_env_and_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    from decentd.errors import StartupError
    from decentd.service.config import load_config

    for var in ("DECENT_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_config(None, {"rank": "auto", "peers": ["a:1", "b:2", "c:3"]})
    monkeypatch.setenv("SLURM_PROCID", "2")
    assert cfg.resolved_rank() == 2
    monkeypatch.delenv("SLURM_PROCID")
    monkeypatch.setattr("socket.gethostname", lambda: "decent-worker-1")
    assert cfg.resolved_rank() == 1
    monkeypatch.setattr("socket.gethostname", lambda: "laptop")
    with pytest.raises(StartupError, match="rank: 'auto'"):
        cfg.resolved_rank()


@pytest.mark.slow
def test_decentctl_status_and_topology() -> None:
    c = Cluster(2, "ring")
    try:
        c.connect()
        c.run(lambda cl: cl.allreduce(torch.ones(4), name="ctl"))
        proc = subprocess.run([sys.executable, "-m", "decentd.tools.ctl", "status", "--daemon",
                               c.sockets[0]], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "rank 0/2" in proc.stdout and "completed 1" in proc.stdout
        assert "127.0.0.1" in proc.stdout and " up " in proc.stdout, proc.stdout
        assert "local workers (1 per node)" in proc.stdout
    finally:
        c.stop()
    proc = subprocess.run([sys.executable, "-m", "decentd.tools.ctl", "topology", "exponential",
                           "-n", "8"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "rho = 0.5000" in proc.stdout


@pytest.mark.slow
def test_idle_peers_hear_heartbeats_on_the_bulk_connections() -> None:
    """An idle link carries an empty frame every heartbeat interval: every peer keeps hearing
    from every other while nothing runs (frames counted on the bulk connections, the last one
    heard after the wait began), whatever the host's load."""
    interval = 0.2
    c = Cluster(3, "ring", "--set", f"timeouts.heartbeat={interval}")
    try:
        c.connect()  # every daemon has all its peers connected

        def links() -> dict[tuple[int, int], pb.PeerStatus]:
            return {(r, p.rank): p for r in range(3) for p in c.status(r).peers}

        began, before = time.monotonic(), links()

        def heard(beats: int) -> bool:
            now = links()
            return all(now[k].frames_received >= before[k].frames_received + beats
                       and now[k].bytes_sent > before[k].bytes_sent for k in before)

        # idle: only heartbeats go out, so each link's frames grow only if they do
        until(lambda: heard(5), "5 heartbeats on every idle link", timeout=120)
        now, waited = links(), time.monotonic() - began
        for key, p in now.items():
            assert p.connected, (key, p)
            assert 0 <= p.last_heartbeat_age_s <= waited, (key, p)  # heard since the wait began
    finally:
        c.stop()


@pytest.mark.slow
def test_decentrun_ctrl_c_tears_everything_down(tmp_path: Path) -> None:
    marker = tmp_path / "pids"
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(f"""
        import os, time, decent.torch as dt
        c = dt.init()
        with open({str(marker)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        time.sleep(120)
    """))
    proc = subprocess.Popen([*RUN, "-np", "2", "--nodes", "2", sys.executable, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while (not marker.exists() or len(marker.read_text().split()) < 2) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        workers = [int(p) for p in marker.read_text().split()]
        # "--": the pattern begins with "-m", which pgrep would take for an option
        daemons = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "--", "-m decentd --rank"],
                                 capture_output=True, text=True).stdout.split()
        assert len(workers) == 2 and len(daemons) == 2
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err
    for pid in workers + [int(d) for d in daemons]:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", f"{pid} still running"


def test_free_ports_never_hands_out_a_port_twice() -> None:
    # two calls before anything binds (peers, then metrics ports) once drew the same port
    first, second = free_ports(300), free_ports(300)
    assert len(set(first)) == 300 and not set(first) & set(second)


def test_free_ports_of_two_processes_never_meet() -> None:
    """Two processes that pick ports at once (pytest's workers, two decentruns) never hand out
    the same one, though neither is bound yet: a quarter of the range drawn by one misses all
    that the other holds (about 50 would meet by chance)."""
    pick = ("import sys; from decentd.tools.launcher import free_ports; "
            "print(' '.join(map(str, free_ports(int(sys.argv[1])))), flush=True); "
            "sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", pick, "200"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        held = set(map(int, holder.stdout.readline().split()))
        drawn = subprocess.run([sys.executable, "-c", pick, "3000"], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=120, check=True)
        assert len(held) == 200 and not held & set(map(int, drawn.stdout.split()))
    finally:
        holder.communicate(timeout=60)


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root for a PID namespace")
def test_a_daemon_as_pid_1_outlives_the_trainer_that_stopped_it(tmp_path: Path) -> None:
    # a container's trainer sharing its daemon's PID namespace ends with `kill -TERM 1; exit`:
    # when PID 1 exits the kernel SIGKILLs the rest of the namespace, so the daemon waits for
    # the others (up to its shutdown grace) and the trainer's own exit code stands (here the
    # trainer takes 1 s after the signal, far longer than the daemon's shutdown)
    sock = tmp_path / "d.sock"
    (port,) = free_ports(1)
    daemon = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-m",
         "decentd", "--rank", "0", "--peers", f"127.0.0.1:{port}", "--socket", str(sock)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        children = Path(f"/proc/{daemon.pid}/task/{daemon.pid}/children")
        until(lambda: children.read_text().split() != [] and sock.exists(),
              "the daemon listening in its PID namespace")
        init = int(children.read_text().split()[0])  # the daemon: PID 1 inside
        trainer = subprocess.run(
            ["nsenter", f"--pid=/proc/{init}/ns/pid", "sh", "-c",
             "kill -TERM 1; sleep 1; exit 7"], timeout=30, check=False)
        assert trainer.returncode == 7
        assert daemon.wait(timeout=30) == 0
    finally:
        daemon.kill()
        daemon.wait()
