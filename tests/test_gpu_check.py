"""`make gpu-check` on a machine without a GPU: it says so in one line, lists what it would run on one, and the
refusal it expects from NCCL on a shared GPU is real (the trainer refuses before touching a GPU)."""
from __future__ import annotations

import subprocess

import pytest
import torch
from conftest import PYTHON, ROOT, env

from tutorial.bench import gpucheck

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run make gpu-check itself")


def test_without_a_gpu_it_says_so_in_one_line():
    proc = subprocess.run(["make", "-s", "gpu-check"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == [errors[0]] and "no CUDA GPU is visible" in errors[0]


def test_it_lists_every_trainer_precision_nccl_horovod_notebooks_and_resnet50():
    out = subprocess.run([PYTHON, "-m", "tutorial.bench.gpucheck", "--list"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300, env=env()).stdout
    names = [line.split()[0] for line in out.splitlines()]
    for stage in ("single", "dp"):
        assert {f"{stage}-{p}" for p in ("fp32", "bf16", "fp16")} <= set(names)
    assert "single-compile" in names and "ddp-nccl-1-bf16" in names
    assert "ddp-gloo-2-ranks-on-1-gpus" in names and "ddp-nccl-shared-gpu-refused" in names
    assert "horovod-nccl-1" in names and "resnet50-bf16-channels-last-trainer" in names
    for stage in ("fsdp", "deepspeed", "lightning"):  # every trainer, not only those DDP derives from
        assert {f"{stage}-1gpu-{p}" for p in ("fp32", "bf16")} <= set(names)
    assert not {n for n in names if n.startswith(("tp-", "pp-", "2d-"))}  # one GPU: no NCCL model parallel
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    # here (no GPU) it lists a one-GPU node: every notebook under the one-GPU allocation
    assert [n for n in names if n.startswith("notebook-")] == [f"notebook-{nb}-1gpu" for nb in notebooks]


def _listed(*args) -> list[str]:
    proc = subprocess.run([PYTHON, "-m", "tutorial.bench.gpucheck", "--list", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=env())
    assert proc.returncode == 0, proc.stderr
    return [line.split()[0] for line in proc.stdout.splitlines()]


def test_an_8_gpu_node_adds_nccl_runs_of_every_trainer_and_the_notebooks_on_all_gpus():
    names = _listed("--gpus", "8")
    for stage in ("fsdp", "deepspeed", "lightning"):
        assert {f"{stage}-{n}-{p}" for n in ("1gpu", "nccl-8") for p in ("fp32", "bf16")} <= set(names)
    assert "ddp-nccl-8-bf16" in names and "ddp-gloo-9-ranks-on-8-gpus" in names
    assert {"tp-nccl-2", "pp-nccl-2", "2d-nccl-4"} <= set(names)  # model parallel (11) where a GPU per rank exists
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    assert {f"notebook-{nb}-{a}" for nb in notebooks for a in ("1gpu", "8gpu")} <= set(names)


def test_only_selects_by_name_prefix_and_a_bad_selection_is_one_line():
    assert _listed("--gpus", "2", "--only", "deepspeed,notebook-07") == [
        "deepspeed-1gpu-fp32", "deepspeed-nccl-2-fp32", "deepspeed-1gpu-bf16", "deepspeed-nccl-2-bf16",
        "notebook-07_scaling_study-1gpu", "notebook-07_scaling_study-2gpu"]
    for bad in (["--only", "nosuch"], ["--gpus", "-1"]):
        proc = subprocess.run([PYTHON, "-m", "tutorial.bench.gpucheck", "--list", *bad], capture_output=True,
                              text=True, cwd=ROOT, timeout=300, env=env())
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_each_notebook_run_sees_only_its_allocations_gpus(tmp_path):
    runs = gpucheck.notebook_checks(tmp_path, ["4", "5", "6"])
    seen = {c["name"].rsplit("-", 1)[1]: c["visible"] for c in runs}
    assert seen == {"1gpu": "4", "3gpu": "4,5,6"}


def test_the_expected_nccl_refusal_is_a_one_line_error(tmp_path):
    check = next(c for c in gpucheck.checks(1, tmp_path) if c["name"] == "ddp-nccl-shared-gpu-refused")
    command = check["command"]  # with the smoke preset instead of the workshop's: quick on a CPU
    check["command"] = [a for a in command if a not in ("--preset", "--generated", "5000")]
    check["command"] = ["--preset=smoke" if a == "workshop" else a for a in check["command"]]
    result = gpucheck.run_check(check, timeout=240, env=dict(env(), OMP_NUM_THREADS="1"))
    assert result["ok"], result["tail"]
    assert result["exit_code"] not in (0, None)
