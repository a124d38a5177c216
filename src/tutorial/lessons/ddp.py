"""Infrastructure, plots and checks for 03a_ddp_by_hand and 03b_ddp_trainer; the DDP code itself is typed in the
notebooks.

Here: the learning-rate schedule for several world sizes, the replicas compared tensor by tensor, a profiler trace
of one DDP backward turned into a timeline, reading back what rank 0 saved, and the exercises' and the capstone's
checkers with their solutions (tests/test_exercises_03.py checks each checker against its solution and skeleton).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import train_ddp
from ..core.config import TrainConfig
from ..core.data import SHAPES, build_datasets
from ..core.distributed import init_process_group, teardown, world_from_env
from ..core.models import build_model, unwrap
from ..core.optim import lr_at, scaled_lr
from .ranks import first_error, first_line, on_every_rank
from .sharded import max_difference  # noqa: F401 - notebook 03b compares two runs' weights with it


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
    """Run on every engine: train cfg with train_ddp.main (through its build hook, which converts the BatchNorm
    layers for global_bn), then gather every rank's state_dict and compare each tensor by name, as
    compare_models.py compares the models each rank saved.
    global_bn: BatchNorm over the global batch with GlobalBatchNorm2d, the CPU counterpart of sync_bn=True.
    Returns one row per tensor: its name, parameter or buffer, identical on all ranks, the largest difference.
    """
    # Join the group here, so that it outlives train_ddp.main (which leaves alone a group it did not create): the
    # ranks compare their tensors after training.
    device, _ = train_ddp.setup(cfg)
    created = init_process_group(world_from_env(), device, cfg.timeout, cfg.backend)
    built = []

    def build(cfg, device):  # train_ddp.main's build hook: its own build, then the lesson's BatchNorm
        model, *rest = train_ddp.build(cfg, device)
        if global_bn:
            GlobalBatchNorm2d.convert(model)
        built.append(model)
        return (model, *rest)

    try:
        train_ddp.main(cfg, build=build)
        module = unwrap(built[0])
        mine = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        every = [None] * dist.get_world_size()
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
        teardown(created)


# ------------------------------------------------------------------------------------------------ rank 0's files
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



# ------------------------------------------------------------------------- the overlap, from a profiler trace
def backward_timeline(prof) -> list[dict]:
    """From a torch.profiler trace of one DDP backward: the backward ops (main thread) and each bucket's all-reduce,
    as rows {lane, what, start_ms, end_ms} with times from the first backward op.

    A bucket's row spans from DDP handing it to the comm hook (the `record_function("all-reduce bucket i")` range)
    to the end of the collective's own event (`gloo:all_reduce` or `nccl:all_reduce`, run by the backend on its
    own thread, in launch order)."""
    import re
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    prefix = "autograd::engine::evaluate_function: "
    backward = [e for e in events if e.name.startswith(prefix)]
    launches = [e for e in events if e.name.startswith("all-reduce bucket ")]
    collectives = [e for e in events if re.fullmatch(r"(gloo|nccl):all_reduce", e.name)]
    t0 = backward[0].time_range.start
    rows = [{"lane": "backward",
             "what": e.name[len(prefix):].removesuffix("Backward0").replace("torch::autograd::", ""),
             "start_ms": (e.time_range.start - t0) / 1e3, "end_ms": (e.time_range.end - t0) / 1e3} for e in backward]
    for i, launch in enumerate(launches):
        end = collectives[i].time_range.end if i < len(collectives) else launch.time_range.end
        rows.append({"lane": launch.name.removeprefix("all-reduce "), "what": "all-reduce",
                     "start_ms": (launch.time_range.start - t0) / 1e3, "end_ms": (end - t0) / 1e3})
    return rows


def draw_timeline(rows: list[dict], ax=None):
    """A Gantt chart of backward_timeline's rows: backward ops on one lane, each bucket's all-reduce on its own."""
    import matplotlib.pyplot as plt
    lanes = list(dict.fromkeys(r["lane"] for r in rows))
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.55 * len(lanes)), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for r in rows:
        y = lanes.index(r["lane"])
        ax.barh(y, r["end_ms"] - r["start_ms"], left=r["start_ms"], height=0.6, color=colors[min(y, 1) + (y > 1)],
                edgecolor="black", linewidth=0.3)
        if r["lane"] == "backward" and r["end_ms"] - r["start_ms"] > 0.05 * max(x["end_ms"] for x in rows):
            ax.text((r["start_ms"] + r["end_ms"]) / 2, y, r["what"], ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set(xlabel="time since backward started (ms)", title="One DDP backward on rank 0: buckets all-reduced while "
                                                            "backward goes on")
    return ax.figure


# ------------------------------------------------------------------------------------------------------- exercises
def _errors(results) -> str | None:
    failed = first_error(results)
    return f"rank {failed[0]} failed ({failed[1]})" if failed else None


# Exercise 1: set_epoch
def check_epoch_orders(epoch_orders, world_size: int = 2, epochs: int = 3, n: int = 20) -> str:
    """epoch_orders(rank, world_size, epochs) must return the samples the rank reads in each epoch, with a new
    shuffle every epoch (DistributedSampler(range(20), seed=0) with set_epoch). Runs here, no process group."""
    from torch.utils.data.distributed import DistributedSampler
    orders = [epoch_orders(rank, world_size, epochs) for rank in range(world_size)]
    for rank, o in enumerate(orders):
        if not isinstance(o, list) or len(o) != epochs:
            return f"wrong: rank {rank} returned {o!r:.80}; expected a list of {epochs} lists, one per epoch"
    for epoch in range(epochs):
        together = sorted(i for o in orders for i in o[epoch])
        if together != list(range(n)):
            return (f"wrong: in epoch {epoch} the ranks together read {together}, not every one of the {n} samples "
                    f"once: keep the sampler's num_replicas and rank")
    if all(o[e] == o[0] for o in orders for e in range(epochs)):
        return (f"wrong: rank 0 reads {orders[0][0]} in every epoch, the same samples in the same order: call "
                f"sampler.set_epoch(epoch) at the start of every epoch, the shuffle is seeded with seed + epoch")
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            if orders[rank][epoch] != list(sampler):
                return (f"wrong: rank {rank}'s epoch {epoch} reads {orders[rank][epoch]}, not the order "
                        f"set_epoch({epoch}) gives, {list(sampler)}: call set_epoch(epoch) once, before the epoch")
    return (f"correct: a new shuffle every epoch, and the {world_size} ranks together read all {n} samples once "
            "per epoch")


def solution_epoch_orders(rank, world_size, epochs):
    from torch.utils.data.distributed import DistributedSampler
    sampler = DistributedSampler(range(20), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    orders = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # the shuffle of this epoch: seed + epoch
        orders.append(list(sampler))
    return orders


# Exercise 2: rank 0 writes the checkpoint
def _checkpoint_trial(save_checkpoint, path: str) -> dict:
    """On an engine, in a group: a DDP model, then save_checkpoint(model, path), counting this rank's torch.save."""
    import os
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    writes, real_save = [], torch.save

    def counting_save(obj, f, *args, **kwargs):
        writes.append(str(f))
        return real_save(obj, f, *args, **kwargs)

    torch.save = counting_save
    try:
        save_checkpoint(model, path)
    finally:
        torch.save = real_save
    return {"writes": len(writes), "exists_on_return": os.path.exists(path)}


