"""deploy/systemd: the units verify as shipped, and the daemon speaks systemd's notify protocol.

The daemons here run the template unit's own ``ExecStart=`` line (its specifiers filled in as
systemd would, the installed ``decentd`` and a test config in place of /etc/decent), with
``$NOTIFY_SOCKET`` on a datagram socket this test binds: READY=1 only once the peer is there,
RELOADING=1 then READY=1 at SIGHUP with the new log level and op timeout in effect, STOPPING=1
at SIGTERM.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from decent.core import Client, NumpyCodec
from decent_wire.errors import DecentError
from decentd.service.notify import message, socket_address

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "deploy" / "systemd"
#: the decentd this test suite runs (the project's venv)
DECENTD = ROOT / ".venv" / "bin" / "decentd"
#: the unit directory of the host's systemd (merged /usr or not), copied into the root the units
#: are verified in: their dependencies (network-online.target, ...) must be there
SYSTEM_UNITS = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
                     if p.is_dir()), None)
#: how long a daemon may take to say something (a safety net, not a measurement)
WAIT = 60.0

Unit = dict[str, dict[str, list[str]]]


def read_unit(path: Path) -> Unit:
    """``{section: {key: [values, in order]}}`` of a unit file."""
    unit: Unit = {}
    section: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = unit.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key.strip(), []).append(value.strip())
    return unit


def commands(unit: Unit) -> list[list[str]]:
    """The command lines of the unit's ``Exec*=`` keys."""
    return [shlex.split(v) for k, vs in unit["Service"].items() if k.startswith("Exec")
            for v in vs]


# ---------------------------------------------------------------------------- the unit files


@pytest.mark.slow
def test_units_verify_as_shipped(tmp_path: Path) -> None:
    """``systemd-analyze verify`` in a root where decentd is installed at the path the units
    name (a launcher of this venv's decentd there); nothing to report, not even a warning."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed here (apt-get install systemd)")
    if SYSTEM_UNITS is None:
        pytest.skip("no systemd unit directory (/usr/lib/systemd/system) to verify against")
    root = tmp_path / "root"
    shutil.copytree(SYSTEM_UNITS, root / SYSTEM_UNITS.relative_to("/"), symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    names = sorted(p.name for p in UNITS.glob("*.service"))
    assert names == ["decentd.service", "decentd@.service"]
    for name in names:
        shutil.copy(UNITS / name, root / "etc/systemd/system" / name)
        for argv in commands(read_unit(UNITS / name)):
            program = Path(argv[0].lstrip("-@:+!"))
            assert program.is_absolute(), f"{name}: {argv[0]} is not an absolute path"
            target = root / program.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if program.name == "decentd":
                target.write_text(f'#!/bin/sh\nexec {DECENTD} "$@"\n')
                target.chmod(0o755)
            elif not target.exists():
                shutil.copy(program, target)  # e.g. /bin/kill: the host's own
    done = subprocess.run([tool, "verify", f"--root={root}", "decentd.service",
                           "decentd@0.service"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@pytest.mark.parametrize("name", ["decentd.service", "decentd@.service"])
def test_unit_runs_as_a_hardened_notify_service(name: str) -> None:
    """What the issue asks of the units, and the same hardening in both."""
    service = read_unit(UNITS / name)["Service"]
    one = {k: v[-1] for k, v in service.items()}
    assert {k: one.get(k) for k in (
        "Type", "Restart", "User", "NoNewPrivileges", "ProtectSystem", "ProtectHome",
        "PrivateTmp", "ExecReload", "StandardError", "LimitNOFILE")} == {
        "Type": "notify", "Restart": "on-failure", "User": "decent", "NoNewPrivileges": "yes",
        "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "ExecReload": "/bin/kill -HUP $MAINPID", "StandardError": "journal",
        "LimitNOFILE": "1048576"}
    # /dev/shm stays the host's (workers' shared tensors): writable, not made private
    assert "/dev/shm" in one["ReadWritePaths"].split()
    assert not {"PrivateDevices", "PrivateIPC", "RemoveIPC", "DynamicUser"} & set(one)
    # the worker socket is in the runtime directory systemd makes for the daemon
    argv = shlex.split(one["ExecStart"])
    assert argv[argv.index("--socket") + 1] == f"%t/{one['RuntimeDirectory']}/decentd.sock"
    main = read_unit(UNITS / "decentd.service")["Service"]
    per_instance = {"ExecStart", "RuntimeDirectory", "SyslogIdentifier"}
    assert {k: v for k, v in service.items() if k not in per_instance} == {
        k: v for k, v in main.items() if k not in per_instance}


def test_notify_addresses_and_messages() -> None:
    assert socket_address("@decent/x") == b"\0decent/x"
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    with pytest.raises(ValueError, match="neither an absolute path"):
        socket_address("relative")
    assert message(READY=1, STATUS="a\nb") == b"READY=1\nSTATUS=a b"


# ---------------------------------------------------------------------------- real daemons


def unit_command(instance: int, runtime: Path, config: Path) -> list[str]:
    """The template unit's ExecStart for ``instance``, as systemd would run it here: its
    specifiers filled in, this venv's decentd, and ``config`` for the one in /etc."""
    unit = read_unit(UNITS / "decentd@.service")
    (line,) = unit["Service"]["ExecStart"]
    line = line.replace("%i", str(instance)).replace("%t", str(runtime)).replace("%%", "%")
    argv = shlex.split(line)
    assert argv[0] == "/opt/decent/venv/bin/decentd"
    argv[0] = str(DECENTD)
    argv[argv.index("--config") + 1] = str(config)
    (directory,) = unit["Service"]["RuntimeDirectory"]
    (runtime / directory.replace("%i", str(instance))).mkdir(parents=True, mode=0o750)
    return argv


