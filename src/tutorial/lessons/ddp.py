"""Demonstrations for 03_distributed_data_parallel, so its cells stay short.

Some of these run on the engines (`cluster.run(lessons_ddp.overlap_events, cfg)`): engines import functions by
module and name, so anything a notebook runs on them must live in a module like this one, never in the notebook.
The others run in the notebook's kernel: a diff of one function between two trainers, the learning-rate schedule
for several world sizes, torchrun started from a cell, and reading back what rank 0 saved.
"""
from __future__ import annotations

import difflib
import inspect
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.config import TrainConfig
from ..core.optim import lr_at, scaled_lr


# ----------------------------------------------------------------------------------------- reading the lesson
def function_diff(old, new, name: str, context: int = 2) -> None:
    """The diff of one function between two trainer modules, e.g. function_diff(train_single, train_ddp, "build").

    notebook.diff shows the whole file; one function at a time fits on a slide."""
    a = inspect.getsource(getattr(old, name)).splitlines()
    b = inspect.getsource(getattr(new, name)).splitlines()
    old_name, new_name = old.__name__.rsplit(".", 1)[-1], new.__name__.rsplit(".", 1)[-1]
    for line in difflib.unified_diff(a, b, f"{old_name}.{name}", f"{new_name}.{name}", n=context, lineterm=""):
        print(line)


# --------------------------------------------------------------------------------------- lr scaling and warm-up
def lr_schedules(cfg: TrainConfig, world_sizes=(1, 2, 8), points: int = 200, ax=None):
    """Plot the trainers' lr (optim.lr_at) against the epoch for each world size; returns (figure, rows).

    Each row gives the world size, the global batch, the peak lr (linear scaling rule) and the lr at the start."""
    import matplotlib.pyplot as plt
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 3.4), layout="constrained")
    rows = []
    epochs = [cfg.epochs * i / points for i in range(points + 1)]
    for n in world_sizes:
        peak = scaled_lr(cfg, n)
        ax.plot(epochs, [lr_at(cfg, e, peak) for e in epochs], label=f"{n} process{'es' if n > 1 else ''}")
        rows.append({"world size": n, "global batch": cfg.batch_size * cfg.grad_accum * n, "peak lr": peak,
                     "lr at step 0": lr_at(cfg, 0.0, peak)})
    if cfg.warmup_epochs:
        ax.axvline(cfg.warmup_epochs, color="grey", linestyle=":", label="end of warm-up")
    ax.set(xlabel="epoch", ylabel="learning rate",
           title=f"lr = {cfg.lr} x world size, {cfg.warmup_epochs} warm-up epoch(s), {cfg.schedule}")
    ax.legend()
    return ax.figure, rows


