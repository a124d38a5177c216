"""Stage 1: training on one device (notebook 01_single_device), the parent of every later stage.

A stage's trainer is its parent's plus blocks tagged with the stage's name: diff the two files to
read the stage. Run it with:

    python -m tutorial.train_single --preset smoke --out runs/single
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.utils.data import RandomSampler

from .core import checkpoint, tracking
from .core.config import TrainConfig, parse_args
from .core.data import build_datasets, make_loader
from .core.distributed import replica_checksums
from .core.loop import Loop
from .core.metrics import patience_exhausted, top5_correct
from .core.models import build_model
from .core.optim import build_optimizer, epoch_progress, lr_at, micro_batch_weight, set_lr
from .core.precision import Precision
from .core.process import run_main

STAGE = "single"  # its options (parse_args), its name in the metrics
LOSS_SUM, SAMPLES = 0, 1  # train_one_epoch's totals: the loss summed over samples, the samples


def setup(cfg: TrainConfig):
    """The device, the precision policy and the seed; bad options fail here, before any work."""
    # the machine's GPU (NVIDIA's and AMD's are "cuda" to torch, Intel's "xpu"), else the CPU
    device = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    precision = Precision(cfg.precision, device)
    cfg.check_stage(STAGE, device)  # an option only other trainers read is refused, not ignored
    tracking.prepare_output(cfg)
    torch.manual_seed(cfg.seed)
    return device, precision


def build(cfg: TrainConfig, device: torch.device):
    """Data, model and optimizer: (model, optimizer, train_loader, test_loader, peak_lr)."""
    train_set, test_set, info = build_datasets(cfg)
    # A seeded shuffle, re-seeded every epoch: runs are reproducible, a resumed run sees one order.
    sampler = RandomSampler(train_set, generator=torch.Generator())
    train_loader = make_loader(train_set, cfg, device, sampler=sampler)
    test_loader = make_loader(test_set, cfg, device)
    model = build_model(cfg.model, info).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        model = torch.compile(model)
    lr = cfg.lr
    optimizer = build_optimizer(model, cfg, lr)
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
    loss_sum, correct, correct5, count = sums.tolist()
    return loss_sum / count, correct / count, correct5 / count


def fit(loop: Loop, train_loader, test_loader) -> dict:
    """The epochs: train, evaluate, log, save; stop after cfg.epochs, max_steps, the target
    accuracy or patience."""
    cfg, model, log, state = loop.cfg, loop.model, loop.log, loop.state
    log.metrics["epochs"] = state.history
    for epoch in range(state.epoch, cfg.epochs):
        train_loader.sampler.generator.manual_seed(cfg.seed + epoch)
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
    digests = replica_checksums(model)
    return log.finish(steps=state.step, replica_checksums=digests,
                      replicas_identical=len(set(digests)) == 1)


def main(cfg: TrainConfig, build=build) -> dict:
    """Train cfg; returns the run's metrics (also in cfg.out/metrics.json). main sets up, builds
    and hands the loop to fit. build is a hook for lessons: a function with build's arguments and
    results (usually build itself, then a change to the model it returned), so a lesson trains a
    model it changed exactly as this trainer trains."""
    device, precision = setup(cfg)
    log = tracking.RunLog(cfg, STAGE, device)
    try:
        model, optimizer, train_loader, test_loader, peak_lr = build(cfg, device)
        state = checkpoint.resume(cfg, model, optimizer, precision.scaler, device)
        loop = Loop(cfg, model, optimizer, precision, device, peak_lr, log, state)
        return fit(loop, train_loader, test_loader)
    finally:
        log.close()  # on every exit path: a failed run leaves no TensorBoard writer in an engine


if __name__ == "__main__":
    run_main(main, parse_args(__doc__, stage=STAGE))
