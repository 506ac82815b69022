"""The timeline (issue 25): a real job's ops, phase by phase on every rank, as a Chrome trace.

Two daemons record (``timeline.path``, or ``$DECENT_TIMELINE``) into one file each; the test
job runs named ops (neighbor averages, a fused pair, an allreduce, a broadcast and one that
fails), then the files are read back: valid trace event JSON that chrome://tracing and Perfetto
load (every slice on its lane properly nested, processes and lanes named), every op with all
six phases on both ranks and in order, and ``decentctl timeline`` draws and merges them. A
daemon killed with SIGKILL leaves a file that loads without its closing bracket.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from cluster import Cluster
from decent.core import DecentError
from decentd.service.timeline import PHASES, trace_path
from decentd.tools import ctl
from decentd.tools.timeline_plot import read_events

Event = dict[str, Any]
#: ops of the job that succeed, by lane name (user's op name): their rounds
GOOD = {"w": [0, 1], "f0": [0], "f1": [0], "g": [0]}


def job(c: Any) -> None:
    """The test job, on every rank."""
    for _ in GOOD["w"]:
        c.neighbor_allreduce(torch.full((1000,), float(c.rank)), name="w", timeout=30)
    # a fused pair: the bucket closes only when someone waits (cycle_time is an hour)
    hs = [c.neighbor_allreduce_async(torch.ones(100), name=f"f{k}", timeout=30) for k in (0, 1)]
    [h.wait() for h in hs]
    c.allreduce(torch.ones(2000), name="g", timeout=30)
    c.broadcast(torch.ones(10), root=0, name="b", timeout=30)
    with pytest.raises(DecentError, match="MISMATCH"):  # ranks disagree on the shape
        c.neighbor_allreduce(torch.ones(10 + c.rank), name="bad", timeout=30)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    """The job run on 2 daemons that record into ``<tmp>/trace.json``; their files (daemons
    stopped, so the files are closed)."""
    base = tmp_path_factory.mktemp("timeline") / "trace.json"
    c = Cluster(2, "ring", "--set", f"timeline.path={base}")
    try:
        c.connect(cycle_time=3600.0)
        c.run(job)
        assert c.stop() == [0, 0]
    finally:
        c.kill()
    yield base, [trace_path(str(base), r) for r in range(2)]


def lanes(events: list[Event]) -> dict[tuple[int, int], str]:
    """(pid, tid) -> the lane's name."""
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == "thread_name"}


