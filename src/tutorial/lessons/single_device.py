"""01_single_device: a step profiled by phase, DataLoader workers measured, TensorBoard tags read."""
from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..core.config import TrainConfig
from ..core.data import DataInfo, build_datasets
from ..core.models import build_model
from ..core.precision import Precision

from .notebook import _child_pids
from .measure import SHAPES, _default_device, _native_stderr_silenced, _sync, model_and_batch


# ------------------------------------------------------------------------------------------ 01: profiling a step
PHASES = ("data", "forward", "backward", "optimizer")


class StepProfile:
    """What profile_steps measured: wall seconds per phase and step, and torch.profiler's operator table."""

    def __init__(self, phases: dict, table: str, device: torch.device):
        self.phases, self.op_table, self.device = phases, table, device

    def mean(self, phase: str) -> float:
        return sum(self.phases[phase]) / len(self.phases[phase])

    def share(self, *phases: str) -> float:
        """The fraction of the measured time spent in these phases."""
        total = sum(sum(v) for v in self.phases.values())
        return sum(sum(self.phases[p]) for p in phases) / total

    def summary(self) -> None:
        """A table shaped like PyTorch Lightning's `--profiler simple` report (seed 000)."""
        total = sum(sum(v) for v in self.phases.values())
        rows = [{"action": name, "mean (ms)": 1e3 * self.mean(name), "calls": len(times),
                 "total (ms)": 1e3 * sum(times), "share %": 100 * sum(times) / total}
                for name, times in self.phases.items()]
        print_table(rows, ".2f")


def _forever(loader):
    """Batches from the loader, epoch after epoch (itertools.cycle would replay stored batches instead)."""
    while True:
        yield from loader


def profile_steps(cfg: TrainConfig, steps: int = 20, row_limit: int = 10) -> StepProfile:
    """Time the four phases of `steps` training steps of train_single's loop and profile them with torch.profiler.

    Each phase ends with a device synchronisation, so on a GPU a phase's time is its kernels' time and not just the
    time to queue them (the real loop does not synchronise; this is a measurement, not a training loop).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    from .. import train_single
    device, amp = train_single.setup(cfg.replace(out=""))
    model, optimizer, loader, _, _ = train_single.build(cfg, device)
    model.train()
    batches = _forever(loader)

    def one_step(times=None):
        marks = [time.perf_counter()]
        with record_function("data"):
            X, y = next(batches)
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
            _sync(device)
        marks.append(time.perf_counter())
        with record_function("forward"):
            with amp.autocast():
                loss = F.cross_entropy(model(X), y)
            _sync(device)
        marks.append(time.perf_counter())
        with record_function("backward"):
            amp.backward(loss)
            _sync(device)
        marks.append(time.perf_counter())
        with record_function("optimizer"):
            amp.step(optimizer, model.parameters())
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
        marks.append(time.perf_counter())
        if times is not None:
            for name, a, b in zip(PHASES, marks, marks[1:]):
                times[name].append(b - a)

    for _ in range(3):  # warm-up: first calls allocate memory and pick kernels
        one_step()
    times = {name: [] for name in PHASES}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _native_stderr_silenced():
        with profile(activities=activities) as prof:
            for _ in range(steps):
                one_step(times)
        ops = prof.key_averages()
    sort_by = "self_cpu_time_total" if device.type == "cpu" else "self_device_time_total"
    table = ops.table(sort_by=sort_by, row_limit=row_limit)
    return StepProfile(times, table, device)


# --------------------------------------------------------------------------------------- 01: DataLoader workers
class SlowImages(Dataset):
    """Images that cost time to produce, like files read from a shared file system and decoded.

    kind="io": each sample waits `cost_ms` (a read from disk or network: the process sleeps, the CPU is free).
    kind="cpu": each sample computes for `cost_ms` (decoding and augmentation: a core is busy).
    """

    def __init__(self, size: int = 512, cost_ms: float = 2.0, kind: str = "io", image_size: int = 28):
        if kind not in ("io", "cpu"):
            raise ValueError(f"kind {kind!r} is not one of: io, cpu")
        self.size, self.cost, self.kind, self.image_size = size, cost_ms / 1e3, kind, image_size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        if self.kind == "io":
            time.sleep(self.cost)
        else:
            end = time.perf_counter() + self.cost
            while time.perf_counter() < end:
                pass
        return torch.full((1, self.image_size, self.image_size), float(i % 255) / 255), i % 10


def loader_throughput(workers=(0, 1, 2), size: int = 384, batch_size: int = 32, cost_ms: float = 2.0,
                      kind: str = "io") -> list[dict]:
    """Samples per second a DataLoader delivers with each number of workers (01_single_device).

    `startup (s)` is the wait for the first batch (starting the workers and filling their first batches);
    `samples/s` is the steady rate after it. `processes` counts the child processes alive while iterating.
    """
    dataset = SlowImages(size, cost_ms, kind)
    rows = []
    for n in workers:
        before = set(_child_pids())
        loader = DataLoader(dataset, batch_size=batch_size, num_workers=n)
        start = time.perf_counter()
        it = iter(loader)
        first = next(it)
        first_at = time.perf_counter()
        processes = len(set(_child_pids()) - before)
        count = 0
        for X, _ in it:
            count += len(X)
        end = time.perf_counter()
        del it, loader, first
        rows.append({"workers": n, "processes": processes, "startup (s)": first_at - start,
                     "samples/s": round(count / (end - first_at))})
    return rows
