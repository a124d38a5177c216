"""Stage 3: DistributedDataParallel, one process per GPU (notebooks 03a_ddp_by_hand and 03b_ddp_trainer).

train_single.py plus the lines tagged "# DDP:". Launch it with any of:

    torchrun --standalone --nproc_per_node 2 -m tutorial.train_ddp --preset smoke --out runs/ddp
    mpirun -np 2 python -m tutorial.train_ddp --preset smoke       (also mpiexec/PALS, srun)
    tutorial.launch.engines.start(n=2).run(tutorial.train_ddp.main, cfg)  (ipyparallel engines, from a notebook)
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist  # DDP
import torch.nn.functional as F
from contextlib import nullcontext  # DDP: for no_sync() on gradient-accumulation steps
from torch.nn.parallel import DistributedDataParallel as DDP  # DDP
from torch.utils.data.distributed import DistributedSampler  # DDP

from .core import checkpoint, tracking
from .core.config import TrainConfig, parse_args
from .core.data import build_datasets, make_loader, shard  # DDP: shard
from .core.distributed import (all_reduce_mean, init_process_group, pick_device,  # DDP
                               replica_checksums, teardown, world_from_env)
from .core.metrics import patience_exhausted, top5_correct
from .core.models import build_model  # DDP: the replicas' digests come from core.distributed
from .core.optim import build_optimizer, epoch_progress, lr_at, micro_batch_weight, scaled_lr, set_lr  # DDP: scaled_lr
from .core.precision import Precision
from .core.process import run_main


def setup(cfg: TrainConfig):
    """The device, the precision policy and the seed; bad options fail here, before any work."""
    world = world_from_env()  # DDP: rank, local_rank, world_size from torchrun, MPI, Slurm or the engines
    device = pick_device(world.local_rank, world.local_world_size)  # DDP: one GPU per process, chosen by local rank
    amp = Precision(cfg.precision, device)
    cfg.check_stage("ddp", device)  # DDP: --sync-bn needs GPUs; --zero-stage, --fp16-allreduce are refused
    tracking.prepare_output(cfg)
    created = init_process_group(world, device, cfg.timeout, cfg.backend)  # DDP: nccl on GPUs, gloo on CPUs
    torch.manual_seed(cfg.seed)
    return device, amp, world, created  # DDP: and who we are


def build(cfg: TrainConfig, device: torch.device, world):  # DDP: needs rank and world size
    """Data, model and optimizer."""
    train_set, test_set, info = build_datasets(cfg)
    # DDP: each rank reads its own 1/world_size of a shuffled order; set_epoch(epoch) reshuffles it every epoch.
    sampler = DistributedSampler(train_set, world.world_size, world.rank, shuffle=True, seed=cfg.seed)
    train_loader = make_loader(train_set, cfg, device, sampler=sampler)
    test_loader = make_loader(shard(test_set, world.rank, world.world_size), cfg, device)  # DDP: exact shards
    model = build_model(cfg.model, info).to(device)
    if cfg.sync_bn:  # DDP: BatchNorm statistics over the global batch, not each rank's slice
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # DDP
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:  # DDP: compiled before wrapping: torch.compile(DDP(model)) graph-broke at DDP's own forward and
        model = torch.compile(model)  # DDP: compiled nothing (torch 2.14, measured); DDP's hooks work as before
    # DDP: wrapping broadcasts rank 0's weights, then all-reduces gradients in buckets during backward.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    lr = scaled_lr(cfg, world.world_size)  # DDP: a world_size times larger global batch, a larger lr
    optimizer = build_optimizer(model, cfg, lr)
    torch.manual_seed(cfg.seed + world.rank)  # DDP: each rank its own random crops and flips; weights were shared
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
        # DDP: no_sync() skips the gradient all-reduce on micro-batches that do not end with an optimizer step.
        with amp.autocast(), (nullcontext() if last_micro_batch else model.no_sync()):
            loss = F.cross_entropy(model(X), y)
            amp.backward(loss * micro_batch_weight(loader, i, len(y), cfg.grad_accum))  # DDP: inside no_sync too
        loss_sum += loss.detach() * len(y)
        samples += len(y)
        if last_micro_batch:
            lr = lr_at(cfg, epoch + epoch_progress(loader, i, cfg.grad_accum), peak_lr)
            set_lr(optimizer, lr)
            amp.step(optimizer, model.parameters(), cfg.clip_grad)
            optimizer.zero_grad()
            state.step += 1
            log.step(state.step, loss, lr, amp.loss_scale)
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
    dist.all_reduce(sums)  # DDP: sum the shards' loss, correct and count over all ranks
    loss_sum, correct, correct5, count = sums.tolist()
    return loss_sum / count, correct / count, correct5 / count


def main(cfg: TrainConfig) -> dict:
    device, amp, world, created = setup(cfg)  # DDP: and who we are
    try:  # DDP: leave the process group on every exit path, errors included
        model, optimizer, train_loader, test_loader, peak_lr = build(cfg, device, world)  # DDP: world
        return train(cfg, device, amp, world, model, optimizer, train_loader, test_loader, peak_lr)  # DDP
    finally:  # DDP
        teardown(created)  # DDP


def train(cfg, device, amp, world, model, optimizer, train_loader, test_loader, peak_lr) -> dict:  # DDP: main's loop
    log = tracking.RunLog(cfg, "ddp", device, world.rank, world.world_size)  # DDP: rank 0 prints and writes
    state = checkpoint.resume(cfg, model, optimizer, amp.scaler, device)
    log.metrics["epochs"] = state.history
    for epoch in range(state.epoch, cfg.epochs):
        train_loader.sampler.set_epoch(epoch)  # DDP: a new shuffle every epoch, the same on every rank
        train_loss, samples_per_second, seconds = train_one_epoch(
            cfg, model, optimizer, amp, train_loader, device, epoch, peak_lr, state, log)
        if state.batch:  # a SIGTERM stopped this epoch: save where it stopped, then exit (143)
            if world.is_main_process:  # DDP: one writer; the replicas are identical anyway
                checkpoint.save(cfg, model, optimizer, amp.scaler, state)  # DDP
            raise checkpoint.stopped(state, cfg.out)
        train_loss = all_reduce_mean(train_loss, device)  # DDP: the loss over all ranks' samples
        samples_per_second *= world.world_size  # DDP: every rank processes its own samples at the same time
        test_loss, test_accuracy, test_top5 = evaluate(cfg, model.module, amp, test_loader, device)  # DDP: local replica
        log.epoch(dict(epoch=epoch, train_loss=train_loss, test_loss=test_loss, test_accuracy=test_accuracy,
                       samples_per_second=samples_per_second, epoch_seconds=seconds,
                       lr=optimizer.param_groups[0]["lr"], skipped_steps=amp.skipped_steps), state.step)
        log.metrics["test_top5_accuracy"] = test_top5  # seed 001: the label among the 5 highest scores
        state.epoch = epoch + 1
        if world.is_main_process:  # DDP: one writer; the replicas are identical anyway
            checkpoint.save(cfg, model, optimizer, amp.scaler, state)  # DDP
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
    digests = replica_checksums(model)  # DDP: every rank's parameter digest, to prove the replicas agree
    return log.finish(steps=state.step, replica_checksums=digests, replicas_identical=len(set(digests)) == 1)


if __name__ == "__main__":
    run_main(main, parse_args("Train with DistributedDataParallel, one process per GPU.", stage="ddp"))  # DDP
