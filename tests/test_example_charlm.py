"""examples/train_charlm.py: the character-level transformer LM learns under decentrun, and its
command line refuses what it cannot run."""

from __future__ import annotations

import functools
import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from cluster import DECENTRUN_ARENA

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_charlm.py"
RUN = [sys.executable, "-m", "decentd.tools.launcher"]


@functools.cache
def _example_module() -> ModuleType:
    """The example, imported as a module (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location("train_charlm", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_charlm_learns_on_two_workers() -> None:
    proc = subprocess.run(
        [*RUN, "-np", "2", *DECENTRUN_ARENA, "--topology", "ring", "--", sys.executable,
         str(SCRIPT), "--steps", "30", "--warmup", "5", "--log-every", "10",
         "--val-chars", "8192", "--data-mb", "1"],
        capture_output=True, text=True, timeout=180,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    (vocab,) = re.findall(r"vocab (\d+);", out)
    train = [float(v) for v in re.findall(r"step +\d+/30  train loss ([\d.]+)", out)]
    assert len(train) == 4, out[-3000:]  # steps 1, 10, 20, 30
    assert train[-1] < train[0] - 0.5, train
    (val,) = re.findall(r"averaged model, \d+ validation characters: loss ([\d.a-z]+) nats", out)
    uniform = math.log(int(vocab))
    assert math.isfinite(float(val)) and float(val) < uniform, (val, uniform)
    (bits,) = re.findall(r"nats/char, ([\d.]+) bits/char", out)
    assert float(bits) == pytest.approx(float(val) / math.log(2), abs=2e-3)


@pytest.mark.parametrize("argv", [["--algorithm", "no-such-thing"],
                                  ["--algorithm", "dsgd", "--local-steps", "4"],
                                  ["--mix", "neighbor"],
                                  ["--d-model", "66", "--heads", "4"]])
def test_charlm_refuses_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as err:
        _example_module().parse_args(argv)
    assert err.value.code == 2


def test_charlm_defaults_and_split() -> None:
    example = _example_module()
    args = example.parse_args([])
    assert (args.algorithm, args.inner, args.lr) == ("dsgd", "adamw", 2e-2)
    assert example.parse_args(["--inner", "sgd"]).lr == 0.1
    corpus = example.load_corpus(0.2, 4)
    files = example.stdlib_files()
    assert files == sorted(files) and corpus.val_files >= 1 and corpus.train_files >= 1
    assert len(corpus.train) + len(corpus.val) == 200_000
    assert int(corpus.train.max()) < example.VOCAB
