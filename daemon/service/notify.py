"""systemd's readiness protocol (``Type=notify``), without a library.

The service manager names a datagram socket in ``$NOTIFY_SOCKET`` (a path, or an abstract name
written with a leading ``@``); the daemon sends it newline-separated ``KEY=VALUE`` assignments
(sd_notify(3)): ``READY=1`` once its peers are connected, ``RELOADING=1`` with
``MONOTONIC_USEC`` while it re-reads its config at SIGHUP (then ``READY=1`` again),
``STOPPING=1`` at shutdown, and ``STATUS=`` lines for ``systemctl status``. Without
``$NOTIFY_SOCKET`` (not started by systemd) every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("decentd.service.notify")

#: how long one notification may block (the manager reads them at once; a full queue means a
#: stuck manager, and the daemon must not stall with it)
SEND_TIMEOUT = 1.0


def socket_address(name: str) -> str | bytes:
    """The ``AF_UNIX`` address of ``$NOTIFY_SOCKET``: an abstract name (``@name``) starts with a
    NUL byte; anything else is a filesystem path. ValueError for a name that is neither."""
    if name.startswith("@") and len(name) > 1:
        return b"\0" + os.fsencode(name[1:])
    if name.startswith("/"):
        return name
    raise ValueError(f"$NOTIFY_SOCKET {name!r} is neither an absolute path nor an @abstract name")


def message(**fields: str | int) -> bytes:
    """``KEY=VALUE`` lines; a value's line breaks become spaces (one assignment per line)."""
    lines = (f"{key}={' '.join(str(value).splitlines())}" for key, value in fields.items())
    return "\n".join(lines).encode()


class Notifier:
    """The daemon's side of ``$NOTIFY_SOCKET``; every method is a no-op without one."""

    def __init__(self, name: str | None) -> None:
        """Notify ``name`` (``$NOTIFY_SOCKET``'s value); None: nobody listens."""
        self.name = name
        self._address: str | bytes | None = None
        if name:
            try:
                self._address = socket_address(name)
            except ValueError as exc:
                log.warning("%s; not notifying systemd", exc)

    @classmethod
    def from_env(cls) -> Notifier:
        """The socket systemd gave this process. The variable is removed from the environment,
        as sd_notify(3) advises, so that no child process notifies in the daemon's name."""
        return cls(os.environ.pop("NOTIFY_SOCKET", None))

    @property
    def enabled(self) -> bool:
        """Whether anyone listens."""
        return self._address is not None

    def send(self, **fields: str | int) -> bool:
        """Send one notification; False when there is no socket or it failed (logged)."""
        if self._address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT)
                sock.sendto(message(**fields), self._address)
        except OSError as exc:
            log.warning("cannot notify systemd at %s: %s", self.name, exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        """Started (or reloaded): ``READY=1`` with ``status``."""
        return self.send(READY=1, STATUS=status)

    def reloading(self) -> bool:
        """Re-reading the config now: ``RELOADING=1`` and when (``CLOCK_MONOTONIC``, µs)."""
        return self.send(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(
            time.CLOCK_MONOTONIC) // 1000)

    def stopping(self, status: str) -> bool:
        """Shutting down: ``STOPPING=1`` with ``status``."""
        return self.send(STOPPING=1, STATUS=status)

    def status(self, status: str) -> bool:
        """A status line for ``systemctl status`` (no state change)."""
        return self.send(STATUS=status)
