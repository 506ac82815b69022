"""``benchmarks/wan_train.py`` on a tiny setting, as root: 2 namespaces at 100 Mbit/s and 100 ms
of RTT (the emulated WAN of ``benchmarks/wan``), the gloo baseline against streaming
decentralized DiLoCo with int8 for a few steps. It checks that daemons reach each other across
such a link (before a fix, gRPC gave each connection attempt 100 ms and never got through), that
every method runs its steps and writes what the report needs, and that the figures hold
together: the baseline reaches its own final loss, DiLoCo sends several times fewer bytes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.netns_dsgd import PREFIX, leftover_namespaces  # noqa: E402
from benchmarks.wan.link import cannot_emulate  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.serial, pytest.mark.slow,
              pytest.mark.skipif(cannot_emulate() is not None, reason=cannot_emulate() or "")]

METHODS = ("gloo-allreduce", "streaming-diloco-int8")


def test_the_wan_benchmark_runs_both_systems_across_a_100_ms_link(tmp_path: Path) -> None:
    out = tmp_path / "wan.json"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "wan_train.py"), "--settings", "b",
         "--nodes", "2", "--steps", "10", "--long-steps", "20", "--eval-every", "5",
         "--local-steps", "5", "--overlap", "2", "--methods", ",".join(METHODS),
         "--json", str(out), "--md", str(tmp_path / "wan.md"), "--png",
         str(tmp_path / "wan.png")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert not leftover_namespaces(f"{PREFIX}{proc.pid}")  # its namespaces are gone
    result = json.loads(out.read_text())
    assert result["workload"] == "charlm"
    setting = result["settings"]["b"]
    assert (setting["rate"], setting["rtt_ms"]) == ("100mbit", 100.0)
    rows = setting["summary"]
    assert set(rows) == set(METHODS)
    base, diloco = rows["gloo-allreduce"], rows["streaming-diloco-int8"]
    assert (base["steps_run"], diloco["steps_run"]) == (10, 20)
    assert [e[1] for e in diloco["curve"]] == [5, 10, 15, 20]
    for row in rows.values():
        # the default workload, the byte-level LM: a uniform guess costs log(256) nats
        assert math.isfinite(row["final_loss"]) and 0 < row["final_loss"] < math.log(256) + 1
        assert row["tx_bytes_per_node"] > 0 and 0 < row["utilisation"] <= 1
    # every baseline step waits for an allreduce across the link: at least one crossing of
    # its 50 ms one-way delay
    assert base["step_s"] > 0.05 and base["time_to_target_s"] <= base["wall_s"]
    assert diloco["fewer_bytes"] > 2
    # blocked on decent's exchanges: a share of the loop for decent's method, none for gloo's
    assert base["blocked"] is None and 0 <= diloco["blocked"] <= diloco["waiting"] + 1e-9
    assert {v["what"] for v in setting["targets"]} == {"speedup", "fewer_bytes",
                                                       "final_within", "utilisation"}
    assert (tmp_path / "wan.png").stat().st_size > 0
    assert "streaming-diloco-int8" in (tmp_path / "wan.md").read_text()
