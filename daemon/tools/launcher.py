"""``decentrun -np N [--nodes K] [--topology KIND] [--machine-topology KIND] [--] COMMAND``:
a local cluster in one command.

Starts K daemons ("nodes", default 1: this host is one node) on loopback, each serving N/K
workers (free ports, one Unix socket each), then N copies of COMMAND. Worker ``r`` runs on node
``r // (N/K)`` with ``DECENT_DAEMON``, ``DECENT_RANK``, ``DECENT_SIZE``, ``DECENT_LOCAL_RANK``,
``DECENT_LOCAL_SIZE`` and ``DECENT_JOB`` set, plus torchrun's ``LOCAL_RANK``, ``RANK`` and
``WORLD_SIZE`` (a script picks its GPU by its local rank), and ``MASTER_ADDR`` and
``MASTER_PORT`` (a free port of this launch) unless they are set: torch.distributed's store,
so that ``dist.init_process_group("decent")`` runs as under torchrun. Output lines are
prefixed ``[rank]``; everything is torn down when a worker fails, a daemon dies, or on Ctrl-C.
The exit code is the first failing worker's (0 when all succeed).

With ``--max-restarts K`` a failure (a worker exiting non-zero or killed, a daemon ending)
restarts that node in place instead: its daemon (same rank, ports and socket) and its workers
that have not exited 0 (same ranks, plus ``DECENT_RESTART``: how many times the node has been
restarted); other nodes keep running. K counts restarts over all nodes; the failure after the
K-th tears everything down, and its code is the exit code. Ctrl-C never restarts.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
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
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from decent_wire import topology
from decentd.security.auth import write_secret

_SPLIT = re.compile(rb"([\r\n])")
#: ports this process handed out already: two calls (say peers, then metrics) never share one,
#: though neither is bound yet when the other checks
_GIVEN: set[int] = set()
_GIVEN_LOCK = threading.Lock()
#: ... and the locks on the last ports it handed out, by which other processes picking ports
#: here (pytest's workers, a second decentrun) skip them until their daemons have bound them
_CLAIMED: collections.deque[int] = collections.deque()
_CLAIMS_KEPT = 256
_CLAIMS = Path(tempfile.gettempdir()) / "decent-ports"


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now.

    They are picked below the kernel's ephemeral range, so that the outgoing connections of
    daemons already running cannot take one between this check and the daemon's bind, and
    never one an earlier call of this process gave.
    """
    low = 20000
    with contextlib.suppress(OSError, ValueError):
        low = min(low, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]))
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(max(1024, low - 12000), low)
        with _GIVEN_LOCK:
            if port in _GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            if not _claim(port):
                continue
            _GIVEN.add(port)
        ports.append(port)
    return ports


def _claim(port: int) -> bool:
    """Lock ``port`` against the other processes that pick ports here, for as long as this
    process holds one of its last :data:`_CLAIMS_KEPT` (a lock file per port under the temp
    directory; the kernel drops the locks with the process). False: another one holds it.
    Where the lock cannot be taken at all, the port is this process's (as before locks)."""
    try:
        if not _CLAIMS.is_dir():
            _CLAIMS.mkdir(exist_ok=True)
            os.chmod(_CLAIMS, 0o1777)  # every user's processes claim ports here
        fd = os.open(_CLAIMS / str(port), os.O_RDONLY | os.O_CREAT, 0o444)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _CLAIMED.append(fd)
    while len(_CLAIMED) > _CLAIMS_KEPT:
        os.close(_CLAIMED.popleft())
    return True


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
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart a failed node in place (its daemon and its unfinished workers) "
                   "up to K times in total, counted over all nodes (default 0: a failure stops "
                   "everything)")
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
    cmd = [sys.executable, "-m", "decentd", "--rank", str(rank), "--peers", peers,
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


def worker_env(rank: int, size: int, per_node: int, daemon: str, job: str,
               restart: int = 0, store_port: int = 0) -> dict[str, str]:
    """What worker ``rank`` of the local cluster finds in its environment (``DECENT_RESTART``
    only once its node has been restarted: the number of times it has; torch.distributed's
    store at ``store_port`` on loopback unless ``MASTER_ADDR``/``MASTER_PORT`` are set)."""
    local = str(rank % per_node)
    env = dict(os.environ, DECENT_DAEMON=daemon, DECENT_JOB=job, DECENT_RANK=str(rank),
               DECENT_SIZE=str(size), DECENT_LOCAL_RANK=local,
               DECENT_LOCAL_SIZE=str(per_node), LOCAL_RANK=local, RANK=str(rank),
               WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(per_node), PYTHONUNBUFFERED="1")
    if store_port and not ("MASTER_ADDR" in env and "MASTER_PORT" in env):
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))
    env.pop("DECENT_RESTART", None)  # a decentrun run from a restarted worker starts afresh
    if restart:
        env["DECENT_RESTART"] = str(restart)
    return env


