"""``log_format: json``: every line a daemon writes is one JSON object, and the lines about an op
or a peer say which (job, op, tensor, round, peer)."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster import Cluster
from decent.core import Client, NumpyCodec
from decent_wire.errors import DecentError
from decentd.logs import JsonFormatter
from decentd.service.cli import build_parser, overrides_from

#: what every JSON line holds
REQUIRED = {"time", "level", "rank", "logger", "message"}
#: the safety net of event waits (never a measurement)
WAIT = 60.0


def json_lines(text: str, rank: int) -> list[dict[str, Any]]:
    """Every line of a daemon's output, parsed; each must be a JSON object of ``rank``."""
    records = []
    for line in text.splitlines():
        record = json.loads(line)  # raises on any line that is not JSON
        assert isinstance(record, dict) and record.keys() >= REQUIRED, line
        assert record["rank"] == rank, line
        assert record["level"] in {"debug", "info", "warning", "error", "critical"}, line
        time.strptime(record["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
        records.append(record)
    return records


def wait_for_line(c: Cluster, rank: int, text: str) -> dict[str, Any]:
    """The first JSON line of daemon ``rank`` whose message holds ``text`` (waits for it)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        found = [r for r in json_lines(c.log(rank), rank) if text in r["message"]]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"daemon {rank} never logged {text!r}:\n{c.log(rank)}")


def test_log_format_flag_mirrors_the_config() -> None:
    args = build_parser().parse_args(["--log-format", "json"])
    assert overrides_from(args) == {"log_format": "json"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-format", "xml"])


def test_json_formatter_keeps_one_record_on_one_line() -> None:
    formatter = JsonFormatter(rank=3)
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        record = logging.getLogger("decentd.x").makeRecord(
            "decentd.x", logging.ERROR, __file__, 1, "two\nlines %s", ("here",),
            sys.exc_info(), extra={"peer": 2, "job": "j"})
    line = formatter.format(record)
    assert "\n" not in line
    out = json.loads(line)
    assert {k: out[k] for k in ("level", "rank", "logger", "message", "peer", "job")} == {
        "level": "error", "rank": 3, "logger": "decentd.x", "message": "two\nlines here",
        "peer": 2, "job": "j"}
    assert out["exception"].endswith("ValueError: bad\nthing")


@pytest.mark.slow
def test_json_logs_name_the_op_and_the_peer() -> None:
    c = Cluster(2, "ring", "--log-format", "json", "--set", "memory.arena_bytes=4194304")
    try:
        client = Client(NumpyCodec(), f"unix://{c.sockets[0]}", job="logs-test")
        try:
            # rank 1 has no worker: rank 0's op waits for it until its timeout
            handle = client.neighbor_allreduce_async(np.ones(4, np.float32), name="lonely",
                                                     timeout=1.0)
            with pytest.raises(DecentError, match="timed out after 1s"):
                handle.wait(timeout=WAIT)
        finally:
            client.close()
        # the engine logs the failure before it completes the op
        (failed,) = [r for r in json_lines(c.log(0), 0) if r["logger"] == "decentd.engine.requests"]
        assert failed["message"].startswith("neighbor_allreduce 'lonely' round 0 failed: ")
        assert {k: failed.get(k) for k in ("level", "logger", "job", "op", "tensor", "round",
                                           "peer")} == {
            "level": "warning", "logger": "decentd.engine.requests", "job": "logs-test",
            "op": "neighbor_allreduce", "tensor": "lonely", "round": 0, "peer": 1}
        assert "timed out after 1s on rank 0" in failed["message"]

        c.procs[1].send_signal(signal.SIGTERM)
        assert c.procs[1].wait(WAIT) == 0
        closed = wait_for_line(c, 0, "rank 1: link dropped (stream closed)")
        assert {k: closed.get(k) for k in ("level", "logger", "peer")} == {
            "level": "info", "logger": "decentd.net.links", "peer": 1}
        down = wait_for_line(c, 0, "rank 1 is down")
        assert {k: down.get(k) for k in ("level", "logger", "peer")} == {
            "level": "warning", "logger": "decentd.net.links", "peer": 1}
        assert c.stop() == [0, 0]
        for rank in (0, 1):  # nothing but JSON, from the first line to the last
            messages = [r["message"] for r in json_lines(c.log(rank), rank)]
            assert messages[-1] == f"rank {rank}: stopped"
    finally:
        c.kill()


@pytest.mark.slow
def test_json_startup_errors_are_json_too(tmp_path: Path) -> None:
    """A config error (exit 2) and a daemon that cannot start (exit 1) say so in JSON alone."""
    cmd = [sys.executable, "-m", "decentd", "--log-format", "json",
           "--socket", str(tmp_path / "d.sock")]
    bad = subprocess.run([*cmd, "--set", "timeouts.op=-1"], capture_output=True, text=True,
                         timeout=WAIT)
    (line,) = bad.stderr.splitlines()
    assert bad.returncode == 2 and json.loads(line)["message"].startswith(
        "config error: timeouts.op: ")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        busy = subprocess.run([*cmd, "--rank", "0", "--peers",
                               f"127.0.0.1:{port},127.0.0.1:{port + 1}"],
                              capture_output=True, text=True, timeout=WAIT)
    records = json_lines(busy.stderr, 0)
    assert busy.returncode == 1 and busy.stdout == ""
    assert records[-1]["level"] == "error"
    assert records[-1]["message"].startswith(f"cannot listen for peers on 127.0.0.1:{port}")
