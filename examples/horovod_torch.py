"""A training script written for Horovod's PyTorch API, run by decent: the only change is the
import (``import horovod.torch as hvd`` became ``import decent.torch as hvd``)::

    decentrun -np 2 python examples/horovod_torch.py

A small MLP on scikit-learn's digits (Horovod's MNIST example, shrunk): each worker trains on its
shard (``DistributedSampler``), ``hvd.DistributedOptimizer`` averages the gradients every step,
the initial model and optimizer state come from rank 0, metrics are averaged with
``hvd.allreduce`` and the test predictions collected with ``hvd.allgather``. Rank 0 prints one
line per epoch and, at the end, whether every replica holds the same weights.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import decent.torch as hvd  # was: import horovod.torch as hvd


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The digits as float tensors, split the same way on every worker."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2,
                                                        random_state=0, stratify=y)
    return (TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train)),
            TensorDataset(torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)))


def metric_average(value: float, name: str) -> float:
    """The average of ``value`` over the workers (Horovod's example idiom)."""
    return float(hvd.allreduce(torch.tensor(value), name=name).item())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--fp16-allreduce", action="store_true")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(1234 + hvd.rank())  # different initial weights: the broadcast fixes them
    torch.set_num_threads(1)
    train_set, test_set = digits()
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    # Horovod's rule: scale the learning rate by the number of workers
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                                       momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
        scheduler.step()
        model.eval()
        with torch.no_grad():
            x, y = test_set.tensors
            test_loss = metric_average(F.cross_entropy(model(x), y).item(), "avg_loss")
            handle = hvd.allreduce_async(model(x).argmax(1).eq(y).float().mean(),
                                         name="avg_accuracy")
            accuracy = float(hvd.synchronize(handle).item())
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: test loss {test_loss:.4f}, accuracy {100 * accuracy:.2f}%")

    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(mine.unsqueeze(0), name="weights")  # one row per worker
    reference = hvd.broadcast(mine.clone(), root_rank=0, name="reference")
    identical = all(np.array_equal(row.numpy(), reference.numpy()) for row in everyone)
    if hvd.rank() == 0:
        print(f"{hvd.size()} workers (local size {hvd.local_size()}), replicas identical: "
              f"{identical}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
