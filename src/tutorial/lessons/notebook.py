"""Small helpers the notebooks call, so their cells stay short and their compared outputs are facts.

Every notebook's first code cell is `cfg = notebook.choose_preset()`; cells that train print facts that hold on any
machine with `notebook.check(...)` ("test accuracy >= 0.95: True") rather than raw numbers.
"""
from __future__ import annotations

import dataclasses
import difflib
import gc
import importlib
import inspect
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from ..core.config import GPT_STAGES, STAGES, ConfigError, TrainConfig, default_preset, parse_args
from ..bench.record import print_table  # noqa: F401 - the notebooks' tables: notebook.print_table

# The accuracy each preset reaches when training works; notebooks compare against these, not exact numbers.
EXPECTED_ACCURACY = {"smoke": 0.95, "workshop": 0.85, "workshop-cpu": 0.0, "benchmark": 0.0}
PACKAGE = Path(__file__).parents[1]  # src/tutorial, where the trainers are


def choose_preset(**overrides) -> TrainConfig:
    """The preset for this machine (smoke on a CPU, workshop on a GPU node), or $TUTORIAL_PRESET if set.

    Override a field for the whole notebook by editing this cell, e.g. choose_preset(epochs=2), or by starting
    JupyterLab with TUTORIAL_PRESET=smoke to force the CPU preset on a GPU node. $TUTORIAL_CONFIG adds trainer
    flags on top, e.g. "--generated 5000" (made-up CIFAR-shaped images where CIFAR-10 cannot be downloaded).
    """
    extra = shlex.split(os.environ.get("TUTORIAL_CONFIG", ""))
    cfg = parse_args(argv=["--preset", default_preset(), *extra]).replace(**overrides)
    import torch
    where = f"{torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "CPU only"
    print(f"preset {cfg.preset_name} ({where}): {cfg.dataset}/{cfg.model}, batch {cfg.batch_size} per process, "
          f"{cfg.epochs} epochs, {cfg.precision}")
    return cfg


BY_HAND = None  # allocation's trainer=None: a process group made by hand in %%px cells, not a trainer's
# Who may share a GPU with another rank over gloo with CUDA tensors: DDP's all-reduce and broadcast, and a process
# group made by hand. Not Horovod (its NCCL build wants a GPU per rank), FSDP or DeepSpeed
# (reduce-scatter and all-gather of sharded tensors, NCCL's on a GPU), Lightning ("gpu" accelerator: one device per
# process) or SyncBatchNorm (NCCL only on GPUs): their ranks move to the CPU, sized for it, where GPUs are too few.
GPU_SHARING_TRAINERS = ("ddp", BY_HAND)
GPU_PRESETS = ("workshop", "benchmark")   # sized for GPUs: hours on CPU processes
CPU_PRESET = "smoke"                      # what CPU processes train instead: the real digits, in minutes


@dataclass(frozen=True, repr=False)
class Allocation:
    """What a lesson's ranks run on, and the config they train with (notebook.allocation decides)."""
    ranks: int
    device: str              # "cuda" or "cpu": engines.start(device=...)
    backend: str             # "nccl" (one rank per GPU) or "gloo" (CPU, or ranks sharing a GPU)
    gpus: tuple              # the GPUs the ranks take, as CUDA_VISIBLE_DEVICES names them: engines.start(gpus=...)
    cfg: TrainConfig         # the notebook's config with the backend, and CPU sizes where the ranks run on CPUs
    line: str                # the one-line choice that allocation() printed

    @property
    def env(self) -> str:
        """The variable for a launch typed as a ! command: the GPUs its processes may see ("" hides them all)."""
        if self.device == "cuda":
            return f"CUDA_VISIBLE_DEVICES={','.join(self.gpus)}"
        return "CUDA_VISIBLE_DEVICES=" if _visible_gpus() else ""  # nothing to hide on a CPU-only machine

    @property
    def script_env(self) -> str:
        """For a launch of a script that picks NCCL whenever it sees a GPU (the usual DDP idiom; 03b's capstone): its
        GPUs where there is one per rank, none where its ranks would share one (NCCL refuses that)."""
        if self.backend == "nccl":
            return self.env
        return "CUDA_VISIBLE_DEVICES=" if _visible_gpus() else ""

    def __repr__(self) -> str:
        return self.line


def _visible_gpus() -> list[str]:
    from ..launch.engines import visible_gpus
    return visible_gpus()


