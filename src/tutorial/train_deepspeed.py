"""Stage 9: DeepSpeed ZeRO: optimizer state, gradients, parameters sharded (09_sharded_training).

train_ddp.py plus the blocks tagged "# DeepSpeed:". Run it like train_ddp.py, or with DeepSpeed's
own launcher (deepspeed --num_gpus 8 --no_local_rank --module tutorial.train_deepspeed ...):

    torchrun --standalone --nproc_per_node 2 -m tutorial.train_deepspeed --preset smoke \
        --zero-stage 3 --out runs/ds
"""
from __future__ import annotations

import os  # DeepSpeed: LOCAL_RANK for it
import time

import torch
import torch.distributed as dist  # DDP: the collectives
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler  # DDP: a share of the data per rank

from .core import checkpoint, sharded_checkpoint, tracking  # DeepSpeed: each rank its partitions
from .core.config import TrainConfig, parse_args
from .core.data import build_datasets, make_loader
# DeepSpeed: its import, its process group and its warnings
from .core.deepspeed_compat import import_deepspeed, join_group, quiet_deepspeed
from .core.distributed import replica_checksums
from .core.distributed import init_process_group, pick_device, teardown, world_from_env  # DDP
from .core.loop import Loop
from .core.metrics import patience_exhausted, top5_correct
from .core.models import build_model
from .core.optim import build_optimizer, epoch_progress, lr_at, micro_batch_weight, set_lr
from .core.optim import scaled_lr  # DDP: the lr for a larger global batch
from .core.precision import Precision
from .core.process import run_main

STAGE = "deepspeed"  # DeepSpeed
LOSS_SUM, SAMPLES = 0, 1  # train_one_epoch's totals: the loss summed over samples, the samples
deepspeed = import_deepspeed()  # DeepSpeed: with its accelerator named (it picks one when imported)


def setup(cfg: TrainConfig):
    """The device, the precision policy and the seed; bad options fail here, before any work."""
    # DDP: rank, local rank and world size from torchrun, MPI, Slurm or the engines; then one GPU
    # per process, picked by local rank
    world = world_from_env()
    device = pick_device(world.local_rank, world.local_world_size)  # DDP
    precision = Precision(cfg.precision, device)
    cfg.check_stage(STAGE, device)  # an option only other trainers read is refused, not ignored
    tracking.prepare_output(cfg)
    os.environ["LOCAL_RANK"] = str(world.local_rank)  # DeepSpeed: reads it
    torch.manual_seed(cfg.seed)
    return device, precision


