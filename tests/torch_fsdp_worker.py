"""FSDP2 for tests/torch_ddp_worker.py: a small transformer sharded with ``fully_shard``
trains over the ``decent`` backend and over gloo from the same start on the same data; the
losses must be the same (FSDP2's all_gather_into_tensor and reduce_scatter_tensor run on
decent's daemon ops)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import decent.torch  # noqa: F401  (registers the backend)

STEPS = 10


class Tiny(torch.nn.Module):
    """Embedding, two transformer encoder layers and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.head = torch.nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.head(x)
        return out


def losses(mesh: DeviceMesh) -> list[float]:
    """``STEPS`` steps of FSDP2 over ``mesh``; each step's loss on this rank."""
    torch.manual_seed(0)
    model = Tiny()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    got = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 64, (4, 12), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64),
                                                 tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        got.append(float(loss))
    return got


def fsdp_matches_gloo(gloo: Any) -> None:
    """FSDP2 over the default (decent) group and over ``gloo``: the same losses."""
    world: Any = dist.group.WORLD
    ours = losses(DeviceMesh.from_group(world, "cpu"))
    theirs = losses(DeviceMesh.from_group(gloo, "cpu"))
    print("FSDP2 losses over decent", [round(v, 6) for v in ours], flush=True)
    print("FSDP2 losses over gloo  ", [round(v, 6) for v in theirs], flush=True)
    if dist.get_world_size() == 2:  # sums of two: one order, so the same bits
        assert ours == theirs, (ours, theirs)
    else:
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5,
                                   atol=1e-6)
    assert ours[-1] < ours[0], ours  # it learns
