"""What a run reports: rank-0 console lines, a tqdm bar, TensorBoard scalars and metrics.json; on request
(cfg.time_steps, used by `tutorial bench`) the time of every optimizer step; and aligned text tables.

Only rank 0 writes or prints (03b_ddp_trainer): eight ranks printing the same line teach nothing, and
eight writers on one file corrupt it.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import NamedTuple

import torch

from . import accelerator
from .config import ConfigError, TrainConfig
from .distributed import current_rank, max_over_ranks
from .process import Sigterm


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


NO_RANK = 2**24  # "no rank": above any rank, exact in a float32 all-reduce


def _losses(record: dict) -> str:
    return (f"train loss {record['train_loss']:.4f}  test loss {record['test_loss']:.4f}  "
            f"test accuracy {record['test_accuracy']:.4f}")


class DivergedError(FloatingPointError):
    """The loss became NaN or infinite: one line naming the rank and step (exit code 1)."""


def agree_at_log_step(step: int, loss: float, where: str, remedy: str, finite: bool = True) -> bool:
    """What every rank must learn at the same logged step, in one small all-reduce: whether some rank's loss has
    become NaN or infinite (then DivergedError naming the lowest such rank and the step, raised on every rank at once:
    one rank stopping alone would leave the others waiting in their next collective), and whether some rank got
    SIGTERM (returned: the trainer stops after this step). finite=False skips the loss check (fp16: GradScaler
    skips the steps whose gradients overflow, and the run recovers by itself)."""
    bad = finite and not math.isfinite(loss)
    lowest_bad, sigterm = max_over_ranks([-current_rank() if bad else -NO_RANK, Sigterm.check()])
    first_bad = -lowest_bad
    if first_bad != NO_RANK:
        seen = loss if bad and first_bad == current_rank() else "not finite"
        raise DivergedError(f"rank {int(first_bad)}: the training loss is {seen} at step {step} ({where}): {remedy}")
    return bool(sigterm)


class Agreement(NamedTuple):
    """What every rank agreed on at a logged step, in RunLog.step's one all-reduce: the same value on every rank, so
    the trainer that receives it acts at the same step on all of them (a diverged loss raises DivergedError there)."""
    step: int
    sigterm: bool  # some rank got SIGTERM: every rank stops after this step (checkpoint.stop_requested)


class RunLog:
    """Collects per-epoch metrics; on the main process also prints, draws the bar and writes files."""

    def __init__(self, cfg: TrainConfig, strategy: str, device, rank: int = 0, world_size: int = 1, **meta):
        """rank 0 prints and writes; the global batch is the per-process batch x accumulation x world_size."""
        self.cfg, self.is_main = cfg, rank == 0
        self.metrics = dict(strategy=strategy, world_size=world_size, precision=cfg.precision, device=str(device),
                            global_batch_size=cfg.batch_size * cfg.grad_accum * world_size, **meta,
                            config=cfg.to_dict(), epochs=[])
        self.started = time.perf_counter()
        self.writer = None
        self.timer = StepTimer() if cfg.time_steps else None
        if self.is_main and cfg.out:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(os.path.join(cfg.out, "tb"))
            except ImportError:  # tensorboard is optional on bare GPU nodes; metrics.json is still written
                self.print("tensorboard is not installed: no event files")
        self.header = (f"{strategy}: world size {world_size}, global batch {self.metrics['global_batch_size']}, "
                       f"precision {cfg.precision}, {cfg.dataset}/{cfg.model}")
        if not cfg.quiet:
            self.print(self.header)

    def print(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    def bar(self, loader, epoch: int):
        """The epoch's batches (the loop calls this as the epoch starts), with a progress bar on rank 0."""
        # cfg.time_steps is read here and in step(), where it acts: tests/test_matrix.py's option check counts it so
        batches = self.timer.epoch(loader) if self.cfg.time_steps else loader
        if not (self.is_main and _progress_wanted(self.cfg)):
            return batches
        from tqdm.auto import tqdm
        return tqdm(batches, desc=f"epoch {epoch}", total=len(loader), leave=False)

    def step(self, step: int, loss: torch.Tensor, lr: float, scaler) -> Agreement | None:
        """Step scalars every log_every steps, and what the ranks agree on there: an Agreement at a logged step,
        None at the others. loss.item() waits for the GPU, so it is read at log steps only, and so is the loss scale
        (`scaler` is anything with a loss_scale: the trainer's Precision or DeepSpeed's optimizer). A loss that has
        become NaN or infinite on any rank stops the run there, on every rank at once (one rank stopping alone
        would leave the others waiting in their next all-reduce), instead of training on garbage."""
        if self.cfg.time_steps:
            self.timer.step()
        if step % self.cfg.log_every:
            return None
        value = loss.item()
        sigterm = agree_at_log_step(step, value, f"lr {lr:.3g}; checked every {self.cfg.log_every} steps",
                                    "lower --lr, add --warmup-epochs or --clip-grad, and resume from the last "
                                    "checkpoint", finite=self.cfg.precision != "fp16")
        if self.writer:
            self.writer.add_scalar("train/loss", value, step)
            self.writer.add_scalar("train/lr", lr, step)
            self.writer.add_scalar("train/loss_scale", getattr(scaler, "loss_scale", 1.0), step)
        return Agreement(step, bool(sigterm))

    def epoch(self, record: dict, step: int) -> None:
        self.metrics["epochs"].append(record)
        if not self.cfg.quiet:
            self.print(f"epoch {record['epoch']}: {_losses(record)}  {record['samples_per_second']:.0f} samples/s  "
                       f"{record['epoch_seconds']:.1f} s")
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
        if self.timer:
            self.metrics["step_times"] = self.timer.result()
        if self.cfg.quiet and last:  # the one line of a quiet run: what it was and where it ended
            self.print(f"{self.header}; after epoch {last['epoch']}: {_losses(last)}")
        self._write()
        self.close()
        return self.metrics

    def close(self) -> None:
        """Write out the TensorBoard file and stop its writer's thread. finish() does on a normal end; a trainer's
        main also calls it when an error or a SIGTERM stop ends the run, which would otherwise leave the thread
        running in a notebook engine, one more per failed run. Closing twice does nothing."""
        if self.writer:
            self.writer.close()

    def _write(self) -> None:
        if self.is_main and self.cfg.out:
            path = os.path.join(self.cfg.out, "metrics.json")
            with open(path + ".tmp", "w") as f:
                json.dump(self.metrics, f, indent=1)
            os.replace(path + ".tmp", path)


