"""The timeline: every op's phases on every rank, as a Chrome trace (``timeline.path`` or
``$DECENT_TIMELINE``), like Horovod's timeline.

Each daemon writes its own file (:func:`trace_path`: ``{rank}`` in the path is the daemon's rank,
else ``.rank<N>`` goes before the suffix), so daemons sharing a host or a directory never
write into one file. ``decentctl timeline`` reads them together: a Gantt chart (``--png``) or one
merged trace (``--merge``).

**Format.** The JSON array form of the trace event format, which chrome://tracing, Perfetto and
``json.load`` read: ``[`` and one event per line, each after a comma but the first, and ``]`` when
the daemon closes the timeline. The file is written in whole lines, at most
:data:`FLUSH_SECONDS` after an op completed, so a daemon that is killed leaves every event
written until then in a file that is a valid trace without its closing bracket (chrome://tracing
and Perfetto accept that; ``decentctl timeline`` too).

**Events.** One process per worker rank (``pid`` = rank, named ``rank N``); per rank, a lane
(``tid``) per op name, a second lane beside it for its sends (sending and receiving overlap,
and a lane's slices must nest), and more lanes when calls of one name overlap in time. Each
phase is a complete (``"X"``) event named after it, with the op, round and bytes as args:

- ``queued`` (client): from the user's call to its tensor placed in the arena and queued;
- ``fused`` (client): waiting in the fusion bucket until the request went to the daemon;
- ``sent``: from the op's first send to its last one returned (acknowledged, when it waits
  for that);
- ``received``: from the op's first wait for a peer's data to the last data there;
- ``combined``: from the end of its last transfer to the op's result written: the combining
  that did not overlap the transfers (a lone neighbor's tensor is folded in while it arrives);
- ``completed``: from the result to its completion handed to the worker (the op's keys
  closed, its buffers released; with several workers per node, the copies of a node-level
  result to them follow).

The client's phases come with its request (``SubmitRequest.queued_ns``, ``fused_ns``,
``sent_ns``): ``time.monotonic_ns``, whose clock (CLOCK_MONOTONIC) every process of a host shares.
Times are that clock's whole microseconds (every JSON reader takes integers exactly, so
slices that touch stay nested); each process_name event carries the host and the clock's
offset to the wall clock, so traces of several hosts can be aligned (``decentctl timeline``).
Node-level ops of a daemon with several workers run once for them all: they appear on the
process ``node N`` (pid :data:`NODE_PID` + N) with the daemon's phases only, a large tensor's
segments on lanes of their own (``name [segment k]``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from decent_wire import dtypes
from decent_wire.errors import DecentError
from decent_wire.protocol import op_label
from decent_wire.v1 import decent_pb2 as pb
from decentd.errors import ConfigError
from decentd.keys import OWNER_SEPARATOR, SEGMENT_SEPARATOR

if TYPE_CHECKING:  # only for annotations: decentctl reads timelines without the daemon's modules
    from decentd.ops.api import OpContext
    from decentd.ops.phases import Phases

log = logging.getLogger("decentd.service.timeline")

#: the phases of an op, in order
PHASES = ("queued", "fused", "sent", "received", "combined", "completed")
#: phases measured in the client
CLIENT_PHASES = frozenset(PHASES[:2])
#: buffered events reach the file at most this long after their op completed
FLUSH_SECONDS = 1.0
#: ... or as soon as this many ops' events are buffered
FLUSH_EVENTS = 512
#: pid of a daemon's own process in its trace (node-level ops with several workers per node)
NODE_PID = 1_000_000

#: one phase of one tensor: (phase, start ns, end ns)
Span = tuple[str, int, int]


def trace_path(path: str, rank: int) -> str:
    """Daemon ``rank``'s file: ``{rank}`` in ``path`` replaced by it, else ``.rank<N>`` put
    before the suffix (``/tmp/t.json`` -> ``/tmp/t.rank0.json``)."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}"))


def open_timeline(path: str | None, machine: int, per_node: int) -> Timeline | None:
    """The timeline of daemon ``machine`` that ``path`` (``timeline.path``) or else
    ``$DECENT_TIMELINE`` asks for; None when neither does. ConfigError when its file cannot be
    created."""
    path = path or os.environ.get("DECENT_TIMELINE") or None
    if path is None:
        return None
    try:
        return Timeline(path, machine, per_node)
    except OSError as exc:
        raise ConfigError(f"config error: timeline.path: cannot create "
                          f"{trace_path(path, machine)}: {exc.strerror or exc}") from None


