"""Stage 11: 2D parallel, FSDP over one mesh dimension x tensor parallel over the other (11_model_parallelism).

train_tp.py plus the lines tagged "# 2D:". On 4 ranks, a 2 x 2 mesh: ranks (0, 1) and (2, 3) are tensor-parallel
pairs ("tp", the inner dimension: on a GPU node, GPUs joined by NVLink, since TP talks in every layer), and ranks
(0, 2) and (1, 3) are data-parallel pairs ("dp", the outer one: across nodes), each pair reading its half of the
global batch and FSDP sharding the tensor-parallel slices once more between them. Launch it with any of:

    torchrun --standalone --nproc_per_node 4 -m tutorial.train_2d --tp 2 --out runs/2d
    mpirun -np 4 python -m tutorial.train_2d --tp 2                     (also mpiexec/PALS, srun)
    tutorial.launch.engines.start(n=4).run(tutorial.train_2d.main, cfg)  (ipyparallel engines, from a notebook)

This is how models too large for one GPU train on many (torchtitan, Megatron-LM): tensor parallel inside a node,
data parallel (FSDP, ZeRO-3) across nodes, and pipeline parallel as a third dimension when even that is not enough.
"""
from __future__ import annotations

import contextlib  # TP: a null context for the steps whose collectives are not counted
import time

import torch
import torch.distributed as dist  # 2D: the loss averaged over the data-parallel ranks
from torch.distributed.device_mesh import init_device_mesh  # TP
from torch.distributed.fsdp import fully_shard  # 2D
from torch.distributed.tensor.debug import CommDebugMode  # TP: counts the collectives DTensor issues
from torch.distributed.tensor.parallel import parallelize_module  # 2D: the TP plan's layouts live in train_tp

from .core.config import ConfigError  # TP
from .core.distributed import init_process_group, pick_device, teardown, world_from_env  # TP
from .core.corpus import CharCorpus, batches
from .core.gpt import GPT, loss_fn, parameter_bytes
from .core.parallel_config import ParallelConfig, parse_parallel_args, save_run
from .core.process import run_main
from .train_tp import evaluate, full_state, tp_plan  # 2D: train_tp's plan, evaluation and gathering, unchanged


def setup(cfg: ParallelConfig):
    world = world_from_env()  # TP: rank, local_rank, world_size from torchrun, MPI, Slurm or the engines
    device = pick_device(world.local_rank, world.local_world_size)  # TP: one GPU per process, by local rank
    if world.world_size % cfg.tp or cfg.batch_size % (world.world_size // cfg.tp):  # 2D: a whole mesh, equal halves
        raise ConfigError(f"{world.world_size} ranks cannot form a (dp, tp={cfg.tp}) mesh with batch-size "  # 2D
                          f"{cfg.batch_size} split over dp: tp must divide the ranks and dp the batch")
    dp = world.world_size // cfg.tp  # 2D
    if cfg.n_heads % cfg.tp or cfg.context % cfg.tp:  # 2D: TP over tp ranks, not all of them
        raise ConfigError(f"n-heads {cfg.n_heads} and context {cfg.context} must be multiples of the "  # 2D
                          f"{cfg.tp} tensor-parallel ranks")
    created = init_process_group(world, device, cfg.timeout, cfg.backend)  # TP: nccl on GPUs, gloo on CPUs
    # 2D: rank = dp_index x tp + tp_index: consecutive ranks (the same node's GPUs) form a tensor-parallel group
    mesh = init_device_mesh(device.type, (dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    return device, world, mesh, created


def build(cfg: ParallelConfig, device: torch.device, mesh):  # TP: and the mesh
    corpus = CharCorpus()
    model = GPT(cfg.gpt(), seed=cfg.seed).to(device)  # TP: the whole model, the same on every rank (same seed) ...
    # TP: ... then each rank keeps its slices: its parameters become DTensors, sharded or replicated over the mesh
    parallelize_module(model, mesh["tp"], tp_plan(model, cfg.sequence_parallel))  # 2D: over the "tp" dim only
    for block in model.blocks.values():  # 2D: then FSDP over "dp": each slice sharded once more, per block
        fully_shard(block, mesh=mesh["dp"])  # 2D
    fully_shard(model, mesh=mesh["dp"])  # 2D: the root holds the embedding, the final norm and the head
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # TP: each rank updates its own slices
    return model, optimizer, corpus


def train_step(model, optimizer, X, y, mesh) -> float:  # 2D: and the mesh
    loss = loss_fn(model(X), y)  # TP: every rank has the whole logits (head's output_layouts=Replicate())
    optimizer.zero_grad()
    loss.backward()  # 2D: FSDP reduce-scatters the gradients over "dp", averaging the two halves of the batch
    optimizer.step()
    loss = loss.detach()  # 2D
    dist.all_reduce(loss, group=mesh.get_group("dp"))  # 2D: the loss over the whole global batch
    return loss.item() / mesh["dp"].size()  # 2D


def main(cfg: ParallelConfig) -> dict:
    device, world, mesh, created = setup(cfg)  # TP: and who we are, on which mesh
    try:  # TP: leave the process group on every exit path
        model, optimizer, corpus = build(cfg, device, mesh)  # TP
        return train(cfg, device, world, model, optimizer, corpus, mesh)  # 2D: and the mesh
    finally:  # TP
        teardown(created)  # TP


def train(cfg, device, world, model, optimizer, corpus, mesh) -> dict:  # 2D: and the mesh
    losses, start = [], time.perf_counter()
    comms = CommDebugMode()  # TP: the first step's collectives, counted by type
    for step, (X, y) in enumerate(batches(corpus, cfg.batch_size, cfg.context, cfg.steps, seed=cfg.seed)):  # TP
        dp, part = mesh["dp"].get_local_rank(), cfg.batch_size // mesh["dp"].size()  # 2D: this group's half
        X, y = X[dp * part:(dp + 1) * part].to(device), y[dp * part:(dp + 1) * part].to(device)  # 2D
        with comms if step == 0 else contextlib.nullcontext():  # TP
            losses.append(train_step(model, optimizer, X, y, mesh))  # 2D: and the mesh
    metrics = dict(strategy="2d", mesh=dict(dp=mesh["dp"].size(), tp=cfg.tp),  # 2D
                   world_size=world.world_size, device=str(device), steps=cfg.steps,
                   losses=losses, seconds=time.perf_counter() - start,
                   test_loss=evaluate(cfg, model, corpus, device),
                   parameter_bytes=parameter_bytes(model),  # TP: this rank's slices only
                   collectives={str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()})  # TP
    state = full_state(model)  # TP: a collective: every rank gathers
    if cfg.out and world.is_main_process:  # TP: one writer
        save_run(cfg.out, state, metrics)
    return metrics

if __name__ == "__main__":
    run_main(main, parse_parallel_args("Train a small GPT with FSDP x tensor parallel.", stage="2d"))  # 2D