class Notifications:
    """A datagram socket in place of systemd's: what a daemon tells it, one message at a time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(socket_address(name))

    def next(self) -> dict[str, str]:
        """The next message's assignments (waits for it)."""
        self.sock.settimeout(WAIT)
        raw = self.sock.recv(65536).decode()
        return dict(line.split("=", 1) for line in raw.split("\n"))

    def pending(self) -> list[bytes]:
        """Whatever was sent and not read yet (without waiting)."""
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                out.append(self.sock.recv(65536))
        except BlockingIOError:
            return out


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short directory (Unix socket paths are short) removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="decent-sd-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def write_config(path: Path, peers: list[str], timeouts: str = "{start: 30}", **extra: str
                 ) -> None:
    lines = [f"peers: [{', '.join(peers)}]", "memory: {arena_bytes: 4194304}",
             f"timeouts: {timeouts}", *(f"{k}: {v}" for k, v in extra.items())]
    path.write_text("\n".join(lines) + "\n")


def monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


@pytest.mark.slow
def test_ready_after_peers_reload_and_stop(workdir: Path) -> None:
    # rank 1's address is a plain listener of this test at first: rank 0 connecting to it
    # shows rank 0 is past its start and waiting for its peer
    stand_in = socket.create_server(("127.0.0.1", 0))
    stand_in.settimeout(WAIT)
    p0 = socket.create_server(("127.0.0.1", 0))
    peers = [f"127.0.0.1:{p0.getsockname()[1]}", f"127.0.0.1:{stand_in.getsockname()[1]}"]
    p0.close()
    config = workdir / "local.yaml"
    write_config(config, peers)
    runtime = workdir / "run"
    notes = [Notifications(f"@decent-test-{uuid.uuid4().hex}"),  # abstract, like systemd's
             Notifications(str(workdir / "notify1"))]
    logs = [workdir / f"rank{i}.log" for i in range(2)]
    procs: list[subprocess.Popen[bytes]] = []

    def start(rank: int) -> None:
        with logs[rank].open("wb") as err:
            procs.append(subprocess.Popen(
                unit_command(rank, runtime, config), stdout=err, stderr=subprocess.STDOUT,
                env={**os.environ, "NOTIFY_SOCKET": notes[rank].name}))

    sockets = [runtime / "decentd" / str(i) / "decentd.sock" for i in range(2)]
    try:
        start(0)
        assert notes[0].next() == {
            "STATUS": f"rank 0/2: listening on {peers[0]}; connecting to 1 peer(s)"}
        conn, _ = stand_in.accept()
        assert notes[0].pending() == []  # not ready while its peer is missing
        conn.close()
        stand_in.close()
        start(1)
        ready = [f"rank {i}/2: 1 peer(s) connected; serving workers on {sockets[i]}"
                 for i in range(2)]
        assert notes[0].next() == {"READY": "1", "STATUS": ready[0]}
        assert notes[1].next() == {
            "STATUS": f"rank 1/2: listening on {peers[1]}; connecting to 1 peer(s)"}
        assert notes[1].next() == {"READY": "1", "STATUS": ready[1]}
        check_reload(procs[0], notes[0], config, peers, logs[0], ready[0])
        check_op_timeout_applied(sockets[0])
        for rank in (0, 1):
            procs[rank].send_signal(signal.SIGTERM)
            assert notes[rank].next() == {"STOPPING": "1", "STATUS": f"rank {rank}: shutting down"}
            assert procs[rank].wait(WAIT) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for n in notes:
            n.sock.close()


