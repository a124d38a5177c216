"""Stage 9: Fully Sharded Data Parallel, each rank holds 1/world_size of the model (notebook 09_sharded_training).

train_ddp.py plus the blocks tagged "# FSDP:". Run it with torchrun, mpirun, srun or a notebook's engines (09):

    torchrun --standalone --nproc_per_node 2 -m tutorial.train_fsdp --preset smoke --out runs/fsdp

DDP keeps a whole replica of parameters, gradients and optimizer state on every GPU; FSDP (torch's FSDP2,
`fully_shard`) splits each of them into world_size shards and all-gathers a block's parameters only while it runs.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist  # DDP: the collectives
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # FSDP: the sharding and its precision
from torch.utils.data.distributed import DistributedSampler  # DDP: each rank its share of the data

from .core import checkpoint, sharded_checkpoint, tracking  # FSDP: every rank writes its shards
from .core.config import TrainConfig, parse_args
from .core.data import build_datasets, make_loader  # FSDP: no shard(): every rank evaluates every test batch
from .core.distributed import init_process_group, pick_device, replica_checksums, teardown, world_from_env  # DDP
from .core.loop import Loop
from .core.metrics import patience_exhausted, top5_correct
from .core.models import batch_norms, blocks, build_model  # FSDP: the units to shard
from .core.optim import build_optimizer, epoch_progress, lr_at, micro_batch_weight, scaled_lr, set_lr
from .core.precision import Precision
from .core.process import run_main

STAGE = "fsdp"  # FSDP: its options (--sync-bn is refused here)


def setup(cfg: TrainConfig):
    """The device, the precision policy and the seed; bad options fail here, before any work."""
    world = world_from_env()  # DDP: rank, local rank, world size from torchrun, MPI, Slurm or the engines
    device = pick_device(world.local_rank, world.local_world_size)  # DDP: one GPU per process, by local rank
    precision = Precision(cfg.precision, device)
    cfg.check_stage(STAGE, device)  # an option only other trainers read is refused, not ignored
    tracking.prepare_output(cfg)
    torch.manual_seed(cfg.seed)
    return device, precision


def build(cfg: TrainConfig, device: torch.device, precision):  # FSDP: and the precision, for its policy
    """Data, model and optimizer: (model, optimizer, train_loader, test_loader, peak_lr)."""
    train_set, test_set, info = build_datasets(cfg)
    # A seeded shuffle, re-seeded every epoch: runs are reproducible and a resumed run sees the same order.
    sampler = DistributedSampler(train_set, seed=cfg.seed)  # DDP: each rank 1/world_size, rank and size from the group
    train_loader = make_loader(train_set, cfg, device, sampler=sampler)
    # FSDP: every rank evaluates the whole test set: each forward all-gathers, so all must run as many batches.
    test_loader = make_loader(test_set, cfg, device)
    model = build_model(cfg.model, info).to(device)
    # FSDP: --channels-last converts the inputs only: fully_shard takes contiguous parameters only, and an NHWC input
    # makes the convolutions run in NHWC anyway. Mixed precision is FSDP's own policy, not autocast: parameters
    # gathered in bf16/fp16 (half the bytes) and computed in it, gradients reduced and the shards stepped in fp32.
    # BatchNorm layers compute in fp32 (their running statistics are fp32, and a CPU kernel refuses bf16 weights
    # beside them): one fp32 unit for each block's norms and one for the rest, not one unit per layer (each unit is
    # an all-gather and a reduce-scatter per step). Then one unit per block, and the root (stem, head) last.
    policy = MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=torch.float32)
    groups = [batch_norms(block) for block in blocks(model)]
    groups.append([norm for norm in batch_norms(model) if not any(norm in group for group in groups)])
    for norms in [group for group in groups if group] if precision.dtype else []:
        fully_shard(norms, mp_policy=MixedPrecisionPolicy(torch.float32, output_dtype=precision.dtype))
    for block in blocks(model):
        if cfg.compile:  # FSDP: each block's forward compiled, FSDP's gathers around it left eager (torchtitan too)
            block.forward = torch.compile(block.forward)
        fully_shard(block, mp_policy=policy)  # FSDP: its parameters become DTensors, 1/world_size per rank
    fully_shard(model, mp_policy=MixedPrecisionPolicy(precision.dtype, torch.float32, output_dtype=torch.float32))
    lr = scaled_lr(cfg, dist.get_world_size())  # DDP: a world_size times larger global batch, a larger lr
    torch.manual_seed(cfg.seed + dist.get_rank())  # DDP: each rank its own random crops and flips
    optimizer = build_optimizer(model, cfg, lr)  # FSDP: after sharding, so its state is sharded too
    return model, optimizer, train_loader, test_loader, lr


def train_one_epoch(loop: Loop, loader, epoch: int):
    """One pass over loader: (mean training loss, samples per second, seconds)."""
    cfg, model, precision, device, state = loop.cfg, loop.model, loop.precision, loop.device, loop.state
    model.train()
    sums, start = torch.zeros(2, device=device), time.perf_counter()  # the loss summed over samples, the samples
    for i, (X, y) in enumerate(loop.log.bar(loader, epoch)):
        if checkpoint.trained_before(state, i):  # resumed after a SIGTERM stop: done before it
            continue
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cfg.channels_last:
            X = X.contiguous(memory_format=torch.channels_last)
        last_micro_batch = (i + 1) % cfg.grad_accum == 0 or i + 1 == len(loader)
        model.set_requires_gradient_sync(last_micro_batch)  # FSDP: reduce-scatter only before an optimizer step
        loss = F.cross_entropy(model(X), y)  # FSDP: no autocast, the policy sets the precision
        precision.backward(loss * micro_batch_weight(loader, i, len(y), cfg.grad_accum))
        sums[0] += loss.detach() * len(y)
        sums[1] += len(y)
        if last_micro_batch:
            lr = lr_at(cfg, epoch + epoch_progress(loader, i, cfg.grad_accum), loop.peak_lr)
            set_lr(loop.optimizer, lr)
            precision.step(loop.optimizer, model.parameters(), cfg.clip_grad)  # FSDP: each rank steps its shard
            loop.optimizer.zero_grad()
            state.step += 1
            loop.log.step(state.step, loss, lr, precision)
            if checkpoint.stop_requested(state, i, len(loader), cfg.log_every):  # SIGTERM on any rank
                break
            if cfg.max_steps and state.step >= cfg.max_steps:
                break
    seconds = time.perf_counter() - start
    dist.all_reduce(sums)  # DDP: over all ranks: their mean loss, and the job's samples per second
    loss_sum, samples = sums.tolist()
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
        sums += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum"), (logits.argmax(1) == y).sum(),
                             top5_correct(logits, y), torch.tensor(len(y), device=device)])
    # FSDP: no all-reduce: every rank evaluated the whole test set
    loss_sum, correct, correct5, count = sums.tolist()
    return loss_sum / count, correct / count, correct5 / count


def fit(loop: Loop, train_loader, test_loader) -> dict:
    """The epochs: train, evaluate, log, save; stop after cfg.epochs, max_steps, the target accuracy or patience."""
    cfg, model, log, state = loop.cfg, loop.model, loop.log, loop.state
    log.metrics["epochs"] = state.history
    for epoch in range(state.epoch, cfg.epochs):
        train_loader.sampler.set_epoch(epoch)  # DDP: a new shuffle every epoch, the same on every rank
        train_loss, samples_per_second, seconds = train_one_epoch(loop, train_loader, epoch)
        if not state.batch:  # the epoch ran to its end (a SIGTERM mid-epoch leaves state.batch > 0: no evaluation)
            test_loss, test_accuracy, test_top5 = evaluate(loop, model, test_loader)  # FSDP: the sharded model
            log.epoch(dict(epoch=epoch, train_loss=train_loss, test_loss=test_loss, test_accuracy=test_accuracy,
                           samples_per_second=samples_per_second, epoch_seconds=seconds,
                           lr=loop.optimizer.param_groups[0]["lr"], skipped_steps=loop.precision.skipped_steps),
                      state.step)
            log.metrics["test_top5_accuracy"] = test_top5  # the label among the 5 highest scores
            state.epoch = epoch + 1
        sharded_checkpoint.save_dcp(cfg, model, loop.optimizer, state)  # FSDP: every rank writes its own shards
        if state.stopping:  # a SIGTERM, agreed on by every rank: saved above (mid-epoch or at its end), exit 143
            raise checkpoint.stop_exception(state, cfg.out)
        if cfg.max_steps and state.step >= cfg.max_steps:
            break
        if cfg.target_accuracy and test_accuracy >= cfg.target_accuracy:
            log.print(f"target accuracy {cfg.target_accuracy} reached after epoch {epoch}")
            break
        if patience_exhausted(cfg, log.metrics["epochs"]):  # stop when the test loss stops improving
            log.print(f"no lower test loss for {cfg.patience} epochs: stopped after epoch {epoch}")
            break
    digests = replica_checksums(model)
    return log.finish(steps=state.step, replica_checksums=digests, replicas_identical=len(set(digests)) == 1)


def main(cfg: TrainConfig, build=build) -> dict:
    """Train cfg; returns the run's metrics (also in cfg.out/metrics.json). main sets up, builds and hands the
    loop to fit. build is a hook for lessons: a function with build's arguments and results (usually build itself,
    then a change to the model it returned), so a lesson trains a model it changed exactly as this trainer trains."""
    device, precision = setup(cfg)
    created = init_process_group(world_from_env(), device, cfg.timeout, cfg.backend)  # DDP: join the other ranks
    log = tracking.RunLog(cfg, STAGE, device, dist.get_rank(), dist.get_world_size())  # DDP: rank 0 prints, writes
    try:
        model, optimizer, train_loader, test_loader, peak_lr = build(cfg, device, precision)  # FSDP: its policy
        state = sharded_checkpoint.resume_dcp(cfg, model, optimizer)  # FSDP: each rank reads the slices it holds
        return fit(Loop(cfg, model, optimizer, precision, device, peak_lr, log, state), train_loader, test_loader)
    finally:
        log.close()  # on every exit path: a failed run leaves no TensorBoard writer behind in an engine
        teardown(created)  # DDP: leave the process group if we made it (not a %%px cell's), on every exit path


if __name__ == "__main__":
    run_main(main, parse_args(__doc__, stage=STAGE))