def check_checkpoint(cluster, save_checkpoint) -> str:
    """Exercise 2: every rank calls save_checkpoint(model, path) with a DDP-wrapped nn.Linear(4, 2) and the same
    path; rank 0 alone must write it (torch.save), every rank must return only once it exists, and the file must
    load into the unwrapped model."""
    import os
    import tempfile
    path = os.path.join(tempfile.mkdtemp(prefix="tutorial-ex2-"), "checkpoint.pt")
    cluster.run(on_every_rank, _checkpoint_trial, save_checkpoint, path, seconds=10.0)
    failed = _errors(cluster.results)
    if failed:
        return (f"wrong: {failed}: a collective such as dist.barrier() inside `if rank == 0` waits for the other "
                "ranks in vain; call it on every rank, after the if")
    results = [value for _, value in cluster.results]
    writers = [rank for rank, r in enumerate(results) if r["writes"]]
    if len(writers) > 1:
        return (f"wrong: ranks {', '.join(map(str, writers))} all wrote {os.path.basename(path)}: the replicas are "
                "identical, so write once, `if dist.get_rank() == 0:`; N writers on one path can interleave and "
                "corrupt it, and multiply the I/O on a shared file system")
    if not writers:
        return "wrong: no rank called torch.save: rank 0 should save model.module.state_dict()"
    if writers != [0]:
        return f"wrong: rank {writers[0]} wrote the checkpoint; by convention rank 0 writes, the one that always exists"
    early = [rank for rank, r in enumerate(results) if not r["exists_on_return"]]
    if early:
        return (f"wrong: rank {early[0]} returned before the checkpoint existed: add dist.barrier() after the if, so "
                "that no rank goes on (and reads or resumes from it) before rank 0 has written it")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    if any(k.startswith("module.") for k in state):
        return ("wrong: the keys start with 'module.' (DDP's wrapper): save model.module.state_dict(), the unwrapped "
                "model, so one process can load it without DDP")
    try:
        torch.nn.Linear(4, 2).load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as exc:
        return f"wrong: the file does not load into the model ({first_line(exc, 100)})"
    return "correct: rank 0 alone wrote the unwrapped model, and every rank returned once it was there"


