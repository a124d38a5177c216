"""Stage 9: DeepSpeed ZeRO, optimizer state, gradients and parameters sharded over ranks (09_sharded_training).

train_single.py plus the lines tagged "# DeepSpeed:" (many of them are train_ddp.py's). Launch it with any of:

    torchrun --standalone --nproc_per_node 2 -m tutorial.train_deepspeed --preset smoke --zero-stage 3 --out runs/ds
    deepspeed --num_gpus 8 --no_local_rank --module tutorial.train_deepspeed --preset workshop  (its launcher)
    mpirun -np 2 python -m tutorial.train_deepspeed --preset smoke       (also mpiexec/PALS, srun)
    tutorial.launch.engines.start(n=2).run(tutorial.train_deepspeed.main, cfg)  (ipyparallel engines, from a notebook)
"""
from __future__ import annotations

import os  # DeepSpeed
import time

import torch
import torch.distributed as dist  # DeepSpeed
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler  # DeepSpeed

from .core import checkpoint, sharded_checkpoint, tracking  # DeepSpeed: every rank writes its partitions
from .core.config import TrainConfig, parse_args
from .core.deepspeed_compat import import_deepspeed, prepare, quiet_deepspeed  # DeepSpeed: its import, warnings, state
from .core.data import build_datasets, make_loader
from .core.distributed import (all_reduce_mean, init_process_group, pick_device,  # DeepSpeed
                               replica_checksums, teardown, world_from_env)
from .core.metrics import patience_exhausted, top5_correct
from .core.models import build_model  # DeepSpeed: the ranks' digests come from core.distributed
from .core.optim import (build_optimizer, epoch_progress, lr_at, micro_batch_weight, scaled_lr,  # DeepSpeed: scaled_lr
                         set_lr)
from .core.precision import Precision
from .core.process import run_main

deepspeed = import_deepspeed()  # DeepSpeed: with its accelerator named (it picks one when imported)


def setup(cfg: TrainConfig):
    """The device, the precision policy and the seed; bad options fail here, before any work."""
    world = world_from_env()  # DeepSpeed: rank, local_rank, world_size from torchrun, deepspeed, MPI, Slurm, engines
    device = pick_device(world.local_rank, world.local_world_size)  # DeepSpeed: one GPU per process, by local rank
    amp = Precision(cfg.precision, device)
    cfg.check_stage("deepspeed", device)  # DeepSpeed: --sync-bn is refused here
    tracking.prepare_output(cfg)
    # DeepSpeed: our bounded rendezvous, not DeepSpeed's MPI discovery (rank 0's first `hostname -I`, seed 003).
    created = init_process_group(world, device, cfg.timeout, cfg.backend)
    os.environ["LOCAL_RANK"] = str(world.local_rank)  # DeepSpeed: reads it itself (srun, mpich, alone)
    prepare(device, created)  # DeepSpeed: no CPU shared-memory op; forget a group cloned from an earlier run
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # DeepSpeed: nccl on GPUs, gloo on CPUs
    torch.manual_seed(cfg.seed)
    return device, amp, world, created  # DeepSpeed: and who we are


