"""A plain torch.distributed DDP script, launched by ``torchrun``; decent's only change is the
backend string (``"gloo"`` became ``"decent"``) and its import::

    decentd --config node.yaml &          # once per node (systemd), workers_per_node: 4
    torchrun --nproc-per-node 4 examples/ddp_torchrun.py

A small MLP on scikit-learn's digits: each rank trains on its shard (``DistributedSampler``),
DDP averages the gradients in buckets while backward runs, the test accuracy is summed with
``all_reduce``. Rank 0 prints one line per epoch and, at the end, whether every replica holds
the same weights. ``--backend gloo`` runs the same script over gloo, for comparison.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import decent.torch  # noqa: F401  (registers the "decent" backend)


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The digits as float tensors, split the same way on every rank."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2,
                                                        random_state=0, stratify=y)
    return (TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train)),
            TensorDataset(torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="decent")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    dist.init_process_group(args.backend)  # RANK, WORLD_SIZE, MASTER_*: set by torchrun
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train, test = digits()
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        train, num_replicas=size, rank=rank, seed=0)
    loader = DataLoader(train, batch_size=32, sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        with torch.no_grad():
            shard = torch.arange(rank, len(test), size)
            correct = (model(test.tensors[0][shard]).argmax(1) == test.tensors[1][shard]).sum()
        counts = torch.stack([correct, torch.tensor(len(shard))]).double()
        dist.all_reduce(counts)
        if rank == 0:
            print(f"epoch {epoch}: test accuracy {counts[0] / counts[1]:.3f} over "
                  f"{dist.get_backend()}", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(copies, flat)
    if rank == 0:
        same = all(torch.equal(c, flat) for c in copies)
        print(f"every replica holds the same weights: {same}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
