"""Stage 9: Fully Sharded Data Parallel, each rank holds 1/world_size of the model (notebook 09_sharded_training).

train_single.py plus the lines tagged "# FSDP:" (most of them are train_ddp.py's). Launch it with any of:

    torchrun --standalone --nproc_per_node 2 -m tutorial.train_fsdp --preset smoke --out runs/fsdp
    mpirun -np 2 python -m tutorial.train_fsdp --preset smoke       (also mpiexec/PALS, srun)
    tutorial.launch.engines.start(n=2).run(tutorial.train_fsdp.main, cfg)  (ipyparallel engines, from a notebook)

DDP keeps a whole replica of parameters, gradients and optimizer state on every GPU; FSDP (torch's FSDP2,
`fully_shard`) splits each of them into world_size shards and all-gathers a layer's parameters only while it runs.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # FSDP
from torch.utils.data.distributed import DistributedSampler  # FSDP

from .core import checkpoint, sharded_checkpoint, tracking  # FSDP: every rank writes its shards
from .core.config import TrainConfig, parse_args
from .core.data import build_datasets, make_loader
from .core.distributed import (all_reduce_mean, init_process_group, pick_device,  # FSDP
                               replica_checksums, teardown, world_from_env)
from .core.metrics import patience_exhausted, top5_correct
from .core.models import batch_norms, blocks, build_model  # FSDP: units to shard
from .core.optim import build_optimizer, epoch_progress, lr_at, micro_batch_weight, scaled_lr, set_lr  # FSDP: scaled_lr
from .core.precision import Precision
from .core.process import run_main


def setup(cfg: TrainConfig):
    """The device, the precision policy and the seed; bad options fail here, before any work."""
    world = world_from_env()  # FSDP: rank, local_rank, world_size from torchrun, MPI, Slurm or the engines
    device = pick_device(world.local_rank, world.local_world_size)  # FSDP: one GPU per process, by local rank
    amp = Precision(cfg.precision, device)
    cfg.check_stage("fsdp", device)  # FSDP: --sync-bn is refused here
    tracking.prepare_output(cfg)
    created = init_process_group(world, device, cfg.timeout, cfg.backend)  # FSDP: nccl on GPUs, gloo on CPUs
    torch.manual_seed(cfg.seed)
    return device, amp, world, created  # FSDP: and who we are


def build(cfg: TrainConfig, device: torch.device, world, amp):  # FSDP: rank, world size, precision
    """Data, model and optimizer."""
    train_set, test_set, info = build_datasets(cfg)
    # FSDP: each rank reads its own 1/world_size of a shuffled order; set_epoch(epoch) reshuffles it every epoch.
    sampler = DistributedSampler(train_set, world.world_size, world.rank, shuffle=True, seed=cfg.seed)
    train_loader = make_loader(train_set, cfg, device, sampler=sampler)
    # FSDP: every rank evaluates the whole test set: each forward all-gathers, so all must run as many batches.
    test_loader = make_loader(test_set, cfg, device)
    model = build_model(cfg.model, info).to(device)
    # FSDP: --channels-last converts the inputs only: fully_shard takes contiguous parameters only, and an NHWC input
    # makes the convolutions run in NHWC anyway.
    # FSDP: mixed precision is FSDP's own policy, not autocast: parameters gathered in bf16/fp16 (half the bytes) and
    # FSDP: computed in it, gradients reduced and the sharded weights stepped in fp32, the logits returned in fp32.
    policy = MixedPrecisionPolicy(param_dtype=amp.dtype, reduce_dtype=torch.float32)
    # FSDP: BatchNorm layers are units of their own that compute in fp32 (FSDP1's default): their running statistics
    # FSDP: are fp32, and a CPU kernel refuses bf16 weights beside them; they hand bf16 on to the next layer.
    for norm in batch_norms(model) if amp.dtype else []:
        fully_shard(norm, mp_policy=MixedPrecisionPolicy(torch.float32, output_dtype=amp.dtype))
    for block in blocks(model):  # FSDP: one unit per residual block, each gathered only while it runs
        if cfg.compile:  # FSDP: each block's forward compiled, FSDP's gathers around it left eager (torchtitan
            block.forward = torch.compile(block.forward)  # FSDP: too); a whole compiled model graph-breaks at them
        fully_shard(block, mp_policy=policy)  # FSDP: its parameters become DTensors, 1/world_size per rank
    # FSDP: the root holds the rest (stem, head), starts the first gather and returns fp32 logits
    fully_shard(model, mp_policy=MixedPrecisionPolicy(amp.dtype, torch.float32, output_dtype=torch.float32))
    lr = scaled_lr(cfg, world.world_size)  # FSDP: a world_size times larger global batch, a larger lr
    optimizer = build_optimizer(model, cfg, lr)  # FSDP: after sharding, so its state is sharded too
    torch.manual_seed(cfg.seed + world.rank)  # FSDP: each rank its own random crops and flips; weights were shared
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
        model.set_requires_gradient_sync(last_micro_batch)  # FSDP: reduce-scatter only before an optimizer step
        loss = F.cross_entropy(model(X), y)  # FSDP: no autocast, the policy above sets the precision
        amp.backward(loss * micro_batch_weight(loader, i, len(y), cfg.grad_accum))
        loss_sum += loss.detach() * len(y)
        samples += len(y)
        if last_micro_batch:
            lr = lr_at(cfg, epoch + epoch_progress(loader, i, cfg.grad_accum), peak_lr)
            set_lr(optimizer, lr)
            amp.step(optimizer, model.parameters(), cfg.clip_grad)  # FSDP: each rank updates its own shard
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
        logits = model(X)  # FSDP: no autocast, the policy sets the precision
        sums += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum"), (logits.argmax(1) == y).sum(),
                             top5_correct(logits, y), torch.tensor(len(y), device=device)])
    loss_sum, correct, correct5, count = sums.tolist()
    return loss_sum / count, correct / count, correct5 / count


def main(cfg: TrainConfig) -> dict:
    device, amp, world, created = setup(cfg)  # FSDP: and who we are
    try:  # FSDP: leave the process group on every exit path, errors included
        model, optimizer, train_loader, test_loader, peak_lr = build(cfg, device, world, amp)  # FSDP: world, amp
        return train(cfg, device, amp, world, model, optimizer, train_loader, test_loader, peak_lr)  # FSDP
    finally:  # FSDP
        teardown(created)  # FSDP


def train(cfg, device, amp, world, model, optimizer, train_loader, test_loader, peak_lr) -> dict:  # FSDP: the loop
    log = tracking.RunLog(cfg, "fsdp", device, world.rank, world.world_size)  # FSDP: rank 0 prints and writes
    state = sharded_checkpoint.resume_dcp(cfg, model, optimizer)  # FSDP: each rank reads the slices it holds
    log.metrics["epochs"] = state.history
    for epoch in range(state.epoch, cfg.epochs):
        train_loader.sampler.set_epoch(epoch)  # FSDP: a new shuffle every epoch, the same on every rank
        train_loss, samples_per_second, seconds = train_one_epoch(
            cfg, model, optimizer, amp, train_loader, device, epoch, peak_lr, state, log)
        if state.batch:  # a SIGTERM stopped this epoch: save where it stopped, then exit (143)
            sharded_checkpoint.save_dcp(cfg, model, optimizer, state)  # FSDP: every rank writes its own shards
            raise checkpoint.stopped(state, cfg.out)
        train_loss = all_reduce_mean(train_loss, device)  # FSDP: the loss over all ranks' samples
        samples_per_second *= world.world_size  # FSDP: every rank processes its own samples at the same time
        test_loss, test_accuracy, test_top5 = evaluate(cfg, model, amp, test_loader, device)
        log.epoch(dict(epoch=epoch, train_loss=train_loss, test_loss=test_loss, test_accuracy=test_accuracy,
                       samples_per_second=samples_per_second, epoch_seconds=seconds,
                       lr=optimizer.param_groups[0]["lr"], skipped_steps=amp.skipped_steps), state.step)
        log.metrics["test_top5_accuracy"] = test_top5  # seed 001: the label among the 5 highest scores
        state.epoch = epoch + 1
        sharded_checkpoint.save_dcp(cfg, model, optimizer, state)  # FSDP: every rank writes its own shards
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
    digests = replica_checksums(model)  # FSDP: the gathered parameters' digest on every rank
    return log.finish(steps=state.step, replica_checksums=digests, replicas_identical=len(set(digests)) == 1)


if __name__ == "__main__":
    run_main(main, parse_args("Train with FSDP: parameters, gradients, optimizer state sharded.", stage="fsdp"))  # FSDP