def how_it_ended(code: int) -> str:
    """``exit 3`` or ``killed by SIGKILL``: how a process ended, from its return code."""
    if code >= 0:
        return f"exit {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


@dataclass(frozen=True)
class Failure:
    """A worker that exited non-zero or was killed, or a daemon that ended."""

    node: int
    #: ``rank R`` or ``daemon M``
    who: str
    #: its return code (negative: the signal that killed it)
    code: int
    #: decentrun's exit code should this failure end the job
    exit_code: int

    def ended(self) -> str:
        """``rank 1 exited with 3`` or ``daemon 0 was killed by SIGKILL``."""
        if self.code < 0:
            return f"{self.who} was {how_it_ended(self.code)}"
        return f"{self.who} exited with {self.code}"


@dataclass(frozen=True)
class Launch:
    """What (re)starting a node needs: the command line, the worker command, the job id, the
    peers list (the same for every start: a restarted daemon keeps its ports), the secret and
    the port of torch.distributed's store."""

    args: argparse.Namespace
    command: list[str]
    job: str
    peers: str
    secret: str
    store_port: int


class LocalCluster:
    """K daemons and N workers on this host, their output prefixed and copied to ours; with
    ``max_restarts``, a failed node is started again in place up to that many times in all."""

    def __init__(self, n: int, nodes: int = 1, max_restarts: int = 0) -> None:
        self.n = n
        self.nodes = nodes
        self.per_node = n // nodes
        self.max_restarts = max_restarts
        #: times each node has been restarted
        self.restarts = [0] * nodes
        self.workdir = tempfile.mkdtemp(prefix="decentrun-")
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.workers: list[subprocess.Popen[bytes]] = []
        self.pumps: list[_Prefixer] = []
        self._launch: Launch | None = None

    def socket(self, node: int) -> str:
        """The Unix socket of node ``node``'s daemon."""
        return os.path.join(self.workdir, f"node{node}.sock")

    def start(self, args: argparse.Namespace, command: list[str]) -> None:
        """Start the daemons, then the workers (``stop()`` cleans up whatever started)."""
        job = os.environ.get("DECENT_JOB") or f"decentrun-{secrets.token_hex(4)}"
        *ports, store_port = free_ports(self.nodes + 1)
        peers = ",".join(f"127.0.0.1:{p}" for p in ports)
        secret = str(write_secret(Path(self.workdir) / "secret"))  # the directory is 0700
        self._launch = Launch(args, command, job, peers, secret, store_port)
        for m in range(self.nodes):
            self.daemons.append(self._start_daemon(m))
        for r in range(self.n):
            self.workers.append(self._start_worker(r))
        for pump in self.pumps:
            pump.start()

    def _start_daemon(self, node: int) -> subprocess.Popen[bytes]:
        launch = self._launch
        assert launch is not None
        cmd = daemon_command(launch.args, node, launch.peers, self.socket(node), launch.secret)
        return self._spawn(cmd, None, f"[decentd {node}] ")

    def _start_worker(self, rank: int) -> subprocess.Popen[bytes]:
        launch = self._launch
        assert launch is not None
        node = rank // self.per_node
        env = worker_env(rank, self.n, self.per_node, f"unix://{self.socket(node)}", launch.job,
                         self.restarts[node], launch.store_port)
        return self._spawn(launch.command, env, f"[{rank}] ")

    def _spawn(self, cmd: list[str], env: dict[str, str] | None,
               tag: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        assert proc.stdout is not None
        self.pumps.append(_Prefixer(proc.stdout, tag, sys.stdout.buffer))
        return proc

    def failure(self) -> Failure | None:
        """The first worker that exited non-zero, else the first daemon that ended, else
        None."""
        for r, w in enumerate(self.workers):
            if w.poll() is not None and w.returncode != 0:
                return Failure(r // self.per_node, f"rank {r}", w.returncode, w.returncode)
        for m, d in enumerate(self.daemons):
            if d.poll() is not None:
                return Failure(m, f"daemon {m}", d.returncode, 1)
        return None

    def outcome(self) -> int | None:
        """The exit code once the job is over (all workers exited 0, or a failure with no
        restart left), else None; a failure with a restart left restarts its node."""
        failure = self.failure()
        if failure is None:
            return 0 if all(w.poll() is not None for w in self.workers) else None
        used = sum(self.restarts)
        if used < self.max_restarts:
            print(f"decentrun: {failure.ended()}; restarting node {failure.node} "
                  f"(restart {used + 1} of {self.max_restarts})", file=sys.stderr, flush=True)
            self.restart_node(failure.node)
            return None
        if self.max_restarts:
            print(f"decentrun: {failure.who} failed ({how_it_ended(failure.code)}); no restarts "
                  f"left ({used} used of {self.max_restarts})", file=sys.stderr)
        elif failure.who.startswith("rank"):
            print(f"decentrun: worker {failure.who[5:]} exited with code {failure.code}; "
                  "stopping the rest", file=sys.stderr)
        else:
            print(f"decentrun: {failure.who} exited with code {failure.code}; stopping the rest",
                  file=sys.stderr)
        return failure.exit_code

    def restart_node(self, node: int) -> None:
        """Start node ``node`` again in place: stop its workers that have not exited 0, then its
        daemon (SIGTERM, SIGKILL after a grace), and start the daemon (same rank, ports and
        socket) and those workers (same ranks, ``DECENT_RESTART`` one more) again."""
        ranks = [r for r in range(node * self.per_node, (node + 1) * self.per_node)
                 if self.workers[r].poll() != 0]  # one that exited 0 is done
        stop_processes([self.workers[r] for r in ranks])
        stop_processes([self.daemons[node]])
        sock = self.socket(node)
        for path in (sock, f"{sock}.data", f"{sock}.mem"):  # a killed daemon leaves them
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.restarts[node] += 1
        first = len(self.pumps)
        self.daemons[node] = self._start_daemon(node)
        for r in ranks:
            self.workers[r] = self._start_worker(r)
        for pump in self.pumps[first:]:
            pump.start()

    def stop(self) -> None:
        """Stop workers, then daemons; remove the sockets' directory."""
        stop_processes(self.workers)
        stop_processes(self.daemons)
        for pump in self.pumps:
            pump.join(timeout=2)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _check(args: argparse.Namespace, command: list[str]) -> str | None:
    """Why the command line cannot run, or None."""
    if not command:
        return "no command given"
    if args.np < 1 or args.nodes < 1:
        return "-np and --nodes must be >= 1"
    if args.max_restarts < 0:
        return "--max-restarts must be >= 0"
    if args.np % args.nodes:
        return (f"-np {args.np} is not divisible by --nodes {args.nodes}: every node serves the "
                "same number of workers")
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``decentrun`` console script."""
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if (problem := _check(args, command)) is not None:
        print(f"decentrun: {problem}", file=sys.stderr)
        return 2
    interrupted = threading.Event()
    signal.signal(signal.SIGINT, lambda _signum, _frame: interrupted.set())
    signal.signal(signal.SIGTERM, lambda _signum, _frame: interrupted.set())
    cluster = LocalCluster(args.np, args.nodes, args.max_restarts)
    try:
        cluster.start(args, command)
        while not interrupted.is_set():  # checked first: an interrupt never restarts a node
            if (code := cluster.outcome()) is not None:
                return code
            interrupted.wait(0.05)
        print("decentrun: interrupted; stopping workers and daemons", file=sys.stderr)
        return 130
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
