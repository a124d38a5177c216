"""Stage 5: Horovod, one process per GPU (notebook 05_horovod; Horovod's eight steps).

train_single.py plus the blocks tagged "# Horovod:". Run it with horovodrun (--gloo or --mpi),
mpirun, horovod.run(tutorial.train_horovod.main, args=(cfg,), np=2) or a notebook's MPI engines
(05):

    horovodrun -np 2 -H localhost:2 python -m tutorial.train_horovod --preset smoke --out runs/hvd

Horovod is left initialised when main returns, so a notebook can run it again on the same engines
(its shutdown runs at process exit; after an MPI_Finalize it could not start again).
"""
from __future__ import annotations

import time

import horovod.torch as hvd  # Horovod: its collectives and optimizer wrapper
import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler  # Horovod: step 6, shard the data

from .core import checkpoint, tracking
from .core.config import TrainConfig, parse_args
from .core.data import build_datasets, make_loader, shard  # Horovod: shard
from .core.distributed import pick_device  # Horovod: no process group of torch's
from .core.loop import Loop
from .core.metrics import patience_exhausted, top5_correct
from .core.models import build_model, checksum, convert_batchnorm  # Horovod
from .core.optim import build_optimizer, epoch_progress, lr_at, micro_batch_weight, set_lr
from .core.optim import scaled_lr  # Horovod: the lr for a larger global batch
from .core.precision import Precision
from .core.process import run_main

STAGE = "horovod"  # Horovod
LOSS_SUM, SAMPLES = 0, 1  # train_one_epoch's totals: the loss summed over samples, the samples
# Horovod: finds its ranks through MPI; engines.run refuses engines started without it
RANKS_FROM_MPI = True


def setup(cfg: TrainConfig):
    """The device, the precision policy and the seed; bad options fail here, before any work."""
    hvd.init()  # Horovod: step 1, start the background thread that negotiates and runs collectives
    # Horovod: step 2, one GPU per process, by local rank
    device = pick_device(hvd.local_rank(), hvd.local_size())
    precision = Precision(cfg.precision, device)
    cfg.check_stage(STAGE, device)  # an option only other trainers read is refused, not ignored
    tracking.prepare_output(cfg)
    torch.manual_seed(cfg.seed)
    return device, precision


def build(cfg: TrainConfig, device: torch.device):
    """Data, model and optimizer: (model, optimizer, train_loader, test_loader, peak_lr)."""
    train_set, test_set, info = build_datasets(cfg)
    # A seeded shuffle, re-seeded every epoch: runs are reproducible, a resumed run sees one order.
    # Horovod: each rank reads its 1/size of the order, and its shard of the test set. Loader
    # workers come from a fork server: forking this process, which runs MPI and Horovod's background
    # thread, can leave a worker deadlocked on a lock it inherited (seen in the workshop-cpu lane);
    # Horovod's own PyTorch examples do the same.
    sampler = DistributedSampler(train_set, hvd.size(), hvd.rank(), seed=cfg.seed)
    train_loader = make_loader(train_set, cfg, device, sampler=sampler, start_method="forkserver")
    test_shard = shard(test_set, hvd.rank(), hvd.size())
    test_loader = make_loader(test_shard, cfg, device, start_method="forkserver")
    # Horovod end
    model = build_model(cfg.model, info).to(device)
    if cfg.sync_bn:  # Horovod: BatchNorm statistics over the global batch, not each rank's slice
        model = convert_batchnorm(model, hvd.SyncBatchNorm)  # Horovod
    # Horovod: --channels-last converts the inputs only; 0.28's all-reduce rejects channels_last
    # (NHWC) gradients.
    if cfg.compile:
        model = torch.compile(model)
    lr = scaled_lr(cfg, hvd.size())  # Horovod: step 3, scale the lr with the number of workers
    optimizer = build_optimizer(model, cfg, lr)
    # Horovod: step 4, all-reduce gradients as backward produces them, once per accumulated step;
    # each rank its own random crops and flips (the weights are rank 0's: step 5, in main).
    compression = hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         backward_passes_per_step=cfg.grad_accum)  # Horovod
    torch.manual_seed(cfg.seed + hvd.rank())  # Horovod
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
        with precision.autocast():
            loss = F.cross_entropy(model(X), y)
        precision.backward(loss * micro_batch_weight(loader, i, len(y), cfg.grad_accum))
        totals[LOSS_SUM] += loss.detach() * len(y)
        totals[SAMPLES] += len(y)
        if last_micro_batch:
            lr = lr_at(cfg, epoch + epoch_progress(loader, i, cfg.grad_accum), loop.peak_lr)
            set_lr(loop.optimizer, lr)
            # Horovod: wait for the averaged gradients before unscaling and clipping; then step()
            # must not wait for them a second time
            loop.optimizer.synchronize()
            with loop.optimizer.skip_synchronize():  # Horovod
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
    # Horovod: step 8, the loss and samples of all ranks
    totals = hvd.allreduce(totals, op=hvd.Sum, name="train_sums")
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
    sums = hvd.allreduce(sums, op=hvd.Sum, name="eval_sums")  # Horovod: step 8, all ranks' shards
    loss_sum, correct, correct5, count = sums.tolist()
    return loss_sum / count, correct / count, correct5 / count


