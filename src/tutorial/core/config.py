"""One configuration for every trainer: a dataclass with commented defaults, named presets and the CLI.

Every notebook starts from a preset (`TrainConfig.preset("smoke")` on a CPU, `"workshop"` on a GPU node) and
overrides a few fields; every trainer's `python -m tutorial.train_<stage> --flag value` maps flags to these fields.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from dataclasses import dataclass

from .visible import GPU_DEVICE_TYPES

DATASETS = ("digits", "mnist", "cifar10", "imagefolder", "synthetic")
MODELS = ("cnn", "cnn_bn", "resnet18", "resnet34", "resnet50")
PRECISIONS = ("fp32", "fp16", "bf16")
LR_SCALINGS = ("linear", "none")
SCHEDULES = ("cosine", "constant")
BACKENDS = ("auto", "nccl", "xccl", "gloo")  # auto: nccl on NVIDIA and AMD GPUs, xccl on Intel's, gloo on CPUs


class ConfigError(ValueError):
    """A bad option. The CLI prints it as one line and exits with code 2."""


# gloo prefixes its errors with the C++ source line, "[/path/to/ProcessGroupGloo.cpp:123] ", which says nothing to
# a person and would make every stored verdict depend on the build.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\] ")


def first_line(exc: BaseException | str, limit: int | None = 160) -> str:
    """The first line of an exception's message (or of a text), without gloo's source prefix, cut to `limit`
    characters (one line of a terminal or a notebook's output); "" when there is no message. Every one-line error
    that quotes another error quotes it through this."""
    lines = str(exc).strip().splitlines()
    line = _SOURCE_PREFIX.sub("", lines[0].strip()) if lines else ""
    return line[:limit] if limit else line


# The fields only some trainers read, and which (by the stage in their file name: train_<stage>.py). Any other
# trainer refuses a value other than the default in one line (TrainConfig.check_stage) instead of ignoring it.
ONLY_IN = {
    "sync_bn": ("ddp", "horovod", "lightning"),          # one process has no other replicas to sync with
    "fp16_allreduce": ("horovod",),
    "zero_stage": ("deepspeed",),
    "backend": ("ddp", "fsdp", "deepspeed", "lightning"),  # Horovod picks its own (gloo, MPI or NCCL)
    "timeout": ("ddp", "fsdp", "deepspeed", "lightning"),  # Horovod: horovodrun --start-timeout
    # DataParallel re-replicates the module every step, which torch.compile cannot follow: it graph-breaks back to
    # eager speed (pytorch/pytorch#94636), so train_dp refuses the flag rather than accept it for nothing.
    "compile": ("single", "ddp", "horovod", "fsdp", "deepspeed", "lightning"),
}
STAGES = ("single", "dp", "ddp", "horovod", "fsdp", "deepspeed", "lightning")
GPT_STAGES = ("gpt", "tp", "pp", "2d")  # the trainers of the small GPT (11): core.parallel_config, not TrainConfig


@dataclass
class TrainConfig:
    # data
    dataset: str = "digits"        # digits is real (scikit-learn ships it) and needs no download
    data_dir: str = ""             # mnist/cifar10 are (or get downloaded) here; imagefolder: has train/ and val/;
                                   # "": $TUTORIAL_DATA_DIR, else the checkout's data/ (notebooks and scripts share it)
    generated: int = 0             # N > 0: N made-up images of the dataset's shape through its real transforms (CI)
    image_size: int = 0            # 0: the dataset's own size (synthetic: 224)
    workers: int = 0               # DataLoader worker processes per training process (01_single_device measures it)
    pin_memory: bool = True        # page-locked host memory, only used when training on a GPU
    synthetic: bool = False        # random images of the dataset's shape instead of its data (throughput runs)
    # model
    model: str = "cnn"             # cnn has no BatchNorm or dropout, so distributed runs can match one process exactly
    channels_last: bool = False    # NHWC memory layout: faster convolutions on tensor cores
    compile: bool = False          # torch.compile the model
    sync_bn: bool = False          # on GPUs: BatchNorm -> SyncBatchNorm (statistics over the global batch)
    # optimisation
    epochs: int = 3
    max_steps: int = 0             # stop after this many optimizer steps in total (0: no limit)
    batch_size: int = 32           # per process, as in every seed; the global batch is batch_size x world_size
    lr: float = 0.05               # for one process; see lr_scaling
    lr_scaling: str = "linear"     # linear: lr x world_size (Goyal et al. 2017); none: keep lr
    warmup_epochs: float = 0.0     # ramp the lr up linearly over this many epochs (large global batches need it)
    schedule: str = "cosine"       # after warm-up: cosine decay to zero, or constant
    momentum: float = 0.9
    weight_decay: float = 0.0
    grad_accum: int = 1            # micro-batches per optimizer step
    clip_grad: float = 0.0         # clip the gradient norm to this (0: off); with fp16 it is unscaled first
    target_accuracy: float = 0.0   # stop once test accuracy reaches this (seed 001's --desired-acc); 0: off
    patience: int = 0              # stop after this many epochs without a lower test loss (seed 000); 0: off
    precision: str = "fp32"        # fp32, fp16 (autocast + GradScaler, needs a GPU) or bf16 (autocast)
    fp16_allreduce: bool = False   # Horovod: compress gradients to fp16 for the all-reduce
    zero_stage: int = 2            # DeepSpeed: 1 shards optimizer state, 2 also gradients, 3 also parameters; 0: off
    seed: int = 0
    timeout: float = 300.0         # seconds a rank waits for the others: at the rendezvous and in every collective
    backend: str = "auto"          # auto: nccl on GPUs, gloo on CPUs; gloo on GPUs lets several ranks share one GPU
    # output
    out: str = ""                  # rank 0 writes metrics.json, checkpoint.pt and tb/ here ("" = nothing written)
    resume: str = ""               # "auto": continue from out/checkpoint.pt; or a checkpoint path; "": start fresh
    progress: bool | None = None   # tqdm bar on rank 0; None: only when stderr is a terminal and not in CI
    log_every: int = 10            # steps between TensorBoard step scalars
    quiet: bool = False            # one line at the end instead of a line per epoch (a run the notebook repeats)
    time_steps: bool = False       # time every optimizer step into metrics["step_times"] (tutorial bench)
    preset_name: str = ""          # the preset this config came from (for the record)

    @classmethod
    def preset(cls, name: str, **overrides) -> "TrainConfig":
        """A named preset with some fields overridden: `TrainConfig.preset("smoke", epochs=2)`."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        values = dict(PRESETS[name], preset_name=name)
        values.update(overrides)
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown config field(s) {', '.join(sorted(unknown))}")
        return cls(**values).validate()

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes).validate()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "TrainConfig":
        """Check values a person may get wrong; each failure is one sentence naming the value and what is allowed."""
        choices = {"dataset": DATASETS, "model": MODELS, "precision": PRECISIONS,
                   "lr_scaling": LR_SCALINGS, "schedule": SCHEDULES, "backend": BACKENDS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} {getattr(self, name)!r} is not one of: {', '.join(allowed)}")
        positive = {"batch_size": self.batch_size, "grad_accum": self.grad_accum, "epochs": self.epochs}
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1, got {value}")
        non_negative = {"max_steps": self.max_steps, "workers": self.workers, "warmup_epochs": self.warmup_epochs,
                        "clip_grad": self.clip_grad, "weight_decay": self.weight_decay, "image_size": self.image_size,
                        "generated": self.generated}
        for name, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"{name.replace('_', '-')} must be 0 or more, got {value}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.patience < 0:
            raise ConfigError(f"patience must be 0 (off) or a number of epochs, got {self.patience}")
        if not 0 <= self.target_accuracy <= 1:
            raise ConfigError(f"target-accuracy is a fraction between 0 and 1, got {self.target_accuracy}")
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {self.timeout}")
        if self.log_every < 1:
            raise ConfigError(f"log-every must be at least 1, got {self.log_every}")
        return self

    def check_stage(self, stage: str, device=None) -> "TrainConfig":
        """Refuse an option that the trainer of `stage` would ignore, or that cannot work on `device` (each
        trainer's setup calls this)."""
        defaults = TrainConfig()
        for name, stages in ONLY_IN.items():
            if stage not in stages and getattr(self, name) != getattr(defaults, name):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} {getattr(self, name)} is not used by train_{stage}; it works in "
                                  f"{', '.join('train_' + s for s in stages)} (leave it at its default here)")
        if self.sync_bn and device is not None and device.type not in GPU_DEVICE_TYPES:
            raise ConfigError("sync-bn needs GPUs: SyncBatchNorm (torch's and Horovod's) works on GPU tensors only "
                              "(NVIDIA's and AMD's, and torch's on Intel's)")
        return self

    @property
    def resume_path(self) -> str:
        if self.resume == "auto":
            return os.path.join(self.out, "checkpoint.pt") if self.out else ""
        return self.resume


