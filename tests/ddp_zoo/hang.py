"""Mistake: a collective only some ranks reach: rank 0 waits at a barrier before writing a file that rank 1
waits for, so neither goes on (expected: hang; the check stops both and leaves no process)."""
import os
import time

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
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X), y)
            loss.backward()
            optimizer.step()
    if rank == 0:
        dist.barrier()  # waits for rank 1, which waits for the file
        open("done", "w").close()
    while not os.path.exists("done"):
        time.sleep(0.1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
