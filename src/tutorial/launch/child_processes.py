"""Start commands as "nodes", wait for them with a bound, and find and stop whatever a launch or a cluster left behind.

Every process started here, and every controller, engine and mpiexec of tutorial.launch.engines, carries the
environment variable TUTORIAL_LAUNCH=<this Python process's tag>/<n>. Launchers start their workers in new sessions
(torchrun, horovodrun, ipyparallel), so neither the process tree nor the process group finds them once the launcher is
gone; the inherited variable does. A Python process started under a tag extends it, so a test finds what the
notebook kernel it started has started.

`python -m tutorial.launch.child_processes` (scripts/check_leftovers.sh) lists every process on this machine whose
command line names one of PROCESS_NAMES, and fails if there is one.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ..core.process import open_mpi_env
from ..core.visible import HIDDEN
from .commands import display

TAG_VARIABLE = "TUTORIAL_LAUNCH"
# Marks the processes this Python process starts: below the tag it inherited, if a launch started it.
TAG = "/".join(filter(None, (os.environ.get(TAG_VARIABLE), f"{os.getpid()}-{os.urandom(4).hex()}")))
# What a launch or a cluster may leave running: engines (and their nannies), controllers, MPI launchers and daemons,
# the launchers people type, their workers, and a cluster's reaper. The one list for tests and check_leftovers.sh.
PROCESS_NAMES = ("ipengine", "ipcontroller", "ipcluster", "ipyparallel.engine", "ipyparallel.controller",
                 "ipyparallel.cluster", "mpiexec", "mpirun", "orted", "prted", "hydra_pmi_proxy", "horovodrun",
                 "torchrun", "torch.distributed.run", "tutorial.launch.worker", "tutorial.launch.reaper",
                 "tutorial.train_")
FAILED_NODE_GRACE_S = 15.0
_launches = itertools.count(1)


def new_tag() -> str:
    """A mark for one launch or one cluster: every process started with it in its environment can be found."""
    return f"{TAG}/{next(_launches)}"


def launcher_env(threads: int = 1, cpu: bool = True, **extra) -> dict:
    """The environment for a rehearsal launch. Each rehearsed node gets `threads` cores' worth of threads, and
    cpu=True hides GPUs, so two "nodes" never share one GPU (NCCL refuses that) and every machine gets the
    same gloo result. MASTER_ADDR/PORT from the caller are dropped: the launcher must set them."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", CI=env.get("CI", "true"), OMP_NUM_THREADS=str(threads))
    env[TAG_VARIABLE] = new_tag()
    if cpu:
        env.update(HIDDEN)  # every vendor's variables: which GPUs this machine has is not asked (no torch import)
    env = open_mpi_env(env)
    env.update({k: str(v) for k, v in extra.items()})
    return env


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


class Nodes:
    """Node commands started without waiting. Each writes to its own log file, which we read by path: a pipe could
    fill up and block the node, and a shared file offset would let our reads move its writes."""

    def __init__(self, commands: list[list[str]], env: dict):
        env.setdefault(TAG_VARIABLE, new_tag())
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
        reaped = {p.pid: p.returncode for p in stop(leftovers(self.tag)) if getattr(p, "returncode", None) is not None}
        for p in self.procs:
            if p.returncode is None and p.pid in reaped:  # psutil reaped our child: Popen can no longer see its status
                p.returncode = reaped[p.pid]
            p.wait()
        self.dir.cleanup()


def launch(commands: list[list[str]] | list[str], out: str = "", timeout: float = 240, env: dict | None = None,
           check: bool = True) -> Launch:
    """Start all commands at once, as if each ran on its own node, and wait for all of them.

    On a timeout or an interrupt every process of the launch is stopped, workers included, and so are the other
    nodes FAILED_NODE_GRACE_S after one node failed (torchrun's agents would otherwise wait 300 s for it at their
    exit barrier). check=True turns a failure into one error naming the node and its last output lines. One command
    (mpirun, horovodrun) is a launch from one node that starts the processes on all hosts itself.
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


def leftovers(tag: str | None = TAG, names: tuple[str, ...] = ()) -> list[dict]:
    """Processes that still exist and carry `tag` (this Python process, one launch or one cluster; None: any tag or
    none) and, with `names`, whose command line names one of them. Zombies (finished but never waited for) are
    included and flagged. An empty list is what a finished notebook must leave behind."""
    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "status", "environ"]):
        mark, cmdline = (p.info["environ"] or {}).get(TAG_VARIABLE, ""), " ".join(p.info["cmdline"] or [])
        if p.pid == os.getpid() or (tag is not None and mark != tag and not mark.startswith(tag + "/")):
            continue
        if not names or any(name in cmdline for name in names):
            found.append(dict(pid=p.pid, name=p.info["name"], cmdline=cmdline[:200],
                              zombie=p.info["status"] == psutil.STATUS_ZOMBIE))
    return found


def stop(processes: list[dict] | list[int], grace: float = 5.0) -> list[psutil.Process]:
    """terminate(), wait up to `grace` seconds, kill() what is left and wait again: the one way this project stops
    processes (launches, clusters, the virtual nodes). `processes` are `leftovers()` dicts or pids. Returns the
    processes it signalled; one that was our child was reaped here, and its `returncode` is its exit status.
    Named pids only: `pkill -9 python` would also kill your Jupyter kernel."""
    targets = []
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            targets.append(psutil.Process(p["pid"] if isinstance(p, dict) else p))
    targets = [p for p in targets if _alive(p) and p.pid != os.getpid()]
    for p in targets:
        with contextlib.suppress(psutil.NoSuchProcess):  # psutil spares a pid that another process now has
            p.terminate()
    survivors = _wait_procs(targets, grace)
    for p in survivors:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    _wait_procs(survivors, grace)
    return targets


def _wait_procs(targets: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """psutil.wait_procs, except that a zombie counts as gone: an orphan killed here has ended even when this
    machine's init never reaps it, and wait_procs would wait the whole timeout for its reaping."""
    deadline, alive = time.monotonic() + timeout, list(targets)
    while alive and time.monotonic() < deadline:
        _, alive = psutil.wait_procs(alive, timeout=min(0.2, max(0.0, deadline - time.monotonic())))
        alive = [p for p in alive if _alive(p)]
    return alive


def _alive(process: psutil.Process) -> bool:
    """Running, not a zombie (this machine's init may never reap a killed orphan; it has exited all the same)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


if __name__ == "__main__":  # scripts/check_leftovers.sh
    left = [p for p in leftovers(None, PROCESS_NAMES) if not p["zombie"]]
    for p in left:
        print(f"{p['pid']} {p['cmdline']}", file=sys.stderr)
    print("error: processes left behind (above)" if left else "no engine, controller, MPI or launcher process left")
    sys.exit(1 if left else 0)
