"""Stage 9: Fully Sharded Data Parallel: 1/world_size of the model per rank (09_sharded_training).

train_ddp.py plus the blocks tagged "# FSDP:". Run it with torchrun, mpirun, srun or a notebook's
engines (09):

    torchrun --standalone --nproc_per_node 2 -m tutorial.train_fsdp --preset smoke --out runs/fsdp

DDP keeps a whole replica of parameters, gradients and optimizer state on every GPU; FSDP (torch's
FSDP2, `fully_shard`) splits each of them into world_size shards and all-gathers a block's
parameters only while it runs.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist  # DDP: the collectives
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # FSDP: shards, precision
from torch.utils.data.distributed import DistributedSampler  # DDP: a share of the data per rank

from .core import checkpoint, sharded_checkpoint, tracking  # FSDP: every rank writes its shards
from .core.config import TrainConfig, parse_args
from .core.data import build_datasets, make_loader
from .core.distributed import replica_checksums
from .core.distributed import init_process_group, pick_device, teardown, world_from_env  # DDP
from .core.loop import Loop
from .core.metrics import patience_exhausted, top5_correct
from .core.models import batch_norms, blocks, build_model  # FSDP: the units to shard
from .core.optim import build_optimizer, epoch_progress, lr_at, micro_batch_weight, set_lr
from .core.optim import scaled_lr  # DDP: the lr for a larger global batch
from .core.precision import Precision
from .core.process import run_main

STAGE = "fsdp"  # FSDP
LOSS_SUM, SAMPLES = 0, 1  # train_one_epoch's totals: the loss summed over samples, the samples


def setup(cfg: TrainConfig):
    """The device, the precision policy and the seed; bad options fail here, before any work."""
    # DDP: rank, local rank and world size from torchrun, MPI, Slurm or the engines; then one GPU
    # per process, picked by local rank
    world = world_from_env()
    device = pick_device(world.local_rank, world.local_world_size)  # DDP
    precision = Precision(cfg.precision, device)
    cfg.check_stage(STAGE, device)  # an option only other trainers read is refused, not ignored
    tracking.prepare_output(cfg)
    torch.manual_seed(cfg.seed)
    return device, precision


def build(cfg: TrainConfig, device: torch.device, precision):  # FSDP: and the precision
    """Data, model and optimizer: (model, optimizer, train_loader, test_loader, peak_lr)."""
    train_set, test_set, info = build_datasets(cfg)
    # A seeded shuffle, re-seeded every epoch: runs are reproducible, a resumed run sees one order.
    # DDP: each rank 1/world_size of the order (rank and size from the process group)
    sampler = DistributedSampler(train_set, seed=cfg.seed)
    train_loader = make_loader(train_set, cfg, device, sampler=sampler)
    # FSDP: every rank evaluates the whole test set: each forward all-gathers, so all must run as
    # many batches.
    test_loader = make_loader(test_set, cfg, device)
    model = build_model(cfg.model, info).to(device)
    # FSDP: --channels-last converts the inputs only: fully_shard takes contiguous parameters only,
    # and an NHWC input makes the convolutions run in NHWC anyway. Mixed precision is FSDP's own
    # policy, not autocast: parameters gathered in bf16/fp16 (half the bytes) and computed in it,
    # gradients reduced and the shards stepped in fp32. BatchNorm layers compute in fp32 (their
    # running statistics are fp32, and a CPU kernel refuses bf16 weights beside them): one fp32 unit
    # for each block's norms and one for the rest, not one unit per layer (each unit is an
    # all-gather and a reduce-scatter per step). Then one unit per block, and the root (stem, head).
    policy = MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=torch.float32)
    groups = [batch_norms(block) for block in blocks(model)]
    groups.append([norm for norm in batch_norms(model) if not any(norm in g for g in groups)])
    for norms in [group for group in groups if group] if precision.dtype else []:
        # FSDP: each norm fp32 in, the policy's dtype out, by its own hooks: torch < 2.14's
        # output_dtype casts a unit of several modules only where it ends (an H200 failed so)
        for norm in norms:
            norm.register_forward_pre_hook(lambda _, args: tuple(a.float() for a in args))  # FSDP
            norm.register_forward_hook(lambda _, args, out: out.to(precision.dtype))  # FSDP
        fully_shard(norms, mp_policy=MixedPrecisionPolicy(torch.float32))  # FSDP
    for block in blocks(model):
        # FSDP: each block's forward compiled, FSDP's gathers around it left eager (as torchtitan)
        if cfg.compile:
            block.forward = torch.compile(block.forward)  # FSDP
        fully_shard(block, mp_policy=policy)  # FSDP: parameters become DTensors
    root_policy = MixedPrecisionPolicy(precision.dtype, torch.float32, output_dtype=torch.float32)
    fully_shard(model, mp_policy=root_policy)
    # FSDP end
    lr = scaled_lr(cfg, dist.get_world_size())  # DDP: a world_size times larger batch, a larger lr
    torch.manual_seed(cfg.seed + dist.get_rank())  # DDP: each rank its own random crops and flips
    optimizer = build_optimizer(model, cfg, lr)  # FSDP: after sharding, so its state is sharded too
    return model, optimizer, train_loader, test_loader, lr


def train_one_epoch(loop: Loop, loader, epoch: int):
    """One pass over loader: (mean training loss, samples per second, seconds)."""
    cfg, model, precision, device = loop.cfg, loop.model, loop.precision, loop.device
    state = loop.state
    model.train()
    totals, start = torch.zeros(2, device=device), time.perf_counter()  # [LOSS_SUM, SAMPLES]
    # batches a run stopped by SIGTERM mid-epoch trained already (the loader repeats its order)
    skip = checkpoint.take_resume_offset(state)
    for i, (X, y) in enumerate(loop.log.bar(loader, epoch)):
        if i < skip:
            continue
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cfg.channels_last:
            X = X.contiguous(memory_format=torch.channels_last)
        last_micro_batch = (i + 1) % cfg.grad_accum == 0 or i + 1 == len(loader)
        # FSDP: gradients are reduce-scattered only on a step's last micro-batch
        model.set_requires_gradient_sync(last_micro_batch)
        loss = F.cross_entropy(model(X), y)  # FSDP: no autocast, the policy sets the precision
        precision.backward(loss * micro_batch_weight(loader, i, len(y), cfg.grad_accum))
        totals[LOSS_SUM] += loss.detach() * len(y)
        totals[SAMPLES] += len(y)
        if last_micro_batch:
            lr = lr_at(cfg, epoch + epoch_progress(loader, i, cfg.grad_accum), loop.peak_lr)
            set_lr(loop.optimizer, lr)
            # FSDP: each rank steps its shard
            precision.step(loop.optimizer, model.parameters(), cfg.clip_grad)
            loop.optimizer.zero_grad()
            state.step += 1
            agreed = loop.log.step(state.step, loss, lr, precision)  # what every rank agreed on
            if checkpoint.stop_requested(agreed):  # a SIGTERM on any rank: all stop after this step
                loop.stop(i, len(loader))
                break
            if cfg.max_steps and state.step >= cfg.max_steps:
                break
    seconds = time.perf_counter() - start
    dist.all_reduce(totals)  # DDP: over all ranks: their mean loss, the job's samples per second
    loss_sum, samples = totals.tolist()
    return loss_sum / samples, samples / seconds, seconds


@torch.no_grad()
def evaluate(loop: Loop, model, loader):
    """Loss, accuracy and top-5 accuracy over the whole test set."""
    cfg, precision, device = loop.cfg, loop.precision, loop.device
    model.eval()
    sums = torch.zeros(4, device=device)  # loss sum, correct, correct in the top 5, count
    for X, y in loader:
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cfg.channels_last:
            X = X.contiguous(memory_format=torch.channels_last)
        logits = model(X)  # FSDP: no autocast, the policy sets the precision
        sums += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum"),
                             (logits.argmax(1) == y).sum(), top5_correct(logits, y),
                             torch.tensor(len(y), device=device)])
    # FSDP: no all-reduce: every rank evaluated the whole test set
    loss_sum, correct, correct5, count = sums.tolist()
    return loss_sum / count, correct / count, correct5 / count


def fit(loop: Loop, train_loader, test_loader) -> dict:
    """The epochs: train, evaluate, log, save; stop after cfg.epochs, max_steps, the target
    accuracy or patience."""
    cfg, model, log, state = loop.cfg, loop.model, loop.log, loop.state
    log.metrics["epochs"] = state.history
    for epoch in range(state.epoch, cfg.epochs):
        train_loader.sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on all
        train_loss, samples_per_second, seconds = train_one_epoch(loop, train_loader, epoch)
        # the epoch ran to its end (a SIGTERM mid-epoch leaves state.batch > 0: no evaluation)
        if not state.batch:
            # FSDP: the sharded model, on the whole test set
            test_loss, test_accuracy, test_top5 = evaluate(loop, model, test_loader)
            log.epoch(dict(epoch=epoch, train_loss=train_loss, test_loss=test_loss,
                           test_accuracy=test_accuracy, samples_per_second=samples_per_second,
                           epoch_seconds=seconds, lr=loop.optimizer.param_groups[0]["lr"],
                           skipped_steps=loop.precision.skipped_steps), state.step)
            log.metrics["test_top5_accuracy"] = test_top5  # the label among the 5 highest scores
            state.epoch = epoch + 1
        sharded_checkpoint.save_dcp(cfg, model, loop.optimizer, state)  # FSDP: each rank its shards
        if loop.stopping:  # a SIGTERM, agreed on by all ranks: saved above, mid-epoch or at its end
            raise checkpoint.stop_exception(state, cfg.out)
        if cfg.max_steps and state.step >= cfg.max_steps:
            break
        if cfg.target_accuracy and test_accuracy >= cfg.target_accuracy:
            log.print(f"target accuracy {cfg.target_accuracy} reached after epoch {epoch}")
            break
        if patience_exhausted(cfg, log.metrics["epochs"]):  # the test loss stopped improving
            log.print(f"no lower test loss for {cfg.patience} epochs: stopped after epoch {epoch}")
            break
    digests = replica_checksums(model)
    return log.finish(steps=state.step, replica_checksums=digests,
                      replicas_identical=len(set(digests)) == 1)


def main(cfg: TrainConfig, build=build) -> dict:
    """Train cfg; returns the run's metrics (also in cfg.out/metrics.json). main sets up, builds
    and hands the loop to fit. build is a hook for lessons: a function with build's arguments and
    results (usually build itself, then a change to the model it returned), so a lesson trains a
    model it changed exactly as this trainer trains."""
    device, precision = setup(cfg)
    # DDP: join the other ranks; rank 0 prints and writes
    created = init_process_group(world_from_env(), device, cfg.timeout, cfg.backend)
    log = tracking.RunLog(cfg, STAGE, device, dist.get_rank(), dist.get_world_size())  # DDP
    try:
        # FSDP: build takes the precision (its policy); each rank reads the slices it holds
        model, optimizer, train_loader, test_loader, peak_lr = build(cfg, device, precision)
        state = sharded_checkpoint.resume_dcp(cfg, model, optimizer)  # FSDP
        loop = Loop(cfg, model, optimizer, precision, device, peak_lr, log, state)
        return fit(loop, train_loader, test_loader)
    finally:
        log.close()  # on every exit path: a failed run leaves no TensorBoard writer in an engine
        teardown(created)  # DDP: leave the process group if main made it (not a %%px cell's)


if __name__ == "__main__":
    run_main(main, parse_args(__doc__, stage=STAGE))
