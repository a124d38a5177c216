"""The PBS recipes in scripts/pbs/, rehearsed without PBS (it is not packaged for Debian): each script runs in the
environment a PBS job gives it (PBS_NODEFILE, PBS_O_WORKDIR, PBS_JOBID) with `mpiexec`, `mpirun` and `module`
replaced by stubs that record their arguments, environment and folder, so the launch line can be checked flag by
flag. One recipe runs for real: the Open MPI one, with this machine's mpirun, 2 ranks on localhost, CPU only.

polaris/: Cray PALS mpiexec, 4 GPUs per node. openmpi/: Open MPI mpirun, 8 GPUs per node (ThetaGPU-like).
aurora/: Cray PALS mpiexec, 12 Intel GPU tiles per node, one rank per tile through a per-rank wrapper (gpu_tile.sh).
"""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import ROOT, env, metrics, needs_horovod, needs_mpi
from tutorial.core.distributed import World, world_from_env

PBS = ROOT / "scripts" / "pbs"
SCRIPTS = sorted(PBS.glob("*/*.sh"))
# engines.sh are ipyparallel templates, rendered first; gpu_tile.sh is what mpiexec starts on each rank, not a job
RUNNABLE = [p for p in SCRIPTS if p.name not in ("engines.sh", "gpu_tile.sh")]
STUB = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(dict(argv=sys.argv, env=dict(os.environ), cwd=os.getcwd())) + "\\n")
"""


def test_every_recipe_is_named_and_parses():
    assert {p.relative_to(PBS).as_posix() for p in SCRIPTS} == {
        f"{site}/{name}.sh" for site in ("polaris", "openmpi") for name in ("ddp", "horovod", "engines")} | {
        "aurora/ddp.sh", "aurora/gpu_tile.sh"}
    for path in SCRIPTS:
        proc = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
        assert proc.returncode == 0, f"{path}: {proc.stderr}"


class FakeJob:
    """A PBS job's surroundings in tmp_path: the node file, qsub's folder (with a venv to activate) and stubs."""

    def __init__(self, tmp_path: Path, hosts: list[str], lines_per_host: int = 1):
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp_path
        self.nodefile = tmp_path / "nodefile"
        self.nodefile.write_text("".join(f"{h}\n" for h in hosts for _ in range(lines_per_host)))
        self.workdir = tmp_path / "work"
        (self.workdir / ".venv" / "bin").mkdir(parents=True)
        (self.workdir / ".venv" / "bin" / "activate").write_text("export VIRTUAL_ENV=\"$PWD/.venv\"\n")
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        for name in ("mpiexec", "mpirun", "module"):
            (self.bin / name).write_text(STUB)
            (self.bin / name).chmod(0o755)
        self.log = tmp_path / "calls.jsonl"

    def env(self, **extra) -> dict:
        return dict(PATH=f"{self.bin}:/usr/bin:/bin", HOME=str(self.tmp), PBS_NODEFILE=str(self.nodefile),
                    PBS_O_WORKDIR=str(self.workdir), PBS_JOBID="4242.pbs01", STUB_LOG=str(self.log), **extra)

    def run(self, script: Path, **extra) -> list[dict]:
        """Run the script as PBS would (bash, qsub's folder); the stubs' calls in order."""
        self.log.unlink(missing_ok=True)
        proc = subprocess.run(["bash", script], env=self.env(**extra), cwd=self.tmp, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [json.loads(line) for line in self.log.read_text().splitlines()]


def option(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


def command(argv: list[str]) -> list[str]:
    """What the launcher starts: everything from `python` on."""
    return argv[argv.index("python"):]


# ------------------------------------------------------------------------------------------------ Polaris (PALS)
@pytest.mark.parametrize("stage, out", [("ddp", "runs/ddp-4242.pbs01"), ("horovod", "runs/hvd-4242.pbs01")])
@pytest.mark.parametrize("nodes", [1, 3])
def test_polaris_recipe_starts_four_ranks_per_node_with_pals_flags(tmp_path, stage, out, nodes):
    job = FakeJob(tmp_path, [f"x3006c0s{i}b0n0" for i in range(nodes)])
    module_use, module_load, mpiexec = job.run(PBS / "polaris" / f"{stage}.sh")
    assert module_use["argv"][1:] == ["use", "/soft/modulefiles"] and module_load["argv"][1:] == ["load", "conda"]
    argv = mpiexec["argv"]
    assert Path(argv[0]).name == "mpiexec"
    assert option(argv, "-n") == str(4 * nodes) and option(argv, "--ppn") == "4"
    assert option(argv, "--depth") == "8" and option(argv, "--cpu-bind") == "depth"   # local rank i: cores 8i..8i+7
    assert option(argv, "--hostfile") == str(job.nodefile)
    assert command(argv) == ["python", "-m", f"tutorial.train_{stage}", "--preset", "workshop", "--data-dir", "data",
                             "--out", out]
    assert mpiexec["cwd"] == str(job.workdir) and mpiexec["env"]["VIRTUAL_ENV"] == str(job.workdir / ".venv")
    # GPU 3-i is nearest cores 8i..8i+7, and every rank keeps all four GPUs in view (train_ddp checks one per rank)
    assert mpiexec["env"]["CUDA_VISIBLE_DEVICES"] == "3,2,1,0"
    assert "NCCL_SOCKET_IFNAME" not in mpiexec["env"] and "GLOO_SOCKET_IFNAME" not in mpiexec["env"]


def test_polaris_recipe_keeps_the_users_choices(tmp_path):
    """An interface set because NCCL picked a wrong one, GPUs hidden for a CPU rehearsal, another preset and output."""
    job = FakeJob(tmp_path, ["n0", "n1"])
    *_, mpiexec = job.run(PBS / "polaris" / "ddp.sh", NCCL_SOCKET_IFNAME="hsn0", CUDA_VISIBLE_DEVICES="",
                          PRESET="smoke", OUT="/scratch/run1")
    assert mpiexec["env"]["NCCL_SOCKET_IFNAME"] == "hsn0" and mpiexec["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert option(mpiexec["argv"], "--preset") == "smoke" and option(mpiexec["argv"], "--out") == "/scratch/run1"


# ------------------------------------------------------------------------------------------------ Aurora (PALS, XPU)
AURORA_BIND = "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100"
TILES = [f"{gpu}.{tile}" for gpu in range(6) for tile in range(2)]   # local rank i -> TILES[i]


def tile_wrapper(local_rank, **extra) -> subprocess.CompletedProcess:
    """gpu_tile.sh as mpiexec starts it on one rank (PALS gives it PALS_LOCAL_RANKID), printing what the rank sees."""
    variables = {} if local_rank is None else dict(PALS_LOCAL_RANKID=str(local_rank))
    return subprocess.run(["bash", PBS / "aurora" / "gpu_tile.sh", "printenv", "ZE_AFFINITY_MASK",
                           "ZE_FLAT_DEVICE_HIERARCHY"], env=dict(PATH="/usr/bin:/bin", **variables, **extra),
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("nodes", [1, 3])
def test_aurora_recipe_starts_one_rank_per_tile_with_oneccl_settings(tmp_path, nodes):
    hosts = [f"x4102c5s{i}b0n0.hostmgmt2102.cm.aurora.alcf.anl.gov" for i in range(nodes)]
    job = FakeJob(tmp_path, hosts)
    module_load, mpiexec = job.run(PBS / "aurora" / "ddp.sh")
    assert module_load["argv"][1:] == ["load", "frameworks"]   # the site's torch for XPU, oneCCL with it
    argv = mpiexec["argv"]
    assert Path(argv[0]).name == "mpiexec"
    assert option(argv, "-n") == str(12 * nodes) and option(argv, "--ppn") == "12"   # 6 GPUs x 2 tiles
    assert option(argv, "--cpu-bind") == AURORA_BIND and "--depth" not in argv
    assert option(argv, "--hostfile") == str(job.nodefile)
    # each rank starts through the tile wrapper, which then runs the trainer
    wrapper = argv[argv.index("python") - 1]
    assert wrapper == "scripts/pbs/aurora/gpu_tile.sh" and (ROOT / wrapper).is_file()   # relative to the checkout
    assert command(argv) == ["python", "-m", "tutorial.train_ddp", "--preset", "workshop", "--data-dir", "data",
                             "--out", "runs/ddp-4242.pbs01"]
    env = mpiexec["env"]
    assert mpiexec["cwd"] == str(job.workdir) and env["VIRTUAL_ENV"] == str(job.workdir / ".venv")
    assert {k: env.get(k) for k in ("CCL_PROCESS_LAUNCHER", "CCL_ATL_TRANSPORT", "CCL_KVS_MODE", "FI_PROVIDER")} == \
        dict(CCL_PROCESS_LAUNCHER="pmix", CCL_ATL_TRANSPORT="mpi", CCL_KVS_MODE="mpi", FI_PROVIDER="cxi")
    assert env["MASTER_ADDR"] == hosts[0] and env["MASTER_PORT"] == "24242"   # 20000 + job 4242
    # no CUDA or NCCL settings carried over from Polaris, and no mask for all ranks at once (the wrapper sets it)
    assert not {"CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "ZE_AFFINITY_MASK"} & set(env)
    # what the wrapper then gives the node's 12 ranks: one tile each, GPU.tile
    masks = [tile_wrapper(local).stdout.split() for local in range(12)]
    assert masks == [[tile, "COMPOSITE"] for tile in TILES] and len(set(TILES)) == 12


def test_aurora_recipe_keeps_the_users_choices(tmp_path):
    job = FakeJob(tmp_path, ["x4000c0s0b0n0", "x4000c0s1b0n0"])
    *_, mpiexec = job.run(PBS / "aurora" / "ddp.sh", MASTER_PORT="31000", CCL_ATL_TRANSPORT="ofi", PRESET="smoke",
                          OUT="/flare/run1")
    env = mpiexec["env"]
    assert env["MASTER_PORT"] == "31000" and env["CCL_ATL_TRANSPORT"] == "ofi" and env["MASTER_ADDR"] == "x4000c0s0b0n0"
    assert option(mpiexec["argv"], "--preset") == "smoke" and option(mpiexec["argv"], "--out") == "/flare/run1"


@pytest.mark.parametrize("local_rank, mask", list(enumerate(TILES)))
def test_aurora_tile_wrapper_gives_each_local_rank_one_tile(local_rank, mask):
    """Local ranks 2g and 2g+1 share GPU g; where the user chose the FLAT hierarchy the same tile is device i."""
    proc = tile_wrapper(local_rank)
    assert proc.returncode == 0 and proc.stdout.split() == [mask, "COMPOSITE"], proc.stderr
    flat = tile_wrapper(local_rank, ZE_FLAT_DEVICE_HIERARCHY="FLAT")
    assert flat.returncode == 0 and flat.stdout.split() == [str(local_rank), "FLAT"], flat.stderr


@pytest.mark.parametrize("local_rank, says", [
    (None, "PALS_LOCAL_RANKID='' is not a local rank: start gpu_tile.sh with PALS's mpiexec"),
    ("x", "PALS_LOCAL_RANKID='x' is not a local rank: start gpu_tile.sh with PALS's mpiexec"),
    (12, "local rank 12 has no tile of its own: a node has 12; use --ppn 12 or fewer")])
def test_aurora_tile_wrapper_refuses_a_rank_without_a_tile(local_rank, says):
    proc = tile_wrapper(local_rank)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr == says + "\n"


def test_the_trainers_meet_where_the_aurora_recipe_says(monkeypatch):
    """With MASTER_ADDR and MASTER_PORT both exported the PALS ranks meet there (no mpi4py broadcast); MASTER_ADDR
    alone would be ignored, so the recipe exports both."""
    from tutorial.core import distributed
    world = world_from_env(dict(PALS_RANKID="13", PALS_LOCAL_RANKID="1", PMI_SIZE="24", PALS_LOCAL_SIZE="12"))
    assert world == World(13, 1, 24, 12, "pals")
    monkeypatch.setenv("MASTER_ADDR", "x4000c0s0b0n0")
    monkeypatch.setenv("MASTER_PORT", "24242")
    assert distributed.rendezvous(world) == ("x4000c0s0b0n0", 24242)
    # the control: without MASTER_PORT the address is not used, rank 0's broadcast (a stand-in mpi4py here) decides
    fake = types.ModuleType("mpi4py")
    fake.MPI = types.SimpleNamespace(COMM_WORLD=types.SimpleNamespace(bcast=lambda mine, root: ("rank0", 1234)))
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    monkeypatch.delenv("MASTER_PORT")
    assert distributed.rendezvous(world) == ("rank0", 1234)


# ------------------------------------------------------------------------------------------------ Open MPI
@pytest.mark.parametrize("stage", ["ddp", "horovod"])
def test_openmpi_recipe_starts_one_rank_per_gpu_and_exports_what_is_set(tmp_path, stage):
    # mpiprocs=8: PBS writes each node 8 times
    job = FakeJob(tmp_path, ["dgx01", "dgx02"], lines_per_host=8)
    (mpirun,) = job.run(PBS / "openmpi" / f"{stage}.sh", LD_LIBRARY_PATH="/opt/cuda/lib64")
    argv = mpirun["argv"]
    assert Path(argv[0]).name == "mpirun"
    assert option(argv, "-np") == "16" and option(argv, "-npernode") == "8"
    assert option(argv, "-hostfile") == str(job.nodefile) and option(argv, "-bind-to") == "none"
    if stage == "horovod":
        assert option(argv, "-map-by") == "slot"   # Horovod's documented Open MPI flags
    exported = {argv[i + 1] for i, a in enumerate(argv[:argv.index("python")]) if a == "-x"}
    assert {"PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV"} <= exported
    assert not exported & {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES"}   # none set, none named
    assert "NCCL_SOCKET_IFNAME" not in mpirun["env"]
    assert command(argv)[:3] == ["python", "-m", f"tutorial.train_{stage}"]


def test_openmpi_recipe_honours_gpus_per_node_and_passes_an_interface_on(tmp_path):
    job = FakeJob(tmp_path, ["n0", "n1", "n2"], lines_per_host=4)
    (mpirun,) = job.run(PBS / "openmpi" / "ddp.sh", GPUS_PER_NODE="4", NCCL_SOCKET_IFNAME="ib0")
    argv = mpirun["argv"]
    assert option(argv, "-np") == "12" and option(argv, "-npernode") == "4"
    assert "NCCL_SOCKET_IFNAME" in {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}   # reaches other nodes


@pytest.mark.parametrize("script", RUNNABLE, ids=lambda p: f"{p.parent.name}/{p.name}")
@pytest.mark.parametrize("nodefile", ["", "/nonexistent/nodefile"])
def test_outside_a_job_one_line_names_the_nodefile(tmp_path, script, nodefile):
    job = FakeJob(tmp_path, ["n0"])
    proc = subprocess.run(["bash", script], env=job.env() | dict(PBS_NODEFILE=nodefile), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and not job.log.exists()
    assert proc.stderr == f"PBS_NODEFILE='{nodefile}' is not a readable file: submit this script with qsub\n"


# ------------------------------------------------------------------------------------------------ engines
SITES = {  # site: (GPUs per node, engines, select line, launcher)
    "polaris": (4, 8, "#PBS -l select=2:system=polaris", "mpiexec"),
    "openmpi": (8, 16, "#PBS -l select=2:ngpus=8:mpiprocs=8", "mpirun"),
}


def render(site: str, tmp_path: Path) -> tuple[str, object]:
    """The engines template as tutorial.launch.engines has ipyparallel fill it in (no queue needed)."""
    from ipyparallel.cluster.launcher import PBSEngineSetLauncher
    ppn, n, _, _ = SITES[site]
    launcher = PBSEngineSetLauncher(
        work_dir=str(tmp_path), profile_dir=str(tmp_path), cluster_id="c1", queue="debug",
        batch_template_file=str(PBS / site / "engines.sh"),
        namespace=dict(account="MyProject", walltime="01:00:00", ppn=ppn))
    launcher.write_batch_script(n)
    return Path(launcher.batch_file).read_text(), launcher


@pytest.mark.parametrize("site", SITES)
def test_engines_template_renders_and_starts_one_engine_per_gpu(tmp_path, site):
    ppn, n, select, launcher_name = SITES[site]
    script, launcher = render(site, tmp_path)
    assert "{" not in script and "}" not in script   # every placeholder filled, no shell braces left to misread
    for line in ("#PBS -N ipengine-c1", "#PBS -A MyProject", "#PBS -q debug", select, "#PBS -l walltime=01:00:00",
                 "#PBS -V"):
        assert line in script.splitlines()
    rendered = tmp_path / "engines.pbs"
    rendered.write_text(script)
    assert subprocess.run(["bash", "-n", rendered]).returncode == 0
    # run it as the job would, with the environment qsub passes on (-V): ipyparallel's cluster id and profile
    job = FakeJob(tmp_path / "job", [f"node{i}" for i in range(n // ppn)], lines_per_host=1 if site == "polaris" else ppn)
    (call,) = job.run(rendered, **launcher.get_env())
    argv = call["argv"]
    assert Path(argv[0]).name == launcher_name
    assert argv[-4:] == [sys.executable, "-m", "ipyparallel.engine", "--mpi"]   # --mpi: MPI rank = rank
    if site == "polaris":
        assert option(argv, "-n") == "8" and option(argv, "--ppn") == "4"
        assert option(argv, "--depth") == "8" and option(argv, "--cpu-bind") == "depth"
        assert call["env"]["CUDA_VISIBLE_DEVICES"] == "3,2,1,0"
    else:
        assert option(argv, "-np") == "16" and option(argv, "-npernode") == "8"
        assert option(argv, "-hostfile") == str(job.nodefile)
        exported = {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}
        assert {"PATH", "IPP_CLUSTER_ID", "IPP_PROFILE_DIR"} <= exported   # engines on other nodes find the cluster
    assert call["env"]["IPP_CLUSTER_ID"] == "c1"
    assert "NCCL_SOCKET_IFNAME" not in call["env"]


# ------------------------------------------------------------------------------------------------ ranks
@pytest.mark.parametrize("variables, expected", [
    # what PALS's mpiexec gives rank 5 of 8, 4 per node (Cray PMI adds the PMI_* names)
    (dict(PALS_RANKID="5", PALS_LOCAL_RANKID="1", PALS_LOCAL_SIZE="4", PALS_NODEID="1", PMI_RANK="5", PMI_SIZE="8",
          PMI_LOCAL_RANK="1", PMI_LOCAL_SIZE="4"), World(5, 1, 8, 4, "pals")),
    # what Open MPI's mpirun gives rank 13 of 16, 8 per node
    (dict(OMPI_COMM_WORLD_RANK="13", OMPI_COMM_WORLD_LOCAL_RANK="5", OMPI_COMM_WORLD_SIZE="16",
          OMPI_COMM_WORLD_LOCAL_SIZE="8"), World(13, 5, 16, 8, "openmpi")),
])
def test_the_trainers_read_both_launchers_ranks(variables, expected):
    """Both recipes start the trainer with no torchrun variables; local world size < world size is what tells the
    rendezvous that the job spans nodes (rank 0's host, not 127.0.0.1)."""
    assert world_from_env(variables) == expected


# ------------------------------------------------------------------------------------------------ a real run
@needs_mpi
@pytest.mark.parametrize("stage", ["ddp", pytest.param("horovod", marks=needs_horovod)])
def test_openmpi_recipe_trains_with_the_real_mpirun(tmp_path, stage):
    """The Open MPI recipe as written, on this machine: 2 ranks on localhost (GPUS_PER_NODE=2), GPUs hidden."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("localhost\nlocalhost\n")   # mpiprocs=2 on one node
    proc = subprocess.run(
        ["bash", PBS / "openmpi" / f"{stage}.sh"], capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env=env(PBS_NODEFILE=str(nodefile), PBS_O_WORKDIR=str(ROOT), PBS_JOBID="1.local", GPUS_PER_NODE="2",
                PRESET="smoke", CUDA_VISIBLE_DEVICES="", OUT=str(tmp_path / "out")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = metrics(tmp_path / "out")
    assert m["world_size"] == 2 and m["replicas_identical"] and m["test_accuracy"] >= 0.95
