"""Which local processes may use this daemon: the worker sockets and arenas are the daemon
user's alone (mode 0600), or its and one group's (0660, ``security.worker_group``), and every
process that connects to the data and memory sockets is checked by its credentials
(SO_PEERCRED) against this daemon's uid, ``security.allowed_uids`` and the group."""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat
import struct
from pathlib import Path

from decent_wire.local import private_tmp_dir

#: struct ucred: pid, uid, gid
UCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    pid, uid, gid = UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                 UCRED.size))
    return pid, uid, gid


def groups_of(pid: int) -> set[int]:
    """The supplementary groups of process ``pid`` (empty when it cannot be read)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


class LocalAccess:
    """The daemon's rule for local workers."""

    def __init__(self, allowed_uids: list[int] | None = None, group: str | None = None) -> None:
        self.uid = os.getuid()
        self.allowed = {self.uid, 0, *(allowed_uids or [])}
        self.group = group
        try:
            self.gid = grp.getgrnam(group).gr_gid if group else None
        except KeyError:
            raise ValueError(f"security.worker_group: no group named {group!r}") from None

    @property
    def mode(self) -> int:
        """The file mode of the worker sockets and arenas."""
        return 0o660 if self.gid is not None else 0o600

    def protect(self, path: str) -> None:
        """Give the socket (or file) at ``path`` this rule's mode and group."""
        if self.gid is not None:
            os.chown(path, -1, self.gid)
        os.chmod(path, self.mode)

    def prepare_default_dir(self, socket_path: str) -> None:
        """Make the directory of the default socket in the temporary directory (mode 0700, or
        0750 with the workers' group); ValueError when it is someone else's or writable by
        others. Other directories are the user's to choose and are left as they are."""
        folder = os.path.dirname(socket_path)
        if folder != private_tmp_dir():
            return
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != self.uid:
            raise ValueError(f"{folder} is not a directory of uid {self.uid} (owner uid "
                             f"{info.st_uid}): someone else made it; remove it, or set socket:")
        if self.gid is not None:
            os.chown(folder, -1, self.gid)
        os.chmod(folder, 0o750 if self.gid is not None else 0o700)

    def protect_fd(self, fd: int) -> None:
        """The same for an open file (an arena)."""
        if self.gid is not None:
            os.fchown(fd, -1, self.gid)
        os.fchmod(fd, self.mode)

    def refusal(self, sock: socket.socket | None) -> str | None:
        """Why the process at the other end of ``sock`` may not use this daemon (None: it
        may)."""
        if sock is None:
            return "no socket to check the peer's credentials on"
        try:
            pid, uid, gid = peer_credentials(sock)
        except OSError as exc:
            return f"cannot read the peer's credentials ({exc.strerror})"
        if uid in self.allowed:
            return None
        if self.gid is not None and (gid == self.gid or self.gid in groups_of(pid)):
            return None
        extra = f" or in group {self.group!r}" if self.group else ""
        return (f"process {pid} runs as uid {uid}; this daemon serves uid(s) "
                f"{sorted(self.allowed)}{extra} (security.allowed_uids, security.worker_group)")