def sized_for_cpu(cfg: TrainConfig) -> TrainConfig:
    """A GPU preset's config for CPU processes: what the smoke preset sets differently from the GPU preset (the real
    digits on the small CNN, fp32, its epochs, batch and lr), so that a one-GPU attendee whose ranks run on the CPU
    sees them learn in a minute or two; what the notebook changed on top of its preset (out, quiet, ...) is kept."""
    if cfg.preset_name not in GPU_PRESETS:
        return cfg  # already sized for a CPU (smoke, workshop-cpu)
    base, cpu = TrainConfig.preset(cfg.preset_name), TrainConfig.preset(CPU_PRESET)
    sizes = {f.name: getattr(cpu, f.name) for f in dataclasses.fields(cpu)
             if getattr(base, f.name) != getattr(cpu, f.name) and f.name != "preset_name"}
    return cfg.replace(**sizes, preset_name=CPU_PRESET)


def allocation(ranks: int, cfg: TrainConfig | None = None, trainer: str | None = "ddp") -> Allocation:
    """What a lesson's `ranks` processes run on, and with what config; prints the choice in one line.

    - this node's visible GPUs >= ranks: one rank per GPU, NCCL, the config as it is;
    - fewer GPUs (one GPU per attendee): the ranks share them over gloo with CUDA tensors, where `trainer` can
      (GPU_SHARING_TRAINERS); where it cannot, the ranks run on the CPU with the smoke preset's sizes on the real
      digits;
    - no GPU: the CPU with gloo, and the preset choose_preset() picked (smoke unless $TUTORIAL_PRESET says otherwise).

    trainer: the stage the ranks train with (ddp, horovod, fsdp, deepspeed, lightning, tp, pp, 2d), None for a group
    made by hand in %%px cells. Visible GPUs honour CUDA_VISIBLE_DEVICES: on a shared node each attendee's JupyterLab
    gets its own, and the engines take only those. Use it as:

        alloc = notebook.allocation(2, cfg)
        cluster = engines.start(n=2, device=alloc.device, gpus=alloc.gpus)
        cluster.run(train_ddp.main, alloc.cfg)
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ConfigError(f"ranks must be a whole number of at least 1, got {ranks!r}")
    if trainer is not None and trainer not in STAGES + GPT_STAGES:
        raise ConfigError(f"trainer {trainer!r} is not one of: {', '.join(STAGES + GPT_STAGES)} (or None for a "
                          f"process group made by hand)")
    cfg = cfg if cfg is not None else TrainConfig.preset(default_preset())
    gpus = _visible_gpus()
    named = f"{len(gpus)} GPU(s) visible" + (f" ({','.join(gpus)})" if gpus else "")
    sync_bn = cfg.sync_bn and trainer is not None
    who = f"train_{trainer}" + (" with SyncBatchNorm" if sync_bn and trainer in GPU_SHARING_TRAINERS else "") \
        if trainer else "a process group made by hand"
    if len(gpus) >= ranks:
        alloc = Allocation(ranks, "cuda", "nccl", tuple(gpus[:ranks]), cfg,
                           f"allocation: {ranks} rank(s) on GPU(s) {','.join(gpus[:ranks])}, one per GPU, NCCL "
                           f"({named}); preset {cfg.preset_name}")
    elif gpus and trainer in GPU_SHARING_TRAINERS and not sync_bn:
        shared = cfg.replace(backend="gloo") if trainer else cfg
        alloc = Allocation(ranks, "cuda", "gloo", tuple(gpus), shared,
                           f"allocation: {ranks} ranks share {named} over gloo with CUDA tensors (NCCL needs a GPU "
                           f"per rank); preset {cfg.preset_name}")
    elif gpus:
        small = sized_for_cpu(cfg).replace(sync_bn=False)  # SyncBatchNorm works on CUDA tensors only
        alloc = Allocation(ranks, "cpu", "gloo", (), small,
                           f"allocation: {ranks} ranks on the CPU with gloo ({named}, fewer than the ranks, and "
                           f"{who} cannot share a GPU over gloo); preset {small.preset_name}: its sizes on the "
                           "real digits, where learning shows" + ("; SyncBatchNorm off" if cfg.sync_bn else ""))
    else:
        alloc = Allocation(ranks, "cpu", "gloo", (), cfg,
                           f"allocation: {ranks} rank(s) on the CPU with gloo (no GPU visible); preset "
                           f"{cfg.preset_name}")
    print(alloc.line)
    return alloc


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


def runs_dir(name: str) -> str:
    """Where a notebook's runs go: runs/<name> next to the notebooks (ignored by git)."""
    path = os.path.join(os.environ.get("TUTORIAL_RUNS", "runs"), name)
    os.makedirs(path, exist_ok=True)
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
