"""What a run reports: rank-0 console lines, a tqdm bar, TensorBoard scalars and metrics.json.

Only rank 0 writes or prints (03_distributed_data_parallel): eight ranks printing the same line teach nothing, and
eight writers on one file corrupt it.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from .config import ConfigError, TrainConfig


def prepare_output(cfg: TrainConfig) -> None:
    """Fail before any training when --out cannot be written (every rank checks: a shared file system may differ)."""
    if not cfg.out:
        return
    try:
        os.makedirs(cfg.out, exist_ok=True)
        probe = os.path.join(cfg.out, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"--out {cfg.out!r} is not writable ({exc.strerror or exc})") from None


def _progress_wanted(cfg: TrainConfig) -> bool:
    if cfg.progress is not None:
        return cfg.progress
    return sys.stderr.isatty() and not os.environ.get("CI")


class RunLog:
    """Collects per-epoch metrics; on the main process also prints, draws the bar and writes files."""

    def __init__(self, cfg: TrainConfig, is_main: bool, **meta):
        self.cfg, self.is_main = cfg, is_main
        self.metrics = dict(meta, config=cfg.to_dict(), epochs=[])
        self.started = time.perf_counter()
        self.writer = None
        if is_main and cfg.out:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(os.path.join(cfg.out, "tb"))
            except ImportError:  # tensorboard is optional on bare GPU nodes; metrics.json is still written
                self.print("tensorboard is not installed: no event files")
        self.print(f"{meta.get('strategy')}: world size {meta.get('world_size')}, global batch "
                   f"{meta.get('global_batch_size')}, precision {cfg.precision}, {cfg.dataset}/{cfg.model}")

    def print(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    def bar(self, iterable, epoch: int):
        if not (self.is_main and _progress_wanted(self.cfg)):
            return iterable
        from tqdm.auto import tqdm
        return tqdm(iterable, desc=f"epoch {epoch}", leave=False)

    def step(self, step: int, loss: torch.Tensor, lr: float, loss_scale: float) -> None:
        """Step scalars every log_every steps (loss.item() waits for the GPU, so not every step)."""
        if self.writer and step % self.cfg.log_every == 0:
            self.writer.add_scalar("train/loss", loss.item(), step)
            self.writer.add_scalar("train/lr", lr, step)
            self.writer.add_scalar("train/loss_scale", loss_scale, step)

    def epoch(self, record: dict, step: int) -> None:
        self.metrics["epochs"].append(record)
        self.print(f"epoch {record['epoch']}: train loss {record['train_loss']:.4f}  test loss "
                   f"{record['test_loss']:.4f}  test accuracy {record['test_accuracy']:.4f}  "
                   f"{record['samples_per_second']:.0f} samples/s  {record['epoch_seconds']:.1f} s")
        if self.writer:
            for key in ("train_loss", "test_loss", "test_accuracy", "samples_per_second", "lr", "skipped_steps"):
                self.writer.add_scalar(f"epoch/{key}", record[key], step)
            self.writer.flush()
        self._write()

    def finish(self, **final) -> dict:
        last = self.metrics["epochs"][-1] if self.metrics["epochs"] else {}
        self.metrics.update(test_accuracy=last.get("test_accuracy"), test_loss=last.get("test_loss"),
                            train_loss=last.get("train_loss"), wall_seconds=time.perf_counter() - self.started,
                            **final)
        self._write()
        if self.writer:
            self.writer.close()
        return self.metrics

    def _write(self) -> None:
        if self.is_main and self.cfg.out:
            path = os.path.join(self.cfg.out, "metrics.json")
            with open(path + ".tmp", "w") as f:
                json.dump(self.metrics, f, indent=1)
            os.replace(path + ".tmp", path)
