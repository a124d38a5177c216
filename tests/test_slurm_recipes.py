"""The Slurm recipe for sites that bind one GPU per task (scripts/slurm/ddp_per_task.sbatch, shown in the appendix):
its #SBATCH request, its launch line run against a stub `srun` inside a fake job (no GPUs or Slurm needed), and the
device each of a node's 8 tasks then picks, with one GPU visible per task and, as the negative control, with all 8.

The ROCm recipes (ddp_rocm.sbatch, horovod_rocm.sbatch: Frontier-like nodes, 8 GCDs each) are run the same way,
against stubs of srun and scontrol that record what they were asked and in which environment.

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


# ------------------------------------------------------------------------------------------------ ROCm (Frontier-like)
ROCM = {"ddp_rocm.sbatch": ("tutorial.train_ddp", "runs/ddp-4242"),
        "horovod_rocm.sbatch": ("tutorial.train_horovod", "runs/hvd-4242")}
ENV_STUB = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(dict(argv=sys.argv[1:], env=dict(os.environ))) + "\\n")
"""


def rocm_job(tmp_path: Path, nodes: int) -> tuple[Path, dict]:
    """A fake job's folder (with a venv to activate) and environment, srun and scontrol stubbed."""
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(ENV_STUB)
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf '" + "".join(f"frontier{i:05d}\\n" for i in range(nodes))
                                      + "'\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    (work / ".venv" / "bin").mkdir(parents=True)
    (work / ".venv" / "bin" / "activate").write_text("export VIRTUAL_ENV=\"$PWD/.venv\"\n")
    return work, dict(PATH=f"{bin_dir}:/usr/bin:/bin", HOME=str(tmp_path), SLURM_JOB_ID="4242",
                      SLURM_NNODES=str(nodes), SLURM_JOB_NODELIST=f"frontier[00000-{nodes - 1:05d}]",
                      SLURM_CPUS_PER_TASK="7", STUB_LOG=str(tmp_path / "calls.jsonl"))


@pytest.mark.parametrize("name", ROCM)
def test_rocm_recipe_parses_and_asks_for_one_gcd_per_task(name):
    recipe = ROOT / "scripts" / "slurm" / name
    assert subprocess.run(["bash", "-n", recipe], capture_output=True).returncode == 0
    options = sbatch_options(recipe)
    assert options["ntasks-per-node"] == "8" and options["gpus-per-task"] == "1" and options["nodes"] == "2"
    assert "gpus-per-node" not in options   # every task would see all 8 GCDs


@pytest.mark.parametrize("nodes", [2, 3])
@pytest.mark.parametrize("name", ROCM)
def test_rocm_recipe_starts_one_trainer_per_gcd_on_the_slingshot_interface(tmp_path, monkeypatch, name, nodes):
    """srun starts the trainer itself (no torchrun), 8 tasks a node, one GCD each, the closest; RCCL is told hsn0 and
    MIOpen's database and cache go to node-local /tmp, made on every node before the ranks start."""
    module, out = ROCM[name]
    work, env = rocm_job(tmp_path, nodes)
    proc = subprocess.run(["bash", ROOT / "scripts" / "slurm" / name, "--epochs", "2"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    mkdir, train = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    cache = train["env"]["MIOPEN_USER_DB_PATH"]
    # node-local: straight under /tmp, not in the (shared) home, which the fake job's HOME also lies under /tmp
    assert Path(cache).parent == Path("/tmp") and "4242" in cache and not cache.startswith(env["HOME"])
    assert train["env"]["MIOPEN_CUSTOM_CACHE_DIR"] == cache
    assert mkdir["argv"] == [f"--ntasks={nodes}", "--ntasks-per-node=1", "mkdir", "-p", cache, cache]
    assert train["argv"] == ["--ntasks-per-node=8", "--gpus-per-task=1", "--gpu-bind=closest",
                             "python", "-m", module, "--preset", "workshop", "--out", out, "--epochs", "2"]
    assert train["env"]["NCCL_SOCKET_IFNAME"] == "hsn0" and train["env"]["SRUN_CPUS_PER_TASK"] == "7"
    assert train["env"]["VIRTUAL_ENV"] == str(work / ".venv")
    if module == "tutorial.train_ddp":
        # the address and port the trainers would derive themselves from the job (first node, job id)
        assert (train["env"]["MASTER_ADDR"], train["env"]["MASTER_PORT"]) == ("frontier00000", "24242")
        world = distributed.world_from_env({"SLURM_PROCID": "9", "SLURM_LOCALID": "1",
                                            "SLURM_STEP_NUM_TASKS": str(8 * nodes), "SLURM_STEP_TASKS_PER_NODE":
                                            f"8(x{nodes})"})
        monkeypatch.delenv("MASTER_ADDR", raising=False)
        monkeypatch.delenv("MASTER_PORT", raising=False)
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        monkeypatch.setattr(distributed, "_first_host", lambda: "frontier00000")
        assert distributed.rendezvous(world) == ("frontier00000", 24242)
    else:
        assert "MASTER_ADDR" not in train["env"]   # Horovod: MPI connects the ranks


@pytest.mark.parametrize("name", ROCM)
def test_rocm_recipe_keeps_the_users_interface_and_cache(tmp_path, name):
    work, env = rocm_job(tmp_path, 2)
    proc = subprocess.run(["bash", ROOT / "scripts" / "slurm" / name], cwd=work, capture_output=True, text=True,
                          env=env | dict(NCCL_SOCKET_IFNAME="hsn1", MIOPEN_USER_DB_PATH="/mnt/bb/me/miopen"),
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    *_, train = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert train["env"]["NCCL_SOCKET_IFNAME"] == "hsn1"
    assert train["env"]["MIOPEN_USER_DB_PATH"] == train["env"]["MIOPEN_CUSTOM_CACHE_DIR"] == "/mnt/bb/me/miopen"


@pytest.mark.parametrize("missing", ["SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES"])
@pytest.mark.parametrize("name", ROCM)
def test_rocm_recipe_outside_a_job_says_what_is_missing(tmp_path, name, missing):
    work, env = rocm_job(tmp_path, 2)
    del env[missing]
    proc = subprocess.run(["bash", ROOT / "scripts" / "slurm" / name], cwd=work, env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and not (tmp_path / "calls.jsonl").exists()
    assert proc.stderr == f"{missing} is not set: submit this script with sbatch\n"
