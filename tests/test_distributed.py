"""Who am I under each launcher: the same trainer must find its rank under torchrun, MPI, PALS, Slurm and engines."""
from __future__ import annotations

import pytest

from tutorial.core.distributed import World, world_from_env
from tutorial.lessons.mixed_precision import APEX_OPT_LEVELS, from_apex
from tutorial.core.config import ConfigError

LAUNCH_ENVS = {
    "torchrun": ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"}, World(3, 1, 8, 2)),
    "openmpi": ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, World(5, 5, 16, 8)),
    "pals": ({"PALS_RANKID": "9", "PALS_LOCAL_RANKID": "1", "PMI_SIZE": "16", "PALS_LOCAL_SIZE": "8"},
             World(9, 1, 16, 8)),
    "mpich": ({"PMI_RANK": "2", "MPI_LOCALRANKID": "2", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "4"}, World(2, 2, 4, 4)),
    "slurm": ({"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_STEP_NUM_TASKS": "8",
               "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, World(6, 2, 8, 4)),
}


@pytest.mark.parametrize("launcher", list(LAUNCH_ENVS))
def test_world_from_each_launcher(launcher):
    env, expected = LAUNCH_ENVS[launcher]
    world = world_from_env(env)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == \
        (expected.rank, expected.local_rank, expected.world_size, expected.local_world_size)
    assert world.launcher == launcher


def test_torchrun_variables_win_over_mpi():
    """ipyparallel MPI engines carry Open MPI's variables too; the cluster's torchrun-style ones decide."""
    env = dict(LAUNCH_ENVS["openmpi"][0], RANK="1", LOCAL_RANK="1", WORLD_SIZE="2")
    assert world_from_env(env).launcher == "torchrun" and world_from_env(env).rank == 1


def test_an_salloc_shell_is_not_a_job_step():
    world = world_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "42"})
    assert world.world_size == 1 and world.is_main_process


def test_apex_levels_map_to_settings():
    assert set(APEX_OPT_LEVELS) == {"O0", "O1", "O2", "O3"}
    assert from_apex("O0") == "fp32" and from_apex("O1") == "fp16"
    with pytest.raises(ConfigError, match="O4"):
        from_apex("O4")


def test_allreduce_check_sums_ranks_over_two_processes(tmp_path):
    import json
    from conftest import PYTHON, run
    script = tmp_path / "check.py"
    # Each rank writes its own file: two ranks printing to one pipe can interleave their lines.
    script.write_text("import json, os\nfrom tutorial.bench.collectives import allreduce_check\n"
                      "result = allreduce_check(megabytes=1, repeats=2)\n"
                      f"open(os.path.join({str(tmp_path)!r}, 'rank%d.json' % result['rank']), 'w')"
                      ".write(json.dumps(result))\n")
    run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script])
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum_correct"] and r["world_size"] == 2 and r["bus_gbytes_per_s"] > 0 for r in results)


def exchange(identities: list[str]) -> list:
    """Every rank's refuse_shared_gpus through one store, each rank in a thread as it would be in a process: what
    each rank raised (None when it went on)."""
    import threading

    import torch.distributed as dist

    from tutorial.core.distributed import World, refuse_shared_gpus
    store, raised = dist.HashStore(), [None] * len(identities)

    def rank(r):
        try:
            refuse_shared_gpus(store, World(rank=r, local_rank=r, world_size=len(identities),
                                            local_world_size=len(identities)), identities[r])
        except Exception as exc:  # noqa: BLE001 - what the rank would print
            raised[r] = str(exc)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(identities))]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    return raised


def test_nccl_is_refused_only_where_two_ranks_would_really_share_a_gpu():
    """GPUs are matched by identity (host and UUID), not counted: one GPU per rank by index, and one per rank by
    per-task binding (Slurm --gpus-per-task=1, where every rank sees a single cuda:0 and device_count() is 1, which
    the old rule `local_world_size > device_count()` refused), both go on; two ranks on one GPU are refused on every
    rank, naming them."""
    assert exchange(["n1/GPU-aaaa", "n1/GPU-bbbb"]) == [None, None]  # by index: cuda:0, cuda:1
    assert exchange(["n1/GPU-aaaa", "n1/GPU-bbbb", "n2/GPU-aaaa", "n2/GPU-cccc"]) == [None] * 4  # bound per task
    refused = exchange(["n1/GPU-aaaa", "n1/GPU-aaaa", "n1/GPU-bbbb"])
    assert all(r and r.startswith("ranks 0, 1 would use the same GPU: NCCL cannot put two ranks on one GPU")
               for r in refused), refused


def test_this_torch_is_in_the_supported_range_and_the_floor_lane_runs_the_floor():
    """The supported torch range is declared once, pyproject.toml's "torch>=X.Y", no higher than the lent GPU node's
    2.11; make test's floor lane (.venv-floor, scripts/torch_floor.sh) runs this file and others on exactly that
    floor, which this test checks from inside the lane (so an overlay that fell back to .venv's torch fails here)."""
    import re
    import sys
    from pathlib import Path

    import torch
    root = Path(__file__).resolve().parents[1]
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', (root / "pyproject.toml").read_text())
    assert floor and (int(floor[1]), int(floor[2])) <= (2, 11)
    here = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert here >= (int(floor[1]), int(floor[2]))
    if Path(sys.prefix).name == ".venv-floor":
        assert here == (int(floor[1]), int(floor[2])) and ".venv-floor" in torch.__file__, torch.__file__
        # and the torchrun a cell types beside this Python (08) starts the floor's torch, not .venv's
        import subprocess
        run = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "1",
                              "-m", "torch.utils.collect_env"], capture_output=True, text=True, timeout=120)
        assert f"PyTorch version: {torch.__version__}" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"torch {floor[1]}.{floor[2]}" in (root / "README.md").read_text()  # said where people read it


def test_a_rank_takes_its_local_gpu_of_any_vendor_and_the_cpu_without_one(monkeypatch):
    """pick_device by core.accelerator: local rank i gets device i of the node's kind (Intel's tiles are "xpu", which
    no machine here has: the vendor and count are given, and set_device is recorded), i modulo the count; no GPU, the
    CPU. A CUDA build on this GPU-less machine says cpu for real."""
    import torch
    from tutorial.core import accelerator, distributed

    assert distributed.pick_device(0, 2) == torch.device("cpu")
    chosen = []
    monkeypatch.setattr(accelerator, "vendor", lambda: accelerator.INTEL)
    monkeypatch.setattr(accelerator, "device_count", lambda: 12)
    monkeypatch.setattr(torch, "xpu", type("xpu", (), {"set_device": staticmethod(chosen.append)}), raising=False)
    assert [distributed.pick_device(r, 12) for r in (0, 5, 13)] == [torch.device("xpu", i) for i in (0, 5, 1)]
    assert chosen == [torch.device("xpu", i) for i in (0, 5, 1)]
