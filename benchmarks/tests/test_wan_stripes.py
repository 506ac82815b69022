"""Striped links across an emulated WAN (``benchmarks/wan_stripes.py`` on a small setting, as
root): 2 namespaces at 1 Gbit/s with a 100 ms round trip and the kernel's default socket buffer
maxima. Checked: each daemon measured the round trip when its link opened, ``auto`` opened the
connections that round trip needs (8: 1 Gbit/s x 100 ms x 1.25 over the 2 MiB one flow keeps in
flight) and ``stripes: 1`` one; the results are exact; nothing was retransmitted; the namespaces
are gone afterwards. Timings are the benchmark's to report, not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.netns_dsgd import leftover_namespaces  # noqa: E402
from benchmarks.wan.link import cannot_emulate  # noqa: E402
from decentd.net.stripes import Striping  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.serial, pytest.mark.slow,
              pytest.mark.skipif(cannot_emulate() is not None, reason=cannot_emulate() or "")]

RTT_MS = 100.0


def test_auto_stripes_a_long_fat_link_and_moves_tensors_exactly(tmp_path: Path) -> None:
    out = tmp_path / "wan_stripes.json"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "wan_stripes.py"), "--rate", "1gbit",
         "--rtt", str(RTT_MS), "--mbytes", "16", "--repeats", "2", "--buffers", "default",
         "--stripes", "1,auto", "--json", str(out), "--md", str(tmp_path / "wan_stripes.md"),
         "--png", str(tmp_path / "wan_stripes.png")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    one, auto = json.loads(out.read_text())["cases"]
    assert (one["stripes"], auto["stripes"]) == ("1", "auto")
    # the nodes' defaults: tcp_rmem max 6 MiB, tcp_wmem max 4 MiB: 2 MiB in flight per flow
    expected = Striping(window=2 << 20).count(RTT_MS / 1e3)
    assert expected == 8
    assert one["summary"]["stripes"] == [1, 1]
    assert auto["summary"]["stripes"] == [expected, expected]
    for case in (one, auto):
        s = case["summary"]
        assert s["exact"], case
        assert all(abs(rtt - RTT_MS) <= 0.1 * RTT_MS for rtt in s["connect_rtt_ms"]), case
        assert s["retransmitted"] == 0, case
    assert not leftover_namespaces(f"dcnt{proc.pid}-")