def fit(loop: Loop, train_loader, test_loader) -> dict:
    """The epochs: train, evaluate, log, save; stop after cfg.epochs, max_steps, the target
    accuracy or patience."""
    cfg, model, log, state = loop.cfg, loop.model, loop.log, loop.state
    log.metrics["epochs"] = state.history
    for epoch in range(state.epoch, cfg.epochs):
        train_loader.sampler.set_epoch(epoch)  # Horovod: a new shuffle each epoch, the same on all
        train_loss, samples_per_second, seconds = train_one_epoch(loop, train_loader, epoch)
        # the epoch ran to its end (a SIGTERM mid-epoch leaves state.batch > 0: no evaluation)
        if not state.batch:
            test_loss, test_accuracy, test_top5 = evaluate(loop, model, test_loader)
            log.epoch(dict(epoch=epoch, train_loss=train_loss, test_loss=test_loss,
                           test_accuracy=test_accuracy, samples_per_second=samples_per_second,
                           epoch_seconds=seconds, lr=loop.optimizer.param_groups[0]["lr"],
                           skipped_steps=loop.precision.skipped_steps), state.step)
            log.metrics["test_top5_accuracy"] = test_top5  # the label among the 5 highest scores
            state.epoch = epoch + 1
        if hvd.rank() == 0:  # Horovod: step 7, checkpoints from rank 0 only
            checkpoint.save(cfg, model, loop.optimizer, loop.precision.scaler, state)
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
    # Horovod: every rank's digest, to prove the replicas agree
    digests = hvd.allgather_object(checksum(model))
    return log.finish(steps=state.step, replica_checksums=digests,
                      replicas_identical=len(set(digests)) == 1)


def main(cfg: TrainConfig, build=build) -> dict:
    """Train cfg; returns the run's metrics (also in cfg.out/metrics.json). main sets up, builds
    and hands the loop to fit. build is a hook for lessons: a function with build's arguments and
    results (usually build itself, then a change to the model it returned), so a lesson trains a
    model it changed exactly as this trainer trains."""
    device, precision = setup(cfg)
    log = tracking.RunLog(cfg, STAGE, device, hvd.rank(), hvd.size())  # Horovod: rank 0 prints
    try:
        model, optimizer, train_loader, test_loader, peak_lr = build(cfg, device)
        state = checkpoint.resume(cfg, model, optimizer, precision.scaler, device)
        # Horovod: step 5, start from rank 0's weights, and its optimizer state (a fresh optimizer
        # has none to send)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if state.step:  # Horovod
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # Horovod
        loop = Loop(cfg, model, optimizer, precision, device, peak_lr, log, state)
        return fit(loop, train_loader, test_loader)
    finally:
        log.close()  # on every exit path: a failed run leaves no TensorBoard writer in an engine


if __name__ == "__main__":
    run_main(main, parse_args(__doc__, stage=STAGE))
