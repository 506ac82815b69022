"""``decentrun -np N [--nodes K] [--topology KIND] [--machine-topology KIND] [--] COMMAND``:
a local cluster in one command.

Starts K daemons ("nodes", default 1: this host is one node) on loopback, each serving N/K
workers (free ports, one Unix socket each), then N copies of COMMAND. Worker ``r`` runs on node
``r // (N/K)`` with ``DECENT_DAEMON``, ``DECENT_RANK``, ``DECENT_SIZE``, ``DECENT_LOCAL_RANK``,
``DECENT_LOCAL_SIZE`` and ``DECENT_JOB`` set, plus torchrun's ``LOCAL_RANK``, ``RANK`` and
``WORLD_SIZE`` (a script picks its GPU by its local rank). Output lines are prefixed ``[rank]``;
everything is torn down when a worker fails, a daemon dies, or on Ctrl-C. The exit code is the
first failing worker's (0 when all succeed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from decent_wire import topology
from decentd.auth import write_secret

_SPLIT = re.compile(rb"([\r\n])")


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now.

    They are picked below the kernel's ephemeral range, so that the outgoing connections of
    daemons already running cannot take one between this check and the daemon's bind.
    """
    low = 20000
    with contextlib.suppress(OSError, ValueError):
        low = min(low, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]))
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(max(1024, low - 12000), low)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


class _Prefixer(threading.Thread):
    """Copies a child's output to ours, each line (or \\r-update) prefixed with a tag."""

    lock = threading.Lock()

    def __init__(self, stream: IO[bytes], tag: str, out: IO[bytes]) -> None:
        super().__init__(daemon=True)
        self.stream, self.tag, self.out = stream, tag.encode(), out

    def run(self) -> None:
        pending = b""
        for chunk in iter(lambda: self.stream.read1(65536), b""):  # type: ignore[attr-defined]
            parts = _SPLIT.split(pending + chunk)
            pending = parts.pop()
            with self.lock:
                for i in range(0, len(parts), 2):
                    # a bare \r (progress bars redraw with it) gets no tag of its own
                    tag = self.tag if parts[i] else b""
                    self.out.write(tag + parts[i] + parts[i + 1])
                self.out.flush()
        if pending:
            with self.lock:
                self.out.write(self.tag + pending + b"\n")
                self.out.flush()


