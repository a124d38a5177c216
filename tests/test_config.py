"""The command line and the config are one thing seen two ways: to_argv(cfg) parses back to cfg."""
from __future__ import annotations

import pytest

from tutorial.core.config import TrainConfig, parse_args, to_argv

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
    assert "--fp16-allreduce" not in to_argv(cfg)
    assert parse_args(argv=to_argv(cfg, horovod=True), horovod=True) == cfg
