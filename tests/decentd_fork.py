"""Daemon processes forked from a process that has imported decentd once.

Every ``python -m decentd`` spends most of a second of CPU importing its modules (gRPC, pydantic,
networkx, numpy, ...); the suite starts hundreds of daemons on a machine of two cores. Here one
fork server per test process (:mod:`multiprocessing`'s ``forkserver``, decentd's modules preloaded)
imports them once, and each daemon is a fork of it running ``decentd``'s own ``main`` with the
same arguments, environment and working directory, its output in its log file: the same daemon,
started in a few milliseconds. Its command line names decentd's modules (``pgrep -f decentd``
finds it). :class:`ForkedDaemon` is a :class:`subprocess.Popen` for what tests ask of one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
from multiprocessing.context import ForkServerContext
from typing import Any

from decentd.service import cli, server
from decentd.workers import sigbus

__all__ = ["ForkedDaemon"]

#: what every daemon imports (decentd's main imports them on its way): once, in the fork server
#: (by these names: its sys.path is the installed packages', not the tests')
PRELOADED = (cli, server, sigbus)
_context: ForkServerContext | None = None


def _forkserver() -> ForkServerContext:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        assert isinstance(context, ForkServerContext)
        context.set_forkserver_preload([m.__name__ for m in PRELOADED])
        _context = context
    return _context


def _serve(argv: list[str], log: str, env: dict[str, str], cwd: str) -> None:
    """The daemon's process: ``decentd argv`` with ``env`` in ``cwd``, output to ``log``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.exit(cli.main(argv))


class ForkedDaemon(subprocess.Popen[bytes]):
    """``decentd argv`` (its output appended to ``log``), forked from the fork server: a
    :class:`subprocess.Popen` for what tests ask of one (pid, poll, wait, returncode and
    signals)."""

    def __init__(self, argv: list[str], log: str) -> None:  # Popen's own __init__ is not run
        self._child_created = False  # nothing for Popen.__del__ to reap
        self.args = ["decentd", *argv]
        self.stdin = self.stdout = self.stderr = None
        self.returncode: int | Any = None
        self._process = _forkserver().Process(
            target=_serve, args=(argv, log, dict(os.environ), os.getcwd()),
            name=f"decentd {' '.join(argv[:2])}", daemon=True)
        self._process.start()
        assert self._process.pid is not None
        self.pid = self._process.pid

    def poll(self) -> int | None:
        """The exit status (a signal as its negative number), or None while it runs."""
        self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status once it exits; subprocess.TimeoutExpired after ``timeout``."""
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        """Signal it (nothing once it has exited)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)
