"""Stage 11: 2D parallel, FSDP over one mesh dim x tensor parallel over the other (notebook 11).

train_tp.py plus the lines tagged "# 2D:". On 4 ranks, a 2 x 2 mesh: ranks (0, 1) and (2, 3) are
tensor-parallel pairs ("tp", the inner dimension: on a GPU node, GPUs joined by NVLink, since TP
talks in every layer), and ranks (0, 2) and (1, 3) are data-parallel pairs ("dp", the outer one:
across nodes), each pair reading its half of the global batch and FSDP sharding the tensor-parallel
slices once more between them. Launch it with any of:

    torchrun --standalone --nproc_per_node 4 -m tutorial.train_2d --tp 2 --out runs/2d
    mpirun -np 4 python -m tutorial.train_2d --tp 2                     (also mpiexec/PALS, srun)
    tutorial.launch.engines.start(n=4).run(tutorial.train_2d.main, cfg) (engines, in a notebook)

This is how models too large for one GPU train on many (torchtitan, Megatron-LM): tensor parallel
inside a node, data parallel (FSDP, ZeRO-3) across nodes, and pipeline parallel as a third
dimension when even that is not enough.
"""
from __future__ import annotations

import contextlib  # TP: a null context for the steps whose collectives are not counted
import time

import torch
import torch.distributed as dist  # 2D: the loss averaged over the data-parallel ranks
from torch.distributed.device_mesh import init_device_mesh  # TP
from torch.distributed.fsdp import fully_shard  # 2D
from torch.distributed.tensor.debug import CommDebugMode  # TP: counts DTensor's collectives
from torch.distributed.tensor.parallel import parallelize_module  # 2D: the plan is train_tp's

from .core.distributed import init_process_group, pick_device, teardown, world_from_env  # TP
from .core.corpus import CharCorpus, batches
from .core.gpt import GPT, loss_fn, parameter_bytes
from .core.layout import Layout, check_layout  # TP: the checks 12's planner makes too
from .core.parallel_config import (ParallelConfig, check_stopped, log_step, parse_parallel_args,
                                    save_run)
from .core.process import run_main
# 2D: train_tp's plan, evaluation and gathering, unchanged
from .train_tp import evaluate, full_state, tp_plan

STAGE = "2d"  # 2D


def setup(cfg: ParallelConfig):
    """The device."""  # TP: (device, world, mesh, created): who we are, on which mesh
    # TP: rank, local_rank, world_size from torchrun, MPI, Slurm or the engines; one GPU per process
    world = world_from_env()
    device = pick_device(world.local_rank, world.local_world_size)  # TP
    # 2D: a whole mesh, equal parts of the batch over dp, TP over tp ranks (not all of them)
    dp = max(world.world_size // cfg.tp, 1)
    check_layout(Layout(dp=dp, tp=cfg.tp), cfg.n_heads, cfg.n_layers,  # 2D
                 context=cfg.context if cfg.sequence_parallel else None,
                 batch=cfg.batch_size, ranks=world.world_size)
    created = init_process_group(world, device, cfg.timeout, cfg.backend)  # TP: nccl or gloo
    # 2D: rank = dp_index x tp + tp_index: consecutive ranks (the same node's GPUs) form a
    # tensor-parallel group
    mesh = init_device_mesh(device.type, (dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    return device, world, mesh, created  # TP


def build(cfg: ParallelConfig, device: torch.device, mesh):  # TP: and the mesh
    """The text, model and optimizer: (model, optimizer, corpus)."""
    corpus = CharCorpus()
    model = GPT(cfg.gpt(), seed=cfg.seed).to(device)  # TP: the whole model, the same on every rank
    # TP: then each rank keeps its slices: its parameters become DTensors, sharded or replicated
    parallelize_module(model, mesh["tp"], tp_plan(model, cfg.sequence_parallel))  # 2D: "tp" only
    # 2D: then FSDP over "dp": each slice sharded once more, per block, and the root (the
    # embedding, the final norm and the head)
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh["dp"])  # 2D
    fully_shard(model, mesh=mesh["dp"])  # 2D
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # TP: each rank steps its slices
    return model, optimizer, corpus


def train_step(model, optimizer, X, y, mesh) -> torch.Tensor:  # 2D: and the mesh
    """One optimizer step on the batch; its loss, left on the device (a read waits for the GPU)."""
    optimizer.zero_grad()
    loss = loss_fn(model(X), y)  # TP: every rank has the whole logits (the head's Replicate())
    # 2D: FSDP reduce-scatters the gradients over "dp", averaging the two halves of the batch
    loss.backward()
    optimizer.step()
    # 2D: the loss over the whole global batch, all-reduced over "dp" (read at the run's end)
    loss = loss.detach()
    dist.all_reduce(loss, group=mesh.get_group("dp"))  # 2D
    return loss / mesh["dp"].size()  # 2D


def fit(cfg, device, world, model, optimizer, corpus, mesh) -> dict:  # 2D: and the mesh
    """cfg.steps steps; the run's metrics, and its record in cfg.out (metrics.json, model.pt)."""
    losses, start = [], time.perf_counter()
    comms = CommDebugMode()  # TP: the first step's collectives, counted by type
    batched = batches(corpus, cfg.batch_size, cfg.context, cfg.steps, seed=cfg.seed)
    for step, (X, y) in enumerate(batched, 1):
        # 2D: this data-parallel group's part of the global batch
        dp, part = mesh["dp"].get_local_rank(), cfg.batch_size // mesh["dp"].size()
        rows = slice(dp * part, (dp + 1) * part)  # 2D
        X, y = X[rows].to(device), y[rows].to(device)  # 2D
        with comms if not losses else contextlib.nullcontext():  # TP: the first step only
            losses.append(train_step(model, optimizer, X, y, mesh))  # 2D: and the mesh
        if log_step(cfg, step, losses[-1]):  # read at log steps: a NaN raises, a SIGTERM stops
            break
    losses = torch.stack(losses).tolist()
    metrics = dict(strategy=STAGE, mesh=dict(dp=mesh["dp"].size(), tp=cfg.tp),  # 2D
                   world_size=world.world_size, device=str(device), steps=len(losses),
                   losses=losses, seconds=time.perf_counter() - start,
                   test_loss=evaluate(cfg, model, corpus, device),
                   parameter_bytes=parameter_bytes(model),  # TP: this rank's slices only
                   collectives={str(op).split(".")[-1]: n  # TP: the first step's collectives
                                for op, n in comms.get_comm_counts().items()})
    state = full_state(model)  # TP: a collective: every rank gathers
    if cfg.out and world.is_main_process:  # TP: one writer
        save_run(cfg.out, state, metrics)
    check_stopped(cfg, len(losses))
    return metrics


def main(cfg: ParallelConfig, build=build) -> dict:
    """Train cfg; returns the run's metrics. main sets up, builds and hands the model to fit. build
    is a hook for lessons, as in the image trainers: a function with build's arguments and results,
    so a lesson trains a model it changed exactly as this trainer trains."""
    device, world, mesh, created = setup(cfg)  # TP: and who we are, on which mesh
    try:  # TP: leave the process group on every exit path
        model, optimizer, corpus = build(cfg, device, mesh)  # TP
        return fit(cfg, device, world, model, optimizer, corpus, mesh)  # 2D: and the mesh
    finally:  # TP
        teardown(created)  # TP


if __name__ == "__main__":
    run_main(main, parse_parallel_args("Train a small GPT, FSDP x TP.", stage=STAGE))  # 2D
