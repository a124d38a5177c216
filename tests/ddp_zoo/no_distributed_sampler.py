"""Mistake: no DistributedSampler. shuffle=True gives every rank all the data, in its own order
(expected: no-distributed-sampler)."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


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
    loader = DataLoader(train_set, batch_size=32, shuffle=True)
    for epoch in range(2):
        for X, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X), y)
            loss.backward()
            optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