def build(cfg: TrainConfig, device: torch.device, world):  # DeepSpeed: needs rank and world size
    """Data, model and optimizer."""
    train_set, test_set, info = build_datasets(cfg)
    # DeepSpeed: each rank reads its own 1/world_size of a shuffled order; set_epoch(epoch) reshuffles it.
    sampler = DistributedSampler(train_set, world.world_size, world.rank, shuffle=True, seed=cfg.seed)
    train_loader = make_loader(train_set, cfg, device, sampler=sampler)
    # DeepSpeed: every rank evaluates the whole test set: ZeRO-3's forward all-gathers, so all run as many batches.
    test_loader = make_loader(test_set, cfg, device)
    model = build_model(cfg.model, info).to(device)
    # DeepSpeed: --channels-last converts the inputs only: it flattens parameters, which must be contiguous, and an
    # DeepSpeed: NHWC input makes the convolutions run in NHWC anyway.
    lr = scaled_lr(cfg, world.world_size)  # DeepSpeed: a world_size times larger global batch, a larger lr
    optimizer = build_optimizer(model, cfg, lr)
    ds_config = {  # DeepSpeed: the engine does what the other trainers spell out, configured from the same cfg
        "train_micro_batch_size_per_gpu": cfg.batch_size, "gradient_accumulation_steps": cfg.grad_accum,
        "zero_optimization": {"stage": cfg.zero_stage}, "gradient_clipping": cfg.clip_grad,
        # DeepSpeed: fp16 is its loss-scaled fp16 mode; bf16 is autocast around the forward (below), as in every
        # DeepSpeed: trainer: its "bf16" mode keeps bf16 weights beside fp32 BatchNorm statistics, which the CPU
        # DeepSpeed: batch_norm kernel refuses ("expected scalar type BFloat16 but found Float").
        "fp16": {"enabled": cfg.precision == "fp16"},
        "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1}  # DeepSpeed: our SGD; RunLog prints
    with quiet_deepspeed():  # DeepSpeed: its note on our torch optimizer, also when a lesson calls build() directly
        model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    torch.manual_seed(cfg.seed + world.rank)  # DeepSpeed: each rank its own random crops and flips
    return model, optimizer, train_loader, test_loader, lr


def train_one_epoch(cfg, model, optimizer, amp, loader, device, epoch, peak_lr, state, log):
    model.train()
    loss_sum, samples, start = torch.zeros((), device=device), 0, time.perf_counter()
    for i, (X, y) in enumerate(log.bar(loader, epoch)):
        if checkpoint.trained_before(state, i):  # resumed after a SIGTERM stop: done before it
            continue
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cfg.channels_last:
            X = X.contiguous(memory_format=torch.channels_last)
        last_micro_batch = (i + 1) % cfg.grad_accum == 0 or i + 1 == len(loader)
        model.set_gradient_accumulation_boundary(last_micro_batch)  # DeepSpeed: reduce gradients before a step only
        with amp.autocast():
            loss = F.cross_entropy(model(X), y)
        # DeepSpeed: our weight, not its 1 / grad_accum (which under-weights a short last group); it then all-reduces
        # DeepSpeed: or reduce-scatters the gradients at the group's end
        model.backward(loss * micro_batch_weight(loader, i, len(y), cfg.grad_accum), scale_wrt_gas=False)
        loss_sum += loss.detach() * len(y)
        samples += len(y)
        if last_micro_batch:
            lr = lr_at(cfg, epoch + epoch_progress(loader, i, cfg.grad_accum), peak_lr)
            set_lr(optimizer, lr)
            model.step()  # DeepSpeed: clip, step (each rank its partition), share the new weights, zero the grads
            state.step += 1
            log.step(state.step, loss, lr, getattr(optimizer, "loss_scale", 1.0))  # DeepSpeed: its fp16 scaler
            if checkpoint.stop_requested(state, i, len(loader), cfg.log_every):  # SIGTERM on any rank
                break
            if cfg.max_steps and state.step >= cfg.max_steps:
                break
    seconds = time.perf_counter() - start
    return loss_sum.item() / samples, samples / seconds, seconds


@torch.no_grad()
def evaluate(cfg, model, amp, loader, device):
    """Loss, accuracy and top-5 accuracy over the whole test set."""
    model.eval()
    sums = torch.zeros(4, device=device)  # loss sum, correct, correct in the top 5, count
    for X, y in loader:
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cfg.channels_last:
            X = X.contiguous(memory_format=torch.channels_last)
        with amp.autocast():
            logits = model(X)
        sums += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum"), (logits.argmax(1) == y).sum(),
                             top5_correct(logits, y), torch.tensor(len(y), device=device)])
    loss_sum, correct, correct5, count = sums.tolist()
    return loss_sum / count, correct / count, correct5 / count


