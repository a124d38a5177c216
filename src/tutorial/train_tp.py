"""Stage 11: tensor parallel, every rank holds a slice of every layer of a small GPT (notebook 11).

A one-process GPT loop plus the lines tagged "# TP:". Launch it with any of:

    torchrun --standalone --nproc_per_node 2 -m tutorial.train_tp --steps 20 --out runs/tp
    mpirun -np 2 python -m tutorial.train_tp                            (also mpiexec/PALS, srun)
    tutorial.launch.engines.start(n=2).run(tutorial.train_tp.main, cfg) (engines, in a notebook)

Data parallelism copies the model; tensor parallelism (Megatron-LM, Shoeybi et al. 2019) cuts each
matrix product. Attention's q, k and v are cut column-wise (each rank computes n_heads / tp whole
heads), its output projection row-wise (each rank multiplies its heads' columns and the partial sums
are added across ranks); the MLP likewise, its first layer column-wise and its second row-wise, so
each block needs only one collective forward and one backward. Sequence parallelism (Korthikanti et
al. 2022) also splits the LayerNorms and the residual stream along the sequence between those
layers: the all-reduce becomes a reduce-scatter plus an all-gather, and activations shrink. Every
rank sees the same global batch; the result equals one process's at that batch.
"""
from __future__ import annotations

import contextlib  # TP: a null context for the steps whose collectives are not counted
import time

import torch
from torch.distributed.device_mesh import init_device_mesh  # TP
from torch.distributed.tensor import Replicate, Shard  # TP
from torch.distributed.tensor.debug import CommDebugMode  # TP: counts DTensor's collectives
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,  # TP
                                               PrepareModuleOutput, RowwiseParallel,  # TP
                                               SequenceParallel, parallelize_module)  # TP

from .core.distributed import init_process_group, pick_device, teardown, world_from_env  # TP
from .core.corpus import CharCorpus, batches
from .core.gpt import GPT, loss_fn, parameter_bytes
from .core.layout import Layout, check_layout  # TP: the checks 12's planner makes too
from .core.parallel_config import (ParallelConfig, check_stopped, log_step, parse_parallel_args,
                                    save_run)
from .core.process import run_main

STAGE = "tp"  # TP


def setup(cfg: ParallelConfig):
    """The device."""  # TP: (device, world, mesh, created): who we are, on which mesh
    # TP: rank, local_rank, world_size from torchrun, MPI, Slurm or the engines; one GPU per process
    world = world_from_env()
    device = pick_device(world.local_rank, world.local_world_size)  # TP
    # TP: whole heads and, with sequence parallel, equal slices of the sequence per rank
    check_layout(Layout(tp=world.world_size), cfg.n_heads, cfg.n_layers,
                 context=cfg.context if cfg.sequence_parallel else None)
    created = init_process_group(world, device, cfg.timeout, cfg.backend)  # TP: nccl or gloo
    # TP: one mesh dimension, all ranks
    mesh = init_device_mesh(device.type, (world.world_size,), mesh_dim_names=("tp",))
    return device, world, mesh, created  # TP


# TP: which layer is cut which way
def tp_plan(model: GPT, sequence_parallel: bool = True) -> dict:
    """The plan parallelize_module applies: module name -> how its weights and its inputs and
    outputs are laid out."""
    # TP: the head's output (the vocabulary) split, the whole logits gathered on every rank
    plan = {"head": ColwiseParallel(output_layouts=Replicate())}
    for i in model.blocks:  # TP
        plan.update({
            f"blocks.{i}.attn.q": ColwiseParallel(),  # TP: output columns = this rank's heads
            f"blocks.{i}.attn.k": ColwiseParallel(),  # TP
            f"blocks.{i}.attn.v": ColwiseParallel(),  # TP
            f"blocks.{i}.attn.out": RowwiseParallel(),  # TP: partial sums over heads, all-reduced
            f"blocks.{i}.mlp.fc": ColwiseParallel(),  # TP: hidden units split, GELU per slice
            f"blocks.{i}.mlp.proj": RowwiseParallel(),  # TP: partial sums, all-reduced
        })
    if not sequence_parallel:  # TP
        return plan  # TP
    # TP: sequence parallel: between the cut layers the residual stream is (B, T/tp, C) on each
    # rank, the norms work on their slice of the sequence, and each all-reduce becomes a
    # reduce-scatter (out, proj) plus an all-gather (the attention's and the MLP's input): the same
    # bytes moved, 1/tp of the activations kept.
    seq = Shard(1)
    # TP: the embedding stays whole (it is small); its output is cut along the sequence, without
    # communication
    plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq)
    plan["norm"] = SequenceParallel()
    plan["head"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    gathered = PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate())
    for i in model.blocks:
        for part in ("attn", "mlp"):  # TP
            plan[f"blocks.{i}.{part}_norm"] = SequenceParallel()  # TP: a norm per sequence slice
            plan[f"blocks.{i}.{part}"] = gathered  # TP: its input, the whole sequence
        plan[f"blocks.{i}.attn.out"] = RowwiseParallel(output_layouts=seq)  # TP: reduce-scatter
        plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel(output_layouts=seq)  # TP
    # TP end
    return plan  # TP


def build(cfg: ParallelConfig, device: torch.device, mesh):  # TP: and the mesh
    """The text, model and optimizer: (model, optimizer, corpus)."""
    corpus = CharCorpus()
    model = GPT(cfg.gpt(), seed=cfg.seed).to(device)  # TP: the whole model, the same on every rank
    # TP: then each rank keeps its slices: its parameters become DTensors, sharded or replicated
    parallelize_module(model, mesh, tp_plan(model, cfg.sequence_parallel))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # TP: each rank steps its slices
    return model, optimizer, corpus


def train_step(model, optimizer, X, y) -> torch.Tensor:
    """One optimizer step on the batch; its loss, left on the device (a read waits for the GPU)."""
    optimizer.zero_grad()
    loss = loss_fn(model(X), y)  # TP: every rank has the whole logits (the head's Replicate())
    # TP: replicated weights (norms, embedding) get their gradient summed over the sequence slices
    loss.backward()
    optimizer.step()
    return loss.detach()


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


def fit(cfg, device, world, model, optimizer, corpus) -> dict:  # TP: world
    """cfg.steps steps; the run's metrics, and its record in cfg.out (metrics.json, model.pt)."""
    losses, start = [], time.perf_counter()
    comms = CommDebugMode()  # TP: the first step's collectives, counted by type
    batched = batches(corpus, cfg.batch_size, cfg.context, cfg.steps, seed=cfg.seed)
    for step, (X, y) in enumerate(batched, 1):
        X, y = X.to(device), y.to(device)
        with comms if not losses else contextlib.nullcontext():  # TP: the first step only
            losses.append(train_step(model, optimizer, X, y))  # TP: in the with
        if log_step(cfg, step, losses[-1]):  # read at log steps: a NaN raises, a SIGTERM stops
            break
    losses = torch.stack(losses).tolist()
    metrics = dict(strategy=STAGE, world_size=world.world_size, device=str(device),
                   steps=len(losses), losses=losses, seconds=time.perf_counter() - start,
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
        return fit(cfg, device, world, model, optimizer, corpus)  # TP
    finally:  # TP
        teardown(created)  # TP


if __name__ == "__main__":
    run_main(main, parse_parallel_args("Train a small GPT, tensor parallel.", stage=STAGE))  # TP
