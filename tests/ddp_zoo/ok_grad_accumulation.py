"""Correct: gradient accumulation over 4 micro-batches, all but the last inside no_sync (one all-reduce
per optimizer step); rank 0 alone evaluates on a test loader of its own and prints the accuracy, which needs no
reduction (it saw all the test data). Expected: no finding."""
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def dataset(n=256):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(n, 16, generator=g)
    return TensorDataset(X, (X[:, 0] > 0).long())


def main():
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    train_set = dataset()
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * world_size)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for X, y in loader:
            micro = list(zip(X.chunk(4), y.chunk(4)))
            for i, (micro_X, micro_y) in enumerate(micro):
                last = i == len(micro) - 1
                with contextlib.nullcontext() if last else model.no_sync():  # all-reduce on the last only
                    loss = F.cross_entropy(model(micro_X), micro_y) / len(micro)
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if rank == 0:  # evaluation on rank 0 only, on a loader of its own
        model.eval()
        with torch.no_grad():
            correct = sum((model(X).argmax(1) == y).sum().item() for X, y in DataLoader(dataset(64), batch_size=16))
        print(f"test accuracy {correct / 64:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
