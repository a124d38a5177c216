"""The launch commands the workbook teaches, as argument lists: mpirun -H, horovodrun -H and hand-written ranks
(06_multi_node). Nothing here starts a process; `child_processes.launch` does."""
from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path


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
