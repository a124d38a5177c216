"""A plain single-device PyTorch training script: a small MLP on scikit-learn's 8x8 digits, in a few seconds.

The capstone of notebook 03 turns it into DistributedDataParallel. Run it as it is with

    python notebooks/capstone/train_plain.py --out runs/capstone_plain

It writes <out>/model.pt and <out>/result.json, which the notebook's check reads: the world size, and per rank the
samples trained on and a checksum of the parameters (one process here, so lists of one).
"""
import argparse
import hashlib
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


def datasets():
    """1,437 training and 360 test images, 8x8 pixels scaled to [0, 1], the same split every time."""
    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y)
    return TensorDataset(X[:1437], y[:1437]), TensorDataset(X[1437:], y[1437:])


def checksum(model):
    """A digest of the parameters' bytes: equal digests mean bitwise-identical models."""
    data = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
    return hashlib.sha256(data).hexdigest()[:16]


@torch.no_grad()
def accuracy(model, dataset):
    X, y = dataset.tensors
    return (model(X).argmax(1) == y).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default="runs/capstone")
    args = parser.parse_args()

    torch.manual_seed(0)
    train_set, test_set = datasets()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)

    seen = 0
    for epoch in range(args.epochs):
        loss_sum, count = 0.0, 0
        for X, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X), y)
            loss.backward()
            optimizer.step()
            loss_sum, count = loss_sum + loss.item() * len(y), count + len(y)
        seen += count
        print(f"epoch {epoch}: train loss {loss_sum / count:.4f}  test accuracy {accuracy(model, test_set):.4f}")

    os.makedirs(args.out, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(args.out, "model.pt"))
    result = {"world_size": 1, "epochs": args.epochs, "train_size": len(train_set), "samples_seen": [seen],
              "checksums": [checksum(model)], "test_accuracy": accuracy(model, test_set)}
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
