"""Measurements and demonstrations the notebooks call, so their cells stay short (01, 02 and 04).

Nothing here trains a model to the end: the trainers do that. These functions take a few steps apart (a profile of
one step, a DataLoader's throughput, one DataParallel step spelled out by hand, a GradScaler's reaction to an inf
gradient) and return numbers or rows that a notebook prints. Everything runs on a CPU; on a GPU the same functions
measure the GPU.
"""
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

from .config import TrainConfig
from .data import DataInfo, build_datasets
from .models import build_model
from .precision import Precision


# ------------------------------------------------------------------------------------------------------ printing
def print_table(rows: list[dict], floatfmt: str = ".3g") -> None:
    """Rows of dicts as an aligned text table (the notebooks' tables of measurements)."""
    if not rows:
        print("(no rows)")
        return
    keys = list(rows[0])

    def fmt(v):
        if isinstance(v, float):
            return format(v, floatfmt)
        return str(v)

    cells = [[fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _native_stderr_silenced():
    """Send file descriptor 2 to /dev/null: the profiler's C++ library (kineto) writes timestamped progress lines
    there, which Jupyter would show under the next cell."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _default_device() -> torch.device:
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


# The shape of each dataset's images, so that speed measurements need no download (random data of that shape).
SHAPES = {"digits": DataInfo(1, 10, 8), "mnist": DataInfo(1, 10, 28), "cifar10": DataInfo(3, 10, 32)}


def model_and_batch(cfg: TrainConfig, batch_size: int | None = None, device: torch.device | None = None,
                    real: bool = True):
    """The preset's model (seeded, as the trainers build it) and one training batch.

    real=True: the first samples of the training set; real=False: random images of the dataset's shape (speed
    measurements, where the values do not matter and the data may not be downloaded).
    """
    device = device or torch.device("cpu")
    n = batch_size or cfg.batch_size
    if real:
        train_set, _, info = build_datasets(cfg)
        X, y = zip(*(train_set[i % len(train_set)] for i in range(n)))
        X, y = torch.stack(X), torch.as_tensor(y)
    else:
        info = SHAPES.get(cfg.dataset, DataInfo(3, 1000, cfg.image_size or 224))
        gen = torch.Generator().manual_seed(cfg.seed)
        X = torch.randn(n, info.in_channels, info.image_size, info.image_size, generator=gen)
        y = torch.randint(0, info.num_classes, (n,), generator=gen)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, info).to(device)
    return model, X.to(device), y.to(device)


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

    from . import train_single
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


def _child_pids() -> list[int]:
    import psutil
    return [p.pid for p in psutil.Process().children(recursive=True)]


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


def child_processes() -> list[int]:
    """Process ids of this kernel's children still alive (DataLoader workers end with their loaders)."""
    gc.collect()  # a loader kept alive only by a reference cycle keeps its workers until collected
    deadline = time.monotonic() + 5
    while _child_pids() and time.monotonic() < deadline:  # workers that were told to stop are still exiting
        time.sleep(0.1)
    return _child_pids()


# ----------------------------------------------------------------------------------------------- 01: TensorBoard
def tensorboard_tags(logdir: str) -> list[str]:
    """The scalar tags in a run's TensorBoard event files (what `tensorboard --logdir` would plot)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(logdir)
    acc.Reload()
    return sorted(acc.Tags()["scalars"])


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
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
            if device.type == "cuda":
                for i in range(k):
                    torch.cuda.reset_peak_memory_stats(i)
            for i in range(steps + 3):
                if i == 3:
                    _sync(device)
                    start = time.perf_counter()
                F.cross_entropy(model(X), y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            _sync(device)
            seconds = time.perf_counter() - start
            row = {"model": "DataParallel" if wrapped else "plain", "gpus": k, "batch": len(X),
                   "samples/s": round(steps * len(X) / seconds)}
            if device.type == "cuda":
                row["peak MiB per GPU"] = " ".join(f"{torch.cuda.max_memory_allocated(i) / 2**20:.0f}"
                                                   for i in range(k))
            rows.append(row)
            del model, optimizer
    return rows


# ---------------------------------------------------------------------------------------- 04: mixed precision
def float_formats(dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> list[dict]:
    """Bits, range and precision of floating-point formats, from torch.finfo."""
    rows = []
    for dtype in dtypes:
        info = torch.finfo(dtype)
        mantissa = round(-math.log2(info.eps))
        rows.append({"dtype": str(dtype).replace("torch.", ""), "bits": info.bits,
                     "exponent": info.bits - 1 - mantissa, "mantissa": mantissa, "max": info.max,
                     "smallest normal": info.smallest_normal,
                     "smallest subnormal": info.smallest_normal * info.eps, "eps": info.eps})
    return rows


def scaler_demo(gradients=("ok", "ok", "inf", "ok", "ok", "nan", "ok"), init_scale: float = 2.0 ** 16,
                growth_interval: int = 2, device_type: str = "cpu") -> list[dict]:
    """A real torch.amp.GradScaler reacting to finite and inf/nan gradients, one row per step.

    The "model" is one weight w with loss = g * w, so its gradient is whatever we choose: a finite number, or inf
    and nan as an fp16 overflow would produce. growth_interval is small so that doubling shows up in a few steps
    (the default is 2000).
    """
    w = nn.Parameter(torch.ones((), device=device_type))
    optimizer = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_interval)
    rows = []
    for step, kind in enumerate(gradients):
        g = {"ok": 1.0, "inf": math.inf, "nan": math.nan}[kind]
        before, scale = w.item(), scaler.get_scale()
        scaler.scale(g * w).backward()
        scaler.step(optimizer)           # skipped when the unscaled gradients hold inf or nan
        scaler.update()                  # halves the scale after a skip, doubles it after growth_interval good steps
        optimizer.zero_grad()
        rows.append({"step": step, "gradient": kind, "scale": scale, "weight updated": w.item() != before,
                     "next scale": scaler.get_scale()})
    return rows


def autocast_dtypes(device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Which dtype autocast gives each operation's output, and the dtype the weights stay in."""
    layer = nn.Linear(8, 4).to(device_type)
    x = torch.randn(2, 8, device=device_type)
    y = torch.tensor([0, 1], device=device_type)
    with torch.autocast(device_type, dtype=dtype):
        logits = layer(x)
        loss = F.cross_entropy(logits, y)
    names = lambda t: str(t.dtype).replace("torch.", "")  # noqa: E731
    return [{"tensor": "input x", "dtype": names(x)},
            {"tensor": "weight (the master copy)", "dtype": names(layer.weight)},
            {"tensor": "linear output (matmul)", "dtype": names(logits)},
            {"tensor": "cross-entropy loss", "dtype": names(loss)}]


def precision_benchmark(cfg: TrainConfig, precisions=("fp32", "bf16"), steps: int = 20) -> list[dict]:
    """Training samples per second and peak memory for each precision, same model and batch (04_mixed_precision).

    Uses the trainers' own Precision policy. fp16 is only accepted on a GPU.
    """
    device = _default_device()
    rows = []
    for name in precisions:
        amp = Precision(name, device)
        model, X, y = model_and_batch(cfg, device=device, real=False)
        if cfg.channels_last:
            model, X = model.to(memory_format=torch.channels_last), X.contiguous(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(steps + 3):
            if i == 3:
                _sync(device)
                start = time.perf_counter()
            with amp.autocast():
                loss = F.cross_entropy(model(X), y)
            amp.backward(loss)
            amp.step(optimizer, model.parameters())
            optimizer.zero_grad(set_to_none=True)
        _sync(device)
        row = {"precision": name, "samples/s": round(steps * len(X) / (time.perf_counter() - start))}
        if device.type == "cuda":
            row["peak MiB"] = torch.cuda.max_memory_allocated(device) / 2**20
        rows.append(row)
        del model, optimizer
    return rows
