"""Where a lesson's ranks run, and with what config: the launch policy (which GPUs, which backend, which sizes) that
every notebook asks before it starts engines or types a launch (notebook.allocation, README's allocation table), and
that engines.start(device=..., gpus=...) and a launch's visible-devices variable (CUDA_VISIBLE_DEVICES on NVIDIA)
then take as decided."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core import accelerator
from ..core.config import GPT_STAGES, STAGES, ConfigError, TrainConfig, default_preset
from ..core.parallel_config import ParallelConfig
from .engine_options import visible_gpus

BY_HAND = None  # allocation's trainer=None: a process group made by hand in %%px cells, not a trainer's
# Who may share a GPU with another rank over gloo with CUDA tensors: DDP's all-reduce and broadcast, and a process
# group made by hand. Not Horovod (its NCCL build wants a GPU per rank), FSDP or DeepSpeed
# (reduce-scatter and all-gather of sharded tensors, NCCL's on a GPU), Lightning ("gpu" accelerator: one device per
# process), SyncBatchNorm (NCCL only on GPUs) or the GPT's tensor and pipeline parallel (DTensor's collectives and
# point-to-point sends, NCCL's on a GPU): their ranks move to the CPU, sized for it, where GPUs are too few.
GPU_SHARING_TRAINERS = ("ddp", BY_HAND)  # over gloo with CUDA tensors: NVIDIA's and AMD's GPUs (gloo has no XPU)
NO_XPU_TRAINERS = ("horovod", "lightning")  # no XPU operations in Horovod, no XPU accelerator in Lightning's core
GPU_PRESETS = ("workshop", "benchmark")   # sized for GPUs: hours on CPU processes
CPU_PRESET = "smoke"                      # what CPU processes train instead: the real digits, in minutes


@dataclass(frozen=True, repr=False)
class Allocation:
    """What a lesson's ranks run on, and the config they train with (allocation() decides)."""
    ranks: int
    device: str              # "gpu" or "cpu": engines.start(device=...)
    backend: str             # "nccl" (one rank per GPU; "xccl" on Intel) or "gloo" (CPU, or ranks sharing a GPU)
    gpus: tuple              # the GPUs the ranks take, as visible_gpus() names them: engines.start(gpus=...)
    # The image trainers' TrainConfig with the backend, and CPU sizes where the ranks run on CPUs; for the GPT
    # trainers the ParallelConfig given, with the backend (None when none was given: they are small on any device).
    cfg: TrainConfig | ParallelConfig | None
    line: str                # the one-line choice that allocation() printed

    @property
    def env(self) -> str:
        """The variable for a launch typed as a ! command: the GPUs its processes may see (CUDA_VISIBLE_DEVICES=0,1
        on NVIDIA; an empty value hides them all; the vendor's variable on AMD and Intel, accelerator.showing)."""
        if self.device == "gpu":
            return env_prefix(self.gpus)
        return env_prefix(()) if visible_gpus() else ""  # nothing to hide on a CPU-only machine

    @property
    def script_env(self) -> str:
        """For a launch of a script that picks NCCL whenever it sees a GPU (the usual DDP idiom; 03b's capstone): its
        GPUs where there is one per rank, none where its ranks would share one (NCCL refuses that)."""
        if self.backend != "gloo":  # nccl, or xccl on Intel
            return self.env
        return env_prefix(()) if visible_gpus() else ""

    def __repr__(self) -> str:
        return self.line


def env_prefix(gpus) -> str:
    """accelerator.showing(gpus) as a shell command's prefix: "CUDA_VISIBLE_DEVICES=0,1"; () hides every GPU."""
    return " ".join(f"{name}={value}" for name, value in accelerator.showing(gpus).items())


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


