"""Errors of the daemon process itself (requests fail with ``decent_wire.errors.DecentError``)."""

from __future__ import annotations


class StartupError(Exception):
    """The daemon cannot start (bad config, peers missing past the start timeout, ...)."""