def spans(phases: Phases, client: tuple[int, int, int] | None) -> list[Span]:
    """The phases of one tensor of an op that completed, in order, each as (phase, start, end)
    in ``time.monotonic_ns``; ``client``: its (queued, fused, sent) times, if stamped.

    A phase that did not happen (no send, no receive, no result: the op failed) is left out.
    """
    out: list[Span] = []
    if client is not None and 0 < client[0] <= client[1] <= client[2] <= phases.started_ns:
        out += [("queued", client[0], client[1]), ("fused", client[1], client[2])]
    if phases.send_ns and phases.sent_ns >= phases.send_ns:
        out.append(("sent", phases.send_ns, phases.sent_ns))
    ran, done = phases.ran_ns, phases.done_ns
    received = min(phases.received_ns, ran or done or phases.received_ns)  # nested in its lane
    if phases.recv_ns and received >= phases.recv_ns:
        out.append(("received", phases.recv_ns, received))
    moved = max(phases.sent_ns, received) or phases.started_ns
    if ran:
        out.append(("combined", min(moved, ran), ran))
    if done:
        out.append(("completed", min(ran or moved, done), done))
    return out


@dataclass
class Lane:
    """Where one op name's calls go on one rank: a lane for its phases, one for its sends."""

    tid: int  #: the phases' thread id (the sends': ``tid + 1``)
    #: each phase's event up to its ``"ts":`` (made once per lane: the hot path only adds times)
    heads: dict[str, str]
    busy_until: int = 0  #: the end of the last op placed here (ns)


