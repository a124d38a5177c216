"""Stage 11: tensor parallel, every rank holds a slice of every layer of a small GPT (notebook 11_model_parallelism).

A one-process GPT loop plus the lines tagged "# TP:". Launch it with any of:

    torchrun --standalone --nproc_per_node 2 -m tutorial.train_tp --steps 20 --out runs/tp
    mpirun -np 2 python -m tutorial.train_tp                              (also mpiexec/PALS, srun)
    tutorial.launch.engines.start(n=2).run(tutorial.train_tp.main, cfg)   (ipyparallel engines, from a notebook)

Data parallelism copies the model; tensor parallelism (Megatron-LM, Shoeybi et al. 2019) cuts each matrix product.
Attention's q, k and v are cut column-wise (each rank computes n_heads / tp whole heads), its output projection
row-wise (each rank multiplies its heads' columns and the partial sums are added across ranks); the MLP likewise,
its first layer column-wise and its second row-wise, so each block needs only one collective forward and one
backward. Sequence parallelism (Korthikanti et al. 2022) also splits the LayerNorms and the residual stream along the
sequence between those layers: the all-reduce becomes a reduce-scatter plus an all-gather, and activations shrink.
Every rank sees the same global batch; the result equals one process's at that batch.
"""
from __future__ import annotations

import contextlib  # TP: a null context for the steps whose collectives are not counted
import time

import torch
from torch.distributed.device_mesh import init_device_mesh  # TP
from torch.distributed.tensor import Replicate, Shard  # TP
from torch.distributed.tensor.debug import CommDebugMode  # TP: counts the collectives DTensor issues
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,  # TP
                                               PrepareModuleOutput, RowwiseParallel,  # TP
                                               SequenceParallel, parallelize_module)  # TP

from .core.config import ConfigError  # TP
from .core.distributed import init_process_group, pick_device, teardown, world_from_env  # TP
from .core.corpus import CharCorpus, batches
from .core.gpt import GPT, loss_fn, parameter_bytes
from .core.parallel_config import ParallelConfig, parse_parallel_args, save_run
from .core.process import run_main


def setup(cfg: ParallelConfig):
    world = world_from_env()  # TP: rank, local_rank, world_size from torchrun, MPI, Slurm or the engines
    device = pick_device(world.local_rank, world.local_world_size)  # TP: one GPU per process, by local rank
    if cfg.n_heads % world.world_size or cfg.context % world.world_size:  # TP: whole heads, equal sequence slices
        raise ConfigError(f"n-heads {cfg.n_heads} and context {cfg.context} must be multiples of the "  # TP
                          f"{world.world_size} tensor-parallel ranks")
    created = init_process_group(world, device, cfg.timeout, cfg.backend)  # TP: nccl on GPUs, gloo on CPUs
    mesh = init_device_mesh(device.type, (world.world_size,), mesh_dim_names=("tp",))  # TP: one dim, all ranks
    return device, world, mesh, created  # TP


# TP: which layer is cut which way
def tp_plan(model: GPT, sequence_parallel: bool = True) -> dict:
    """The plan parallelize_module applies: module name -> how its weights and its inputs/outputs are laid out."""
    plan = {"head": ColwiseParallel(output_layouts=Replicate())}  # TP: vocab split, whole logits gathered on all
    for i in model.blocks:
        plan.update({
            f"blocks.{i}.attn.q": ColwiseParallel(),  # TP: output columns = this rank's heads
            f"blocks.{i}.attn.k": ColwiseParallel(),  # TP
            f"blocks.{i}.attn.v": ColwiseParallel(),  # TP
            f"blocks.{i}.attn.out": RowwiseParallel(),  # TP: partial sums over the heads, all-reduced
            f"blocks.{i}.mlp.fc": ColwiseParallel(),  # TP: hidden units split, GELU works on each slice alone
            f"blocks.{i}.mlp.proj": RowwiseParallel(),  # TP: partial sums, all-reduced
        })
    if not sequence_parallel:
        return plan
    # TP: sequence parallel: between the cut layers the residual stream is (B, T/tp, C) on each rank, the norms
    # TP: work on their slice of the sequence, and each all-reduce becomes a reduce-scatter (out, proj) plus an
    # TP: all-gather (the attention's and the MLP's input): the same bytes moved, 1/tp of the activations kept.
    seq = Shard(1)
    # TP: the embedding stays whole (it is small); its output is cut along the sequence, with no communication
    plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq)
    plan["norm"] = SequenceParallel()
    plan["head"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    for i in model.blocks:
        for part in ("attn", "mlp"):
            plan[f"blocks.{i}.{part}_norm"] = SequenceParallel()  # TP: a LayerNorm per sequence slice
            plan[f"blocks.{i}.{part}"] = PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate())
        plan[f"blocks.{i}.attn.out"] = RowwiseParallel(output_layouts=seq)  # TP: reduce-scatter
        plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel(output_layouts=seq)  # TP
    return plan