class StepTimer:
    """The time of every optimizer step (cfg.time_steps): a stamp as each epoch starts and after each step. On a GPU
    the stamp is a CUDA event on the stream, read once after the run, so timing never drains the GPU's queue. On a
    CPU it is the wall clock and this process's CPU time, which on a shared machine leaves out the time other
    programs had the core. The first step of an epoch counts from the epoch's start (creating the loader's iterator
    is loading data); evaluation between epochs is not a step. Leaving out warm-up steps is the reader's choice."""

    def __init__(self):
        self.gpu = accelerator.device_module()  # torch.cuda or torch.xpu: events on the GPU's stream
        self.marks, self.samples = [], 0  # (stamp, samples in the step it ends, whether it starts an epoch)

    def _stamp(self):
        if self.gpu:
            event = self.gpu.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter(), time.process_time()

    def epoch(self, loader):
        self.start_epoch()
        return self._counted(loader)

    def start_epoch(self) -> None:
        """An epoch starts (train_lightning calls it from a hook: Lightning iterates the loader itself)."""
        self.marks.append((self._stamp(), 0, True))

    def _counted(self, loader):
        for X, y in loader:
            self.samples += y.shape[0]  # exact with a short last batch and with gradient accumulation
            yield X, y

    def step(self) -> None:
        self.marks.append((self._stamp(), self.samples, False))
        self.samples = 0

    def result(self) -> dict:
        """Seconds and samples of every step in order, and (CPU only) the process's CPU seconds."""
        if self.gpu:
            self.gpu.synchronize()
        seconds, cpu_seconds, samples = [], [], []
        for (start, _, _), (end, n, starts_epoch) in zip(self.marks, self.marks[1:]):
            if starts_epoch:  # the time before an epoch starts was evaluation, not a step
                continue
            seconds.append(start.elapsed_time(end) / 1000 if self.gpu else end[0] - start[0])
            cpu_seconds.append(None if self.gpu else end[1] - start[1])
            samples.append(n)
        return dict(seconds=seconds, samples=samples, cpu_seconds=None if self.gpu else cpu_seconds)
