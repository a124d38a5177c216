"""06_multi_node: hand-written ranks with tcp:// and file://, seed 001's killed launcher, interfaces, recipes."""
from __future__ import annotations

import json
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ..core.process import free_port
from ..launch.commands import manual_commands
from ..launch.processes import Launch, Nodes, launch, launcher_env, leftovers


def manual_ranks(init: str = "tcp", world_size: int = 2, shared_dir: str | None = None, timeout: float = 120,
                 **env) -> list[dict]:
    """Start world_size processes that join one gloo group with explicit ranks; return what each rank saw.

    init="tcp": rank 0 listens on tcp://127.0.0.1:<free port>. init="file": the ranks meet in a new file under
    shared_dir, which on a cluster must be a path every node sees (NFS, Lustre, GPFS). Extra keyword arguments
    become environment variables (e.g. GLOO_SOCKET_IFNAME="lo"). A rank that fails reports its error line.
    """
    if init == "tcp":
        method = f"tcp://127.0.0.1:{free_port()}"
    elif init == "file":
        path = Path(shared_dir or tempfile.gettempdir()).resolve() / f"rendezvous-{uuid.uuid4().hex[:8]}"
        method = path.as_uri()  # file:///absolute/path; the file must not exist yet (a stale one blocks the group)
    else:
        raise ValueError(f"init {init!r} is not one of: tcp, file")
    run = launch(manual_commands(method, world_size), timeout=timeout, env=launcher_env(**env), check=False)
    seen = []
    for rank, text in enumerate(run.outputs):
        reports = [json.loads(line) for line in text.splitlines() if line.startswith('{"rank"')]
        errors = [line for line in text.splitlines() if "Error" in line or "error" in line]
        seen.append(reports[-1] if reports else
                    dict(rank=rank, error=errors[-1].strip() if errors else f"exit code {run.returncodes[rank]}"))
    return seen


def rank_reports(run: Launch) -> list[dict]:
    """The JSON lines the tutorial.launch.worker processes of a launch printed, in rank order."""
    lines = [line for text in run.outputs for line in text.splitlines() if line.startswith('{"rank"')]
    return sorted((json.loads(line) for line in lines), key=lambda r: r["rank"])


def kill_the_launcher(nproc: int = 2, hold: float = 60.0, timeout: float = 60) -> list[dict]:
    """Seed 001's pitfall, on purpose: start torchrun with nproc workers, SIGKILL torchrun alone (what a dropped ssh
    session or a killed terminal does to it), and return the workers that are still running without it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "tutorial.launch.worker", "--hold", str(hold)]
    nodes = Nodes([cmd], launcher_env())
    torchrun = nodes.procs[0]
    try:
        deadline = time.monotonic() + timeout
        while nodes.text(0).count(" joined, holding") < nproc:
            if time.monotonic() > deadline or torchrun.poll() is not None:
                raise RuntimeError(f"the workers did not start:\n{nodes.text(0)[-2000:]}")
            time.sleep(0.2)
        torchrun.kill()
        torchrun.wait()
        time.sleep(1.0)  # time enough for the workers to notice; they will not
        return leftovers(nodes.tag)
    except BaseException:
        nodes.close()
        raise


def interfaces() -> dict[str, list[str]]:
    """This machine's network interfaces and IPv4 addresses: the names NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME take."""
    try:
        import psutil
        return {name: [a.address for a in addrs if a.family == socket.AF_INET]
                for name, addrs in psutil.net_if_addrs().items()}
    except ImportError:
        return {name: [] for _, name in socket.if_nameindex()}


def script(relpath: str) -> None:
    """Print one of the repository's launch recipes (scripts/pbs/..., scripts/slurm/...), never a pasted copy."""
    path = Path(__file__).resolve().parents[3] / "scripts" / relpath  # src/tutorial/lessons/ -> the checkout
    if not path.exists():
        raise FileNotFoundError(f"no launch recipe scripts/{relpath} (this needs the repository checkout)")
    print(path.read_text().rstrip())
