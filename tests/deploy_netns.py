"""Named hosts for the deployment tests: one network namespace per host, all on one bridge (in a
"switch" namespace of their own), each with an ``/etc/netns/<ns>/hosts`` that maps every host's
name to its address, so names resolve as on a compose network, a cluster's DNS or a SLURM
cluster's /etc/hosts. ``ip netns exec`` bind-mounts that file over /etc/hosts; the command runs
under ``unshare --uts`` with the host's name as its hostname.

Hosts may also be isolated (loopback only: ``network_mode: none``). Everything made here is
removed by :meth:`Hosts.down` (processes killed, namespaces deleted, hosts files removed), and
namespaces left by a killed run are removed by the next one.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

PREFIX = "dpl"
SUBNET = "10.79.0"
NETNS_ETC = Path("/etc/netns")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` (CalledProcessError with its stderr when ``check`` and it fails)."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
    return proc


def require_root() -> None:
    """Skip the calling test, saying why, unless network namespaces can be made here."""
    if os.geteuid() != 0:
        pytest.skip("needs root: it creates network namespaces (ip netns add) and mounts")
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs the {tool!r} command (iproute2 / util-linux)")


def namespaces() -> list[str]:
    """Every network namespace that exists now."""
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_and_delete(ns: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), sig)
        if pids and sig == signal.SIGTERM:
            time.sleep(0.5)
    ip("netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def remove_leftovers() -> list[str]:
    """Delete namespaces of earlier runs whose process is gone (``dpl<pid>-...``)."""
    gone = []
    for ns in namespaces():
        m = re.fullmatch(rf"{PREFIX}(\d+)-.*", ns)
        if m and int(m.group(1)) != os.getpid() and not Path(f"/proc/{m.group(1)}").exists():
            _kill_and_delete(ns)
            gone.append(ns)
    return gone


class Hosts:
    """Network namespaces named after hosts; ``bridged`` ones share a subnet, ``isolated`` ones
    have loopback only."""

    def __init__(self, bridged: Sequence[str], isolated: Sequence[str] = (), tag: str = "") -> None:
        self.prefix = f"{PREFIX}{os.getpid()}{tag}"
        self.bridged = list(bridged)
        self.isolated = list(isolated)
        self.ns = {name: f"{self.prefix}-{i}"
                   for i, name in enumerate([*self.bridged, *self.isolated])}
        self.switch = f"{self.prefix}-sw"
        self.made: list[str] = []
        self.made_etc = False

    def address(self, name: str) -> str:
        """The IPv4 address of bridged host ``name``."""
        return f"{SUBNET}.{self.bridged.index(name) + 2}"

    def hosts_file(self, name: str) -> str:
        """The /etc/hosts that host ``name`` sees."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        if name in self.isolated:
            lines.append(f"127.0.1.1\t{name}")
        lines += [f"{self.address(h)}\t{h}" for h in self.bridged]
        return "\n".join(lines) + "\n"

    def _add(self, ns: str) -> None:
        proc = ip("netns", "add", ns, check=False)
        if proc.returncode != 0:
            pytest.skip(f"cannot create network namespace {ns}: {proc.stderr.strip()}")
        self.made.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")

    def up(self) -> None:
        """Create the namespaces, the bridge, one veth per bridged host, the hosts files."""
        remove_leftovers()
        self.made_etc = not NETNS_ETC.exists()
        self._add(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.bridged):
            ns = self.ns[name]
            self._add(ns)
            ip("link", "add", "eth0", "netns", ns, "type", "veth",
               "peer", "name", f"p{i}", "netns", self.switch)
            ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            ip("-n", self.switch, "link", "set", f"p{i}", "up")
        for name in self.isolated:
            self._add(self.ns[name])
        for name, ns in self.ns.items():
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(self.hosts_file(name))

    def down(self) -> None:
        """Kill what runs in the namespaces and delete them (idempotent)."""
        for ns in reversed(self.made):
            _kill_and_delete(ns)
        self.made.clear()
        if self.made_etc:
            with contextlib.suppress(OSError):  # not empty: someone else uses it now
                NETNS_ETC.rmdir()
            self.made_etc = False

    def left(self) -> list[str]:
        """This one's namespaces that exist now (none after :meth:`down`); other tests' are
        not looked at (the chaos run may make its own beside)."""
        return [ns for ns in namespaces() if ns.startswith(f"{self.prefix}-")]

    def argv(self, name: str, command: Sequence[str], hostname: str | None = None,
             unshare: Sequence[str] = (), enter: Sequence[str] = ()) -> list[str]:
        """``command`` run in host ``name``'s namespace with its hostname (``hostname`` or the
        name), in a mount namespace of its own, after ``enter`` (an ``nsenter`` command line
        joining other namespaces) and with the extra ``unshare`` flags given."""
        inner = ["sh", "-c", 'hostname "$0" && exec "$@"', hostname or name, *command]
        return ["ip", "netns", "exec", self.ns[name], *enter, "unshare", "--uts", "--mount",
                *unshare, "--", *inner]


@contextlib.contextmanager
def hosts(bridged: Sequence[str], isolated: Sequence[str] = (), tag: str = "") -> Iterator[Hosts]:
    """:class:`Hosts` that are up inside the block and gone after it."""
    require_root()
    net = Hosts(bridged, isolated, tag)
    try:
        net.up()
        yield net
    finally:
        net.down()