PRESETS = {
    # Seconds on a laptop CPU: the real digits set, small CNN. Reaches >= 95 % test accuracy with 1 or 2 processes.
    "smoke": dict(dataset="digits", model="cnn", epochs=4, batch_size=32, lr=0.05, warmup_epochs=0.5),
    # The GPU-node default (one process per A100/H100): CIFAR-10 on ResNet-18, bf16, channels_last.
    "workshop": dict(dataset="cifar10", model="resnet18", epochs=10, batch_size=128, lr=0.1, warmup_epochs=1,
                     weight_decay=5e-4, precision="bf16", channels_last=True, workers=4),
    # The workshop preset's code paths on a CPU, for CI: ResNet-18 with BatchNorm, bf16, channels_last, loader workers
    # and CIFAR-10's augmentation, on made-up CIFAR-like images (nothing can be downloaded there), sized to run
    # every notebook in minutes on 2 cores: 8 images of 16x16, 2 steps of 2 per rank and epoch. A CPU without bf16
    # units emulates it, and the lane's time goes into those steps: a bf16 ResNet-18 step of 2 images took 1.7 s of
    # CPU at 32x32 on an AVX2 EPYC, 0.45 s at 16x16 (fp32: 0.2 s at 32x32). Its accuracy means nothing: it shows
    # the code runs, not that it learns.
    "workshop-cpu": dict(dataset="cifar10", generated=8, image_size=16, model="resnet18", epochs=1, batch_size=2,
                         lr=0.1, weight_decay=5e-4, precision="bf16", channels_last=True, workers=4),
    # Throughput measurements: ImageNet-sized synthetic images on ResNet-50, no data loading cost.
    "benchmark": dict(dataset="synthetic", model="resnet50", image_size=224, epochs=1, max_steps=100,
                      batch_size=128, lr=0.1, precision="bf16", channels_last=True, schedule="constant"),
}


