"""Multi-node launches, rehearsed on one machine (notebook 06_multi_node).

A cluster job is a handful of commands, one per node, that must agree on three things: how many processes there
are, which one is rank 0, and where rank 0 listens. This module starts such commands as "nodes" on localhost and
reports what happened, so the notebook can run every launcher it teaches (torchrun across nodes, mpirun -H,
horovodrun -H, hand-written ranks with tcp:// or file://) and then prove that nothing it started is still running.

Every process started here carries the environment variable TUTORIAL_LAUNCH=<this Python process's tag>/<n>.
Launchers start their workers in new sessions (torchrun, horovodrun), so neither the process tree nor the process
group finds them once the launcher is gone; the inherited variable does.

The module is also the worker of the hand-written launch (seed 004's demo 3), one command per node:

    python -m tutorial.multinode --init-method tcp://NODE0:29500 --rank 0 --world-size 2     # on node 0
    python -m tutorial.multinode --init-method tcp://NODE0:29500 --rank 1 --world-size 2     # on node 1
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

TAG_VARIABLE = "TUTORIAL_LAUNCH"
TAG = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # marks the processes this Python process starts
_launches = 0
FAILED_NODE_GRACE_S = 15.0


def free_port() -> int:
    """A TCP port nobody listens on right now (on a cluster: any open port on node 0, e.g. 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(threads: int = 1, cpu: bool = True, **extra) -> dict:
    """The environment for a rehearsal launch. Each rehearsed node gets `threads` cores' worth of threads, and
    cpu=True hides GPUs, so two "nodes" never share one GPU (NCCL refuses that) and every machine gets the
    same gloo result. MASTER_ADDR/PORT from the caller are dropped: the launcher must set them."""
    global _launches
    _launches += 1
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", CI=env.get("CI", "true"), OMP_NUM_THREADS=str(threads))
    env[TAG_VARIABLE] = f"{TAG}/{_launches}"
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses to run as root without both of these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")  # more ranks than cores on a small machine
    env.update({k: str(v) for k, v in extra.items()})
    return env


# -------------------------------------------------------------------------------------------- the commands
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
    program: what torchrun starts instead of the trainer, e.g. ["-m", "tutorial.multinode"]."""
    port = port or free_port()
    program = program or trainer(stage, out, preset)
    if rdzv not in ("static", "c10d"):
        raise ValueError(f"rdzv {rdzv!r} is not one of: static, c10d")
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
           "--nproc_per_node", str(nproc_per_node)]
    if rdzv == "c10d":
        where = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", TAG]
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
    return [[sys.executable, "-m", "tutorial.multinode", "--init-method", init_method, "--rank", str(r),
             "--world-size", str(world_size), *hold_args] for r in range(world_size)]


# ---------------------------------------------------------------------------------------------- launching
@dataclass
class Launch:
    """What a rehearsed multi-node launch did: the commands (one per node), exit codes, time and output."""
    commands: list[list[str]]
    returncodes: list[int]
    seconds: float
    outputs: list[str]
    out: str = ""
    metrics: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)

    def show(self, tail: int = 6) -> None:
        """The commands as a person would type them, the exit codes, the time and each node's last lines."""
        for node, (cmd, code, text) in enumerate(zip(self.commands, self.returncodes, self.outputs)):
            print(f"node {node}$ {display(cmd)}")
            for line in text.strip().splitlines()[-tail:]:
                print(f"    {line}")
            print(f"    (exit code {code})")
        print(f"{len(self.commands)} node command(s) finished in {self.seconds:.1f} s")


def display(cmd: list[str]) -> str:
    """A command without this machine's paths: `python`, `torchrun`, `mpirun` instead of venv paths."""
    words = ["python" if w == sys.executable else w for w in cmd]
    if Path(words[0]).name in ("mpirun", "mpiexec", "horovodrun", "torchrun", "srun"):
        words[0] = Path(words[0]).name
    if words[:3] == ["python", "-m", "torch.distributed.run"]:
        words = ["torchrun"] + words[3:]
    return shlex.join(words)


class Nodes:
    """Node commands started without waiting. Each writes to its own log file, which we read by path: a pipe could
    fill up and block the node, and a shared file offset would let our reads move its writes."""

    def __init__(self, commands: list[list[str]], env: dict):
        env.setdefault(TAG_VARIABLE, launcher_env()[TAG_VARIABLE])
        self.tag, self.commands = env[TAG_VARIABLE], commands
        self.dir = tempfile.TemporaryDirectory(prefix="tutorial-nodes-")
        self.logs = [Path(self.dir.name) / f"node{i}.log" for i in range(len(commands))]
        self.procs = []
        for cmd, log in zip(commands, self.logs):
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, env=env))

    def text(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def close(self) -> None:
        """Stop whatever the launch left running (workers in their own sessions included), reap, clean up."""
        stop(leftovers(self.tag))
        for p in self.procs:
            p.wait()
        self.dir.cleanup()


def launch(commands: list[list[str]] | list[str], out: str = "", timeout: float = 240, env: dict | None = None,
           check: bool = True) -> Launch:
    """Start all commands at once, as if each ran on its own node, and wait for all of them.

    On a timeout or an interrupt every process of the launch is stopped, workers included, and so are the other
    nodes FAILED_NODE_GRACE_S after one node failed (torchrun's agents would otherwise wait 300 s for it at their
    exit barrier). check=True turns a
    failure into one error naming the node and its last output lines. One command (mpirun, horovodrun) is a
    launch from one node that starts the processes on all hosts itself.
    """
    if commands and isinstance(commands[0], str):
        commands = [commands]
    start = time.perf_counter()
    nodes = Nodes(commands, launcher_env() if env is None else env)
    try:
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.poll() is None for p in nodes.procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the launch did not finish within {timeout:.0f} s: {display(commands[0])}")
            if failed_at is None and any(p.poll() not in (None, 0) for p in nodes.procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILED_NODE_GRACE_S:
                break  # as a scheduler ends a job step: the healthy nodes would wait for the failed one in vain
            time.sleep(0.1)
        outputs = [nodes.text(i) for i in range(len(commands))]
    finally:
        nodes.close()
    result = Launch(commands, [p.returncode for p in nodes.procs], time.perf_counter() - start, outputs, str(out))
    metrics_file = Path(out) / "metrics.json" if out else None
    if metrics_file and metrics_file.exists() and result.ok:
        result.metrics = json.loads(metrics_file.read_text())
    if check and not result.ok:
        codes = result.returncodes  # prefer the node that failed over the ones we stopped (SIGTERM, SIGKILL)
        node = next((i for i, c in enumerate(codes) if c not in (0, -signal.SIGTERM, -signal.SIGKILL)),
                    next(i for i, c in enumerate(codes) if c != 0))
        last = "\n".join(result.outputs[node].strip().splitlines()[-8:])
        raise RuntimeError(f"node {node} exited with code {result.returncodes[node]}: "
                           f"{display(commands[node])}\n{last}")
    return result


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
    """The JSON lines the tutorial.multinode workers of a launch printed, in rank order."""
    lines = [line for text in run.outputs for line in text.splitlines() if line.startswith('{"rank"')]
    return sorted((json.loads(line) for line in lines), key=lambda r: r["rank"])


def rank_report(init_method: str = "env://", rank: int | None = None, world_size: int | None = None,
                hold: float = 0.0) -> dict:
    """Inside one process: join the group, all-reduce, broadcast rank 0's random weights, report what it saw."""
    import torch
    import torch.distributed as dist

    kwargs = {} if rank is None else dict(rank=rank, world_size=world_size)
    dist.init_process_group("gloo", init_method=init_method, timeout=datetime.timedelta(seconds=60), **kwargs)
    try:
        me, n = dist.get_rank(), dist.get_world_size()
        total = torch.tensor([float(me + 1)])
        dist.all_reduce(total)  # 1 + 2 + ... + n on every rank
        weights = torch.randn(1000, generator=torch.Generator().manual_seed(1234 + me))
        dist.broadcast(weights, src=0)  # what DDP does when it wraps a model: everyone starts from rank 0's copy
        digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
        digests = [None] * n
        dist.all_gather_object(digests, digest)
        if hold:
            print(f"rank {me} joined, holding {hold} s", flush=True)
            time.sleep(hold)
        return dict(rank=me, world_size=n, all_reduce_sum=int(total.item()),
                    weights_match_rank_0=len(set(digests)) == 1, init_method=init_method.split(":")[0],
                    host=socket.gethostname(), pid=os.getpid())
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- leftovers
def _processes():
    """(pid, name, state, environ) of every process we may read; /proc on Linux, psutil elsewhere."""
    if Path("/proc/self/environ").exists():
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile, or not ours to read
                continue
            name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
            yield int(entry.name), name, state, environ
        return
    import psutil
    for p in psutil.process_iter(["pid", "name", "status"]):
        try:
            environ = [f"{k}={v}".encode() for k, v in p.environ().items()]
        except (psutil.Error, OSError):
            continue
        yield p.info["pid"], p.info["name"], "Z" if p.info["status"] == psutil.STATUS_ZOMBIE else "R", environ


def leftovers(tag: str = TAG) -> list[dict]:
    """Processes started by this module (tag: this Python process, or one launch) that still exist, zombies
    (finished but never waited for) included. An empty list is what a finished notebook must leave behind."""
    prefix = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for pid, name, state, environ in _processes():
        if pid != os.getpid() and any(v == prefix or v.startswith(prefix + b"/") for v in environ):
            found.append(dict(pid=pid, name=name, zombie=state == "Z"))
    return found


def stop(processes: list[dict], grace: float = 5.0) -> int:
    """SIGTERM, then SIGKILL what is still there after `grace` seconds. Returns how many were signalled.
    Named pids only: `pkill -9 python` (seed 001's cure) would also kill your Jupyter kernel."""
    pids = [p["pid"] for p in processes if not p.get("zombie")]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
    return len(pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and ") Z" in stat.read_text())


def kill_the_launcher(nproc: int = 2, hold: float = 60.0, timeout: float = 60) -> list[dict]:
    """Seed 001's pitfall, on purpose: start torchrun with nproc workers, SIGKILL torchrun alone (what a dropped ssh
    session or a killed terminal does to it), and return the workers that are still running without it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "tutorial.multinode", "--hold", str(hold)]
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
    path = Path(__file__).resolve().parents[2] / "scripts" / relpath
    if not path.exists():
        raise FileNotFoundError(f"no launch recipe scripts/{relpath} (this needs the repository checkout)")
    print(path.read_text().rstrip())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Join a gloo process group with an explicit rank (seed 004).")
    parser.add_argument("--init-method", default="env://", help="tcp://HOST:PORT, file:///shared/path or env://")
    parser.add_argument("--rank", type=int, default=None, help="this process's rank (default: from the launcher)")
    parser.add_argument("--world-size", type=int, default=None, help="how many processes join in all")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds to stay in the group before leaving")
    args = parser.parse_args(argv)
    if (args.rank is None) != (args.world_size is None):
        parser.error("give --rank and --world-size together, or neither (then a launcher sets them)")
    print(json.dumps(rank_report(args.init_method, args.rank, args.world_size, args.hold)), flush=True)


if __name__ == "__main__":
    main()
