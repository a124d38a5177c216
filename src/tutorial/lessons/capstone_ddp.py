"""The capstone's solution (notebook 03): notebooks/capstone/train_plain.py turned into DistributedDataParallel.

Every change is tagged "# DDP:". Launch it the way the notebook launches the learner's copy:

    torchrun --standalone --nproc_per_node 2 src/tutorial/lessons/capstone_ddp.py --out runs/capstone_ddp

tests/test_exercises_03.py runs it so, and checks that tutorial.lessons.ddp.check_capstone accepts its result.
Like the script it solves, it imports nothing from this package.
"""
import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist  # DDP
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP  # DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler  # DDP


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
    parser.add_argument("--batch-size", type=int, default=32)  # DDP: per process
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default="runs/capstone")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # DDP: RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP
    torch.manual_seed(0)
    train_set, test_set = datasets()
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))  # DDP: rank 0's weights everywhere
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=0.9)  # DDP: linear scaling
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)  # DDP: this rank's 1/world_size of the data
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)  # DDP: sampler, not shuffle

    seen = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle every epoch
        sums = torch.zeros(2)  # DDP: loss sum and count, to be summed over the ranks
        for X, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X), y)
            loss.backward()  # DDP: the gradients are averaged over the ranks here
            optimizer.step()
            sums += torch.tensor([loss.item() * len(y), len(y)])
        seen += int(sums[1])
        dist.all_reduce(sums)  # DDP: the mean over every rank's samples
        if rank == 0:  # DDP: one copy of every line
            print(f"epoch {epoch}: train loss {sums[0] / sums[1]:.4f}  "
                  f"test accuracy {accuracy(model.module, test_set):.4f}")

    seens, checksums = [None] * world_size, [None] * world_size  # DDP: every rank's numbers, on every rank
    dist.all_gather_object(seens, seen)
    dist.all_gather_object(checksums, checksum(model.module))
    if rank == 0:  # DDP: rank 0 alone writes, the unwrapped model
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.out, "model.pt"))
        result = {"world_size": world_size, "epochs": args.epochs, "train_size": len(train_set),
                  "samples_seen": seens, "checksums": checksums, "test_accuracy": accuracy(model.module, test_set)}
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()  # DDP: nobody leaves before the files are written
    dist.destroy_process_group()  # DDP


if __name__ == "__main__":
    main()