def main(cfg: TrainConfig) -> dict:
    device, amp, world, created = setup(cfg)  # DeepSpeed: and who we are
    try:  # DeepSpeed: leave the process group on every exit path, errors included
        with quiet_deepspeed():  # DeepSpeed: its warnings that do not apply, hidden while it runs
            model, optimizer, train_loader, test_loader, peak_lr = build(cfg, device, world)  # DeepSpeed: world
            return train(cfg, device, amp, world, model, optimizer, train_loader, test_loader, peak_lr)  # DeepSpeed
    finally:  # DeepSpeed
        teardown(created)  # DeepSpeed


def train(cfg, device, amp, world, model, optimizer, train_loader, test_loader, peak_lr) -> dict:  # DeepSpeed
    if cfg.compile:
        model.compile()  # DeepSpeed: the engine compiles the module it wraps
    # DeepSpeed: rank 0 prints and writes
    log = tracking.RunLog(cfg, f"deepspeed-zero{cfg.zero_stage}", device, world.rank, world.world_size)
    state = sharded_checkpoint.resume_deepspeed(cfg, model)  # DeepSpeed: weights, partitions, loss scale
    log.metrics["epochs"] = state.history
    for epoch in range(state.epoch, cfg.epochs):
        train_loader.sampler.set_epoch(epoch)  # DeepSpeed: a new shuffle every epoch, the same on every rank
        train_loss, samples_per_second, seconds = train_one_epoch(
            cfg, model, optimizer, amp, train_loader, device, epoch, peak_lr, state, log)
        if state.batch:  # a SIGTERM stopped this epoch: save where it stopped, then exit (143)
            sharded_checkpoint.save_deepspeed(cfg, model, state)  # DeepSpeed: every rank writes its own partitions
            raise checkpoint.stopped(state, cfg.out)
        train_loss = all_reduce_mean(train_loss, device)  # DeepSpeed: the loss over all ranks' samples
        samples_per_second *= world.world_size  # DeepSpeed: every rank processes its own samples at the same time
        test_loss, test_accuracy, test_top5 = evaluate(cfg, model, amp, test_loader, device)
        log.epoch(dict(epoch=epoch, train_loss=train_loss, test_loss=test_loss, test_accuracy=test_accuracy,
                       samples_per_second=samples_per_second, epoch_seconds=seconds,
                       lr=optimizer.param_groups[0]["lr"], skipped_steps=model.skipped_steps), state.step)  # DeepSpeed
        log.metrics["test_top5_accuracy"] = test_top5  # seed 001: the label among the 5 highest scores
        state.epoch = epoch + 1
        sharded_checkpoint.save_deepspeed(cfg, model, state)  # DeepSpeed: every rank writes its own partitions
        if state.stopping:  # the SIGTERM came at the epoch's last step: saved above, now exit (143)
            raise checkpoint.stopped(state, cfg.out)
        if cfg.max_steps and state.step >= cfg.max_steps:
            break
        if cfg.target_accuracy and test_accuracy >= cfg.target_accuracy:
            log.print(f"target accuracy {cfg.target_accuracy} reached after epoch {epoch}")
            break
        if patience_exhausted(cfg, log.metrics["epochs"]):  # seed 000: stop when the test loss stops improving
            log.print(f"no lower test loss for {cfg.patience} epochs: stopped after epoch {epoch}")
            break
    with deepspeed.zero.GatheredParameters(list(model.module.parameters())):  # DeepSpeed: ZeRO-3 holds slices
        digests = replica_checksums(model.module)  # DeepSpeed: every rank's digest of the whole model
    return log.finish(steps=state.step, replica_checksums=digests, replicas_identical=len(set(digests)) == 1)


if __name__ == "__main__":
    run_main(main, parse_args("Train with DeepSpeed ZeRO (sharded state).", stage="deepspeed"))  # DeepSpeed
