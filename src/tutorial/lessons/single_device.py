"""01_single_device: a step profiled by phase, DataLoader workers measured, TensorBoard tags read."""
from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, Dataset

from .. import train_single
from ..core import checkpoint, tracking
from ..core.config import TrainConfig
from .measure import _native_stderr_silenced, _sync
from .notebook import _child_pids, print_table


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


def profile_steps(cfg: TrainConfig, steps: int = 20, row_limit: int = 10, warmup: int = 3) -> StepProfile:
    """Run train_single's own setup, build and train_one_epoch for warmup + steps optimizer steps; time the four
    phases of the last `steps` and record them with torch.profiler.

    The phases are cut by hooks torch offers: the model's forward pre-hook and forward hook, and the optimizer's
    step pre- and post-hooks (the loss falls into backward). Each cut first waits for the device, so on a GPU a
    phase's time is its kernels' time and not just the time to queue them; the trainer itself never waits.
    """
    device, amp = train_single.setup(cfg.replace(out=""))
    model, optimizer, loader, _, peak_lr = train_single.build(cfg, device)
    state, log = checkpoint.State(), tracking.RunLog(cfg, False)  # not the main process: prints and writes nothing
    times = {name: [] for name in PHASES}
    now = {"phase": "data", "since": time.perf_counter(), "recording": False}

    def begins(phase):
        def hook(*_):  # the phase under way ends here, and `phase` begins
            _sync(device)
            end = time.perf_counter()
            if now["recording"]:
                times[now["phase"]].append(end - now["since"])
            now.update(phase=phase, since=end)
        return hook

    hooks = [model.register_forward_pre_hook(begins("forward")), model.register_forward_hook(begins("backward")),
             optimizer.register_step_pre_hook(begins("optimizer")), optimizer.register_step_post_hook(begins("data"))]

    def train(until_step):  # the trainer's loop, epoch after epoch if an epoch is shorter
        while state.step < until_step:
            train_single.train_one_epoch(cfg.replace(max_steps=until_step), model, optimizer, amp, loader, device,
                                         0, peak_lr, state, log)

    train(warmup)  # the first steps allocate memory and pick kernels
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _native_stderr_silenced(), profile(activities=activities) as prof:
        now.update(phase="data", since=time.perf_counter(), recording=True)
        train(warmup + steps)
    for hook in hooks:
        hook.remove()
    sort_by = "self_cpu_time_total" if device.type == "cpu" else "self_device_time_total"
    return StepProfile(times, prof.key_averages().table(sort_by=sort_by, row_limit=row_limit), device)


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
