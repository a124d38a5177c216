"""02_data_parallel: one DataParallel step spelled out by hand, and DataParallel's throughput."""
from __future__ import annotations

import copy
import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

from ..core.config import TrainConfig
from ..core.precision import Precision
from .measure import _default_device, model_and_batch, step_seconds


# ------------------------------------------------------------------------------------------- 02: DataParallel
def batch_gradient(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of the mean loss over the whole batch on one model, as one flat vector."""
    model = copy.deepcopy(model)
    F.cross_entropy(model(X), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def data_parallel_by_hand(model: nn.Module, X: torch.Tensor, y: torch.Tensor, replicas: int = 2) -> dict:
    """One nn.DataParallel step spelled out so it runs on a CPU: replicate, scatter, parallel_apply, gather, reduce.

    Returns the summed gradient (as a flat vector) and which process and threads ran the replicas.
    """
    model = copy.deepcopy(model)
    copies = [copy.deepcopy(model) for _ in range(replicas)]   # replicate: DP copies the weights to every GPU, every step
    inputs = X.chunk(replicas)                                  # scatter: each replica gets a slice of the batch
    outputs, threads_seen = [None] * replicas, [None] * replicas

    def forward(i):                                             # parallel_apply: one Python thread per replica
        threads_seen[i] = (os.getpid(), threading.get_ident())
        outputs[i] = copies[i](inputs[i])

    threads = [threading.Thread(target=forward, args=(i,)) for i in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    logits = torch.cat(outputs)                                 # gather: all outputs back on GPU 0
    F.cross_entropy(logits, y).backward()                       # the loss over the whole batch, on GPU 0
    for p, *replica_params in zip(model.parameters(), *(c.parameters() for c in copies)):
        p.grad = sum(q.grad for q in replica_params)            # reduce: gradients summed back onto GPU 0
    return {"gradient": torch.cat([p.grad.reshape(-1) for p in model.parameters()]),
            "processes": len({pid for pid, _ in threads_seen}),
            "threads": len({tid for _, tid in threads_seen}),
            "batch slices": [len(x) for x in inputs]}


def dp_throughput(cfg: TrainConfig, gpu_counts=None, steps: int = 20) -> list[dict]:
    """Training steps per second with nn.DataParallel over the first k GPUs, and each GPU's peak memory.

    The batch grows with k (cfg.batch_size per GPU, as DDP's --batch-size is per process), so ideal scaling keeps
    the time per step constant. On a CPU it compares the plain model with the DataParallel wrapper, which there
    is a pass-through.
    """
    device = _default_device()
    gpu_counts = gpu_counts or (list(range(1, torch.cuda.device_count() + 1)) if device.type == "cuda" else [0])
    rows = []
    for k in gpu_counts:
        for wrapped in ([False, True] if device.type == "cpu" else [True]):
            model, X, y = model_and_batch(cfg, cfg.batch_size * max(k, 1), device, real=False)
            if cfg.channels_last:
                model, X = model.to(memory_format=torch.channels_last), X.contiguous(memory_format=torch.channels_last)
            if wrapped:
                model = nn.DataParallel(model, device_ids=list(range(k)) if k else None)
            if device.type == "cuda":
                for i in range(k):
                    torch.cuda.reset_peak_memory_stats(i)
            seconds = step_seconds(model, X, y, Precision("fp32", device), steps)
            row = {"model": "DataParallel" if wrapped else "plain", "gpus": k, "batch": len(X),
                   "samples/s": round(len(X) / seconds)}
            if device.type == "cuda":
                row["peak MiB per GPU"] = " ".join(f"{torch.cuda.max_memory_allocated(i) / 2**20:.0f}"
                                                   for i in range(k))
            rows.append(row)
            del model
    return rows
