"""What a running daemon takes from its re-read config at SIGHUP (``systemctl reload``).

Only values that nothing holds on to past the moment it reads them can change safely while ops
run: the log level and format, the default timeout of ops submitted from then on (and of window
reads parked from then on), the stall warning, and the shutdown grace. Everything else (peers,
ranks, topology, sockets, security, memory bounds, heartbeat, ...) is baked into connections,
buffers and the peers' agreement at start: a changed value is named in a warning and ignored,
and the daemon keeps running with the config it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from decentd.logs import DaemonLog
from decentd.service.config import NodeConfig
from decentd.service.notify import Notifier

#: the dotted keys a reload applies (every other changed key needs a restart)
RELOADABLE = frozenset({"log_level", "log_format", "timeouts.op", "timeouts.stall_warning",
                        "timeouts.shutdown"})


@dataclass(frozen=True)
class Change:
    """One config key whose value differs between the running and the re-read config."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {self.old!r} -> {self.new!r}"


@dataclass
class Service:
    """How the daemon runs as a service: how to read its config again, who hears of its state
    (systemd), and its log (whose level and format a reload changes)."""

    #: the config as the command line gives it now (file and flags); None: nothing to re-read
    reread: Callable[[], NodeConfig] | None = None
    #: the file ``reread`` reads, for messages
    path: str | None = None
    notifier: Notifier = field(default_factory=lambda: Notifier(None))
    log: DaemonLog | None = None


def flatten(model: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a config as ``{"timeouts.op": 60.0, ...}`` (an unset section is a leaf)."""
    out: dict[str, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out.update(flatten(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def changes(running: NodeConfig, reread: NodeConfig) -> list[Change]:
    """The keys whose values differ, in the config's order."""
    old, new = flatten(running), flatten(reread)
    keys = list(old) + [k for k in new if k not in old]  # a section set only in one of them
    return [Change(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)]


def split(found: list[Change]) -> tuple[list[Change], list[Change]]:
    """``(applied, ignored)``: the changes a reload takes, and those that need a restart."""
    return ([c for c in found if c.key in RELOADABLE],
            [c for c in found if c.key not in RELOADABLE])


def assign(cfg: NodeConfig, applied: list[Change]) -> None:
    """Set the applied keys in the running config (validated again on assignment)."""
    for change in applied:
        *sections, leaf = change.key.split(".")
        target: BaseModel = cfg
        for section in sections:
            target = getattr(target, section)
        setattr(target, leaf, change.new)


def summary(path: str | None, applied: list[Change], ignored: list[Change]) -> str:
    """One line for the log and ``systemctl status``."""
    source = path or "the command line"
    if not applied and not ignored:
        return f"reloaded {source}: nothing changed"
    parts = []
    if applied:
        parts.append("applied " + ", ".join(map(str, applied)))
    if ignored:
        parts.append("ignored until a restart: " + ", ".join(c.key for c in ignored))
    return f"reloaded {source}: " + "; ".join(parts)