def solution_save_checkpoint(model, path):
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 0:  # one writer: the replicas are identical
        torch.save(model.module.state_dict(), path)  # the unwrapped model, no "module." prefix
    dist.barrier()  # every rank, outside the if: nobody goes on before the file exists


# Exercise 3: gradient accumulation with no_sync
MICRO_BATCHES = 4


def _micro_batches(rank: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(MICRO_BATCHES)]


def _accumulation_trial(accumulate) -> dict:
    """On an engine, in a group: accumulate(model, optimizer, micro_batches) on a DDP nn.Linear(8, 4), counting
    the all-reduces with a comm hook (one bucket: one call per synchronised backward)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hooks
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    model = DDP(net)
    calls = []

    def counting_allreduce(state, bucket):
        calls.append(bucket.index())
        return hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_allreduce)
    # DDP decides in forward whether the coming backward all-reduces: note, per forward, whether it ran in no_sync
    forwards = []
    model.register_forward_pre_hook(lambda module, inputs: forwards.append(module.require_backward_grad_sync))
    entered, no_sync = [], model.no_sync

    def counting_no_sync():
        entered.append(True)
        return no_sync()

    model.no_sync = counting_no_sync
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    accumulate(model, optimizer, _micro_batches(dist.get_rank()))
    return {"allreduces": len(calls), "weight": torch.cat([p.detach().reshape(-1) for p in net.parameters()]),
            "no_sync_entered": len(entered), "forwards_in_no_sync": forwards.count(False)}


def _accumulation_reference(world_size: int) -> torch.Tensor:
    """One process: the same step from every rank's micro-batches, each loss divided by the number of
    micro-batches, the gradient averaged over the ranks."""
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    for rank in range(world_size):
        for X, y in _micro_batches(rank):
            (torch.nn.functional.cross_entropy(net(X), y) / MICRO_BATCHES / world_size).backward()
    optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def check_accumulation(cluster, accumulate) -> str:
    """Exercise 3: one optimizer step from 4 micro-batches per rank, with one all-reduce, equal to the averaged
    accumulated gradient."""
    cluster.run(on_every_rank, _accumulation_trial, accumulate, seconds=10.0)
    failed = _errors(cluster.results)
    if failed:
        return f"wrong: {failed}"
    results = [value for _, value in cluster.results]
    counts = [r["allreduces"] for r in results]
    if counts[0] > 1 and results[0]["no_sync_entered"] and not results[0]["forwards_in_no_sync"]:
        return (f"wrong: {counts[0]} all-reduces although you entered no_sync(): every forward ran outside it. DDP "
                "decides in forward whether the next backward all-reduces, so `with model.no_sync():` must hold the "
                "forward (model(X) and the loss) as well as backward() of every micro-batch but the last")
    if counts[0] > 1:
        return (f"wrong: {counts[0]} all-reduces for one optimizer step over {MICRO_BATCHES} micro-batches: DDP "
                "averages the gradients after every backward; run every backward but the last inside "
                "`with model.no_sync():`, so the gradients add up locally and are all-reduced once")
    if counts[0] == 0:
        return ("wrong: no all-reduce at all, so every replica stepped with its own gradients and they drift apart: "
                "the last micro-batch's backward must run outside no_sync()")
    if any(not torch.equal(r["weight"], results[0]["weight"]) for r in results):
        return "wrong: one all-reduce, but the replicas differ after the step: every rank must call backward equally"
    expected = _accumulation_reference(len(results))
    if not torch.allclose(results[0]["weight"], expected, atol=1e-6):
        return ("wrong: one all-reduce, but not the step of the averaged accumulated gradient: divide each "
                "micro-batch's loss by the number of micro-batches, and zero_grad/step once around the loop")
    return f"correct: one all-reduce for {MICRO_BATCHES} micro-batches, and the step of their averaged gradient"


def solution_accumulate(model, optimizer, micro_batches):
    from contextlib import nullcontext
    import torch.nn.functional as F
    optimizer.zero_grad()
    for i, (X, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with nullcontext() if last else model.no_sync():  # no all-reduce until the last micro-batch
            loss = F.cross_entropy(model(X), y) / len(micro_batches)
            loss.backward()
    optimizer.step()


# Exercise 4: metrics averaged over the ranks
def _shard_losses(rank: int) -> tuple:
    """(loss sum, sample count) of rank r's shard: rank 0 read 4 samples with mean 1.5, rank 1 2 with mean 3."""
    return [(6.0, 4), (6.0, 2)][rank % 2]


