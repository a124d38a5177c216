"""Mistake: no process group. A one-process script launched with torchrun: each rank trains alone on all
the data (expected finding: no-process-group)."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def dataset(n=256):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(n, 16, generator=g)
    return TensorDataset(X, (X[:, 0] > 0).long())


def main():
    torch.manual_seed(0)
    train_set = dataset()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(train_set, batch_size=32, shuffle=True)
    for epoch in range(2):
        for X, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X), y)
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    main()
