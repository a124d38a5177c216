"""Stage 1: training on one device (notebook 01_single_device).

The baseline that every later stage changes by a small, tagged diff:

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
from .core.metrics import patience_exhausted, top5_correct
from .core.models import build_model, checksum
from .core.optim import build_optimizer, epoch_progress, lr_at, micro_batch_weight, set_lr
from .core.precision import Precision
from .core.process import run_main


def setup(cfg: TrainConfig):
    """The device, the precision policy and the seed; bad options fail here, before any work."""
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    amp = Precision(cfg.precision, device)
    cfg.check_stage("single", device)  # an option only other trainers read is refused, not ignored
    tracking.prepare_output(cfg)
    torch.manual_seed(cfg.seed)
    return device, amp


def build(cfg: TrainConfig, device: torch.device):
    """Data, model and optimizer."""
    train_set, test_set, info = build_datasets(cfg)
    # A seeded shuffle, re-seeded every epoch: runs are reproducible and a resumed run sees the same order.
    sampler = RandomSampler(train_set, generator=torch.Generator())
    train_loader = make_loader(train_set, cfg, device, sampler=sampler)
    test_loader = make_loader(test_set, cfg, device)
    model = build_model(cfg.model, info).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    lr = cfg.lr
    optimizer = build_optimizer(model, cfg, lr)
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
        with amp.autocast():
            loss = F.cross_entropy(model(X), y)
        amp.backward(loss * micro_batch_weight(loader, i, len(y), cfg.grad_accum))
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
    loss_sum, correct, correct5, count = sums.tolist()
    return loss_sum / count, correct / count, correct5 / count


def main(cfg: TrainConfig) -> dict:
    device, amp = setup(cfg)
    model, optimizer, train_loader, test_loader, peak_lr = build(cfg, device)
    if cfg.compile:
        model = torch.compile(model)
    log = tracking.RunLog(cfg, "single", device)
    state = checkpoint.resume(cfg, model, optimizer, amp.scaler, device)
    log.metrics["epochs"] = state.history
    for epoch in range(state.epoch, cfg.epochs):
        train_loader.sampler.generator.manual_seed(cfg.seed + epoch)
        train_loss, samples_per_second, seconds = train_one_epoch(
            cfg, model, optimizer, amp, train_loader, device, epoch, peak_lr, state, log)
        if state.batch:  # a SIGTERM stopped this epoch: save where it stopped, then exit (143)
            checkpoint.save(cfg, model, optimizer, amp.scaler, state)
            raise checkpoint.stopped(state, cfg.out)
        test_loss, test_accuracy, test_top5 = evaluate(cfg, model, amp, test_loader, device)
        log.epoch(dict(epoch=epoch, train_loss=train_loss, test_loss=test_loss, test_accuracy=test_accuracy,
                       samples_per_second=samples_per_second, epoch_seconds=seconds,
                       lr=optimizer.param_groups[0]["lr"], skipped_steps=amp.skipped_steps), state.step)
        log.metrics["test_top5_accuracy"] = test_top5  # seed 001: the label among the 5 highest scores
        state.epoch = epoch + 1
        checkpoint.save(cfg, model, optimizer, amp.scaler, state)
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
    digests = [checksum(model)]
    return log.finish(steps=state.step, replica_checksums=digests, replicas_identical=len(set(digests)) == 1)


if __name__ == "__main__":
    run_main(main, parse_args("Train on one device (CPU or one GPU).", stage="single"))
