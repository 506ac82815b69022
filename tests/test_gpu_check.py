"""scripts/gpu_check.sh, the one run of the GPU checks: its shell is sound, and on a machine
without a GPU it runs and reports every check as skipped (on a GPU it is the check itself)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"

pytestmark = pytest.mark.slow


def test_the_script_is_sound_shell() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    proc = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this is scripts/gpu_check.sh")
def test_without_a_gpu_every_check_is_skipped_and_said_so(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={"PATH": "/usr/bin:/bin",
                                                       "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "GPU: none" in proc.stdout
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    states = {t["test"]: t["state"] for t in result["tests"]}
    assert result["passed"] == result["failed"] == 0 and result["skipped"] == len(states)
    assert states["train_digits on cuda (2 daemons)"] == states["gpu_bench"] == "skipped"
    assert sum(name.startswith("tests.test_cuda") for name in states) >= 60
    assert proc.stdout.strip().splitlines()[-1].startswith(
        f"0 passed, 0 failed ({len(states)} skipped)")
