"""File descriptors: the daemon's limit raised at start, and a warning before it runs out.

Every peer connection, local worker, arena and gRPC connection holds descriptors. At the limit
the kernel refuses new ones: a local worker then cannot register, and neither gRPC's core nor
the event loop says why. So the daemon raises its soft limit to the hard one at start (systemd's
``LimitNOFILE=`` sets both), and watches how many it holds: past :data:`WARN_SHARE` of the limit
it logs who holds them and what will fail, again at most once a minute while it stays there.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import time

log = logging.getLogger("decentd.service.descriptors")

#: the share of the limit past which the daemon warns
WARN_SHARE = 0.9
#: seconds between two warnings while the count stays high
WARN_EVERY = 60.0


def raise_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def open_count(limit: int) -> int:
    """Descriptors this process holds: ``limit`` when not even one more can be opened to
    count them, -1 where /proc is missing."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError as exc:
        return limit if exc.errno in (errno.EMFILE, errno.ENFILE) else -1


class DescriptorWatch:
    """Logs when the daemon's descriptors near its limit."""

    def __init__(self, limit: int, share: float = WARN_SHARE, every: float = WARN_EVERY) -> None:
        """Warn past ``share`` of ``limit``, at most once per ``every`` seconds."""
        self.limit = limit
        self.threshold = int(limit * share)
        self.every = every
        self._warned = -float("inf")
        self.high = False  #: over the threshold at the last check

    def check(self, count: int, now: float) -> None:
        """``count`` descriptors are open now."""
        if count < self.threshold:
            if self.high:
                log.info("open file descriptors back to %d of %d", count, self.limit)
            self.high = False
            return
        self.high = True
        if now - self._warned >= self.every:
            self._warned = now
            log.warning("%d of the %d file descriptors this daemon may open are in use: new "
                        "connections (peers' and gRPC callers') and local workers registering "
                        "will fail at the limit; many idle connections to the peer ports point "
                        "at a flood; raise LimitNOFILE (ulimit -n) if the load is real",
                        count, self.limit)

    async def run(self, interval: float) -> None:
        """Check every ``interval`` seconds."""
        while True:
            self.check(open_count(self.limit), time.monotonic())
            await asyncio.sleep(interval)
