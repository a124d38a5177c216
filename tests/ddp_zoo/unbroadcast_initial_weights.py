"""Mistake: DDP done by hand (gradients all-reduced after backward) with no seed and no broadcast:
the ranks start from different random weights and stay apart (expected: unbroadcast-initial-weights)."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def dataset(n=256):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(n, 16, generator=g)
    return TensorDataset(X, (X[:, 0] > 0).long())


def main():
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train_set = dataset()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * world_size)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for X, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X), y)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
            optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
