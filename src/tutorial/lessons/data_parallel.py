"""02_data_parallel: one DataParallel step spelled out by hand, its picture, DataParallel's throughput, and the
exercises' checkers and solutions (combining replica gradients; saving a wrapped model)."""
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
from .ranks import describe


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
        # the OS thread id: Python's get_ident() of a finished thread is handed to the next one at once
        threads_seen[i] = (os.getpid(), threading.get_native_id())
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


# ----------------------------------------------------------------------------------------- 02: the picture
def draw_dp_step(slices: list[int], ax=None):
    """One DataParallel step as a picture: the batch scattered in `slices` (real slice sizes), the model replicated,
    the replicas run in threads, the outputs gathered and the gradients summed on GPU 0."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    n = len(slices)
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.5 + 0.9 * n))
    stages = ["batch\non GPU 0", "scatter", "replicate", "parallel_apply", "gather\non GPU 0", "backward:\nsum grads"]
    colors = ["#dddddd", "#9ecae1", "#fdae6b", "#a1d99b", "#dddddd", "#fc9272"]
    start = [sum(slices[:i]) for i in range(n)]
    total = sum(slices)

    def box(x, y, text, color):
        ax.add_patch(FancyBboxPatch((x - 0.42, y - 0.33), 0.84, 0.66, boxstyle="round,pad=0.02", fc=color, ec="k"))
        ax.text(x, y, text, ha="center", va="center", fontsize=8)

    for col, (stage, color) in enumerate(zip(stages, colors)):
        ax.text(col, n - 0.35, stage, ha="center", va="bottom", fontsize=9, weight="bold")
        for gpu in range(n):
            y = n - 1 - gpu
            if col in (0, 4, 5) and gpu > 0:
                continue
            text = {0: f"X: {total} rows\nweights",
                    1: f"rows {start[gpu]}-{start[gpu] + slices[gpu] - 1}\n({slices[gpu]})",
                    2: "copy of the\nweights",
                    3: f"thread {gpu}\nforward",
                    4: f"{total} outputs\nloss",
                    5: "grad = sum of\nreplica grads"}[col]
            box(col, y, text, color)
            if col in (1, 2, 3):
                src = n - 1 if col == 1 else y
                ax.annotate("", (col - 0.43, y), (col - 0.57, src), arrowprops=dict(arrowstyle="->"))
            if col == 4:
                for g in range(n):
                    ax.annotate("", (col - 0.43, y), (col - 0.57, n - 1 - g), arrowprops=dict(arrowstyle="->"))
            if col == 5:
                ax.annotate("", (col - 0.43, y), (col - 0.57, y), arrowprops=dict(arrowstyle="->"))
    for gpu in range(n):
        ax.text(-0.75, n - 1 - gpu, f"GPU {gpu}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.3, len(stages) - 0.5)
    ax.set_ylim(-0.6, n + 0.1)
    ax.axis("off")
    ax.set_title(f"one nn.DataParallel step, batch of {total} over {n} GPUs: every arrow is a copy or a thread")
    return ax.figure


# -------------------------------------------------------------------------------------------- 02: exercises
def _exercise_problem(batch: int = 32, seed: int = 0):
    """A BatchNorm-free model and a batch, so that combining replicas' gradients correctly gives the full-batch one."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.randn(batch, 10, generator=gen), torch.randint(0, 4, (batch,), generator=gen)


