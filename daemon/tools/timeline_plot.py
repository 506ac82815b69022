"""``decentctl timeline FILE... [--png OUT] [--merge OUT]``: the daemons' timelines read together,
drawn as a Gantt chart or merged into one trace.

A FILE that does not exist stands for the per-rank files a timeline path gives
(:func:`decentd.service.timeline.trace_path`): ``/tmp/t.json`` finds ``/tmp/t.rank0.json``,
``/tmp/t.rank1.json``, ...; a path with ``{rank}`` finds every rank's. A file cut short (a
killed daemon) is read up to its last whole event. Files from several hosts are aligned by the
wall clock (each process_name event carries its host's offset); from one host they already
share CLOCK_MONOTONIC.

The chart has one row per op lane of each rank (rank by rank, as the trace's lanes): the
phases ``queued``, ``fused``, ``received``, ``combined`` and ``completed`` in the upper band of
the row, ``sent`` (which overlaps receiving) in the lower band, one color per phase.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decentd.service.timeline import NODE_PID, PHASES, trace_path

Event = dict[str, Any]

#: one color per phase (colorblind-safe palette); a failed op's phases are hatched
COLORS = {"queued": "#bbbbbb", "fused": "#ee7733", "sent": "#0077bb", "received": "#33bbee",
          "combined": "#009988", "completed": "#aa3377"}
#: most rows drawn (shared by the ranks: each rank's first lanes)
MAX_ROWS = 160


def expand(paths: Iterable[str]) -> list[str]:
    """The trace files ``paths`` name (see the module's docstring); FileNotFoundError when a
    path names none."""
    found: list[str] = []
    for path in paths:
        if Path(path).is_file():
            found.append(path)
            continue
        pattern = trace_path(path, 0).replace(".rank0", ".rank*") if "{rank}" not in path \
            else path.replace("{rank}", "*")
        matches = sorted(glob.glob(glob.escape(pattern).replace("[*]", "*")), key=_rank_key)
        if not matches:
            raise FileNotFoundError(f"no timeline at {path} (nor per-rank files {pattern})")
        found += matches
    return found


def _rank_key(path: str) -> tuple[int, str]:
    numbers = re.findall(r"\d+", Path(path).name)
    return (int(numbers[-1]) if numbers else -1, path)


def read_events(path: str) -> list[Event]:
    """The events of one trace file (array or ``{"traceEvents": [...]}`` form); a file cut
    short is read up to its last whole event."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _read_truncated(text)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def _read_truncated(text: str) -> list[Event]:
    """Events of a file without its end: one per line, a partial last line left out."""
    events = []
    for line in text.splitlines():
        line = line.strip().strip(",").strip()
        if line.startswith("["):
            line = line[1:].strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def load(paths: Iterable[str]) -> list[Event]:
    """The events of every file, on one time axis (files of other hosts shifted by the wall
    clock)."""
    per_file = [read_events(p) for p in expand(paths)]
    clocks = [_clock(events) for events in per_file]
    hosts = {host for host, _ in clocks if host}
    base = next((offset for _, offset in clocks if offset), 0)
    out: list[Event] = []
    for events, (_, offset) in zip(per_file, clocks, strict=True):
        shift = (offset - base) / 1000 if len(hosts) > 1 and offset else 0.0
        for e in events:
            if shift and "ts" in e:
                e = dict(e, ts=e["ts"] + shift)
            out.append(e)
    return out


def _clock(events: list[Event]) -> tuple[str, int]:
    """(host, wall minus monotonic ns) of a file, from its first process_name event."""
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            args = e.get("args", {})
            return str(args.get("host", "")), int(args.get("wall_minus_monotonic_ns", 0))
    return "", 0


def merge(paths: Iterable[str], out: str) -> int:
    """Write every file's events as one trace (``{"traceEvents": [...]}``); the event count."""
    events = load(paths)
    with open(out, "w") as f:
        f.write('{"traceEvents": [\n')
        f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in events))
        f.write("\n]}\n")
    return len(events)


