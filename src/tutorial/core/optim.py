"""Optimizer and learning-rate schedule (lr scaling and warm-up are taught in 03b_ddp_trainer)."""
from __future__ import annotations

import math

import torch

from .config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def scaled_lr(cfg: TrainConfig, world_size: int) -> float:
    """The linear scaling rule: a global batch k times larger takes a k times larger learning rate."""
    return cfg.lr * world_size if cfg.lr_scaling == "linear" else cfg.lr


def lr_at(cfg: TrainConfig, epoch: float, peak: float) -> float:
    """The lr at a fractional epoch: linear warm-up to the peak, then cosine decay (or constant).

    A function of epochs, not steps, so a run resumed with another world size (other steps per epoch) continues the
    same curve.
    """
    if cfg.warmup_epochs and epoch < cfg.warmup_epochs:
        return peak * (epoch + 1e-3) / cfg.warmup_epochs
    if cfg.schedule == "constant":
        return peak
    progress = (epoch - cfg.warmup_epochs) / max(cfg.epochs - cfg.warmup_epochs, 1e-9)
    return peak * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def epoch_progress(loader, i: int, grad_accum: int) -> float:
    """How far into its epoch the optimizer step that micro-batch i belongs to starts, counted in optimizer steps:
    step k of n is at k / n, as for one process at the global batch, so accumulation follows the same lr curve."""
    return (i // grad_accum) / math.ceil(len(loader) / grad_accum)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def micro_batch_weight(loader, i: int, batch: int, grad_accum: int) -> float:
    """What micro-batch i's mean loss is multiplied by before backward: its share of the samples in its accumulation
    group. Summed over the group, the gradients are those of the group's mean loss, also for an epoch's last,
    shorter group (loss / grad_accum would under-weight it). 1.0 without accumulation."""
    group_start = i // grad_accum * grad_accum * loader.batch_size
    group = min(grad_accum * loader.batch_size, len(loader.sampler) - group_start)
    return batch / group