def build(cfg: ParallelConfig, device: torch.device, mesh):  # TP: and the mesh
    corpus = CharCorpus()
    model = GPT(cfg.gpt(), seed=cfg.seed).to(device)  # TP: the whole model, the same on every rank (same seed) ...
    # TP: ... then each rank keeps its slices: its parameters become DTensors, sharded or replicated over the mesh
    parallelize_module(model, mesh, tp_plan(model, cfg.sequence_parallel))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # TP: each rank updates its own slices
    return model, optimizer, corpus


def train_step(model, optimizer, X, y) -> float:
    loss = loss_fn(model(X), y)  # TP: every rank has the whole logits (head's output_layouts=Replicate())
    optimizer.zero_grad()
    loss.backward()  # TP: replicated weights (norms, embedding) get their gradient summed over the sequence slices
    optimizer.step()
    return loss.item()


@torch.no_grad()
def evaluate(cfg, model, corpus, device) -> float:
    """The mean loss over 4 fixed batches no step trained on (another seed)."""
    model.eval()
    losses = [loss_fn(model(X.to(device)), y.to(device)).item()
              for X, y in batches(corpus, cfg.batch_size, cfg.context, 4, seed=cfg.seed + 10_000)]
    model.train()
    return sum(losses) / len(losses)


def full_state(model) -> dict:
    """The whole model's weights, on the CPU: for the run's record."""
    # TP: a DTensor's full_tensor() gathers its slices from every rank, so every rank must call this
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
            for k, v in model.state_dict().items()}


def main(cfg: ParallelConfig) -> dict:
    device, world, mesh, created = setup(cfg)  # TP: and who we are, on which mesh
    try:  # TP: leave the process group on every exit path
        model, optimizer, corpus = build(cfg, device, mesh)  # TP
        return train(cfg, device, world, model, optimizer, corpus)  # TP
    finally:  # TP
        teardown(created)  # TP


def train(cfg, device, world, model, optimizer, corpus) -> dict:  # TP: world
    losses, start = [], time.perf_counter()
    comms = CommDebugMode()  # TP: the first step's collectives, counted by type
    for step, (X, y) in enumerate(batches(corpus, cfg.batch_size, cfg.context, cfg.steps, seed=cfg.seed)):  # TP
        X, y = X.to(device), y.to(device)
        with comms if step == 0 else contextlib.nullcontext():  # TP
            losses.append(train_step(model, optimizer, X, y))  # TP: in the with
    metrics = dict(strategy="tp", world_size=world.world_size, device=str(device), steps=cfg.steps,  # TP
                   losses=losses, seconds=time.perf_counter() - start,
                   test_loss=evaluate(cfg, model, corpus, device),
                   parameter_bytes=parameter_bytes(model),  # TP: this rank's slices only
                   collectives={str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()})  # TP
    state = full_state(model)  # TP: a collective: every rank gathers
    if cfg.out and world.is_main_process:  # TP: one writer
        save_run(cfg.out, state, metrics)
    return metrics

if __name__ == "__main__":
    run_main(main, parse_parallel_args("Train a small GPT with tensor parallelism (DTensor).", stage="tp"))  # TP
