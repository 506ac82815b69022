"""``benchmarks/wan/workloads.py``: what the WAN benchmark trains. The language model's batches
are windows of the text and their next bytes, a rank's draws are its own and repeat, the
held-out loss is the model's on the same bytes every time, and the language model's DiLoCo recipe
is the library's own defaults (no tuning of ours)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.wan.workloads import WORKLOADS, CharText, load  # noqa: E402

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
