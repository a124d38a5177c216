"""The launch commands the workbook teaches, as argument lists: torchrun across nodes, mpirun -H, horovodrun -H and
hand-written ranks (06_multi_node). Nothing here starts a process; `child_processes.launch` does. (A c10d
rendezvous on this host is held here, core.distributed.hold_port, until the next one.)"""
from __future__ import annotations

import shlex
import shutil
import sys
import uuid
from pathlib import Path

from ..core.process import free_port


def _tool(name: str) -> str:
    """A launcher from this Python's environment first (the venv's horovodrun), then from PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} is not installed here (make install provides it)")
    return found


def trainer(stage: str, out: str, preset: str = "smoke", *args: str) -> list[str]:
    """`-m tutorial.train_<stage> --preset P --out DIR`: what every launcher below starts."""
    return ["-m", f"tutorial.train_{stage}", "--preset", preset, "--out", str(out), *args]


def torchrun_nodes(out: str, nnodes: int = 2, nproc_per_node: int = 1, port: int | None = None,
                   rdzv: str = "static", stage: str = "ddp", preset: str = "smoke",
                   program: list[str] | None = None) -> list[list[str]]:
    """One torchrun command per node. static: every node is told its --node_rank and node 0's address (seed 001's
    recipe); c10d: the nodes agree on a rendezvous endpoint and torchrun numbers them (scripts/slurm/ddp.sbatch).
    program: what torchrun starts instead of the trainer, e.g. ["-m", "tutorial.launch.worker"]."""
    if rdzv not in ("static", "c10d"):
        raise ValueError(f"rdzv {rdzv!r} is not one of: static, c10d")
    # c10d: this process hosts the rendezvous store on a port it holds, and both agents, failing to bind it, join it
    # as clients (torch's c10d backend falls back to that). static: node 0's agent must bind --master_port itself.
    from ..core.distributed import hold_port  # torch, needed only here
    port = port or (hold_port() if rdzv == "c10d" else free_port())
    program = program or trainer(stage, out, preset)
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
           "--nproc_per_node", str(nproc_per_node)]
    if rdzv == "c10d":
        where = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", uuid.uuid4().hex[:8]]
        return [run + where + program for _ in range(nnodes)]
    return [run + ["--node_rank", str(i), "--master_addr", "127.0.0.1", "--master_port", str(port)] + program
            for i in range(nnodes)]


def mpirun_command(out: str, np: int = 2, hosts: str = "localhost:2", stage: str = "ddp",
                   preset: str = "smoke") -> list[str]:
    """Open MPI starts every rank (over ssh on the other hosts of -H); the trainer reads OMPI_COMM_WORLD_*."""
    return [_tool("mpirun"), "-np", str(np), "-H", hosts, sys.executable, *trainer(stage, out, preset)]


def horovodrun_command(out: str, np: int = 2, hosts: str = "localhost:2", controller: str = "",
                       preset: str = "smoke") -> list[str]:
    """horovodrun -np N -H host:slots,...; controller "--gloo" or "--mpi" (default: MPI when Horovod has it)."""
    return [_tool("horovodrun"), "-np", str(np), "-H", hosts, *([controller] if controller else []),
            sys.executable, *trainer("horovod", out, preset)]


def manual_commands(init_method: str, world_size: int = 2, hold: float = 0.0) -> list[list[str]]:
    """Seed 004's demo 3: the same command on every node, each with its own --rank."""
    hold_args = ["--hold", str(hold)] if hold else []
    return [[sys.executable, "-m", "tutorial.launch.worker", "--init-method", init_method, "--rank", str(r),
             "--world-size", str(world_size), *hold_args] for r in range(world_size)]


def display(cmd: list[str]) -> str:
    """A command without this machine's paths: `python`, `torchrun`, `mpirun` instead of venv paths."""
    words = ["python" if w == sys.executable else w for w in cmd]
    if Path(words[0]).name in ("mpirun", "mpiexec", "horovodrun", "torchrun", "srun"):
        words[0] = Path(words[0]).name
    if words[:3] == ["python", "-m", "torch.distributed.run"]:
        words = ["torchrun"] + words[3:]
    return shlex.join(words)