def build_parser() -> argparse.ArgumentParser:
    """The decentrun command line."""
    p = argparse.ArgumentParser(prog="decentrun", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-np", "--np", dest="np", type=int, required=True, help="number of workers")
    p.add_argument("--nodes", type=int, default=1,
                   help="daemons, each serving np/nodes workers (default 1)")
    p.add_argument("--topology", default="ring", choices=topology.kinds(),
                   help="topology kind over the workers (default ring)")
    p.add_argument("--machine-topology", choices=topology.kinds(),
                   help="topology kind over the nodes (hierarchical ops; default: --topology's)")
    p.add_argument("--config", help="node.yaml applied to every daemon")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every daemon")
    p.add_argument("--daemon-log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    p.add_argument("command", nargs=argparse.REMAINDER, help="worker command")
    return p


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    """SIGTERM every process still running, SIGKILL those still alive ``grace`` s later."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def daemon_command(args: argparse.Namespace, rank: int, peers: str, sock: str,
                   secret: str) -> list[str]:
    """The command line of daemon ``rank`` of the local cluster (secret mode, with the
    launch's fresh secret in the file ``secret``; ``--set security.mode=...`` overrides it)."""
    cmd = [sys.executable, "-m", "decentd.cli", "--rank", str(rank), "--peers", peers,
           "--socket", sock, "--topology", args.topology, "--log-level", args.daemon_log_level,
           "--workers-per-node", str(args.np // args.nodes), "--security-mode", "secret",
           "--secret-file", secret]
    if args.machine_topology:
        cmd += ["--machine-topology", args.machine_topology]
    if args.config:
        cmd += ["--config", args.config]
    for item in args.set:
        cmd += ["--set", item]
    return cmd


def worker_env(rank: int, size: int, per_node: int, daemon: str, job: str) -> dict[str, str]:
    """What worker ``rank`` of the local cluster finds in its environment."""
    local = str(rank % per_node)
    return dict(os.environ, DECENT_DAEMON=daemon, DECENT_JOB=job, DECENT_RANK=str(rank),
                DECENT_SIZE=str(size), DECENT_LOCAL_RANK=local,
                DECENT_LOCAL_SIZE=str(per_node), LOCAL_RANK=local, RANK=str(rank),
                WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(per_node), PYTHONUNBUFFERED="1")


class LocalCluster:
    """K daemons and N workers on this host, their output prefixed and copied to ours."""

    def __init__(self, n: int, nodes: int = 1) -> None:
        self.n = n
        self.nodes = nodes
        self.workdir = tempfile.mkdtemp(prefix="decentrun-")
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.workers: list[subprocess.Popen[bytes]] = []
        self.pumps: list[_Prefixer] = []

    def start(self, args: argparse.Namespace, command: list[str]) -> None:
        """Start the daemons, then the workers (``stop()`` cleans up whatever started)."""
        job = os.environ.get("DECENT_JOB") or f"decentrun-{secrets.token_hex(4)}"
        peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(self.nodes))
        secret = str(write_secret(Path(self.workdir) / "secret"))  # the directory is 0700
        for m in range(self.nodes):
            sock = os.path.join(self.workdir, f"node{m}.sock")
            self.daemons.append(self._spawn(daemon_command(args, m, peers, sock, secret), None,
                                            f"[decentd {m}] "))
        per_node = self.n // self.nodes
        for r in range(self.n):
            daemon = f"unix://{self.workdir}/node{r // per_node}.sock"
            self.workers.append(self._spawn(command, worker_env(r, self.n, per_node, daemon, job),
                                            f"[{r}] "))
        for pump in self.pumps:
            pump.start()

    def _spawn(self, cmd: list[str], env: dict[str, str] | None,
               tag: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        assert proc.stdout is not None
        self.pumps.append(_Prefixer(proc.stdout, tag, sys.stdout.buffer))
        return proc

    def outcome(self) -> int | None:
        """The exit code once the job is over (a worker failed, a daemon died, all workers
        ended), else None."""
        failed = [(i, w.returncode) for i, w in enumerate(self.workers)
                  if w.poll() is not None and w.returncode != 0]
        if failed:
            rank, code = failed[0]
            print(f"decentrun: worker {rank} exited with code {code}; stopping the rest",
                  file=sys.stderr)
            return code
        dead = [i for i, d in enumerate(self.daemons) if d.poll() is not None]
        if dead:
            print(f"decentrun: daemon {dead[0]} exited with code "
                  f"{self.daemons[dead[0]].returncode}; stopping the rest", file=sys.stderr)
            return 1
        if all(w.poll() is not None for w in self.workers):
            return 0
        return None

    def stop(self) -> None:
        """Stop workers, then daemons; remove the sockets' directory."""
        stop_processes(self.workers)
        stop_processes(self.daemons)
        for pump in self.pumps:
            pump.join(timeout=2)
        shutil.rmtree(self.workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``decentrun`` console script."""
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("decentrun: no command given", file=sys.stderr)
        return 2
    if args.np < 1 or args.nodes < 1:
        print("decentrun: -np and --nodes must be >= 1", file=sys.stderr)
        return 2
    if args.np % args.nodes:
        print(f"decentrun: -np {args.np} is not divisible by --nodes {args.nodes}: every node "
              "serves the same number of workers", file=sys.stderr)
        return 2
    interrupted = threading.Event()
    signal.signal(signal.SIGINT, lambda _signum, _frame: interrupted.set())
    signal.signal(signal.SIGTERM, lambda _signum, _frame: interrupted.set())
    cluster = LocalCluster(args.np, args.nodes)
    try:
        cluster.start(args, command)
        while (code := cluster.outcome()) is None:
            if interrupted.wait(0.05):
                print("decentrun: interrupted; stopping workers and daemons", file=sys.stderr)
                return 130
        return code
    finally:
        cluster.stop()

if __name__ == "__main__":
    sys.exit(main())