def default_preset() -> str:
    """The preset for this machine: $TUTORIAL_PRESET if set, else workshop with a GPU and smoke without."""
    name = os.environ.get("TUTORIAL_PRESET")
    if name:
        return name
    from . import accelerator
    return "workshop" if accelerator.device_count() else "smoke"


# ---------------------------------------------------------------------------------------------------------------- CLI
def build_parser(description: str, stage: str | None = None) -> argparse.ArgumentParser:
    """Flags for every TrainConfig field (--batch-size sets batch_size); --preset picks the starting point. A flag
    that only other trainers read (ONLY_IN) is still accepted, so that giving it says why it does not apply here."""
    # A trainer's --help shows its docstring as written: what the stage is and the command that runs it.
    parser = OneLineErrorParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smoke", help=f"starting point: {', '.join(PRESETS)} (default smoke)")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "preset_name":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = type(f.default)
        only = f" (train_{', train_'.join(ONLY_IN[f.name])} only)" if f.name in ONLY_IN else None
        if stage and f.name in ONLY_IN and stage not in ONLY_IN[f.name]:
            only = argparse.SUPPRESS  # refused by this trainer: not offered in its --help
        if f.name == "resume":
            parser.add_argument(flag, nargs="?", const="auto", default=None,
                                help="continue from --out/checkpoint.pt, or from the given checkpoint")
        elif f.name == "progress" or kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=only)
        else:
            parser.add_argument(flag, type=kind, default=None, metavar=f.name.upper(), help=only)
    return parser


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the whole usage on a bad flag; a person needs the one line that names the problem. Every
    command line of the package that exits 2 on bad input parses with this."""

    def error(self, message):
        choice = re.fullmatch(r"argument ([^:]+): invalid choice: (.+?) \(choose from (.+)\)", message)
        if choice:  # argparse quotes every choice (Python 3.11); say it as the workbook's other one-line errors do
            message = f"{choice[1]} {choice[2]} is not one of: {choice[3].replace(chr(39), '')}"
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def parse_args(description: str = "", argv=None, stage: str | None = None) -> TrainConfig:
    """Parse the command line into a TrainConfig for the trainer of `stage` (None: any trainer, as a notebook's
    config); a bad value, or one this trainer would ignore, prints one line and exits with code 2."""
    args = build_parser(description, stage).parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None and k != "preset"}
    try:
        cfg = TrainConfig.preset(args.preset, **overrides)
        return cfg.check_stage(stage) if stage else cfg
    except ConfigError as exc:
        fail(exc)


def to_argv(cfg: TrainConfig) -> list[str]:
    """The inverse of parse_args: `--preset P` and a flag for each field that differs from preset P, so that
    parse_args(argv=to_argv(cfg)) == cfg for a config made from a preset (a notebook's cfg, typed at a terminal)."""
    name = cfg.preset_name or "smoke"  # build_parser's default preset
    base = TrainConfig.preset(name)
    argv = ["--preset", name]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "preset_name" or value == getattr(base, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:  # None (progress) is every preset's value, so it never gets here
            argv += [flag, str(value)]
    return argv


def fail(exc: BaseException, code: int = 2):
    """Print a user error as one line on stderr and exit (no traceback)."""
    sys.stderr.write(f"error: {exc}\n")  # one write: the ranks of a job share the pipe
    sys.stderr.flush()
    raise SystemExit(code)
