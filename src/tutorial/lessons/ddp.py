"""Demonstrations for 03_distributed_data_parallel, so its cells stay short.

Some of these run on every engine (`cluster.run(lesson.overlap_events, cfg)`): the gradient buckets, and the
replicas compared tensor by tensor. The others run in the notebook's kernel: the learning-rate schedule for several
world sizes, torchrun started from a cell, and reading back what rank 0 saved.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import train_ddp
from ..core.config import TrainConfig, to_argv
from ..core.data import SHAPES, build_datasets
from ..core.models import build_model, unwrap
from ..core.optim import lr_at, scaled_lr
from ..core.process import threads_per_process
from ..launch.commands import display
from ..launch.processes import launch, launcher_env
from .notebook import engine_device


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
    device, _, world, created = train_ddp.setup(cfg)  # the trainer's: who we are, our device, the group joined
    try:
        train_set, _, info = build_datasets(cfg)
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
        train_ddp.teardown(created)


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
        c, dtype = x.shape[1], x.dtype
        x = x.float()  # statistics in fp32, as BatchNorm keeps them under autocast (bf16 sums of squares lose digits)
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
        return (y * self.weight.view(shape) + self.bias.view(shape)).to(dtype)

    @classmethod
    def convert(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Replace every BatchNorm2d in module (DDP-wrapped or not) by a GlobalBatchNorm2d that holds the very same
        parameter and buffer tensors, so a DDP wrapper and an optimizer made before keep working on them."""
        for name, child in module.named_children():
            if isinstance(child, torch.nn.BatchNorm2d):
                new = cls(child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats)
                for tensor in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
                    setattr(new, tensor, getattr(child, tensor))
                setattr(module, name, new)
            else:
                cls.convert(child)
        return module


def compare_replicas(cfg: TrainConfig, global_bn: bool = False) -> list[dict]:
    """Run on every engine: train cfg with train_ddp's own setup, build and train, then gather every rank's
    state_dict and compare each tensor by name, as seed 004's compare_models.py compares the models each rank saved.
    global_bn: BatchNorm over the global batch with GlobalBatchNorm2d, the CPU counterpart of sync_bn=True.
    Returns one row per tensor: its name, parameter or buffer, identical on all ranks, the largest difference.
    """
    device, amp, world, created = train_ddp.setup(cfg)
    try:
        model, optimizer, train_loader, test_loader, peak_lr = train_ddp.build(cfg, device, world)
        if global_bn:
            GlobalBatchNorm2d.convert(model)
        train_ddp.train(cfg, device, amp, world, model, optimizer, train_loader, test_loader, peak_lr)
        module = unwrap(model)
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
def torchrun(cfg: TrainConfig, out: str, nproc: int = 2, stage: str = "ddp", timeout: float = 600) -> dict:
    """Launch `torchrun --standalone --nproc_per_node nproc -m tutorial.train_<stage>` with cfg's flags, as from a
    terminal, wait for it (at most timeout seconds), print the command and rank 0's output, and return the
    metrics.json rank 0 wrote. On a failure, a timeout or an interrupt, torchrun and its workers are stopped."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", f"tutorial.train_{stage}", *to_argv(cfg.replace(out=out), horovod=stage == "horovod")]
    print("$ " + display(cmd), flush=True)
    # The workers' fair share of the cores: torchrun would otherwise give each 1 thread and print a banner saying so.
    # Where the node has fewer GPUs than workers, they run on the CPU (NCCL cannot share a GPU between ranks).
    cpu = engine_device(nproc) == "cpu"
    run = launch(cmd, out=out, timeout=timeout, env=launcher_env(threads=threads_per_process(nproc), cpu=cpu),
                 check=False)
    if not run.ok:  # the failed worker's own error line comes before torchrun's long summary of the failure
        raise RuntimeError(f"torchrun exited with code {run.returncodes[0]}:\n{run.outputs[0][-3000:]}")
    print(run.outputs[0], end="", flush=True)  # only rank 0 prints: one copy of every line, not nproc
    return run.metrics


def load_checkpoint(out: str):
    """The model rank 0 saved in out/checkpoint.pt, rebuilt on the CPU in one process: (model, checkpoint dict).

    Checkpoints hold the unwrapped model, so no DDP and no process group is needed to read one back."""
    ckpt = torch.load(Path(out, "checkpoint.pt"), map_location="cpu", weights_only=True)
    cfg = TrainConfig(**ckpt["config"])
    # The model's shape needs no data where the dataset fixes it; an image folder's classes are its sub-folders.
    fixed = cfg.dataset in ("digits", "mnist", "cifar10") and not (cfg.synthetic or cfg.image_size)
    info = SHAPES[cfg.dataset] if fixed else build_datasets(cfg)[2]
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

