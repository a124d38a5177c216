"""What the GPT trainers (train_gpt, train_tp, train_pp, train_2d) read, from the command line or a notebook, and
the record rank 0 writes of a run. TrainConfig (core.config) is about images; this is about the small GPT of core.gpt
and how it is cut.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from .config import BACKENDS, ConfigError, OneLineErrorParser, fail
from .gpt import GPTConfig
from .process import Stopped
from .tracking import agree_at_log_step

SCHEDULES = ("gpipe", "1f1b")


@dataclass
class ParallelConfig:
    """What train_tp, train_pp and train_2d read (TrainConfig is about images). Unlike the data-parallel stages,
    `batch_size` is the global batch: tensor-parallel ranks all see the same batch, pipeline stages cut it into
    micro-batches, and 2D gives each data-parallel group batch_size / dp of it."""
    # model (GPTConfig's fields)
    context: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    # training
    steps: int = 20               # optimizer steps
    batch_size: int = 16          # the global batch, in sequences of `context` characters
    lr: float = 3e-3              # AdamW
    log_every: int = 5            # steps between reads of the loss on the host, where a NaN or a SIGTERM stops the run
    seed: int = 0                 # the weights and the batches: every rank and the one-process run use the same
    # parallelism
    tp: int = 2                   # train_2d: ranks per tensor-parallel group (the "tp" mesh dim); dp = world / tp
    sequence_parallel: bool = True  # TP: the norms and the residual stream split along the sequence between layers
    micro_batches: int = 4        # PP: micro-batches per step; batch_size must be a multiple of it
    schedule: str = "1f1b"        # PP: gpipe (all forwards, then all backwards) or 1f1b (interleaved)
    backend: str = "auto"         # auto: nccl on GPUs, gloo on CPUs
    timeout: float = 300.0        # seconds a rank waits for the others
    out: str = ""                 # rank 0 writes metrics.json and the whole model's model.pt here ("": nothing)

    def gpt(self, vocab_size: int = 48) -> GPTConfig:
        return GPTConfig(vocab_size=vocab_size, context=self.context, d_model=self.d_model, n_heads=self.n_heads,
                         n_layers=self.n_layers).validate()

    def validate(self) -> "ParallelConfig":
        for name in ("steps", "batch_size", "log_every", "tp", "micro_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule {self.schedule!r} is not one of: {', '.join(SCHEDULES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not one of: {', '.join(BACKENDS)}")
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {self.timeout}")
        self.gpt()
        return self

    def replace(self, **changes) -> "ParallelConfig":
        return dataclasses.replace(self, **changes).validate()


# The fields only some of the four trainers read; the others refuse a value other than the default in one line.
PARALLEL_ONLY_IN = {"tp": ("2d",), "sequence_parallel": ("tp", "2d"), "micro_batches": ("pp",), "schedule": ("pp",),
                    "backend": ("tp", "pp", "2d"), "timeout": ("tp", "pp", "2d")}  # train_gpt has no process group


def parse_parallel_args(description: str, argv=None, stage: str | None = None) -> ParallelConfig:
    """--flag value for every ParallelConfig field; a bad value, or one train_<stage> would ignore, is one line and
    exit 2."""
    parser = OneLineErrorParser(description=description)
    for f in dataclasses.fields(ParallelConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, metavar=f.name.upper())
    try:
        cfg = ParallelConfig(**vars(parser.parse_args(argv))).validate()
        for name, stages in PARALLEL_ONLY_IN.items():
            if stage and stage not in stages and getattr(cfg, name) != getattr(ParallelConfig(), name):
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)} is not used by train_{stage}; it "
                                  f"works in {', '.join('train_' + s for s in stages)}")
        return cfg
    except ConfigError as exc:
        fail(exc)


def log_step(cfg: ParallelConfig, step: int, loss: torch.Tensor) -> bool:
    """After optimizer step `step` (from 1): at every log_every-th step and the last, the loss is read on the host (a
    wait for the GPU, so not at every step: nanoGPT and torchtitan read at their log steps) and the ranks agree, in
    one all-reduce, that it is finite (else every rank raises DivergedError naming the first bad rank and the step)
    and whether any got SIGTERM (True: stop after this step, on every rank)."""
    if step % cfg.log_every and step != cfg.steps:
        return False
    return agree_at_log_step(step, loss.item(), f"lr {cfg.lr:g}; checked every {cfg.log_every} steps",
                             "lower --lr")


def check_stopped(cfg: ParallelConfig, done: int) -> None:
    """After the run's record is saved: a run that a SIGTERM stopped before cfg.steps ends as the image trainers'
    runs do (core.process.Stopped: one line, exit 143)."""
    if done < cfg.steps:
        kept = f"; the steps so far are in {cfg.out}" if cfg.out else ""
        raise Stopped(f"SIGTERM: stopped after step {done} of {cfg.steps} on every rank{kept}")


def save_run(out: str, state: dict, metrics: dict) -> None:
    """Rank 0's record of a run: the whole model's weights (out/model.pt) and the metrics (out/metrics.json)."""
    import json
    import os
    os.makedirs(out, exist_ok=True)
    torch.save(state, os.path.join(out, "model.pt"))
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