def check_replica_gradient(data_parallel_gradient) -> str:
    """Exercise 1: does data_parallel_gradient(model, X, y, replicas) return the full-batch gradient, with 3 replicas
    on a batch of 32 (slices 11, 11, 10)?"""
    model, X, y = _exercise_problem()
    full = batch_gradient(model, X, y)
    try:
        got = data_parallel_gradient(copy.deepcopy(model), X, y, 3)
    except Exception as exc:  # noqa: BLE001 -- the learner's code; report it
        return f"wrong: it raised {describe(exc)}"
    got = torch.as_tensor(got).reshape(-1)
    if got.shape != full.shape:
        return f"wrong: {got.numel()} gradient values, the model has {full.numel()} parameters"
    if torch.allclose(got, full, atol=1e-6):
        return "correct: the replicas' gradients combine to the full-batch gradient (slices 11, 11, 10)"
    ratio = (got.norm() / full.norm()).item()
    slices = [len(x) for x in X.chunk(3)]
    if abs(ratio - 3) < 0.3:
        return (f"wrong: the gradient is {ratio:.2f}x the full-batch gradient (slices {slices}): each replica's loss "
                "is a mean over its slice, so summing 3 replicas' gradients counts the batch 3 times; weight replica "
                "i by len(slice i) / len(X)")
    worst = ((got - full).abs().max() / full.abs().max()).item()
    return (f"wrong: off by up to {worst:.1%} of the largest gradient (slices {slices}): dividing the sum by the "
            "number of replicas weights the 10-sample slice like the 11-sample ones; weight replica i by "
            "len(slice i) / len(X)")


def solution_data_parallel_gradient(model, X, y, replicas=3):
    copies = [copy.deepcopy(model) for _ in range(replicas)]               # replicate
    grads = []
    for replica, xs, ys in zip(copies, X.chunk(replicas), y.chunk(replicas)):   # scatter
        F.cross_entropy(replica(xs), ys).backward()                         # each replica: mean loss over its slice
        grads.append(torch.cat([p.grad.reshape(-1) for p in replica.parameters()]) * len(xs) / len(X))
    return sum(grads)                                                       # reduce: a weighted sum = full batch


def check_train_and_save(train_and_save) -> str:
    """Exercise 2: can a plain (unwrapped) model load what train_and_save(model, X, y, path) wrote, strictly, and does
    it then hold the trained weights?"""
    import tempfile
    from pathlib import Path

    model, X, y = _exercise_problem()
    if torch.cuda.is_available():  # where nn.DataParallel will put the module: its inputs and targets must be there too
        device = torch.device("cuda", torch.cuda.current_device())
        model, X, y = model.to(device), X.to(device), y.to(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.pt"
        try:
            train_and_save(model, X, y, path)
        except Exception as exc:  # noqa: BLE001
            return f"wrong: it raised {describe(exc)}"
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 -- a pickled module, or no file at all
            return (f"wrong: the file is not a state_dict of tensors ({describe(exc, 100)}): saving the model object "
                    "pickles its class too, which the plain side may not have; save dp_model.module.state_dict()")
    if not isinstance(state, dict):
        return f"wrong: the file holds a {type(state).__name__}, not a state_dict: save dp_model.module.state_dict()"
    plain, _, _ = _exercise_problem()
    keys = list(state)
    try:
        plain.load_state_dict(state)
    except RuntimeError:
        if keys and all(k.startswith("module.") for k in keys):
            return (f"wrong: the saved keys are {keys[:2]}...: a DataParallel's state_dict names every parameter "
                    "'module.' + its name, so load_state_dict of a plain model fails (missing and unexpected keys); "
                    "save dp_model.module.state_dict() instead")
        return f"wrong: a plain model cannot load the file; its keys are {keys[:3]}..."
    trained = dict(model.named_parameters())
    if not all(torch.equal(v, trained[k].detach().cpu()) for k, v in plain.named_parameters()):
        return "wrong: the file loads, but holds other weights than the trained model's"
    return f"correct: a plain model loads the file strictly (keys {keys[:2]}...) and holds the trained weights"


def solution_train_and_save(model, X, y, path):
    dp_model = nn.DataParallel(model)
    optimizer = torch.optim.SGD(dp_model.parameters(), lr=0.1)
    F.cross_entropy(dp_model(X), y).backward()
    optimizer.step()
    torch.save(dp_model.module.state_dict(), path)      # the wrapped model's keys, without "module."
