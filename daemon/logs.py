"""The daemon's log lines: plain text for people, or one JSON object per line for log shippers.

``log_format: json`` (or ``--log-format json``) writes every record as one line holding
``time`` (UTC, ISO 8601), ``level``, ``rank`` (this daemon's), ``logger`` and ``message``, plus
what the line is about when the code that logs it knows: ``job``, ``op`` (the op's type),
``tensor`` and ``round`` (the op's name and round), and ``peer`` (the rank on the other side:
a worker's rank on a worker-level op's line, a daemon's on a link's) or ``peers`` (several). A
traceback goes in ``exception``. Code passes them with ``extra=`` (see :func:`op_fields`). Both
formats go to stderr, which systemd hands to journald.

Python warnings and uncaught exceptions (any thread) go through the same handler. gRPC's C core
writes to stderr on its own, past Python's logging: a daemon started with ``json`` turns those
lines off (``GRPC_VERBOSITY=NONE``, unless the environment sets it), so that its stderr is JSON
alone; the daemon logs the failures it acts on itself.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Literal, Protocol

from decent_wire.protocol import op_label
from decentd.keys import display_name, job_of

LogFormat = Literal["text", "json"]

#: the ``extra=`` keys a JSON line carries when a record has them, in this order
CONTEXT_FIELDS = ("job", "op", "tensor", "round", "peer", "peers")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self, rank: int) -> None:
        """Lines of the daemon of ``rank``."""
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        """The record as a JSON object (``json.dumps`` escapes line breaks)."""
        out: dict[str, Any] = {
            "time": _utc(record.created),
            "level": record.levelname.lower(),
            "rank": self.rank,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def _utc(created: float) -> str:
    """``2024-05-01T12:00:00.123Z``."""
    whole = int(created)
    millis = int((created - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def text_formatter(rank: int) -> logging.Formatter:
    """The plain format: ``<time> decentd[<rank>] <LEVEL> <message>``."""
    return logging.Formatter(f"%(asctime)s decentd[{rank}] %(levelname)s %(message)s")


class DaemonLog:
    """The daemon's one stderr handler on the root logger; its level and format can change
    while the daemon runs (SIGHUP)."""

    def __init__(self, rank: int, level: str, fmt: LogFormat) -> None:
        """Log at ``level`` (``info``, ...) in ``fmt``; replaces any handler already there."""
        self.rank = rank
        self.handler = logging.StreamHandler(sys.stderr)
        root = logging.getLogger()
        for old in list(root.handlers):
            root.removeHandler(old)
        root.addHandler(self.handler)
        logging.captureWarnings(True)  # warnings.warn goes through the handler too
        sys.excepthook = _uncaught
        threading.excepthook = _uncaught_in_thread
        if fmt == "json":  # before grpc is imported: its core reads this once
            os.environ.setdefault("GRPC_VERBOSITY", "NONE")
        self.level = self.format = ""
        self.apply(level, fmt)

    def apply(self, level: str, fmt: LogFormat) -> None:
        """Switch to ``level`` and ``fmt`` (from the next record on)."""
        logging.getLogger().setLevel(level.upper())
        if fmt != self.format:
            self.handler.setFormatter(JsonFormatter(self.rank) if fmt == "json"
                                      else text_formatter(self.rank))
        self.level, self.format = level, fmt


def _uncaught(kind: type[BaseException], exc: BaseException,
              tb: TracebackType | None) -> None:
    logging.getLogger("decentd").critical("uncaught exception", exc_info=(kind, exc, tb))


def _uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None:
        logging.getLogger("decentd").critical(
            "uncaught exception in thread %s", args.thread.name if args.thread else "?",
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def startup_error(text: str, fmt: str | None) -> str:
    """A line for an error before logging is set up, in the format the command line asked."""
    if fmt != "json":
        return f"decentd: {text}"
    return json.dumps({"time": _utc(time.time()), "level": "error", "logger": "decentd",
                       "message": text}, ensure_ascii=False)


class OpFacts(Protocol):
    """What :func:`op_fields` reads of a running op (:class:`decentd.ops.api.OpContext`)."""

    op: int
    name: str
    round: int
    aborted_by: int
    waiting: set[int]
    unacked: set[int]


def op_fields(ctx: OpFacts) -> dict[str, Any]:
    """``extra=`` for a line about an op: its job, type, tensor name and round, and the peer
    it is about (a rank of the op's level: a worker's for worker ops): the rank that failed it,
    else the rank(s) it still waited on."""
    fields: dict[str, Any] = {"op": op_label(ctx.op), "tensor": display_name(ctx.name),
                              "round": ctx.round}
    job = job_of(ctx.name)
    if job:
        fields["job"] = job
    culprits = [ctx.aborted_by] if ctx.aborted_by >= 0 else sorted(ctx.waiting | ctx.unacked)
    fields.update(peer_fields(culprits))
    return fields


def peer_fields(ranks: Iterable[int]) -> dict[str, Any]:
    """``{"peer": r}`` for one rank, ``{"peers": [...]}`` for several, ``{}`` for none."""
    ranks = list(ranks)
    if len(ranks) == 1:
        return {"peer": ranks[0]}
    return {"peers": ranks} if ranks else {}