def check_chrome_trace(events: list[Event]) -> None:
    """What chrome://tracing and Perfetto need of a trace: complete events with numeric times
    on named processes and lanes, and the slices of one lane properly nested."""
    assert events and all(isinstance(e, dict) and "ph" in e for e in events)
    named = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    names = lanes(events)
    by_lane: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        assert e["ph"] in ("X", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert isinstance(e["name"], str) and e["name"] in PHASES, e
            assert isinstance(e["ts"], int | float) and isinstance(e["dur"], int | float), e
            assert e["dur"] >= 0, e
            assert e["pid"] in named and (e["pid"], e["tid"]) in names, e
            by_lane[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_lane.values():  # sorted by start (longest first): each one inside or after
        open_ends: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"slices overlap on a lane: {spans}"
            open_ends.append(end)


def phases_by_op(events: list[Event]) -> dict[tuple[str, int], dict[str, Event]]:
    """(op name, round) -> phase -> its event, for one rank's file."""
    names = lanes(events)
    ops: dict[tuple[str, int], dict[str, Event]] = defaultdict(dict)
    for e in events:
        if e["ph"] == "X":
            lane = names[(e["pid"], e["tid"])].removesuffix(" (send)").split(" #")[0]
            phase = ops[(lane, e["args"]["round"])]
            assert e["name"] not in phase, f"{e['name']} twice for {lane}"
            phase[e["name"]] = e
    return ops


@pytest.mark.slow
def test_every_op_has_all_its_phases_on_every_rank_in_order(
        traces: tuple[Path, list[str]]) -> None:
    _, files = traces
    for rank, path in enumerate(files):
        events = json.loads(Path(path).read_text())  # closed cleanly: plain JSON
        assert isinstance(events, list)
        check_chrome_trace(events)
        assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {
            f"rank {rank}"}
        # a call made after the previous one completed reuses its lane (no "w #2")
        assert not [n for n in lanes(events).values() if " #" in n]
        ops = phases_by_op(events)
        for name, rounds in GOOD.items():
            for r in rounds:
                got = ops[(name, r)]
                assert set(got) == set(PHASES), (rank, name, r, sorted(got))
                start = {p: got[p]["ts"] for p in PHASES}
                end = {p: got[p]["ts"] + got[p]["dur"] for p in PHASES}
                assert start["queued"] <= end["queued"] <= start["fused"] <= end["fused"]
                assert end["fused"] <= min(start["sent"], start["received"])
                assert max(end["sent"], end["received"]) <= start["combined"]
                assert end["combined"] <= start["completed"]
                assert {e["pid"] for e in got.values()} == {rank}
                assert all("error" not in e["args"] for e in got.values())
        fused = [ops[(f, 0)]["fused"] for f in ("f0", "f1")]  # one request: sent at one time
        assert {e["args"]["fused"] for e in fused} == {2}
        assert len({e["ts"] + e["dur"] for e in fused}) == 1
        assert ops[("w", 0)]["sent"]["args"] == {"op": "neighbor_allreduce", "round": 0,
                                                 "bytes": 4000}


@pytest.mark.slow
def test_a_broadcast_sends_on_the_root_and_receives_elsewhere_and_failures_are_marked(
        traces: tuple[Path, list[str]]) -> None:
    _, files = traces
    for rank, path in enumerate(files):
        ops = phases_by_op(json.loads(Path(path).read_text()))
        moved = {"sent"} if rank == 0 else {"received"}
        assert set(ops[("b", 0)]) == {"queued", "fused", "combined", "completed"} | moved
        bad = ops[("bad", 0)]
        assert {"queued", "fused", "completed"} <= set(bad)
        assert "combined" not in bad  # it produced no result
        assert {e["args"]["error"] for e in bad.values()} == {"MISMATCH"}


@pytest.mark.slow
def test_decentctl_timeline_draws_a_png_and_merges_the_ranks(
        traces: tuple[Path, list[str]], tmp_path: Path) -> None:
    base, _ = traces
    png, merged = tmp_path / "timeline.png", tmp_path / "merged.json"
    # the path the daemons were given stands for their per-rank files
    assert ctl.main(["timeline", str(base), "--png", str(png), "--merge", str(merged)]) == 0
    with Image.open(png) as image:
        assert image.format == "PNG"
        width, height = image.size
    assert width > 600 and height > 300
    events = json.loads(merged.read_text())["traceEvents"]
    check_chrome_trace(events)
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}


def test_trace_path_gives_each_daemon_its_own_file() -> None:
    assert trace_path("/var/log/decent/t.json", 3) == "/var/log/decent/t.rank3.json"
    assert trace_path("/tmp/t", 0) == "/tmp/t.rank0.json"
    assert trace_path("/tmp/{rank}/t.json", 2) == "/tmp/2/t.json"


@pytest.mark.slow
def test_a_killed_daemon_leaves_a_loadable_file(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "killed.json"
    monkeypatch.setenv("DECENT_TIMELINE", str(base))  # the daemons inherit it
    c = Cluster(2, "ring")
    path = Path(trace_path(str(base), 0))
    try:
        c.connect()
        c.run(lambda cl: cl.neighbor_allreduce(torch.ones(100), name="k", timeout=30))
        deadline = time.monotonic() + 30  # the file is written within a second of the op
        while '"completed"' not in path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        c.procs[0].kill()
        c.procs[0].wait()
    finally:
        c.kill()
    text = path.read_text()
    assert text.startswith("[") and text.rstrip().endswith("}")  # no closing bracket
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    events = json.loads(text + "]")  # what chrome://tracing does with such a file
    assert events == read_events(str(path))
    check_chrome_trace(events)
    assert set(phases_by_op(events)[("k", 0)]) == set(PHASES)
    assert os.path.getsize(path) > 0
