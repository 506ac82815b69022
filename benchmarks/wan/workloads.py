"""What ``benchmarks/wan_train.py`` trains: each workload's model, its training batches, its
held-out loss and the recipe every method shares on it.

* ``charlm`` (the default): the small character-level transformer language model of
  ``examples/train_charlm.py`` (2 blocks, d_model 64, 4 heads, a context of 64 bytes: 137,216
  parameters, 549 KB of float32) on the Python standard library's own sources (offline on
  every machine). Each rank samples its own random windows (its generator seeded with the seed
  and its rank); the held-out loss is the mean next-byte loss over the first
  :data:`HELD_OUT_CHARS` bytes of the held-out files. The language model is the work the
  DiLoCo family is published for: a step computes for tens of milliseconds, not one.
* ``digits``: a 64-256-256-10 MLP (85 k parameters, 340 KB) on scikit-learn's handwritten
  digits, each rank an iid shard, 20% held out; a step computes for about a millisecond and
  the model stops improving after about 200 steps.

Each workload's :class:`Recipe` holds the AdamW lr every method shares, what its DiLoCo forms
run with and how long: ``charlm`` takes the library's own DiLoCo defaults (H = 50; outer lr 0.7
and Nesterov momentum 0.9, as published) and the lr at which the gloo baseline does best after
200 steps (1.2e-2, from ``benchmarks/wan_lr.py``: 3e-3 left the baseline at 2.21 where 1.2e-2
gets it to 1.85); ``digits`` keeps the shorter H = 20, outer lr 1.0, momentum 0.5 its short
regime needed, and 3e-3 (not swept).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[2]
#: the held-out bytes each evaluation of ``charlm`` scores
HELD_OUT_CHARS = 16384
#: ``charlm``'s model shape: the example's defaults
CONTEXT, D_MODEL, LAYERS, HEADS = 64, 64, 2, 4


@dataclass(frozen=True)
class Recipe:
    """The settings every method shares on a workload (each one a command-line default)."""

    lr: float
    local_steps: int
    outer_lr: float
    outer_momentum: float
    long_steps: int


class Workload(Protocol):
    """One rank's data and the model every method trains on it."""

    def model(self) -> Any:
        """A freshly initialized model (the caller seeds torch first)."""

    def batch(self, gen: Any, size: int) -> tuple[Any, Any]:
        """``size`` training examples drawn with ``gen``: inputs and targets."""

    def loss(self, net: Any, x: Any, y: Any) -> Any:
        """The mean training loss of ``net`` on ``x``, ``y`` (a scalar tensor)."""

    def held_out_loss(self, net: Any) -> float:
        """``net``'s mean loss on the held-out split (no gradients)."""


@dataclass
class Digits:
    """scikit-learn's digits, scaled to [0, 1]; 20% held out (the same on every rank), the rest
    dealt to the ranks in turn after one fixed shuffle."""

    x: Any
    y: Any
    x_val: Any
    y_val: Any

    @classmethod
    def load(cls, rank: int, size: int) -> Digits:
        """Rank ``rank``'s shard of ``size``."""
        import numpy as np
        import torch
        from sklearn.datasets import load_digits

        digits = load_digits()
        order = np.random.default_rng(0).permutation(len(digits.target))
        x = torch.tensor(digits.data[order] / 16.0, dtype=torch.float32)
        y = torch.tensor(digits.target[order], dtype=torch.int64)
        held = len(y) // 5
        return cls(x[held:][rank::size], y[held:][rank::size], x[:held], y[:held])

    def model(self) -> Any:
        """The MLP."""
        from torch import nn

        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 10))

    def batch(self, gen: Any, size: int) -> tuple[Any, Any]:
        """``size`` examples of this rank's shard, drawn with replacement."""
        import torch

        pick = torch.randint(0, len(self.y), (size,), generator=gen)
        return self.x[pick], self.y[pick]

    def loss(self, net: Any, x: Any, y: Any) -> Any:
        """Cross-entropy of the class logits."""
        import torch

        return torch.nn.functional.cross_entropy(net(x), y)

    def held_out_loss(self, net: Any) -> float:
        """Cross-entropy on the held-out split."""
        import torch

        with torch.no_grad():
            return float(self.loss(net, self.x_val, self.y_val))


@cache
def charlm_example() -> ModuleType:
    """``examples/train_charlm.py`` as a module (its model and corpus; ``main`` not run)."""
    path = REPO / "examples" / "train_charlm.py"
    spec = importlib.util.spec_from_file_location("train_charlm", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass
class CharText:
    """The standard library's sources as bytes (the example's corpus: 2 MB, every 10th file
    held out); every rank samples windows of the whole training text with its own generator."""

    train: Any
    held_out: Any

    @classmethod
    def load(cls, rank: int, size: int) -> CharText:
        """The corpus (the same on every rank: ranks differ by their generators)."""
        corpus = charlm_example().load_corpus(2.0, 10)
        return cls(corpus.train, corpus.val[:HELD_OUT_CHARS + 1])

    def model(self) -> Any:
        """The example's transformer."""
        return charlm_example().CharLM(CONTEXT, D_MODEL, LAYERS, HEADS)

    def batch(self, gen: Any, size: int) -> tuple[Any, Any]:
        """``size`` random windows of ``CONTEXT`` bytes and their next bytes."""
        return charlm_example().sample_batch(self.train, CONTEXT, size, gen)

    def loss(self, net: Any, x: Any, y: Any) -> Any:
        """Mean next-byte cross-entropy (nats per byte)."""
        import torch

        return torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())

    def held_out_loss(self, net: Any) -> float:
        """Over the non-overlapping windows of the held-out bytes."""
        import torch

        n = (len(self.held_out) - 1) // CONTEXT
        w = torch.stack([self.held_out[s * CONTEXT:(s + 1) * CONTEXT + 1] for s in range(n)])
        with torch.no_grad():
            return float(self.loss(net, w[:, :-1], w[:, 1:]))


#: every workload: how a rank loads it, and its recipe
WORKLOADS: dict[str, tuple[Any, Recipe]] = {
    "charlm": (CharText.load, Recipe(lr=1.2e-2, local_steps=50, outer_lr=0.7,
                                     outer_momentum=0.9, long_steps=1000)),
    "digits": (Digits.load, Recipe(lr=3e-3, local_steps=20, outer_lr=1.0,
                                   outer_momentum=0.5, long_steps=3000)),
}


def load(name: str, rank: int, size: int) -> Workload:
    """Workload ``name`` as rank ``rank`` of ``size`` sees it."""
    loader, _ = WORKLOADS[name]
    workload: Workload = loader(rank, size)
    return workload
