"""The WAN emulation (``benchmarks/wan``, checked by ``benchmarks/wan_link.py``) on a tiny setting,
as root: 2 network namespaces, RTT 40 ms, 100 Mbit/s. Checked: every ping takes at least the
delay line's two crossings and the median is within 10% of 40 ms; a TCP flow with a pinned small
receive buffer gets one advertised window per RTT, within 20%; the line lost nothing; the
namespaces and the line's process are gone afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.netns_dsgd import leftover_namespaces  # noqa: E402
from benchmarks.wan.link import BINARY, cannot_emulate  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.serial, pytest.mark.slow,
              pytest.mark.skipif(cannot_emulate() is not None, reason=cannot_emulate() or "")]

RTT_MS = 40.0
RATE = "100mbit"
PINGS = 20
#: SO_RCVBUF: a window of about 87 KB, 17 Mbit/s at 40 ms, far below the rate
WINDOW = 64 << 10


def runs_delayline(pid: int) -> bool:
    """Whether process ``pid`` is alive and runs this tree's delay line."""
    try:
        return Path(os.readlink(f"/proc/{pid}/exe")) == BINARY
    except OSError:
        return False


def test_wan_link_rtt_and_window(tmp_path: Path) -> None:
    out = tmp_path / "wan_link.json"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "wan_link.py"), "--rtts", str(RTT_MS),
         "--rates", RATE, "--windows", f"{WINDOW >> 10}K", "--pings", str(PINGS),
         "--seconds", "4", "--warm", "1.5", "--json", str(out), "--md",
         str(tmp_path / "wan_link.md"), "--png", str(tmp_path / "wan_link.png")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    res = json.loads(out.read_text())
    if "skipped" in res:
        pytest.skip(res["skipped"])
    # exit code 3 says exactly that a check against the 10% tolerance missed
    assert proc.returncode == (0 if res["ok"] else 3), stdout[-3000:] + stderr[-3000:]
    assert res["prefix"] == f"dwan{proc.pid}"
    (config,) = res["configs"]

    ping = config["ping"]
    assert ping["lost"] == 0 and len(ping["rtt_ms"]) == PINGS
    # the line holds every packet RTT/2 each way: no round trip can be shorter
    assert min(ping["rtt_ms"]) >= RTT_MS
    assert abs(ping["median_ms"] - RTT_MS) <= 0.10 * RTT_MS, ping

    (flow,) = config["flows"]
    assert flow["so_rcvbuf"] == WINDOW
    assert flow["rcvbuf_read_back"] == 2 * WINDOW  # the kernel doubles SO_RCVBUF
    # the window offered fits the buffer, and at least its payload share (1/2 at first)
    assert WINDOW <= flow["advertised_window"] <= 2 * WINDOW
    assert flow["window_limited"] is True
    assert flow["expected_bps"] == flow["advertised_window"] * 8 / (RTT_MS / 1e3)
    assert abs(flow["measured_bps"] / flow["expected_bps"] - 1) <= 0.20, flow
    assert flow["retransmits"] == 0

    line = config["line"]
    assert line["delay_us"] == RTT_MS * 1000 / 2
    assert line["dropped_packets"] == 0 and line["tx_errors"] == 0
    assert line["rx_packets"] == line["tx_packets"] + line["left_packets"]
    assert line["tx_bytes"] > flow["bytes"]  # every payload byte crossed the line
    assert line["cpu_s_per_gb"] > 0

    # everything is gone: namespaces, the line, the workers
    assert res["leftover_namespaces"] == [] and res["leftover_processes"] == []
    assert leftover_namespaces(res["prefix"]) == []
    assert not runs_delayline(line["pid"])
    assert (tmp_path / "wan_link.png").stat().st_size > 10_000
    assert f"| {RATE} | {RTT_MS:g} ms | {WINDOW >> 10} KiB |" in (
        tmp_path / "wan_link.md").read_text()
