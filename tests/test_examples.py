"""The examples train end to end (short settings), under decentrun."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import DECENTRUN_ARENA

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RUN = [sys.executable, "-m", "decentd.tools.launcher"]


def _example(script: str, *args: str, layout: tuple[str, ...] = ("-np", "2")
             ) -> subprocess.CompletedProcess[str]:
    """``examples/<script>`` on 2 workers (ring) under decentrun; it must exit 0."""
    proc = subprocess.run(
        [*RUN, *layout, *DECENTRUN_ARENA, "--topology", "ring", "--", sys.executable,
         str(REPO / "examples" / script), *args],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_train_digits_dsgd_and_allreduce_learn() -> None:
    proc = _example("train_digits.py", "--epochs", "3")
    rows = {}
    for line in proc.stdout.splitlines():
        m = re.search(r"│ (dsgd|allreduce)\s+│([\d. ]+)│\s+([\d.]+) │\s+([\d.]+) │\s+([\d.e-]+) │",
                      line)
        if m:
            rows[m.group(1)] = [float(v) for v in m.group(2).split()], float(m.group(4)), \
                float(m.group(5))
    assert set(rows) == {"dsgd", "allreduce"}, proc.stdout[-3000:]
    for algo, (workers, averaged, _) in rows.items():
        assert len(workers) == 2
        assert averaged > 80.0, (algo, averaged)  # 3 epochs on digits: well above chance (10%)
    assert rows["allreduce"][2] == 0.0  # allreduce keeps the replicas identical


def test_train_digits_hierarchical_on_two_nodes_of_two_workers() -> None:
    proc = _example("train_digits.py", "--epochs", "6", "--hierarchical",
                    layout=("-np", "4", "--nodes", "2"))
    rows = dict(re.findall(r"│ (dsgd|allreduce)\s+│[\d. ]+│\s+[\d.]+ │\s+([\d.]+) │",
                           proc.stdout))
    assert set(rows) == {"dsgd", "allreduce"}, proc.stdout[-3000:]
    # two machines on a ring: the machine mix is the exact mean, so hierarchical D-SGD keeps
    # the replicas as identical as allreduce does
    consensus = re.findall(r"│ dsgd\s+│[\d. ]+│\s+[\d.]+ │\s+[\d.]+ │\s+([\d.e-]+) │",
                           proc.stdout)
    assert consensus == ["0"], proc.stdout[-3000:]
    assert all(float(v) > 70.0 for v in rows.values()), rows


def test_keras_example_trains_dsgd_beside_allreduce() -> None:
    # and gradient tracking, whose Keras step runs over host buffers, in the same model.fit
    proc = _example("train_digits_keras.py", "--epochs", "3",
                    "--algorithms", "dsgd,allreduce,gradient-tracking")
    rows = dict(re.findall(r"│ (dsgd|allreduce|gradient-tracking)\s+│[\d. ]+│\s+([\d.]+) │",
                           proc.stdout))
    assert set(rows) == {"dsgd", "allreduce", "gradient-tracking"}, proc.stdout[-3000:]
    assert all(float(v) > 80.0 for v in rows.values()), rows  # 3 epochs: far above chance
    assert "Epoch 3/3" in proc.stdout  # Keras' own progress, on rank 0


def _decent_lines(script: str) -> list[str]:
    """The lines of ``examples/<script>``'s code (its docstring aside) that mention decent."""
    source = (REPO / "examples" / script).read_text()
    tree = ast.parse(source)
    doc = tree.body[0]
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    code = source.splitlines()[doc.end_lineno or 0:]
    return [line for line in code if "decent" in line]


def test_a_horovod_torch_script_runs_with_only_its_import_changed() -> None:
    assert _decent_lines("horovod_torch.py") == [
        "import decent.torch as hvd  # was: import horovod.torch as hvd"]
    for epochs, flags in ((3, []), (1, ["--fp16-allreduce"])):
        proc = _example("horovod_torch.py", "--epochs", str(epochs), *flags)
        accuracy = [float(v) for v in re.findall(r"accuracy ([\d.]+)%", proc.stdout)]
        assert len(accuracy) == epochs and accuracy[-1] > 80.0, proc.stdout[-3000:]
        assert "2 workers (local size 2), replicas identical: True" in proc.stdout


def test_a_horovod_keras_script_runs_with_only_its_import_changed() -> None:
    assert _decent_lines("horovod_keras.py") == [
        "import decent.tf as hvd  # was: import horovod.tensorflow.keras as hvd"]
    proc = _example("horovod_keras.py", "--epochs", "3")
    (accuracy,) = re.findall(r"test accuracy ([\d.]+)%; 2 replicas identical: True",
                             proc.stdout)
    assert float(accuracy) > 80.0, proc.stdout[-3000:]
    assert proc.stdout.count("finished gradual learning rate warmup to 0.02") == 1