def _epoch_loss_trial(epoch_loss):
    return float(epoch_loss(*_shard_losses(dist.get_rank())))


def check_epoch_loss(cluster, epoch_loss) -> str:
    """Exercise 4: rank 0's loss sum 6 over 4 samples, rank 1's 6 over 2; every rank must report 12 / 6 = 2."""
    cluster.run(on_every_rank, _epoch_loss_trial, epoch_loss, seconds=10.0)
    failed = _errors(cluster.results)
    if failed:
        hint = (": this torch's gloo has no ReduceOp.AVG (NCCL has), and the mean over all samples needs the sums "
                "anyway: all_reduce the loss sum and the count, then divide" if "AVG" in failed.upper() else "")
        return f"wrong: {failed}{hint}"
    values = [value for _, value in cluster.results]
    sums = [_shard_losses(r) for r in range(len(values))]
    expected = sum(s for s, _ in sums) / sum(c for _, c in sums)
    mean_of_means = sum(s / c for s, c in sums) / len(sums)
    total = sum(s for s, _ in sums)
    if len(values) > 1 and all(abs(v - total / c) < 1e-9 for v, (_, c) in zip(values, sums)):
        return (f"wrong: the ranks report {', '.join(f'{v:g}' for v in values)}: the loss sum is summed over the "
                f"ranks, but each divides by its own count; all_reduce the count too, then divide: {expected:g}")
    if len(set(values)) > 1:
        return (f"wrong: the ranks report {', '.join(f'{v:g}' for v in values)}: each reports the mean of its own "
                f"shard; all_reduce the loss sum and the sample count, then divide, so every rank reports {expected:g}")
    if abs(values[0] - mean_of_means) < 1e-9:
        return (f"wrong: every rank reports {values[0]:g}, the mean of the ranks' means; rank 1 read fewer samples "
                f"(a shorter last batch), so sum the losses and the counts separately and divide: {expected:g}")
    if abs(values[0] - expected) > 1e-9:
        return f"wrong: every rank reports {values[0]:g}; the mean over all samples is {expected:g}"
    return f"correct: every rank reports {expected:g}, the mean over all {sum(c for _, c in sums)} samples"


def solution_epoch_loss(loss_sum, count):
    import torch
    import torch.distributed as dist
    sums = torch.tensor([loss_sum, count], dtype=torch.float64)
    dist.all_reduce(sums)  # the sums over every rank, on every rank
    return (sums[0] / sums[1]).item()


# Capstone: notebooks/capstone/train_plain.py turned into DDP (solution: examples/ddp_standalone.py)
CAPSTONE_ACCURACY = 0.85
PLAIN_LR = 0.05  # train_plain.py's --lr default, for one process (tests/test_exercises_03.py checks it)


def _probe_capstone(script: str, world_size: int, timeout: float = 240) -> list[dict] | str:
    """Launch the capstone script again under torchrun, watched by capstone_probe (nothing in it changes), into a
    scratch folder; returns every rank's report, or the reason the launch failed."""
    import json
    import os
    import re
    import subprocess
    import sys
    import tempfile
    with tempfile.TemporaryDirectory(prefix="tutorial-capstone-") as scratch:
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
        env.update(CAPSTONE_PROBE_DIR=scratch, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        # Two epochs show all it watches (a second epoch's order, the writers, the lr) in less than half the time.
        epochs = ["--epochs", "2"] if "--epochs" in Path(script).read_text() else []
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size),
               "-m", "tutorial.lessons.capstone_probe", os.path.abspath(script), "--out", os.path.join(scratch, "out"),
               *epochs]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=scratch)
        except subprocess.TimeoutExpired:
            return f"it did not finish within {timeout:.0f} s"
        reports = []
        for rank in range(world_size):
            path = os.path.join(scratch, f"rank{rank}.json")
            if not os.path.exists(path):
                lines = (proc.stdout + proc.stderr).splitlines()
                errors = [line for line in lines if re.match(r"\s*\w+(Error|Exception|Interrupt): ", line)]
                return (f"exit code {proc.returncode}, rank {rank} never finished: "
                        f"{first_line(errors[0] if errors else (lines or [''])[-1])}")
            with open(path) as f:
                reports.append(json.load(f))
            if "error" in reports[-1]:
                return f"exit code {proc.returncode}, rank {rank} raised {first_line(reports[-1]['error'])}"
        return reports


