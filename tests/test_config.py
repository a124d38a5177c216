"""The command line and the config are one thing seen two ways: to_argv(cfg) parses back to cfg."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tutorial.core.config import ConfigError, TrainConfig, parse_args, to_argv

CONFIGS = [
    TrainConfig.preset("smoke"),
    TrainConfig.preset("smoke", model="cnn_bn", epochs=1, max_steps=5, out="runs/a b", progress=False),
    TrainConfig.preset("workshop", lr=0.1 + 0.2, seed=-3, channels_last=False, resume="auto", warmup_epochs=0.5),
    TrainConfig.preset("benchmark", precision="fp32", schedule="cosine", data_dir="/data/imagenet", progress=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda cfg: cfg.preset_name)
def test_to_argv_round_trips(cfg):
    assert parse_args(argv=to_argv(cfg)) == cfg


def test_to_argv_names_only_what_differs_from_the_preset():
    assert to_argv(TrainConfig.preset("smoke")) == ["--preset", "smoke"]
    assert to_argv(TrainConfig.preset("smoke", epochs=2, pin_memory=False)) == \
        ["--preset", "smoke", "--no-pin-memory", "--epochs", "2"]


def test_fp16_allreduce_is_a_horovod_flag():
    cfg = TrainConfig.preset("smoke", fp16_allreduce=True)
    assert "--fp16-allreduce" in to_argv(cfg)
    assert parse_args(argv=to_argv(cfg), stage="horovod") == cfg


@pytest.mark.parametrize("stage, field, value", [
    ("single", "sync_bn", True), ("dp", "sync_bn", True), ("fsdp", "sync_bn", True), ("deepspeed", "sync_bn", True),
    ("ddp", "fp16_allreduce", True), ("fsdp", "zero_stage", 3), ("horovod", "backend", "gloo"),
    ("horovod", "timeout", 60.0), ("single", "backend", "gloo"), ("lightning", "zero_stage", 1)])
def test_a_trainer_refuses_what_it_would_ignore(stage, field, value):
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')} .* is not used by train_{stage}"):
        TrainConfig.preset("smoke", **{field: value}).check_stage(stage)


@pytest.mark.parametrize("stage", ["ddp", "horovod", "lightning"])
def test_sync_bn_is_accepted_where_it_works_and_needs_a_gpu(stage):
    cfg = TrainConfig.preset("smoke", sync_bn=True)
    assert cfg.check_stage(stage, torch.device("cuda", 0)) is cfg
    with pytest.raises(ConfigError, match="sync-bn needs GPUs"):
        cfg.check_stage(stage, torch.device("cpu"))


def test_the_refusal_is_one_line_and_exit_2_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "tutorial.train_single", "--preset", "smoke", "--sync-bn"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["error: --sync-bn True is not used by train_single; it works in train_ddp, "
                                        "train_horovod, train_lightning (leave it at its default here)"]
