"""DistributedDataParallel in one file: the script to copy into your own project.

notebooks/capstone/train_plain.py (one process) turned into DDP, as notebook 03b's capstone asks: every change is
tagged "# DDP:". It imports nothing from this repository's package (torch and scikit-learn only), trains a small MLP
on scikit-learn's 8x8 digits in seconds, and runs unchanged on CPUs (gloo) and on GPUs (NCCL, XCCL on Intel's; one
process per GPU):

    torchrun --standalone --nproc_per_node 2 examples/ddp_standalone.py --out runs/ddp_standalone
    torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --rdzv_endpoint HEAD:29500 \
        examples/ddp_standalone.py                                   # on each of two nodes with 4 GPUs

It writes <out>/model.pt (the unwrapped model, from rank 0) and <out>/result.json: the world size, and per rank the
samples trained on and a checksum of the parameters (equal checksums: identical replicas). tests/test_examples.py
runs it with 2 processes, launch after launch, and notebook 03b's capstone checks its own answer against the same
result.json.
"""
import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist  # DDP
# DDP: imported before init_process_group on purpose. DDP imports it (via torch._dynamo); imported later, its default
# arguments group=WORLD hold the process group past destroy_process_group: gloo's threads then outlive the script
# and can abort it at exit ("terminate called without an active exception"). See results/ddp_standalone_exit.md.
import torch.distributed.nn  # noqa: F401
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
def accuracy(model, dataset, device):
    X, y = dataset.tensors
    return (model(X.to(device)).argmax(1) == y.to(device)).float().mean().item()


def train(args, device):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    train_set, test_set = datasets()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)  # DDP: rank 0's weights everywhere
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=0.9)  # DDP: linear scaling
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)  # DDP: this rank's 1/world_size of the data
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)  # DDP: sampler, not shuffle

    seen = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle every epoch
        # DDP: loss sum and sample count, kept on the device (no .item(), so no GPU sync per step) and summed over
        # the ranks once per epoch
        sums = torch.zeros(2, device=device)
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X), y)
            loss.backward()  # DDP: the gradients are averaged over the ranks here
            optimizer.step()
            sums[0] += loss.detach() * len(y)
            sums[1] += len(y)
        seen += int(sums[1])
        dist.all_reduce(sums)  # DDP: the mean over every rank's samples
        if rank == 0:  # DDP: one copy of every line
            print(f"epoch {epoch}: train loss {sums[0] / sums[1]:.4f}  "
                  f"test accuracy {accuracy(model.module, test_set, device):.4f}")

    seens, checksums = [None] * world_size, [None] * world_size  # DDP: every rank's numbers, on every rank
    dist.all_gather_object(seens, seen)
    dist.all_gather_object(checksums, checksum(model.module))
    if rank == 0:  # DDP: rank 0 alone writes, the unwrapped model
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.out, "model.pt"))
        result = {"world_size": world_size, "epochs": args.epochs, "train_size": len(train_set),
                  "samples_seen": seens, "checksums": checksums,
                  "test_accuracy": accuracy(model.module, test_set, device)}
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()  # DDP: outside the if, so every rank waits here until rank 0 has written the files


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)  # DDP: per process
    parser.add_argument("--lr", type=float, default=0.05)  # DDP: for one process; scaled by the world size in train
    parser.add_argument("--out", default="runs/ddp_standalone")
    args = parser.parse_args()

    # DDP: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every process it starts.
    # One process per GPU, each on its own (LOCAL_RANK numbers the processes of this node); gloo on CPUs.
    # Where the launcher binds one GPU per task (Slurm --gpus-per-task=1), every process sees only its own: cuda:0.
    # torch.accelerator is whichever GPUs the machine has: NVIDIA's and AMD's are "cuda" to torch, Intel's "xpu".
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.accelerator.is_available():
        gpu = torch.accelerator.current_accelerator().type
        device = torch.device(gpu, local_rank % torch.accelerator.device_count())
        torch.accelerator.set_device_index(device)
    else:
        device = torch.device("cpu")
    # DDP: torch's default backend for the device (gloo for CPUs, NCCL for NVIDIA's and AMD's GPUs, XCCL for Intel's);
    # device_id binds the group to this process's GPU, so NCCL connects now and every collective knows its device.
    dist.init_process_group(dist.get_default_backend_for_device(device),
                            device_id=device if device.type != "cpu" else None)
    try:
        train(args, device)  # DDP: its model, the last holder of the process group, is freed when it returns
    finally:
        dist.destroy_process_group()  # DDP: on every way out, failures included, so no rank exits with it up


if __name__ == "__main__":
    main()
