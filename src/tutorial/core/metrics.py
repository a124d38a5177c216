"""Two things every trainer's loop asks at the end of an epoch: how many test images had the right class among the
top 5 (seed 001's curves plot top-1 and top-5 accuracy), and whether to stop early (seed 000: when the test loss has
not improved for `patience` epochs). Written once, so that every trainer changes by the same line."""
from __future__ import annotations

import torch


def top5_correct(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """How many samples have their label among the 5 highest logits (all of them with fewer than 5 classes)."""
    top = logits.topk(min(5, logits.shape[1]), dim=1).indices
    return (top == y[:, None]).any(dim=1).sum()


def patience_exhausted(cfg, history: list[dict]) -> bool:
    """True once the best test loss is `cfg.patience` epochs old (never with patience 0). Read from the epoch records,
    so a resumed run stops where the uninterrupted one would have."""
    if not cfg.patience or not history:
        return False
    losses = [e["test_loss"] for e in history]
    return len(losses) - 1 - losses.index(min(losses)) >= cfg.patience
