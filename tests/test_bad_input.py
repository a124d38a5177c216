"""Bad input: one line on stderr naming the value and what is allowed, exit code 2, no traceback."""
from __future__ import annotations

import pytest
from conftest import PYTHON, run, train_cmd

CASES = {
    "negative batch size": (["--batch-size", "-4"], "batch-size must be at least 1, got -4"),
    "unknown dataset": (["--dataset", "imagenet"], "dataset 'imagenet' is not one of"),
    "unknown precision": (["--precision", "fp8"], "precision 'fp8' is not one of: fp32, fp16, bf16"),
    "unknown model": (["--model", "vgg"], "model 'vgg' is not one of"),
    "unknown preset": (["--preset", "huge"], "unknown preset 'huge'"),
    "missing data dir": (["--dataset", "imagefolder", "--data-dir", "/nonexistent/imagenet"], "/nonexistent/imagenet"),
    "fp16 on a CPU": (["--precision", "fp16"], "fp16 needs a CUDA GPU"),
    "zero grad accumulation": (["--grad-accum", "0"], "grad-accum must be at least 1, got 0"),
    "unwritable out": (["--out", "/proc/forbidden/run"], "/proc/forbidden/run' is not writable"),
    "not a number": (["--lr", "fast"], "invalid float value: 'fast'"),
    "missing resume checkpoint": (["--resume", "/nonexistent/checkpoint.pt"], "does not exist"),
}


def assert_one_line_error(proc, expected):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_single_rejects(case):
    args, expected = CASES[case]
    assert_one_line_error(run(train_cmd("single", *args), check=False), expected)


@pytest.mark.parametrize("stage", ["dp", "ddp", "horovod"])
def test_every_trainer_rejects_bad_values(stage):
    assert_one_line_error(run(train_cmd(stage, "--precision", "fp16"), check=False), "fp16 needs a CUDA GPU")
    assert_one_line_error(run(train_cmd(stage, "--batch-size", "0"), check=False), "batch-size must be at least 1")


def test_ddp_rejects_sync_bn_without_gpus():
    assert_one_line_error(run(train_cmd("ddp", "--model", "cnn_bn", "--sync-bn"), check=False), "sync-bn needs GPUs")


def test_cli_rejects_unknown_stage_and_command():
    assert_one_line_error(run([PYTHON, "-m", "tutorial", "train", "zero3"], check=False),
                          "'zero3' is not one of: single, dp, ddp, horovod, fsdp, deepspeed, lightning, gpt, tp, pp, 2d")
    assert_one_line_error(run([PYTHON, "-m", "tutorial", "frobnicate"], check=False), "'frobnicate'")
    assert_one_line_error(run([PYTHON, "-m", "tutorial", "train", "tp", "--schedule", "gpipe"], check=False),
                          "--schedule gpipe is not used by train_tp")  # the model-parallel trainers' own options


def test_cli_lists_every_trainer():
    """`tutorial train --help` names every train_*.py of the package (the subparsers come from cli.TRAINERS)."""
    import re

    from conftest import ROOT
    trainers = sorted(p.stem.removeprefix("train_") for p in (ROOT / "src" / "tutorial").glob("train_*.py"))
    listed = run([PYTHON, "-m", "tutorial", "train", "--help"]).stdout
    assert len(trainers) >= 11 and [t for t in trainers if not re.search(rf"^ +{t}\b", listed, re.M)] == []