class TraceFile:
    """The trace file, written in whole events (see the module's docstring)."""

    def __init__(self, path: str) -> None:
        """Create (or truncate) ``path``; OSError when that fails."""
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._buffer: list[str] = []
        self._first = True
        self._timer: asyncio.TimerHandle | None = None
        self.broken = False

    def add(self, events: list[str]) -> None:
        """Buffer events (JSON objects); they are written within :data:`FLUSH_SECONDS`."""
        self._buffer.append(("[\n" if self._first else ",\n") + ",\n".join(events))
        self._first = False
        if len(self._buffer) >= FLUSH_EVENTS:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not on the loop (tests, shutdown): written at close
                return
            self._timer = loop.call_later(FLUSH_SECONDS, self.flush)

    def flush(self) -> None:
        """Write what is buffered."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._buffer or self.broken:
            return
        data = "".join(self._buffer).encode()
        self._buffer.clear()
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:  # a full disk must not take the daemon down: stop recording
            self.broken = True
            log.warning("timeline %s: %s; no more events are recorded", self.path, exc)

    def close(self) -> None:
        """Write what is buffered and the closing bracket, and close the file."""
        if self._fd < 0:
            return
        if self._first:
            self._buffer.append("[")
        self._buffer.append("\n]\n")
        self._first = False
        self.flush()
        os.close(self._fd)
        self._fd = -1


class Timeline:
    """A daemon's timeline: an engine ``PhaseObserver`` that writes each op's phases to its
    trace file once the op completed. Called on the event loop."""

    def __init__(self, path: str, machine: int, per_node: int = 1) -> None:
        """Record into daemon ``machine``'s file of ``path`` (:func:`trace_path`); OSError when
        it cannot be created."""
        self.machine, self.per_node = machine, per_node
        self.file = TraceFile(trace_path(path, machine))
        self.path = self.file.path
        self._lanes: dict[tuple[int, str], list[Lane]] = {}
        self._next_tid: dict[int, int] = {}
        self._ops: dict[int, str] = {}
        log.info("timeline: recording into %s", self.path)

    # ------------------------------------------------------------------ OpObserver

    def submitted(self, session: object, req: pb.SubmitRequest) -> None:
        """Nothing: the engine stamps the request's tensors with their client's times."""

    def ended(self, ctx: OpContext, error: DecentError | None, seconds: float) -> None:
        """Note the error an op failed with."""
        if error is not None and ctx.phases is not None:
            ctx.phases.error = pb.ErrorCode.Name(error.code)

    def completed(self, ctx: OpContext) -> None:
        """Record the phases of every tensor of ``ctx``."""
        phases = ctx.phases
        if phases is None or self.file.broken:
            return
        pid = NODE_PID + self.machine if ctx.level.node and self.per_node > 1 else ctx.rank
        if pid not in self._next_tid:
            self._process(pid)
        fused = f',"fused":{len(ctx.parts)}' if len(ctx.parts) > 1 else ""
        error = f',"error":"{phases.error}"' if phases.error else ""
        op = self._ops.get(ctx.op) or self._ops.setdefault(ctx.op, op_label(ctx.op))
        for p in ctx.parts:
            got = spans(phases, p.submitted)
            if got:
                nbytes = dtypes.nbytes(p.dtype, p.shape)  # its views are released by now
                args = (f'"args":{{"op":"{op}","round":{p.round},"bytes":{nbytes}'
                        f'{fused}{error}}}}}')
                self._record(pid, _lane_name(p.name, p.display), got, args)

    # ------------------------------------------------------------------ events

    def _record(self, pid: int, name: str, got: list[Span], args: str) -> None:
        """One tensor's phases on a free lane of its name."""
        # the earliest phase is one of the first two (sent and received start in either order)
        start = min(got[0][1], got[1][1]) if len(got) > 1 else got[0][1]
        lanes = self._lanes.get((pid, name))
        if lanes is None:
            lanes = self._lanes[(pid, name)] = []
        for lane in lanes:
            if lane.busy_until <= start:
                break
        else:
            lane = self._lane(pid, name, len(lanes))
            lanes.append(lane)
        last = got[-1]  # completed: it ends last
        lane.busy_until = last[2] if last[0] == "completed" else max(e for _, _, e in got)
        heads = lane.heads
        # whole microseconds: slices that touch share exact bounds
        self.file.add([f'{heads[phase]}{b // 1000},"dur":{e // 1000 - b // 1000},{args}'
                       for phase, b, e in got])

    def _lane(self, pid: int, name: str, index: int) -> Lane:
        """A new lane pair for ``name`` on ``pid`` (named, and sorted in creation order)."""
        tid = self._next_tid[pid]
        self._next_tid[pid] = tid + 2
        label = name if index == 0 else f"{name} #{index + 1}"
        self.file.add([_meta(kind, pid, t, {key: value}) for t, text in (
            (tid, label), (tid + 1, f"{label} (send)")) for kind, key, value in (
            ("thread_name", "name", text), ("thread_sort_index", "sort_index", t))])
        heads = {}
        for phase in PHASES:
            cat = "client" if phase in CLIENT_PHASES else "daemon"
            heads[phase] = (f'{{"name":"{phase}","cat":"{cat}","ph":"X","pid":{pid},'
                            f'"tid":{tid + 1 if phase == "sent" else tid},"ts":')
        return Lane(tid, heads)

    def _process(self, pid: int) -> None:
        """Name a new process: ``rank N`` (or ``node N``), its host and clock offset."""
        self._next_tid[pid] = 1
        name = f"node {pid - NODE_PID}" if pid >= NODE_PID else f"rank {pid}"
        offset = time.time_ns() - time.monotonic_ns()
        self.file.add([_meta("process_name", pid, 0, {
            "name": name, "host": socket.gethostname(), "daemon": self.machine,
            "wall_minus_monotonic_ns": offset}), _meta("process_sort_index", pid, 0,
                                                       {"sort_index": pid})])

    def flush(self) -> None:
        """Write what is buffered now."""
        self.file.flush()

    def close(self) -> None:
        """Write everything and the closing bracket."""
        self.file.close()
        log.info("timeline: wrote %s", self.path)


def _lane_name(key: str, display: str) -> str:
    """The lane of a tensor: its name, and the segment of a node-level tensor that runs in
    segments (:func:`decentd.keys.segment`; segment 0 is the tensor's own key)."""
    if SEGMENT_SEPARATOR not in key:
        return display
    index = key.rsplit(SEGMENT_SEPARATOR, 1)[1].split(OWNER_SEPARATOR, 1)[0]
    return f"{display} [segment {index}]"


def _meta(name: str, pid: int, tid: int, args: dict[str, object]) -> str:
    """A metadata (``"M"``) event."""
    return json.dumps({"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args},
                      separators=(",", ":"))