def allocation(ranks: int, cfg: TrainConfig | ParallelConfig | None = None, trainer: str | None = "ddp") -> Allocation:
    """What a lesson's `ranks` processes run on, and with what config; prints the choice in one line.

    - this node's visible GPUs >= ranks: one rank per GPU, NCCL, the config as it is;
    - fewer GPUs (one GPU per attendee): the ranks share them over gloo with CUDA tensors, where `trainer` can
      (GPU_SHARING_TRAINERS); where it cannot, the ranks run on the CPU, an image trainer's with the smoke preset's
      sizes on the real digits;
    - no GPU: the CPU with gloo, and the preset choose_preset() picked (smoke unless $TUTORIAL_PRESET says otherwise).

    trainer: the stage the ranks train with (ddp, horovod, fsdp, deepspeed, lightning; tp, pp, 2d, whose cfg is a
    ParallelConfig or None), None for a group made by hand in %%px cells. Visible GPUs honour CUDA_VISIBLE_DEVICES
    (the vendor's variable: engine_options.visible_gpus): on a shared node each attendee's JupyterLab gets its own,
    and the engines take only those. Use it as:

        alloc = notebook.allocation(2, cfg)
        cluster = engines.start(n=2, device=alloc.device, gpus=alloc.gpus)
        cluster.run(train_ddp.main, alloc.cfg)
    """
    _check(ranks, cfg, trainer)
    gpt = trainer in GPT_STAGES
    cfg = cfg if cfg is not None or gpt else TrainConfig.preset(default_preset())
    gpus = visible_gpus()
    found = accelerator.vendor() or accelerator.NVIDIA  # the words for a GPU run: NCCL and CUDA on NVIDIA
    library, kind = found.library, found.device_type
    named = f"{len(gpus)} GPU(s) visible" + (f" ({','.join(gpus)})" if gpus else "")
    sync_bn = not gpt and trainer is not None and cfg.sync_bn
    if found is accelerator.INTEL and trainer in NO_XPU_TRAINERS and gpus:
        how, taken = "moved", []
        where = f"{ranks} rank(s) on the CPU with gloo ({named}, and train_{trainer} has no Intel GPU support)"
    elif len(gpus) >= ranks:
        how, taken = "one per GPU", gpus[:ranks]
        where = f"{ranks} rank(s) on GPU(s) {','.join(taken)}, one per GPU, {library} ({named})"
    elif gpus and trainer in GPU_SHARING_TRAINERS and not sync_bn and kind == "cuda":  # gloo has no XPU tensors
        how, taken = "shared", gpus
        where = (f"{ranks} ranks share {named} over gloo with {kind.upper()} tensors ({library} needs a GPU per "
                 f"rank)")
    elif gpus:
        who = f"train_{trainer}" + (" with SyncBatchNorm" if sync_bn and trainer in GPU_SHARING_TRAINERS else "") \
            if trainer else "a process group made by hand"
        how, taken = "moved", []
        where = (f"{ranks} ranks on the CPU with gloo ({named}, fewer than the ranks, and {who} cannot share a GPU "
                 f"over gloo)")
    else:
        how, taken = "cpu", []
        where = f"{ranks} rank(s) on the CPU with gloo (no GPU visible)"
    backend = accelerator.backend() if how == "one per GPU" else "gloo"  # nccl, or xccl on Intel
    cfg, what = _config(cfg, trainer, how, backend)
    alloc = Allocation(ranks, "gpu" if taken else "cpu", backend, tuple(taken), cfg, f"allocation: {where}{what}")
    print(alloc.line)
    return alloc


def _check(ranks, cfg, trainer) -> None:
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ConfigError(f"ranks must be a whole number of at least 1, got {ranks!r}")
    if trainer is not None and trainer not in STAGES + GPT_STAGES:
        raise ConfigError(f"trainer {trainer!r} is not one of: {', '.join(STAGES + GPT_STAGES)} (or None for a "
                          f"process group made by hand)")
    if (trainer in GPT_STAGES) != isinstance(cfg, ParallelConfig) and cfg is not None:
        wanted = "a ParallelConfig (core.parallel_config)" if trainer in GPT_STAGES else "a TrainConfig"
        raise ConfigError(f"train_{trainer} reads {wanted}, not a {type(cfg).__name__}" if trainer else
                          f"a process group made by hand takes a TrainConfig, not a {type(cfg).__name__}")


def _config(cfg, trainer: str | None, how: str, backend: str) -> tuple:
    """The config the ranks train with, and what the allocation's line says of it: the backend where ranks share a
    GPU or train the GPT, the CPU's sizes where an image trainer's ranks moved off too few GPUs."""
    if trainer in GPT_STAGES:  # the GPT's sizes fit a CPU as they are; it has no presets
        return (cfg.replace(backend=backend) if cfg is not None else None), ""
    if how == "moved":
        small = sized_for_cpu(cfg).replace(sync_bn=False)  # SyncBatchNorm works on GPU tensors only
        return small, (f"; preset {small.preset_name}: its sizes on the real digits, where learning shows"
                       + ("; SyncBatchNorm off" if cfg.sync_bn else ""))
    if how == "shared" and trainer is not None:  # the trainer's default backend on a GPU would be NCCL
        cfg = cfg.replace(backend="gloo")
    return cfg, f"; preset {cfg.preset_name}"
