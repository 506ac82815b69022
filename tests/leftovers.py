"""What a test session must not leave behind: daemon processes and network namespaces.

The session's first process marks its environment (:data:`MARK`); every process the tests start
inherits the mark, so at the session's end :func:`marked_daemons` finds the daemons it started,
however they were started (the fork server, ``python -m decentd``, ``decentrun``) and whether
their test was killed or not. Network namespaces are told apart by the prefixes the suite and
its benchmarks give them, against those that existed when the session began.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

__all__ = ["MARK", "NETNS_PREFIXES", "Leftovers", "mark_session"]

#: the environment variable that marks this session's processes
MARK = "DECENT_TEST_SESSION"
#: the prefixes of the namespaces tests and benchmarks create (deploy_netns, netns_dsgd,
#: netns_hier, chaos_run)
NETNS_PREFIXES = ("dpl", "dcnt", "dchr", "dchs")
#: how long processes that are ending anyway (fork servers, daemons being stopped) may take
GRACE = 15.0


def mark_session() -> str:
    """Mark this process's environment (kept when a parent session marked it already)."""
    return os.environ.setdefault(MARK, uuid.uuid4().hex)


def _environ(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/environ").read_bytes()
    return b""


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    return ""


def _parent(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return 0


def marked_daemons(mark: str) -> dict[int, str]:
    """Live decentd processes carrying ``mark``: pid -> command. This process's own fork
    server (:mod:`decentd_fork`, which ends with it) is not one; the daemons forked from it
    (its children) are."""
    needle = f"{MARK}={mark}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        command = _cmdline(pid)
        if "decentd" not in command or needle not in _environ(pid).split(b"\0"):
            continue
        if "forkserver" in command and _parent(pid) == os.getpid():
            continue
        found[pid] = command
    return found


def namespaces() -> set[str]:
    """This host's network namespaces of the suite's prefixes (none where ip is missing)."""
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    return {n for n in names if n.startswith(NETNS_PREFIXES)}


class Leftovers:
    """The session's check: what it started that still exists at its end."""

    def __init__(self) -> None:
        """Taken at the session's start."""
        self.mark = mark_session()
        self.namespaces_before = namespaces()

    def find(self) -> list[str]:
        """What is left (waiting :data:`GRACE` for what is ending anyway), each removed."""
        deadline = time.monotonic() + GRACE
        while (daemons := marked_daemons(self.mark)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [f"process {pid}: {command[:160]}" for pid, command in sorted(daemons.items())]
        for pid in daemons:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for ns in sorted(namespaces() - self.namespaces_before):
            left.append(f"network namespace {ns}")
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, check=False)
        return left