def check_reload(proc: subprocess.Popen[bytes], notes: Notifications, config: Path,
                 peers: list[str], log: Path, ready: str) -> None:
    """SIGHUP: a broken file changes nothing; a good one applies the log level and the op
    timeout, and names the key it cannot apply."""
    config.write_text(config.read_text() + "log_level: loud\n")
    proc.send_signal(signal.SIGHUP)
    assert notes.next().keys() == {"RELOADING", "MONOTONIC_USEC"}
    failed = notes.next()
    assert failed["READY"] == "1"
    assert failed["STATUS"].startswith(f"{ready} (reload failed, running config kept: "
                                       "config error: log_level: ")
    assert " DEBUG " not in log.read_text()  # still at info

    write_config(config, peers, log_level="debug", timeouts="{start: 30, op: 1, heartbeat: 3}")
    before = monotonic_usec()
    proc.send_signal(signal.SIGHUP)
    reloading = notes.next()
    assert reloading["RELOADING"] == "1"
    assert before <= int(reloading["MONOTONIC_USEC"]) <= monotonic_usec()
    summary = (f"reloaded {config}: applied timeouts.op 60.0 -> 1.0, log_level 'info' -> "
               "'debug'; ignored until a restart: timeouts.heartbeat")
    assert notes.next() == {"READY": "1", "STATUS": f"{ready} ({summary})"}
    lines = log.read_text().splitlines()
    reloaded = [i for i, line in enumerate(lines) if line.endswith(f" INFO SIGHUP: {summary}")]
    debug = [i for i, line in enumerate(lines) if " DEBUG " in line]
    assert len(reloaded) == 1 and debug and min(debug) > reloaded[0]
    assert lines[debug[0]].split(" DEBUG ")[1].startswith("rank 0: running config: {")
    assert any(line.endswith(" WARNING SIGHUP: changed keys that need a restart were ignored "
                             "(running values kept): timeouts.heartbeat") for line in lines)


def check_op_timeout_applied(sock: Path) -> None:
    """An op with no timeout of its own, whose peer never joins, now ends after 1 s (the
    reloaded default), not 60."""
    client = Client(NumpyCodec(), f"unix://{sock}", job="systemd-test")
    try:
        handle = client.neighbor_allreduce_async(np.ones(4, np.float32), name="alone")
        with pytest.raises(DecentError, match="timed out after 1s on rank 0"):
            handle.wait(timeout=WAIT / 2)
    finally:
        client.close()
