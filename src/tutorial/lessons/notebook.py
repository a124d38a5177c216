"""Small helpers the notebooks call, so their cells stay short and their compared outputs are facts.

Every notebook's first code cell is `cfg = notebook.choose_preset()`; cells that train print facts that hold on any
machine with `notebook.check(...)` ("test accuracy >= 0.95: True") rather than raw numbers.
"""
from __future__ import annotations

import difflib
import gc
import importlib
import inspect
import os
import shlex
import shutil
import time
from pathlib import Path

from ..core.config import TrainConfig, default_preset, parse_args
from ..bench.record import print_table  # noqa: F401 - the notebooks' tables: notebook.print_table
# Where a lesson's ranks go is launch policy (launch/allocation.py); the notebooks ask notebook.allocation(...).
from ..launch.allocation import allocation, env_prefix, sized_for_cpu  # noqa: F401

# The accuracy each preset reaches when training works; notebooks compare against these, not exact numbers.
EXPECTED_ACCURACY = {"smoke": 0.95, "workshop": 0.85, "workshop-cpu": 0.0, "benchmark": 0.0}
PACKAGE = Path(__file__).parents[1]  # src/tutorial, where the trainers are


def cpu_only() -> str:
    """The prefix of a ! command that keeps its processes off the GPUs: "CUDA_VISIBLE_DEVICES=" on NVIDIA, each
    vendor's own variables on AMD and Intel (core.accelerator.showing), for launches a lesson runs on the CPU."""
    return env_prefix(())


def choose_preset(**overrides) -> TrainConfig:
    """The preset for this machine (smoke on a CPU, workshop on a GPU node), or $TUTORIAL_PRESET if set.

    Override a field for the whole notebook by editing this cell, e.g. choose_preset(epochs=2), or by starting
    JupyterLab with TUTORIAL_PRESET=smoke to force the CPU preset on a GPU node. $TUTORIAL_CONFIG adds trainer
    flags on top, e.g. "--generated 5000" (made-up CIFAR-shaped images where CIFAR-10 cannot be downloaded).
    """
    extra = shlex.split(os.environ.get("TUTORIAL_CONFIG", ""))
    cfg = parse_args(argv=["--preset", default_preset(), *extra]).replace(**overrides)
    import torch
    where = f"{torch.accelerator.device_count()} GPU(s)" if torch.accelerator.is_available() else "CPU only"
    print(f"preset {cfg.preset_name} ({where}): {cfg.dataset}/{cfg.model}, batch {cfg.batch_size} per process, "
          f"{cfg.epochs} epochs, {cfg.precision}")
    return cfg


def expected_accuracy(cfg: TrainConfig) -> float:
    return EXPECTED_ACCURACY.get(cfg.preset_name, 0.0)


def check(label: str, value: bool) -> bool:
    """Print a fact as 'label: True/False' (what strict nbval compares)."""
    print(f"{label}: {bool(value)}")
    return bool(value)


def check_accuracy(metrics: dict, cfg: TrainConfig) -> bool:
    return check(f"test accuracy >= {expected_accuracy(cfg)}", metrics["test_accuracy"] >= expected_accuracy(cfg))


def source(obj) -> None:
    """Print a function's or module's source: notebooks show the package's code, never a pasted copy."""
    print(inspect.getsource(obj))


def diff(old: str, new: str, function: str | None = None, context: int = 1) -> None:
    """The lesson of a stage as a unified diff of two trainers: `diff("train_single", "train_ddp")` prints what DDP
    adds to the file, `diff("train_single", "train_ddp", "build")` what it adds to one function (fits a slide)."""
    if function:
        a, b = (inspect.getsource(getattr(importlib.import_module(f"tutorial.{m}"), function)) for m in (old, new))
        labels = f"{old}.{function}", f"{new}.{function}"
    else:  # read, not imported: train_horovod's diff shows where Horovod is not installed
        a, b = ((PACKAGE / f"{m}.py").read_text() for m in (old, new))
        labels = f"{old}.py", f"{new}.py"
    for line in difflib.unified_diff(a.splitlines(), b.splitlines(), *labels, n=context, lineterm=""):
        print(line)


def runs_dir(name: str, empty: bool = True) -> str:
    """Where a notebook's runs go: runs/<name> next to the notebooks (ignored by git), emptied unless `empty=False`
    (03b's capstone keeps the learner's edited script). A cell must never read what an earlier execution left: after
    a launch that failed (a `!` command does not fail its cell), the next cell would check the last run's
    metrics.json as this one's, and a trainer would resume an old checkpoint. So re-running a notebook's setup cell
    starts its runs afresh: run the sections after it again. The folder itself stays (it may link to scratch)."""
    path = os.path.join(os.environ.get("TUTORIAL_RUNS", "runs"), name)
    os.makedirs(path, exist_ok=True)
    for entry in os.scandir(path) if empty else ():
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    return path


def _child_pids() -> list[int]:
    import psutil
    return [p.pid for p in psutil.Process().children(recursive=True)]


def child_processes() -> list[int]:
    """Process ids of this kernel's children still alive (DataLoader workers end with their loaders)."""
    gc.collect()  # a loader kept alive only by a reference cycle keeps its workers until collected
    deadline = time.monotonic() + 5
    while _child_pids() and time.monotonic() < deadline:  # workers that were told to stop are still exiting
        time.sleep(0.1)
    return _child_pids()


def tensorboard_tags(logdir: str) -> list[str]:
    """The scalar tags in a run's TensorBoard event files (what `tensorboard --logdir` would plot)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(logdir)
    acc.Reload()
    return sorted(acc.Tags()["scalars"])
