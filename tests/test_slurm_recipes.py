"""The Slurm recipe for sites that bind one GPU per task (scripts/slurm/ddp_per_task.sbatch, shown in the appendix):
its #SBATCH request, its launch line run against a stub `srun` inside a fake job (no GPUs or Slurm needed), and the
device each of a node's 8 tasks then picks, with one GPU visible per task and, as the negative control, with all 8.

The CPU variants of the other Slurm recipes run on real Slurm daemons in tests/test_virtual_cluster.py; this one asks
for GPUs per task, which the virtual nodes do not have.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from tutorial.core import distributed

RECIPE = ROOT / "scripts" / "slurm" / "ddp_per_task.sbatch"
STUB = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(dict(argv=sys.argv[1:], cwd=os.getcwd(), cpus=os.environ.get("SRUN_CPUS_PER_TASK"))) + "\\n")
"""


def sbatch_options(path: Path) -> dict:
    options = {}
    for line in path.read_text().splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line.removeprefix("#SBATCH --").partition("=")
            options[key] = value
    return options


def test_recipe_parses_and_asks_for_one_gpu_per_task():
    assert subprocess.run(["bash", "-n", RECIPE], capture_output=True).returncode == 0
    options = sbatch_options(RECIPE)
    assert options["gpus-per-task"] == "1" and options["ntasks-per-node"] == "8" and options["nodes"] == "2"
    assert "gpus-per-node" not in options  # a per-node request would let every task see all the node's GPUs


def test_recipe_starts_one_trainer_per_task_with_srun(tmp_path):
    """In a fake job: srun gets the trainer directly (one process per task, no torchrun) with --gpu-bind=single:1,
    the job's output folder, and the arguments given to sbatch."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text(STUB)
    (tmp_path / "bin" / "srun").chmod(0o755)
    work = tmp_path / "work"
    (work / ".venv" / "bin").mkdir(parents=True)
    (work / ".venv" / "bin" / "activate").write_text("export VIRTUAL_ENV=\"$PWD/.venv\"\n")
    log = tmp_path / "calls.jsonl"
    env = dict(PATH=f"{tmp_path / 'bin'}:/usr/bin:/bin", HOME=str(tmp_path), SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="gpu[01-02]", SLURM_CPUS_PER_TASK="8", STUB_LOG=str(log))
    proc = subprocess.run(["bash", RECIPE, "--epochs", "2"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [dict(argv=["--gpu-bind=single:1", "python", "-m", "tutorial.train_ddp", "--preset", "workshop",
                                "--out", "runs/ddp-4242", "--epochs", "2"], cwd=str(work), cpus="8")]


@pytest.mark.parametrize("visible, expected", [(1, lambda local: 0), (8, lambda local: local)])
def test_each_task_picks_a_gpu_it_can_see(monkeypatch, visible, expected):
    """The second node's 8 tasks under srun: ranks 8-15, local ranks 0-7. With one GPU bound per task every task
    uses cuda:0 (local_rank % device_count); where all 8 are visible (the control), task i uses cuda:i. A trainer
    that used cuda:LOCAL_RANK would ask for cuda:7 on a task that has only cuda:0."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(device.index))
    for local in range(8):
        world = distributed.world_from_env({"SLURM_PROCID": str(8 + local), "SLURM_LOCALID": str(local),
                                            "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "8(x2)"})
        assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (8 + local, local, 16, 8)
        device = distributed.pick_device(world.local_rank, world.local_world_size)
        assert device == torch.device("cuda", expected(local)) and device.index < visible
    assert chosen == [expected(local) for local in range(8)]


@pytest.mark.parametrize("recipe", sorted((ROOT / "scripts" / "slurm").glob("*.sbatch")), ids=lambda p: p.name)
def test_every_srun_gets_the_cores_the_job_asked_for(recipe, tmp_path):
    """Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task (SRUN_CPUS_PER_TASK carries it): without
    it every task of ddp.sbatch gets one core for 4 ranks and their loader workers. Each recipe runs in a fake job
    that asked for 8 cores per task, against stubs of srun and scontrol; every srun must see SRUN_CPUS_PER_TASK=8.
    (On 4e6582a every srun saw None.)"""
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(STUB)
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'node01\\nnode02\\n'\n")  # one write, as scontrol's
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    (work / ".venv" / "bin").mkdir(parents=True)
    (work / ".venv" / "bin" / "activate").write_text("export VIRTUAL_ENV=\"$PWD/.venv\"\n")
    log = tmp_path / "calls.jsonl"
    env = dict(PATH=f"{bin_dir}:/usr/bin:/bin", HOME=str(tmp_path), SLURM_JOB_ID="4242", SLURM_NNODES="2",
               SLURM_JOB_NODELIST="node[01-02]", SLURM_GPUS_PER_NODE="4", SLURM_CPUS_PER_TASK="8",
               STUB_LOG=str(log))
    proc = subprocess.run(["bash", recipe], cwd=work, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls and all(call["cpus"] == "8" for call in calls), calls


@pytest.mark.parametrize("template", ["engines.sh", "engines_cpu.sh"])
def test_the_engines_batch_templates_pass_the_cores_on_to_srun(template):
    """ipyparallel fills these in and submits them (test_cluster renders them); srun must come after the export."""
    text = (ROOT / "scripts" / "slurm" / template).read_text()
    assert 0 <= text.find('export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"') < text.find("\nsrun ")
