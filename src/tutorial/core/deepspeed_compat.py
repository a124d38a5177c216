"""What train_deepspeed.py needs around DeepSpeed itself (09_sharded_training): its import, the warnings that do not
apply, and joining our process group. Infrastructure, not the lesson; kept here so the trainer has no
process-wide side effects when it is imported (a notebook kernel imports it next to every other trainer), and in
core rather than beside the trainer because `tutorial doctor` imports DeepSpeed the same way (import_deepspeed)."""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import warnings

import torch

from . import accelerator


def import_deepspeed():
    """`import deepspeed` with its accelerator named: it picks one once, when imported, and without a GPU it guesses
    with a warning. The variable is set for the import only."""
    before = os.environ.get("DS_ACCELERATOR")
    # DeepSpeed's names are torch's: cuda (NVIDIA, AMD), xpu (Intel), cpu
    os.environ.setdefault("DS_ACCELERATOR", accelerator.gpu_type())
    try:
        return importlib.import_module("deepspeed")
    finally:
        if before is None:
            os.environ.pop("DS_ACCELERATOR", None)


@contextlib.contextmanager
def quiet_deepspeed():
    """While DeepSpeed trains: hide what does not apply here, torch 2.14's renames of the collectives it calls (said
    on every step) and its note on the torch optimizer we allow on purpose ("zero_allow_untested_optimizer")."""
    def not_untested(record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()

    logger = importlib.import_module("deepspeed").utils.logger
    logger.addFilter(not_untested)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
            yield
    finally:
        logger.removeFilter(not_untested)


def join_group(device: torch.device, created_group: bool) -> None:
    """Make DeepSpeed use the process group this process already joined (init_process_group), not discover one of
    its own through MPI, after fixing two pieces of its private state (checked against 0.19.8; each guarded so a
    release without it still trains): on a CPU, its shared-memory all-reduce op (for CPU inference, minutes of
    compiling) is switched off; in a process that made a new process group (notebook engines run trainer after
    trainer), the copy of the old world group it keeps is dropped, or it would use a destroyed group."""
    deepspeed = importlib.import_module("deepspeed")
    if device.type == "cpu" and isinstance(getattr(deepspeed.ops, "__compatible_ops__", {}), dict):
        deepspeed.ops.__dict__.setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    groups = deepspeed.utils.groups
    if created_group and hasattr(groups, "_WORLD_GROUP"):
        groups._WORLD_GROUP = None
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