def _capstone_behaviour(reports: list[dict], world_size: int) -> str | None:
    """What result.json cannot show: which ranks wrote the files, whether the shuffle changes every epoch, and the
    learning rate. None when all is right, else the verdict."""
    writers = sorted(r["rank"] for r in reports if {"result.json", "model.pt"} & set(r["writes"]))
    if writers != [0]:
        who = "no rank" if not writers else "ranks " + ", ".join(map(str, writers))
        return (f"wrong: {who} wrote model.pt or result.json: the replicas are identical, so rank 0 alone writes "
                "(`if rank == 0:`); several writers on one path can interleave and corrupt the files")
    for r in reports:
        for sampler in r["samplers"].values():
            orders = sampler["orders"]
            if sampler["shuffle"] and len(orders) > 1 and all(o == orders[0] for o in orders):
                return (f"wrong: rank {r['rank']} read its samples in the same order in all {len(orders)} epochs: "
                        "the DistributedSampler shuffles with seed + epoch, so call sampler.set_epoch(epoch) at the "
                        "start of every epoch")
    lrs = reports[0]["lrs"]
    if lrs and abs(lrs[0] - PLAIN_LR) < 1e-12 and world_size > 1:
        return (f"wrong: the optimizer's learning rate is {lrs[0]:g}, the single process's: the global batch is "
                f"{world_size}x larger, so there are {world_size}x fewer steps per epoch; scale the learning rate by "
                f"the world size: lr = args.lr * world_size = {PLAIN_LR * world_size:g}")
    return None


def check_capstone(out: str, world_size: int = 2, script: str | None = None) -> str:
    """The result.json the capstone script wrote in out, launched with torchrun --nproc_per_node world_size; then
    the script (default out/train_ddp.py, where the notebook keeps the learner's copy) is launched once more,
    watched, for what result.json cannot show: one writer, a new shuffle every epoch, a scaled learning rate."""
    import json
    import math
    import os
    path = Path(out, "result.json")
    if not path.exists():
        return f"wrong: no {path}: the launch failed or the script wrote elsewhere; read the launch's output above"
    r = json.loads(path.read_text())
    if r.get("world_size") == 1:
        return ("wrong: result.json says world size 1: torchrun started 2 copies of a single-process script, each "
                "training alone on all the data. Join the process group (dist.init_process_group('gloo')) and "
                "report dist.get_world_size()")
    if r.get("world_size") != world_size:
        return f"wrong: world size {r.get('world_size')}, expected {world_size} (--nproc_per_node {world_size})"
    sums, seen = r.get("checksums", []), r.get("samples_seen", [])
    if len(sums) != world_size or len(seen) != world_size:
        return (f"wrong: result.json has {len(sums)} checksums and {len(seen)} sample counts for world size "
                f"{world_size}: gather every rank's with dist.all_gather_object")
    if len(set(sums)) > 1:
        differ = ", ".join(str(rank) for rank, s in enumerate(sums) if s != sums[0])
        return (f"wrong: the replicas differ (rank {differ} against rank 0): wrap the model in DDP(model), so that "
                "backward averages the gradients and every rank takes the same step")
    full = r["epochs"] * r["train_size"]
    if any(s >= full for s in seen):
        return (f"wrong: each rank trained on all {r['train_size']} samples per epoch: give the DataLoader a "
                "DistributedSampler(train_set) (instead of shuffle=True) and call set_epoch(epoch) every epoch")
    share = r["epochs"] * math.ceil(r["train_size"] / world_size)
    if any(s != share for s in seen):
        return f"wrong: the ranks trained on {seen} samples; with a DistributedSampler each reads {share}"
    script = script or os.path.join(out, "train_ddp.py")
    if not os.path.exists(script):
        return f"wrong: no script at {script} to check how it trains"
    reports = _probe_capstone(script, world_size)
    if isinstance(reports, str):
        return f"wrong: launched again by the checker, {script} failed ({reports})"
    behaviour = _capstone_behaviour(reports, world_size)
    if behaviour:
        return behaviour
    if r["test_accuracy"] < CAPSTONE_ACCURACY:
        return (f"wrong: test accuracy {r['test_accuracy']:.3f} < {CAPSTONE_ACCURACY}: with {world_size} ranks there "
                f"are {world_size}x fewer steps per epoch; scale the learning rate by the world size")
    return (f"correct: {world_size} ranks, identical replicas, each rank read 1/{world_size} of "
            f"the data, test accuracy {r['test_accuracy']:.3f} >= {CAPSTONE_ACCURACY}")
