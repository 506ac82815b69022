"""``decentd --config node.yaml``: run one node's daemon (flags override the file).

SIGTERM stops it; SIGHUP re-reads the file (with the same flags) and applies what may change
while it runs (:mod:`decentd.service.reload`). Under systemd (``$NOTIFY_SOCKET``) it reports
readiness. As PID 1 of a PID namespace (a container that trainers share, ``pid: service:decent-0``)
it waits, after its shutdown and for up to its shutdown grace, for the namespace's other processes
to exit: the kernel kills them with SIGKILL when PID 1 exits, so a trainer that stopped its daemon
would otherwise race it to its own exit."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from decentd.errors import ConfigError, StartupError
from decentd.logs import DaemonLog, startup_error
from decentd.service.config import NodeConfig, load_config, parse_set
from decentd.service.notify import Notifier
from decentd.service.reload import Service


def build_parser() -> argparse.ArgumentParser:
    """The decentd command line."""
    p = argparse.ArgumentParser(prog="decentd", description=__doc__)
    p.add_argument("--config", help="node.yaml (optional: every key has a default)")
    p.add_argument("--rank", help="this node's rank, or 'auto'")
    p.add_argument("--peers", help="comma-separated host:port of every rank, in rank order")
    p.add_argument("--listen", help="host:port to listen on for peers")
    p.add_argument("--socket", help="Unix socket path for local workers")
    p.add_argument("--topology", help="topology kind over the workers (ring, exponential, ...)")
    p.add_argument("--machine-topology", help="topology kind over the daemons (hierarchical ops)")
    p.add_argument("--workers-per-node", type=int, help="workers this daemon serves")
    p.add_argument("--cluster-id", help="cluster id peers must share")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=["text", "json"],
                   help="log_format: text lines, or one JSON object per line (log shippers)")
    p.add_argument("--security-mode", choices=["secret", "mtls", "insecure"],
                   help="security.mode: how peers prove who they are")
    p.add_argument("--secret-file", help="security.secret_file (mode secret)")
    p.add_argument("--ca", help="security.ca: the CA certificate (mode mtls)")
    p.add_argument("--cert", help="security.cert: this node's certificate (mode mtls)")
    p.add_argument("--key", help="security.key: this node's private key (mode mtls)")
    p.add_argument("--encrypt-bulk", action=argparse.BooleanOptionalAction, default=None,
                   help="security.encrypt_bulk: TLS on the bulk data path too (mode mtls)")
    p.add_argument("--worker-group", help="security.worker_group: group allowed on the "
                   "worker sockets")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set timeouts.op=30")
    return p


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted config overrides from the flags that were given."""
    out: dict[str, Any] = {}
    if args.rank is not None:
        out["rank"] = int(args.rank) if args.rank.lstrip("-").isdigit() else args.rank
    if args.peers is not None:
        out["peers"] = [p.strip() for p in args.peers.split(",") if p.strip()]
    for key in ("listen", "socket", "log_level", "log_format", "cluster_id"):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    if args.topology is not None:
        out["topology.kind"] = args.topology
    if args.machine_topology is not None:
        out["machine_topology.kind"] = args.machine_topology
    if args.workers_per_node is not None:
        out["workers_per_node"] = args.workers_per_node
    for flag, key in (("security_mode", "mode"), ("secret_file", "secret_file"), ("ca", "ca"),
                      ("cert", "cert"), ("key", "key"), ("encrypt_bulk", "encrypt_bulk"),
                      ("worker_group", "worker_group")):
        if getattr(args, flag) is not None:
            out[f"security.{key}"] = getattr(args, flag)
    out.update(parse_set(args.set))
    return out


def raise_fd_limit() -> None:
    """Lift the soft open-file limit to the hard one: every registered worker region holds a
    descriptor, besides peers' and workers' sockets."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and want > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def others_in_namespace() -> list[int]:
    """The live processes of this PID namespace besides this one (PID 1), zombies reaped or
    left out; none when ``/proc`` is not this namespace's (it cannot tell)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:  # orphans re-parented to PID 1
            pass
    if os.readlink("/proc/self") != str(os.getpid()):
        return []
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(int(entry))
    return alive


def outlive_namespace(grace: float) -> None:
    """As PID 1, wait up to ``grace`` seconds for the namespace's other processes to exit."""
    if os.getpid() != 1:
        return
    deadline = time.monotonic() + grace
    while others_in_namespace() and time.monotonic() < deadline:
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``decentd`` console script."""
    args = build_parser().parse_args(argv)
    notifier = Notifier.from_env()
    try:
        overrides = overrides_from(args)
        cfg = load_config(args.config, overrides)
        rank = cfg.resolved_rank()
    except StartupError as exc:
        print(startup_error(str(exc), args.log_format), file=sys.stderr)
        notifier.status(f"failed: {exc}")
        return 2
    daemon_log = DaemonLog(rank, cfg.log_level, cfg.log_format)

    def reread() -> NodeConfig:
        return load_config(args.config, overrides)

    service = Service(reread, args.config, notifier, daemon_log)
    from decentd.service.server import Daemon  # after logging: grpc import is slow-ish
    from decentd.workers import sigbus

    raise_fd_limit()
    sigbus.install()  # memory a worker shrinks under the daemon fails its ops, not the daemon
    os.umask(0o077)  # sockets and files are the daemon user's until it widens them on purpose

    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - non-Linux
        runner = asyncio.run

    async def serve() -> None:
        await Daemon(cfg, service).run()

    try:
        runner(serve())
    except StartupError as exc:
        logging.getLogger("decentd").error("%s", exc)
        if daemon_log.format != "json":  # a JSON log has the line above, and nothing else
            print(f"decentd: {exc}", file=sys.stderr)
        notifier.status(f"failed: {exc}")
        return 2 if isinstance(exc, ConfigError) else 1
    outlive_namespace(cfg.timeouts.shutdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
