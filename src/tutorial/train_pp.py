"""Stage 11: pipeline parallel, every rank holds some of the blocks of a small GPT (notebook 11).

A one-process GPT loop plus the lines tagged "# PP:". Launch it with any of:

    torchrun --standalone --nproc_per_node 2 -m tutorial.train_pp --schedule 1f1b --micro-batches 4
    mpirun -np 2 python -m tutorial.train_pp --schedule gpipe           (also mpiexec/PALS, srun)
    tutorial.launch.engines.start(n=2).run(tutorial.train_pp.main, cfg) (engines, in a notebook)

Rank r runs stage r: consecutive blocks (rank 0 also the embedding, the last rank the final norm,
the head and the loss). Activations go forward to the next rank and their gradients come back,
point to point. A stage would wait for its neighbours most of the time, so the batch is cut into
micro-batches that flow through the stages one after the other (GPipe, Huang et al. 2019: all
forwards, then all backwards; 1F1B, Narayanan et al. 2019: one forward, one backward, so at most p
micro-batches' activations are held instead of m). Both leave each stage idle for a fraction
(p-1)/(m+p-1) of the step, the bubble: more micro-batches, a smaller bubble.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist  # PP: the loss goes from the last stage to all
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # PP

from .core.distributed import init_process_group, pick_device, teardown, world_from_env  # PP
from .core.corpus import CharCorpus, batches
from .core.gpt import GPT, loss_fn, parameter_bytes
from .core.gpt import pipeline_stage  # PP: cuts the model into stages
from .core.layout import Layout, check_layout  # PP: the checks 12's planner makes too
from .core.parallel_config import (ParallelConfig, check_stopped, log_step, parse_parallel_args,
                                    save_run)
from .core.process import run_main

STAGE = "pp"  # PP
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # PP


def setup(cfg: ParallelConfig):
    """The device."""  # PP: (device, world, created): and who we are
    world = world_from_env()  # PP: rank, local_rank, world_size from torchrun, MPI, Slurm, engines
    # PP: every micro-batch the same shape, as the stages' buffers expect; equal stages
    check_layout(Layout(pp=world.world_size), cfg.n_heads, cfg.n_layers,  # PP
                 batch=cfg.batch_size, micro_batches=cfg.micro_batches)
    device = pick_device(world.local_rank, world.local_world_size)  # PP: one GPU per process
    created = init_process_group(world, device, cfg.timeout, cfg.backend)  # PP: nccl or gloo
    return device, world, created  # PP


def build(cfg: ParallelConfig, device: torch.device, world):  # PP: and who we are
    """The text, model and optimizer: (model, optimizer, corpus)."""  # PP: and the schedule
    corpus = CharCorpus()
    # PP: the whole model from the seed, so that the stages fit together; this rank keeps its part,
    # and its PipelineStage knows its neighbours by rank
    model = GPT(cfg.gpt(), seed=cfg.seed)
    model = pipeline_stage(model, world.rank, world.world_size).to(device)  # PP
    stage = PipelineStage(model, world.rank, world.world_size, device)  # PP
    # PP: the schedule cuts each batch into micro-batches and runs them through the stages; the last
    # stage calls loss_fn per micro-batch, and the gradients are divided by their number
    # (scale_grads), as for one batch.
    schedule = SCHEDULES[cfg.schedule](stage, n_microbatches=cfg.micro_batches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # PP: each stage its blocks
    return model, optimizer, corpus, schedule  # PP: the schedule runs forward and backward


def train_step(schedule, optimizer, world, X, y, device) -> torch.Tensor:  # PP: the schedule
    """One optimizer step on the batch; its loss, left on the device (a read waits for the GPU)."""
    optimizer.zero_grad()
    losses = []  # PP: the last stage gets one loss per micro-batch
    if world.rank == 0:  # PP: the first stage feeds the tokens
        schedule.step(X)  # PP
    elif world.rank == world.world_size - 1:  # PP: the last stage gets the targets
        schedule.step(target=y, losses=losses)  # PP
    else:  # PP: a middle stage only passes activations on and gradients back
        schedule.step()  # PP
    optimizer.step()
    # PP: every rank reports the last stage's loss
    loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
    dist.broadcast(loss, src=world.world_size - 1)  # PP
    return loss.detach()


# PP: no evaluate(): only the last stage has the logits, and evaluating would take a schedule of its
# own


def full_state(model) -> dict:
    """The whole model's weights, on the CPU: for the run's record."""  # PP: this stage's
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def fit(cfg, device, world, model, optimizer, corpus, schedule) -> dict:  # PP: world, schedule
    """cfg.steps steps; the run's metrics, and its record in cfg.out (metrics.json, model.pt)."""
    losses, start = [], time.perf_counter()
    batched = batches(corpus, cfg.batch_size, cfg.context, cfg.steps, seed=cfg.seed)
    for step, (X, y) in enumerate(batched, 1):
        X, y = X.to(device), y.to(device)
        losses.append(train_step(schedule, optimizer, world, X, y, device))  # PP
        if log_step(cfg, step, losses[-1]):  # read at log steps: a NaN raises, a SIGTERM stops
            break
    losses = torch.stack(losses).tolist()
    metrics = dict(strategy=STAGE, schedule=cfg.schedule, micro_batches=cfg.micro_batches,  # PP
                   world_size=world.world_size, device=str(device), steps=len(losses),
                   losses=losses, seconds=time.perf_counter() - start,
                   parameter_bytes=parameter_bytes(model))  # PP: this stage's blocks only
    # PP: rank 0 collects every stage's weights to save the whole model
    stages = [None] * world.world_size
    dist.gather_object(full_state(model), stages if world.is_main_process else None)
    state = {k: v for s in stages or [] for k, v in s.items()} if world.is_main_process else None
    if cfg.out and world.is_main_process:  # PP: one writer
        save_run(cfg.out, state, metrics)
    # PP end
    check_stopped(cfg, len(losses))
    return metrics


def main(cfg: ParallelConfig, build=build) -> dict:
    """Train cfg; returns the run's metrics. main sets up, builds and hands the model to fit. build
    is a hook for lessons, as in the image trainers: a function with build's arguments and results,
    so a lesson trains a model it changed exactly as this trainer trains."""
    device, world, created = setup(cfg)  # PP: and who we are
    try:  # PP: leave the process group on every exit path
        model, optimizer, corpus, schedule = build(cfg, device, world)  # PP
        return fit(cfg, device, world, model, optimizer, corpus, schedule)  # PP
    finally:  # PP
        teardown(created)  # PP


if __name__ == "__main__":
    run_main(main, parse_parallel_args("Train a small GPT, pipeline parallel.", stage=STAGE))  # PP
