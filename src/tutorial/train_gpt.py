"""Stage 11's starting point: a small GPT trained in one process (notebook 11_model_parallelism).

train_tp.py is this file plus the lines tagged "# TP:", train_pp.py this file plus those tagged
"# PP:", and train_2d.py is train_tp.py plus those tagged "# 2D:" (`diff -u train_gpt.py
train_tp.py` is the tensor-parallel lesson). It is also the reference the three are compared with:
the same model from the same seed, the same global batch at every step, so their losses and weights
must equal this file's up to float rounding. The image trainers' skeleton (setup, build, evaluate,
fit, main(cfg, build=build)) without their core.loop.Loop: see the README. Run it with:

    python -m tutorial.train_gpt --steps 20 --out runs/gpt
"""
from __future__ import annotations

import time

import torch

from .core.distributed import pick_device
from .core.corpus import CharCorpus, batches
from .core.gpt import GPT, loss_fn, parameter_bytes
from .core.parallel_config import (ParallelConfig, check_stopped, log_step, parse_parallel_args,
                                    save_run)
from .core.process import run_main

STAGE = "gpt"  # its options (parse_parallel_args), its name in the metrics


def setup(cfg: ParallelConfig):
    """The device."""
    device = pick_device(0)  # the first GPU, or the CPU
    return device


def build(cfg: ParallelConfig, device: torch.device):
    """The text, model and optimizer: (model, optimizer, corpus)."""
    corpus = CharCorpus()
    model = GPT(cfg.gpt(), seed=cfg.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    return model, optimizer, corpus


def train_step(model, optimizer, X, y) -> torch.Tensor:
    """One optimizer step on the batch; its loss, left on the device (a read waits for the GPU)."""
    optimizer.zero_grad()
    loss = loss_fn(model(X), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


@torch.no_grad()
def evaluate(cfg, model, corpus, device) -> float:
    """The mean loss over 4 fixed batches no step trained on (another seed)."""
    model.eval()
    losses = [loss_fn(model(X.to(device)), y.to(device)).item()
              for X, y in batches(corpus, cfg.batch_size, cfg.context, 4, seed=cfg.seed + 10_000)]
    model.train()
    return sum(losses) / len(losses)


def full_state(model) -> dict:
    """The whole model's weights, on the CPU: for the run's record."""
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def fit(cfg, device, model, optimizer, corpus) -> dict:
    """cfg.steps steps; the run's metrics, and its record in cfg.out (metrics.json, model.pt)."""
    losses, start = [], time.perf_counter()
    batched = batches(corpus, cfg.batch_size, cfg.context, cfg.steps, seed=cfg.seed)
    for step, (X, y) in enumerate(batched, 1):
        X, y = X.to(device), y.to(device)
        losses.append(train_step(model, optimizer, X, y))
        if log_step(cfg, step, losses[-1]):  # read at log steps: a NaN raises, a SIGTERM stops
            break
    losses = torch.stack(losses).tolist()
    metrics = dict(strategy=STAGE, world_size=1, device=str(device), steps=len(losses),
                   losses=losses, seconds=time.perf_counter() - start,
                   test_loss=evaluate(cfg, model, corpus, device),
                   parameter_bytes=parameter_bytes(model))
    state = full_state(model)
    if cfg.out:
        save_run(cfg.out, state, metrics)
    check_stopped(cfg, len(losses))
    return metrics


def main(cfg: ParallelConfig, build=build) -> dict:
    """Train cfg; returns the run's metrics. main sets up, builds and hands the model to fit. build
    is a hook for lessons, as in the image trainers: a function with build's arguments and results,
    so a lesson trains a model it changed exactly as this trainer trains."""
    device = setup(cfg)
    model, optimizer, corpus = build(cfg, device)
    return fit(cfg, device, model, optimizer, corpus)


if __name__ == "__main__":
    run_main(main, parse_parallel_args("Train a small GPT in one process.", stage=STAGE))