@dataclass
class Row:
    """One op lane of one rank in the chart."""

    pid: int
    tid: int
    name: str  #: the lane's name (the op's name)
    label: str  #: ``rank N · name``
    #: by phase (with a trailing ``!`` for a failed op's): (start us, duration us)
    bars: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def rows(events: list[Event]) -> list[Row]:
    """The chart's rows, by rank and lane: each lane's phases (``sent`` from its send lane)."""
    names: dict[tuple[int, int], str] = {}
    procs: dict[int, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = str(e.get("args", {}).get("name", e["pid"]))
    by_lane: dict[tuple[int, int], Row] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("name") not in COLORS:
            continue
        pid, tid = int(e["pid"]), int(e["tid"])
        if e["name"] == "sent":
            tid -= 1  # a lane's sends are on the lane after it
        row = by_lane.get((pid, tid))
        if row is None:
            proc = procs.get(pid, f"node {pid - NODE_PID}" if pid >= NODE_PID else f"rank {pid}")
            name = names.get((pid, tid), str(tid))
            row = by_lane[(pid, tid)] = Row(pid, tid, name, f"{proc} · {name}")
        key = e["name"] + ("!" if e.get("args", {}).get("error") else "")
        row.bars.setdefault(key, []).append((float(e["ts"]), float(e.get("dur", 0.0))))
    return [by_lane[k] for k in sorted(by_lane)]


def draw(events: list[Event], out: str, title: str = "decent timeline",
         window: tuple[float, float] | None = None, ops: str | None = None) -> int:
    """Draw the Gantt chart of ``events`` into the PNG ``out`` (``window``: only that span,
    in ms from the first event; ``ops``: only lanes whose name matches this glob); the number
    of rows drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # an extra, not a dependency of the daemon
        raise SystemExit("decentctl timeline --png needs matplotlib: pip install "
                         "'decent[examples]'") from exc
    lanes = rows(events)
    if not lanes:
        raise ValueError("the timeline holds no op phases")
    start = min(ts for r in lanes for bars in r.bars.values() for ts, _ in bars)
    end = max(ts + d for r in lanes for bars in r.bars.values() for ts, d in bars)
    if ops is not None:
        lanes = [r for r in lanes if fnmatch.fnmatchcase(r.name, ops)]
        if not lanes:
            raise ValueError(f"no op lane matches {ops!r}")
    if window is not None:  # only the lanes with something in it
        lo_us, hi_us = start + window[0] * 1e3, start + window[1] * 1e3
        lanes = [r for r in lanes if any(ts < hi_us and ts + d > lo_us
                                         for bars in r.bars.values() for ts, d in bars)]
        if not lanes:
            raise ValueError(f"no op phase between {window[0]} and {window[1]} ms")
    lanes, cut = _cap(lanes)
    fig, ax = plt.subplots(figsize=(13, 1.6 + 0.32 * len(lanes)))
    for y, row in enumerate(lanes):
        for key, bars in row.bars.items():
            phase = key.rstrip("!")
            lo, height = (y + 0.02, 0.28) if phase == "sent" else (y - 0.38, 0.38)
            failed = key.endswith("!")
            ax.broken_barh([((ts - start) / 1e3, max(d / 1e3, 0.0)) for ts, d in bars],
                           (lo, height), facecolors=COLORS[phase],
                           edgecolor="#222222" if failed else COLORS[phase],
                           linewidth=0.4, hatch="////" if failed else None)
    total = (end - start) / 1e3
    _frame(ax, lanes, (-0.01 * total, 1.01 * total) if window is None else window)
    ax.set_title(title + (f" ({cut} more lanes not drawn: choose with --ops or --window)"
                          if cut else ""))
    handles = [Patch(color=COLORS[p], label=p) for p in PHASES]
    handles.append(Patch(facecolor="white", edgecolor="#555555", hatch="////", label="failed"))
    ax.legend(handles=handles, ncol=len(handles),
              loc="lower center", bbox_to_anchor=(0.5, 1.0 + 0.35 / (1 + len(lanes) * 0.32)),
              frameon=False, fontsize=9)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return len(lanes)


def _cap(lanes: list[Row]) -> tuple[list[Row], int]:
    """At most :data:`MAX_ROWS` lanes, shared by the ranks (each keeps its first ones); and how
    many were left out."""
    if len(lanes) <= MAX_ROWS:
        return lanes, 0
    per = max(1, MAX_ROWS // len({r.pid for r in lanes}))
    kept: list[Row] = []
    seen: dict[int, int] = {}
    for r in lanes:
        seen[r.pid] = seen.get(r.pid, 0) + 1
        if seen[r.pid] <= per:
            kept.append(r)
    return kept, len(lanes) - len(kept)


def _frame(ax: Any, lanes: list[Row], span: tuple[float, float]) -> None:
    """Row labels, a line between ranks, the time axis."""
    ax.set_yticks(range(len(lanes)), [r.label for r in lanes], fontsize=8)
    ax.set_ylim(len(lanes) - 0.5, -0.6)
    for y in range(1, len(lanes)):
        if lanes[y].pid != lanes[y - 1].pid:
            ax.axhline(y - 0.5, color="#444444", linewidth=0.8)
    ax.set_xlim(*span)
    ax.set_xlabel("ms since the first event")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``timeline`` subcommand's arguments."""
    tl = sub.add_parser("timeline", help="draw or merge the daemons' timelines (Chrome traces)")
    tl.add_argument("files", nargs="+", metavar="FILE", help="trace files, or the timeline path "
                    "the daemons were given (finds their per-rank files)")
    tl.add_argument("--png", help="draw a Gantt chart (one row per rank and op lane) here")
    tl.add_argument("--merge", metavar="OUT", help="write all files as one trace (for Perfetto "
                    "or chrome://tracing)")
    tl.add_argument("--window", metavar="FROM:TO", help="only this span (ms since the first "
                    "event) in the chart")
    tl.add_argument("--ops", metavar="GLOB", help="only the lanes of ops whose name matches, "
                    "e.g. 'grad.*'")
    return tl


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``decentctl timeline``."""
    if not args.png and not args.merge:
        parser.error("give --png OUT, --merge OUT or both")
    window = None
    if args.window:
        try:
            lo, hi = (float(v) for v in args.window.split(":"))
        except ValueError:
            parser.error(f"--window takes FROM:TO in ms, got {args.window!r}")
        window = (lo, hi)
    try:
        files = expand(args.files)
        if args.merge:
            print(f"merged {merge(files, args.merge)} events of {len(files)} file(s) into "
                  f"{args.merge}")
        if args.png:
            drawn = draw(load(files), args.png, f"decent timeline: {len(files)} file(s)",
                         window, args.ops)
            print(f"drew {drawn} lanes into {args.png}")
    except (OSError, ValueError) as exc:
        print(f"decentctl timeline: {exc}")
        return 1
    return 0