# ------------------------------------------------------------------------ the all-reduce overlapped with backward
def overlap_events(cfg: TrainConfig, bucket_cap_mb: float = 0.1) -> list[dict]:
    """Run on every engine: one DDP forward and backward, recording the order in which gradients become ready and
    DDP launches the all-reduce of each gradient bucket. Returns the events in order (every rank's are the same).

    DDP groups gradients into buckets of about bucket_cap_mb (default 25 MB; small here so that a small model gets
    several buckets), in reverse order of the parameters, because backward computes the last layers' gradients first.
    A bucket's all-reduce starts as soon as all its gradients are ready, while backward continues with earlier layers.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..core.data import build_datasets
    from ..core.distributed import init_process_group, pick_device, teardown, world_from_env
    from ..core.models import build_model

    world = world_from_env()
    device = pick_device(world.local_rank, world.local_world_size)
    created = init_process_group(world, device)
    try:
        train_set, _, info = build_datasets(cfg)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, info).to(device)
        names = {p: n for n, p in model.named_parameters()}
        events = []
        for p, n in names.items():
            p.register_post_accumulate_grad_hook(lambda p, n=n: events.append({"event": "gradient ready", "what": n}))
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_cap_mb)

        def logged_allreduce(process_group, bucket):
            layers = list(dict.fromkeys(names[p].rsplit(".", 1)[0] for p in bucket.parameters()))
            events.append({"event": f"all-reduce bucket {bucket.index()}", "what": "layers " + ", ".join(layers)})
            return default_hooks.allreduce_hook(process_group, bucket)  # the same averaging DDP does by default

        model.register_comm_hook(None, logged_allreduce)
        X, y = zip(*(train_set[i + world.rank * cfg.batch_size] for i in range(cfg.batch_size)))
        X, y = torch.stack(X).to(device), torch.as_tensor(y).to(device)
        # The first backward puts every gradient in one bucket and notes the order in which they become ready;
        # DDP then rebuilds its buckets in that order. The second backward shows the buckets training will use.
        for _ in range(2):
            events.clear()
            torch.nn.functional.cross_entropy(model(X), y).backward()
        events.append({"event": "backward returned", "what": "every bucket averaged"})
        return events
    finally:
        teardown(created)


# ------------------------------------------------------------------------------------- BatchNorm across replicas
class _AllReduceSum(torch.autograd.Function):
    """A sum over the ranks that autograd can go through: the gradient of a sum is the sum of the gradients."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class GlobalBatchNorm2d(torch.nn.BatchNorm2d):
    """What SyncBatchNorm computes, spelled out with one all-reduce so that it also runs on CPUs (gloo).

    torch.nn.SyncBatchNorm only accepts GPU tensors. This layer all-reduces every channel's sum, sum of squares and
    count over the ranks, so the mean and variance, and with them the running statistics, are those of the global
    batch on every rank. The all-reduce is differentiable (_AllReduceSum), so backward sums the statistics'
    gradients over the ranks as SyncBatchNorm's backward does. A demonstration, not a replacement: no fused kernels.
    """

    def forward(self, x):
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        c = x.shape[1]
        count = torch.full((1,), x.numel() / c, dtype=x.dtype, device=x.device)
        stats = _AllReduceSum.apply(torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)), count]))  # over ranks
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean
        with torch.no_grad():  # the same update as BatchNorm's, from the global batch: identical on every rank
            self.num_batches_tracked += 1
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
        shape = (1, c, 1, 1)
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape)

    @classmethod
    def convert(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Replace every BatchNorm2d in module by a GlobalBatchNorm2d with the same parameters and buffers."""
        for name, child in module.named_children():
            if isinstance(child, torch.nn.BatchNorm2d):
                new = cls(child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats)
                new.load_state_dict(child.state_dict())
                setattr(module, name, new.to(child.weight.device))
            else:
                cls.convert(child)
        return module


def _build_with_global_bn(cfg: TrainConfig, device, world):
    """train_ddp.build with GlobalBatchNorm2d in place of SyncBatchNorm (the CPU counterpart of sync_bn=True)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    from ..core.data import build_datasets, make_loader
    from ..core.models import build_model
    from ..core.optim import build_optimizer
    train_set, _, info = build_datasets(cfg)
    sampler = DistributedSampler(train_set, world.world_size, world.rank, shuffle=True, seed=cfg.seed)
    train_loader = make_loader(train_set, cfg, device, sampler=sampler)
    model = GlobalBatchNorm2d.convert(build_model(cfg.model, info).to(device))
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    lr = scaled_lr(cfg, world.world_size)
    return model, build_optimizer(model, cfg, lr), train_loader, None, lr


def compare_replicas(cfg: TrainConfig, global_bn: bool = False) -> list[dict]:
    """Run on every engine: train cfg with train_ddp's own setup, build and loop (cfg.max_steps steps), then gather
    every rank's state_dict and compare each tensor by name, as seed 004's compare_models.py compares the models
    each rank saved. global_bn: BatchNorm over the global batch with GlobalBatchNorm2d (runs on CPUs too).
    Returns one row per tensor: its name, parameter or buffer, identical on all ranks, the largest difference.
    """
    from ..core import checkpoint, tracking
    from .. import train_ddp

    device, amp, world, created = train_ddp.setup(cfg)
    try:
        build = _build_with_global_bn if global_bn else train_ddp.build
        model, optimizer, train_loader, _, peak_lr = build(cfg, device, world)
        log = tracking.RunLog(cfg, False, strategy="ddp", world_size=world.world_size)  # quiet: no output, no files
        state = checkpoint.State()
        for epoch in range(cfg.epochs):
            train_loader.sampler.set_epoch(epoch)
            train_ddp.train_one_epoch(cfg, model, optimizer, amp, train_loader, device, epoch, peak_lr, state, log)
            if cfg.max_steps and state.step >= cfg.max_steps:
                break
        module = checkpoint.unwrap(model)
        mine = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        every = [None] * world.world_size
        dist.all_gather_object(every, mine)  # every rank's tensors, on every rank
        parameters = {n for n, _ in module.named_parameters()}
        rows = []
        for name in mine:
            copies = [d[name] for d in every]
            largest = max((c.double() - copies[0].double()).abs().max().item() for c in copies)
            rows.append({"tensor": name, "kind": "parameter" if name in parameters else "buffer",
                         "identical": all(torch.equal(c, copies[0]) for c in copies), "max difference": largest})
        return rows
    finally:
        train_ddp.teardown(created)


# -------------------------------------------------------------------------------------------- torchrun, rank 0 files
def cli_flags(cfg: TrainConfig) -> list[str]:
    """The command-line flags that turn cfg's preset into cfg (only the fields that differ from the preset)."""
    import dataclasses
    base = TrainConfig.preset(cfg.preset_name) if cfg.preset_name else TrainConfig()
    flags = ["--preset", cfg.preset_name] if cfg.preset_name else []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("preset_name", "out", "fp16_allreduce") or value == getattr(base, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def torchrun(cfg: TrainConfig, out: str, nproc: int = 2, stage: str = "ddp", timeout: float = 600) -> dict:
    """Launch `torchrun --standalone --nproc_per_node nproc -m tutorial.train_<stage>` with cfg's flags, as from a
    terminal, wait for it (at most timeout seconds), print the command and rank 0's output, and return the
    metrics.json rank 0 wrote. On a timeout the whole launch (torchrun and its workers) is killed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", f"tutorial.train_{stage}", *cli_flags(cfg), "--out", out]
    print("$ torchrun " + " ".join(cmd[3:]), flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["PYTHONUNBUFFERED"] = "1"
    # The engines' fair share of the cores (tutorial.launch.engines does the same); torchrun would otherwise pick 1 and
    # print a banner saying so.
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # A session of its own, so a timeout can end torchrun and every worker it started in one signal.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"torchrun did not finish within {timeout:g} s and was stopped") from None
    except BaseException:  # an interrupted cell must not leave the workers running
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with code {proc.returncode}:\n{output[-3000:]}")
    print(output, end="", flush=True)  # only rank 0 prints: one copy of every line, not nproc
    return json.loads(Path(out, "metrics.json").read_text())


def load_checkpoint(out: str):
    """The model rank 0 saved in out/checkpoint.pt, rebuilt on the CPU in one process: (model, checkpoint dict).

    Checkpoints hold the unwrapped model, so no DDP and no process group is needed to read one back."""
    from ..core.data import build_datasets
    from ..core.models import build_model
    ckpt = torch.load(Path(out, "checkpoint.pt"), map_location="cpu", weights_only=False)
    cfg = TrainConfig(**ckpt["config"])
    _, _, info = build_datasets(cfg)
    model = build_model(cfg.model, info)
    if cfg.sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.load_state_dict(ckpt["model"])
    return model, ckpt


def max_difference(out_a: str, out_b: str) -> float:
    """The largest absolute difference between the parameters of two runs' checkpoints."""
    a, _ = load_checkpoint(out_a)
    b, _ = load_checkpoint(out_b)
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


# ------------------------------------------------------------------------------------ %%px cells: a fresh port