def build(cfg: TrainConfig, device: torch.device):
    """Data, model and optimizer: (model, optimizer, train_loader, test_loader, peak_lr)."""
    train_set, test_set, info = build_datasets(cfg)
    # A seeded shuffle, re-seeded every epoch: runs are reproducible, a resumed run sees one order.
    # DDP: each rank 1/world_size of the order (rank and size from the process group)
    sampler = DistributedSampler(train_set, seed=cfg.seed)
    train_loader = make_loader(train_set, cfg, device, sampler=sampler)
    # DeepSpeed: every rank evaluates the whole test set: ZeRO-3's forward all-gathers, so all run
    # as many batches.
    test_loader = make_loader(test_set, cfg, device)
    model = build_model(cfg.model, info).to(device)
    # DeepSpeed: --channels-last converts the inputs only (it flattens parameters, which must be
    # contiguous).
    lr = scaled_lr(cfg, dist.get_world_size())  # DDP: a world_size times larger batch, a larger lr
    optimizer = build_optimizer(model, cfg, lr)
    # DeepSpeed: the engine does what the other trainers spell out, configured from the same cfg.
    # fp16 is its loss-scaled mode (module and inputs halved). bf16 is autocast, as in every
    # trainer, declared to the engine: else its forward turns a CUDA autocast off (an H200 ran
    # "bf16" in fp32 so); gradients still reduced in fp32, as DDP. (Its own "bf16" mode keeps bf16
    # weights beside fp32 BatchNorm statistics, which the CPU kernel refuses.) Untested optimizer:
    # our SGD; RunLog prints, not it.
    ds_config = {"train_micro_batch_size_per_gpu": cfg.batch_size,
                 "gradient_accumulation_steps": cfg.grad_accum,
                 "zero_optimization": {"stage": cfg.zero_stage}, "gradient_clipping": cfg.clip_grad,
                 # auto_cast halves the inputs whenever it is set, fp16 on or not
                 "fp16": {"enabled": cfg.precision == "fp16", "auto_cast": cfg.precision == "fp16"},
                 "torch_autocast": {"enabled": cfg.precision == "bf16", "dtype": "bfloat16",
                                    "lower_precision_safe_modules": []},
                 "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1}
    # DeepSpeed: its note on our torch optimizer hidden, also when a lesson calls build() directly
    with quiet_deepspeed():
        model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,  # DeepSpeed
                                                      config=ds_config)
    if cfg.compile:  # DeepSpeed: the engine compiles the module it wraps
        model.compile()  # DeepSpeed
    torch.manual_seed(cfg.seed + dist.get_rank())  # DeepSpeed: each rank its own crops and flips
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
        # DeepSpeed: gradients are reduced only on a step's last micro-batch
        model.set_gradient_accumulation_boundary(last_micro_batch)
        with precision.autocast():
            loss = F.cross_entropy(model(X), y)
        # DeepSpeed: our weight, not its 1 / grad_accum (wrong for a short last group); it reduces
        # at the group's end
        weight = micro_batch_weight(loader, i, len(y), cfg.grad_accum)
        model.backward(loss * weight, scale_wrt_gas=False)  # DeepSpeed
        totals[LOSS_SUM] += loss.detach() * len(y)
        totals[SAMPLES] += len(y)
        if last_micro_batch:
            lr = lr_at(cfg, epoch + epoch_progress(loader, i, cfg.grad_accum), loop.peak_lr)
            set_lr(loop.optimizer, lr)
            # DeepSpeed: clip, step (each rank its partition), share the new weights, zero the grads
            model.step()
            state.step += 1
            # DeepSpeed: its optimizer has the loss scale
            agreed = loop.log.step(state.step, loss, lr, loop.optimizer)
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
        with precision.autocast():
            logits = model(X)
        sums += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum"),
                             (logits.argmax(1) == y).sum(), top5_correct(logits, y),
                             torch.tensor(len(y), device=device)])
    # DeepSpeed: no all-reduce: every rank evaluated the whole test set
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
            # DeepSpeed: the engine, on the whole test set
            test_loss, test_accuracy, test_top5 = evaluate(loop, model, test_loader)
            log.epoch(dict(epoch=epoch, train_loss=train_loss, test_loss=test_loss,
                           test_accuracy=test_accuracy, samples_per_second=samples_per_second,
                           epoch_seconds=seconds, lr=loop.optimizer.param_groups[0]["lr"],
                           skipped_steps=model.skipped_steps), state.step)  # DeepSpeed
            log.metrics["test_top5_accuracy"] = test_top5  # the label among the 5 highest scores
            state.epoch = epoch + 1
        sharded_checkpoint.save_deepspeed(cfg, model, state)  # DeepSpeed: each rank its partitions
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
    # DeepSpeed: ZeRO-3 holds slices: the whole parameters, gathered for the digest
    with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
        digests = replica_checksums(model.module)  # DeepSpeed
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
    log = tracking.RunLog(cfg, f"{STAGE}-zero{cfg.zero_stage}", device,  # DeepSpeed: ZeRO stage
                          dist.get_rank(), dist.get_world_size())
    try:
        # DeepSpeed: it uses our group, not one of its own (see core.deepspeed_compat)
        join_group(device, created)
        with quiet_deepspeed():  # DeepSpeed: its warnings that do not apply, hidden while it runs
            model, optimizer, train_loader, test_loader, peak_lr = build(cfg, device)
            # DeepSpeed: weights, partitions, loss scale
            state = sharded_checkpoint.resume_deepspeed(cfg, model)
            loop = Loop(cfg, model, optimizer, precision, device, peak_lr, log, state)
            return fit(loop, train_loader, test_loader)
    finally:
        log.close()  # on every exit path: a failed run leaves no TensorBoard writer in an engine
        teardown(created)  # DDP: leave the process group if main made it (not a %%px cell's)


if __name__ == "__main__":
    run_main(main, parse_args(__doc__, stage=STAGE))
