"""``benchmarks/wan/workloads.py``: what the WAN benchmark trains. The language model's batches
are windows of the text and their next bytes, a rank's draws are its own and repeat, the
held-out loss is the model's on the same bytes every time, and the language model's DiLoCo recipe
is the library's own defaults (no tuning of ours). ``benchmarks/wan_lr.py``: its baseline step is
the mean of the ranks' gradients, it writes every rate's curve and the best, and the language
model's shared lr is the best rate of the committed sweep."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.wan.workloads import WORKLOADS, CharText, load  # noqa: E402
from benchmarks.wan_lr import baseline_step, main, rank_generators  # noqa: E402

torch = pytest.importorskip("torch")


def test_a_language_model_batch_is_windows_of_the_text_and_their_next_bytes() -> None:
    data = load("charlm", 3, 8)
    assert isinstance(data, CharText)
    x, y = data.batch(torch.Generator().manual_seed(7), 5)
    assert x.shape == y.shape == (5, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])  # each target is the next input byte
    text = bytes(data.train.to(torch.uint8).tolist())
    for row, nxt in zip(x, y, strict=True):
        window = bytes(row.tolist()) + bytes([int(nxt[-1])])
        assert window in text
    again, _ = data.batch(torch.Generator().manual_seed(7), 5)
    other, _ = data.batch(torch.Generator().manual_seed(8), 5)
    assert torch.equal(x, again) and not torch.equal(x, other)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_the_held_out_loss_is_the_same_bytes_each_time(name: str) -> None:
    data = load(name, 0, 8)
    torch.manual_seed(0)
    net = data.model()
    first = data.held_out_loss(net)
    assert first == data.held_out_loss(net)
    classes = 256 if name == "charlm" else 10
    assert abs(first - math.log(classes)) < 0.5  # an untrained model guesses about uniformly
    x, y = data.batch(torch.Generator().manual_seed(1), 4)
    assert float(data.loss(net, x, y).detach()) > 0


def test_the_language_models_diloco_recipe_is_the_librarys_defaults() -> None:
    from decent.core.training.algorithms.local_updates import DiLoCo

    recipe = WORKLOADS["charlm"][1]
    defaults = DiLoCo.defaults
    assert (recipe.local_steps, recipe.outer_lr, recipe.outer_momentum) == (
        defaults["local_steps"], defaults["outer_lr"], defaults["outer_momentum"])


def test_the_sweeps_baseline_step_is_the_mean_of_the_ranks_gradients() -> None:
    data = load("charlm", 0, 3)
    torch.manual_seed(0)
    stacked, by_rank = data.model(), data.model()
    by_rank.load_state_dict(stacked.state_dict())
    baseline_step(data, stacked, torch.optim.SGD(stacked.parameters(), lr=1.0),
                  rank_generators(3, 5), 4)
    grads = [torch.zeros_like(p) for p in by_rank.parameters()]
    for gen in rank_generators(3, 5):  # as the WAN benchmark's ranks: each its own, averaged
        by_rank.zero_grad()
        data.loss(by_rank, *data.batch(gen, 4)).backward()
        for total, p in zip(grads, by_rank.parameters(), strict=True):
            total += p.grad / 3
    with torch.no_grad():
        for p, g in zip(by_rank.parameters(), grads, strict=True):
            p -= g  # SGD at lr 1
    for a, b in zip(stacked.parameters(), by_rank.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert not torch.equal(grads[0], torch.zeros_like(grads[0]))


def test_the_sweep_writes_every_rates_curve_and_the_best(tmp_path: Path) -> None:
    out = {s: tmp_path / f"lr.{s}" for s in ("json", "md", "png")}
    assert main(["--lrs", "1e-1,1e-3", "--steps", "3", "--eval-every", "1", "--nodes", "2",
                 *(f"--{s}={p}" for s, p in out.items())]) == 0
    result = json.loads(out["json"].read_text())
    assert list(result["curves"]) == ["1e-1", "1e-3"]
    assert [step for step, _ in result["curves"]["1e-3"]] == [1, 2, 3]
    final = result["final"]
    assert final["1e-1"] != final["1e-3"]
    assert result["best"] == min(final, key=final.__getitem__)
    assert "| 0.1 |" in out["md"].read_text() and "best" in out["md"].read_text()
    assert out["png"].stat().st_size > 0


def test_the_language_models_lr_is_the_best_of_the_committed_sweep() -> None:
    sweep = json.loads((REPO / "benchmarks" / "results" / "wan_lr.json").read_text())
    assert sweep["workload"] == "charlm"
    assert float(sweep["best"]) == WORKLOADS["charlm"][1].lr == sweep["recipe_lr"]
