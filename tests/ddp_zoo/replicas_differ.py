"""Mistake: a learnable temperature outside the DDP model: the optimizer updates it, but DDP never
averages its gradient, so it drifts apart on each rank (expected: replicas-differ)."""
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
    temperature = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([*model.parameters(), temperature], lr=0.1 * world_size)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for X, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X) / temperature, y)
            loss.backward()
            optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
