"""Engines from a notebook cell: one process per GPU, started, used and stopped from JupyterLab.

Notebook 00_setup starts the cluster and shows who is who (rank, host, pid, device); 03_distributed_data_parallel
and 05_horovod run their trainers on it; 06_multi_node starts engines on other nodes (Slurm, PBS, mpiexec):

    import tutorial.launch.engines, tutorial.train_ddp
    from tutorial.core.config import TrainConfig
    with tutorial.launch.engines.start(n=2) as cluster:              # engines="local" | "mpi" | "slurm" | "pbs"
        metrics = cluster.run(tutorial.train_ddp.main, TrainConfig.preset("smoke"))   # rank 0's metrics
        cluster.results                                        # every rank's result, in rank order

What `start` does, and why:
- It starts an ipyparallel controller and n engines (default: one per visible GPU, else 2 on CPU) and waits for them
  with a bounded timeout. It then gives every engine torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the trainers' `world_from_env()` needs no engine-specific code.
  For MPI engines the rank is the MPI rank, never the engine id: Horovod and mpi4py use the MPI rank, and the two
  must agree. The local rank is the engine's position among the engines on its host; it pins the GPU.
- CPU engines get cores / engines-per-node threads each; n processes with all cores' threads each would fight.
- Two engines on one GPU, or two engines with one rank, stop the start with an error (both are silent slowdowns or
  hangs later). So does asking for more engines than GPUs when GPUs are required (`device="cuda"`).
- ipyparallel's own log lines and progress bars are switched off so notebook outputs stay the same between runs
  (strict nbval), and `%%px` is activated without its progress bar.
- Engines run in their own session, so a notebook kernel that is killed would leave them running. A small reaper
  process waits for this process to exit and then ends the controller, the engines and mpiexec; `stop()` (or leaving
  the `with` block) does it at once.

A second run on the same engines: every `run` creates a new process group on a fresh MASTER_PORT. The trainers
destroy the process group they created; re-initialising one afterwards in the same process works with gloo on torch
2.14.1 *when the port is new* (checked: three init/all_reduce/destroy rounds in one pair of processes, and two DDP runs
on the same engines give bitwise-equal replicas). What hangs is a second rendezvous on the *same* port: rank 1 meets
leftovers of the first round's store. Restarting the engines before every run would also avoid it but costs
seconds of Python and torch start-up per run, so it is not the default; `run(..., fresh=True)` or `restart()` gives
brand-new processes when wanted (e.g. a backend that cannot be re-initialised). Horovod stays initialised between
runs on purpose (see train_horovod.py).

Failures: an exception on any rank is raised here as `EngineError` naming the rank, host and pid, with the remote
traceback. A rank that dies or a run that passes its timeout leaves the other ranks waiting in a collective, so the
engines are restarted (or stopped, `on_failure="stop"`) before the error is raised: the notebook can run again.

Multi-node: engines on other nodes must reach the controller, so bind it to an interface (`interface="hsn0"`) or an
address (`ip="10.1.2.3"`, or `ip="*"` for all); loopback is the default for local and MPI engines. Slurm and PBS
engines use ipyparallel's own batch launchers, configured through `launcher={...}` (queue, account, timelimit,
batch_template_file, namespace); scripts/slurm/engines.sh and scripts/pbs/engines.sh are templates for a Slurm
cluster and a ThetaGPU-like PBS system.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from ..core.config import ConfigError

ENGINE_KINDS = ("local", "mpi", "slurm", "pbs")
DEVICES = ("auto", "cuda", "cpu")
ON_FAILURE = ("restart", "stop")
BATCH_KINDS = ("slurm", "pbs")
# How long the other ranks get to finish (or fail) after one rank failed or died before they are stopped: enough for
# gloo to notice a closed connection, short enough that a rank stuck in a collective does not keep the notebook.
FAILURE_GRACE_S = 5.0
ALL_INTERFACES = ("*", "0.0.0.0")
ANSI_COLOURS = re.compile(r"\x1b\[[0-9;]*m")

log = logging.getLogger(__name__)


class ClusterError(ConfigError):
    """A bad option for start() or run(): one line naming the value and what is allowed. Nothing is left running."""


class EngineError(RuntimeError):
    """Something went wrong on an engine: a rank raised, died, or did not finish in time.

    `rank`, `host` and `pid` say where (the first failure; the others are often its consequences), and
    `remote_traceback` holds the engine's traceback when there is one."""

    def __init__(self, message, rank=None, host=None, pid=None, remote_traceback=""):
        super().__init__(message)
        self.rank, self.host, self.pid, self.remote_traceback = rank, host, pid, remote_traceback


class EngineTimeout(EngineError, TimeoutError):
    """A run or the start did not finish within its timeout."""


@dataclass
class EngineInfo:
    """One engine as the trainers see it (the table that start() prints)."""
    engine_id: int
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    host: str
    pid: int
    device: str = "cpu"
    gpu: str = ""        # the GPU's UUID: equal UUIDs mean a shared GPU, whatever CUDA_VISIBLE_DEVICES said
    threads: int = 1
    mpi_rank: int | None = None


# ------------------------------------------------------------------------------------------ run on the engines
# These run inside the engines, so they live at module level: engines import them by name, as they do the trainers.
def _engine_probe() -> dict:
    """Who am I: pid, host, cores, GPUs, and the MPI rank when the engine was started by mpiexec (ipengine --mpi)."""
    import os
    import socket
    import sys
    info = dict(pid=os.getpid(), host=socket.gethostname(), cores=os.cpu_count() or 1, mpi_rank=None,
                mpi_size=None, gpus=0)
    try:
        info["affinity"] = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        info["affinity"] = info["cores"]
    mpi = sys.modules.get("mpi4py.MPI")  # imported by ipengine --mpi; a plain engine never imports it
    if mpi is not None and mpi.Is_initialized():
        info["mpi_rank"], info["mpi_size"] = mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
    import torch
    if torch.cuda.is_available():
        info["gpus"] = torch.cuda.device_count()
    return info


def _engine_configure(env: dict, threads: int, use_cuda: bool) -> dict:
    """Become rank env['RANK']: torchrun's variables, a fair share of the cores, and the GPU of our local rank."""
    import os
    import socket
    os.environ.update(env)
    import torch
    torch.set_num_threads(threads)
    device, gpu = "cpu", ""
    if use_cuda and torch.cuda.is_available():
        index = int(env["LOCAL_RANK"]) % torch.cuda.device_count()
        torch.cuda.set_device(index)  # so nccl and .cuda() never default to GPU 0
        props = torch.cuda.get_device_properties(index)
        device = f"cuda:{index} {props.name}"
        gpu = str(getattr(props, "uuid", "") or f"{socket.gethostname()}:{index}")
    return dict(device=device, gpu=gpu, threads=torch.get_num_threads())


def _engine_prepare(module: str) -> tuple[int, bool]:
    """On rank 0 before a run: a port nobody listens on (where the next process group's rendezvous will listen), and
    whether the function's module can be imported here (engines get functions by module and name)."""
    import importlib.util
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    try:
        importable = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        importable = False
    return port, importable


def _engine_set_environ(values: dict) -> None:
    import os
    os.environ.update(values)


def _engine_run(fn, master_port: int, args: tuple, kwargs: dict):
    """One run: a fresh rendezvous port (a second process group on the old port hangs), then the function."""
    import os
    os.environ["MASTER_PORT"] = str(master_port)
    return fn(*args, **kwargs)


# -------------------------------------------------------------------------------------------------- the reaper
# A process of its own session that outlives a killed notebook kernel: when its parent is gone, it ends every process
# listed in the file (and their children). stop() removes the file, which tells it to exit quietly.
_REAPER = r"""
import json, os, sys, time
import psutil
parent, path = psutil.Process(int(sys.argv[2])), sys.argv[3]
def parent_alive():
    try:
        return parent.is_running() and parent.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
while os.path.exists(path) and parent_alive():
    time.sleep(0.5)
if os.path.exists(path):
    with open(path) as f:
        listed = json.load(f)
    procs = []
    for pid, created in listed:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1:  # not a new process that reused the pid
                procs += [p] + p.children(recursive=True)
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    gone, alive = psutil.wait_procs(procs, timeout=3)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    os.remove(path)
"""


# --------------------------------------------------------------------------------------------- input checks
def _engine_count(n, kind: str, device: str, elsewhere: bool = False) -> tuple[int, bool]:
    """How many engines, and whether they use GPUs; every bad combination fails here, before anything starts.
    elsewhere: the engines may run on other nodes (batch jobs, mpiexec with a hostfile), whose GPUs count."""
    if kind not in ENGINE_KINDS:
        raise ClusterError(f"engines {kind!r} is not one of: {', '.join(ENGINE_KINDS)}")
    if device not in DEVICES:
        raise ClusterError(f"device {device!r} is not one of: {', '.join(DEVICES)}")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ClusterError(f"n (the number of engines) must be a whole number of at least 1, got {n!r}")
    if kind in BATCH_KINDS or elsewhere:
        # The GPUs that count are on the engines' nodes, not here; they are checked once the engines report in.
        if n is None:
            raise ClusterError(f"engines={kind!r} on other nodes needs n, the number of engines to start there")
        return n, device != "cpu"
    if device == "cpu":
        return (n or 2), False
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus == 0:
        raise ClusterError("device='cuda' needs GPUs, but none is visible here (device='auto' uses the CPU)")
    if gpus == 0:
        return (n or 2), False
    n = n or gpus
    if n > gpus:
        raise ClusterError(f"n={n} engines on this node but only {gpus} GPU(s) visible: two engines would share a "
                           f"GPU; use n<={gpus}, or device='cpu' for CPU engines")
    return n, True


def _bind_address(kind: str, ip, interface) -> tuple[str, str]:
    """The address the controller listens on, and the one engines connect to (they differ when it listens on all)."""
    if ip and interface:
        raise ClusterError("give ip or interface, not both")
    if interface:
        import psutil
        addresses = psutil.net_if_addrs()
        if interface not in addresses:
            raise ClusterError(f"interface {interface!r} does not exist here; choose from: {', '.join(addresses)}")
        ipv4 = [a.address for a in addresses[interface] if a.family == socket.AF_INET]
        if not ipv4:
            raise ClusterError(f"interface {interface!r} has no IPv4 address")
        ip = ipv4[0]
    if not ip:
        # Engines of a batch job run on other nodes: loopback would be unreachable for them.
        ip = "*" if kind in BATCH_KINDS else "127.0.0.1"
    location = socket.getfqdn() if ip in ALL_INTERFACES else ip
    return ip, location


def _check_ports(ports, ip: str) -> str:
    """The controller's port pool (e.g. "10000-10030" where a firewall allows only those); busy ports fail here."""
    from ipyparallel.traitlets import PortList
    text = ports if isinstance(ports, str) else ",".join(str(p) for p in ports)
    try:
        numbers = PortList.parse_port_range(text)
    except ValueError:
        raise ClusterError(f"ports {ports!r} is not a port list like '10000-10030' or [10000, 10001]") from None
    host = "" if ip in ALL_INTERFACES else ip
    for port in numbers:
        if not 0 < port < 65536:
            raise ClusterError(f"port {port} is out of range (1-65535)")
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                raise ClusterError(f"port {port} on {ip} is in use; choose other ports than {text}") from None
    return text


def _mpi_environment(n: int) -> dict:
    """What mpiexec needs on this machine: Open MPI refuses root without two variables (set only for root), and
    refuses more ranks than cores unless oversubscription is allowed (a laptop running 2 engines on 1 core)."""
    env = {}
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if n > (os.cpu_count() or 1):
        env["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
    return env


def _quiet_logger() -> logging.Logger:
    """ipyparallel's INFO lines ("Starting 2 engines with ...") in a notebook cell would differ on every run."""
    quiet = logging.getLogger("tutorial.launch.engines.ipyparallel")
    quiet.setLevel(logging.ERROR)
    return quiet


# ------------------------------------------------------------------------------------------------------ start
def start(n: int | None = None, engines: str = "local", *, device: str = "auto", timeout: float = 90.0,
          run_timeout: float = 3600.0, ip: str | None = None, interface: str | None = None,
          location: str | None = None, ports=None, mpi_args=(), launcher: dict | None = None,
          profile: str | None = None, on_failure: str = "restart", activate: bool = True,
          show: bool = True) -> "Cluster":
    """Start a controller and n engines, make them ranks 0..n-1, and return the Cluster (00_setup).

    n: engines (default: one per visible GPU, else 2). engines: local, mpi (mpiexec; MPI rank = rank), slurm or pbs.
    device: auto (GPUs if visible), cuda (GPUs required) or cpu. timeout: seconds to wait for the engines.
    run_timeout: default limit of one run(). ip/interface/location: where the controller listens and how engines on
    other nodes find it. ports: the controller's port pool. mpi_args: extra mpiexec arguments (e.g. a hostfile).
    launcher: options of ipyparallel's engine launcher (queue, account, timelimit, batch_template_file, namespace, ...).
    on_failure: restart or stop the engines after a failed run. activate: enable %%px. show: print the engine table.
    """
    n, use_cuda = _engine_count(n, engines, device, elsewhere=engines == "mpi" and bool(mpi_args))
    if on_failure not in ON_FAILURE:
        raise ClusterError(f"on_failure {on_failure!r} is not one of: {', '.join(ON_FAILURE)}")
    if not timeout > 0 or not run_timeout > 0:
        raise ClusterError(f"timeouts must be positive, got timeout={timeout} and run_timeout={run_timeout}")
    if engines == "mpi" and not shutil.which("mpiexec"):
        raise ClusterError("engines='mpi' needs mpiexec on the PATH (apt-get install openmpi-bin, or load an MPI "
                           "module)")
    submit = {"slurm": "sbatch", "pbs": "qsub"}.get(engines)
    if submit and not shutil.which(submit):
        raise ClusterError(f"engines={engines!r} needs {submit}, which is not on the PATH: run it on a login or "
                           f"compute node of a {engines.upper()} system")
    bind, where = _bind_address(engines, ip, interface)
    port_pool = _check_ports(ports, bind) if ports else None
    cluster = Cluster(n=n, kind=engines, use_cuda=use_cuda, hide_gpus=device == "cpu", timeout=timeout,
                      run_timeout=run_timeout, ip=bind, location=location or where, ports=port_pool,
                      mpi_args=list(mpi_args), launcher=dict(launcher or {}), profile=profile,
                      on_failure=on_failure, activate=activate)
    try:
        cluster._start()
    except BaseException:  # KeyboardInterrupt too: never leave half a cluster behind
        cluster.stop()
        raise
    if show:
        print(cluster.table(), flush=True)
    return cluster


@dataclass
class Cluster:
    """A running controller and its engines, ranks 0..n-1. Use start() to make one."""
    n: int
    kind: str = "local"
    use_cuda: bool = False
    hide_gpus: bool = False
    timeout: float = 90.0
    run_timeout: float = 3600.0
    ip: str = "127.0.0.1"
    location: str = ""
    ports: str | None = None
    mpi_args: list = field(default_factory=list)
    launcher: dict = field(default_factory=dict)
    profile: str | None = None
    on_failure: str = "restart"
    activate: bool = True
    engines: list = field(default_factory=list)   # EngineInfo per rank, in rank order
    results: list = field(default_factory=list)   # the last run's result per rank, in rank order
    client: object = None
    view: object = None                            # a blocking DirectView on all engines, in rank order
    _ipp: object = None
    _reaper: object = None
    _reaper_file: str = ""
    _stopped: bool = False

    # ------------------------------------------------------------------------------------------ lifecycle
    def _config(self):
        from traitlets.config import Config
        config = Config()
        # Engine environment, fixed at launch: OpenMP reads its thread count when it starts.
        env = {"PYTHONUNBUFFERED": "1"}
        if self.kind == "local" or (self.kind == "mpi" and not self.mpi_args):  # all on this node: a fair share
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.n))
        if self.hide_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""
        if self.kind == "mpi":
            env.update(_mpi_environment(self.n))
            config.MPIEngineSetLauncher.mpi_args = list(self.mpi_args)
        config.EngineLauncher.environment = env
        # Engines keep no state worth saving: SIGKILL 1 s after SIGTERM (the default 5 s adds up over restarts).
        config.LocalProcessLauncher.stop_seconds_until_kill = 1
        config.ControllerLauncher.connection_info_timeout = float(self.timeout)
        if self.kind in BATCH_KINDS:
            launcher_class = {"slurm": "SlurmEngineSetLauncher", "pbs": "PBSEngineSetLauncher"}[self.kind]
            for key, value in self.launcher.items():
                setattr(config[launcher_class], key, value)
        elif self.launcher:
            launcher_class = {"local": "LocalEngineSetLauncher", "mpi": "MPIEngineSetLauncher"}[self.kind]
            for key, value in self.launcher.items():
                setattr(config[launcher_class], key, value)
        return config

    def _start(self) -> None:
        # Read by ipyparallel at import: no progress bars and no streamed %px output in cells (stable nbval outputs).
        os.environ.setdefault("IPP_NONINTERACTIVE", "1")
        import ipyparallel as ipp
        controller_args = ["--ports", self.ports] if self.ports else []
        kwargs = dict(profile=self.profile) if self.profile else {}
        self._ipp = ipp.Cluster(engines=self.kind, n=self.n, config=self._config(), log=_quiet_logger(),
                                controller_ip=self.ip, controller_location=self.location,
                                controller_args=controller_args, **kwargs)
        self._start_reaper()
        self._ipp.start_controller_sync()
        self._remember_processes()
        self.client = self._ipp.connect_client_sync()
        self._start_engines(old_ids=set())

    def _start_engines(self, old_ids: set) -> None:
        """Start n engines, wait for them (bounded), and make them ranks."""
        self._ipp.start_engines_sync(self.n)
        self._remember_processes()
        ids = self._wait_for_engines(old_ids)
        self._assign_ranks(ids)
        self._remember_processes()
        if self.activate:
            self._activate_magics()

    def _wait_for_engines(self, old_ids: set) -> list:
        """Wait for n new engines; fail early, with the launcher's output, when the launcher process exits."""
        deadline = time.monotonic() + self.timeout
        while True:
            new = sorted(set(self.client.ids) - old_ids)
            if len(new) >= self.n:
                return new[:self.n]
            stopped = [es for es in self._ipp.engines.values() if self._launcher_exited(es)]
            if stopped or self._launcher_exited(self._ipp.controller):
                output = "\n".join(es.get_output() for es in stopped)[-3000:]
                raise EngineError(f"the {self.kind} engines stopped while starting ({len(new)} of {self.n} "
                                  f"registered). Their output:\n{output}")
            if time.monotonic() > deadline:
                raise EngineTimeout(f"only {len(new)} of {self.n} {self.kind} engines registered within "
                                    f"{self.timeout:.0f} s (timeout=...); for batch engines the job may still be "
                                    f"queued")
            time.sleep(0.1)

    @staticmethod
    def _launcher_exited(launcher) -> bool:
        """Whether a local launcher's process (an engine, mpiexec, the controller) has exited. Checked here rather
        than through the launcher's state, which misses a process that exits within its first moments."""
        import psutil
        members = list(getattr(launcher, "launchers", {}).values()) or [launcher]
        for member in members:
            process = getattr(member, "process", None)
            if isinstance(process, psutil.Process):
                try:
                    if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
                        return True
                except psutil.NoSuchProcess:
                    return True
        return False

    def _assign_ranks(self, ids: list) -> None:
        """Rank, local rank and world size for every engine; MPI engines keep their MPI rank."""
        probe = self.client[ids]
        probe.block = True
        infos = dict(zip(ids, probe.apply(_engine_probe)))
        mpi_ranks = [infos[i]["mpi_rank"] for i in ids]
        if all(r is not None for r in mpi_ranks) and all(infos[i]["mpi_size"] == self.n for i in ids):
            order = sorted(ids, key=lambda i: infos[i]["mpi_rank"])
            ranks = {i: infos[i]["mpi_rank"] for i in ids}
        else:
            if self.kind == "mpi":
                raise EngineError(f"the MPI engines report MPI ranks {mpi_ranks} and sizes "
                                  f"{[infos[i]['mpi_size'] for i in ids]}, not one world of {self.n}")
            # Engine ids follow registration order; grouping by host keeps a node's ranks contiguous.
            order = sorted(ids, key=lambda i: (infos[i]["host"], i))
            ranks = {i: r for r, i in enumerate(order)}
        if sorted(ranks.values()) != list(range(self.n)):
            raise EngineError(f"two engines share a rank, or a rank is missing: ranks {sorted(ranks.values())}")
        hosts = {}
        for i in order:
            hosts.setdefault(infos[i]["host"], []).append(i)
        single_node = len(hosts) == 1
        rank0_host = infos[order[0]]["host"]
        master_addr = "127.0.0.1" if single_node else rank0_host
        # A free port on rank 0's host for process groups made by hand in %%px cells; every run() picks a new one.
        master_port = self.client[order[0]].apply_sync(_engine_prepare, "os")[0]
        engines = []
        for host, members in hosts.items():
            gpus = infos[members[0]]["gpus"]
            if self.use_cuda and len(members) > gpus:
                raise EngineError(f"{len(members)} engines on {host} but {gpus} GPU(s) there: two engines would "
                                  f"share a GPU")
            for local_rank, i in enumerate(members):
                info = infos[i]
                threads = max(1, min(info["affinity"], info["cores"] // len(members)))
                env = dict(RANK=str(ranks[i]), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(self.n),
                           LOCAL_WORLD_SIZE=str(len(members)), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                           OMP_NUM_THREADS=str(threads))
                done = self.client[i].apply_async(_engine_configure, env, threads, self.use_cuda)
                engines.append((done, EngineInfo(i, ranks[i], local_rank, self.n, len(members), host, info["pid"],
                                                 mpi_rank=info["mpi_rank"])))
        for done, engine in engines:
            configured = done.get(timeout=self.timeout)
            engine.device, engine.gpu, engine.threads = configured["device"], configured["gpu"], configured["threads"]
        self.engines = sorted((e for _, e in engines), key=lambda e: e.rank)
        if self.use_cuda:
            seen = {}
            for e in self.engines:
                if e.gpu in seen:
                    raise EngineError(f"ranks {seen[e.gpu]} and {e.rank} share GPU {e.gpu} on {e.host}: one engine "
                                      f"per GPU (check CUDA_VISIBLE_DEVICES and the launcher's GPU binding)")
                seen[e.gpu] = e.rank
        self.view = self.client[[e.engine_id for e in self.engines]]
        self.view.block = True

    def _activate_magics(self) -> None:
        """%%px on all engines, without its progress bar and with output per engine at the end (stable in nbval)."""
        try:
            from IPython import get_ipython
        except ImportError:
            return
        shell = get_ipython()
        if shell is None:
            return
        from ipyparallel.client.magics import ParallelMagics
        magics = ParallelMagics(shell, self.view)
        magics.progress_after_seconds = -1
        magics.stream_output = False
        shell.magics_manager.register(magics)

    def table(self) -> str:
        """Rank, local rank, host, pid, device and threads of every engine (00_setup shows it)."""
        rows = [("rank", "local", "host", "pid", "device", "threads")]
        rows += [(str(e.rank), str(e.local_rank), e.host, str(e.pid), e.device, str(e.threads)) for e in self.engines]
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)

    def restart(self) -> None:
        """Fresh engine processes (new pids, nothing left from earlier runs), same n, same controller."""
        self._require_running()
        old_ids = set(self.client.ids)
        started = self._processes()  # before the stop: afterwards the engines' children are orphans nobody lists
        self._ipp.stop_engines_sync()
        self._kill(started)
        self.engines = []
        self._start_engines(old_ids)

    def stop(self) -> None:
        """Stop the engines, mpiexec and the controller; safe to call twice. Leaving the `with` block calls it."""
        if self._stopped:
            return
        self._stopped = True
        started = self._processes(everything=True)
        try:
            if self.client is not None:
                self.client.close()
        except Exception:  # a closed or broken client must not keep the processes alive
            pass
        try:
            if self._ipp is not None:
                self._ipp.stop_cluster_sync()
        except Exception as exc:
            log.debug("stopping the cluster: %r", exc)
        finally:
            self._kill(started)  # what ipyparallel's stop missed: nannies, a rank stuck in C code
            self._stop_reaper()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return f"<Cluster {self.kind}: {self.n} engine(s), {'GPU' if self.use_cuda else 'CPU'}, {state}>"

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):
        if not self._stopped and self._ipp is not None:
            try:
                self.stop()
            except Exception:
                pass

    # --------------------------------------------------------------------------------------------- processes
    def _processes(self, everything: bool = False) -> list:
        """What this cluster started on this host and their children (engine nannies, mpiexec's ranks): launchers,
        engines and, with everything, the controller."""
        import psutil
        pids = set()
        if self._ipp is not None:
            if everything and self._ipp.controller is not None:
                pids.add(getattr(self._ipp.controller, "pid", -1))
            for engine_set in self._ipp.engines.values():
                pids.add(getattr(engine_set, "pid", -1))
                for launcher in getattr(engine_set, "launchers", {}).values():
                    pids.add(launcher.pid)
        here = socket.gethostname()
        pids.update(e.pid for e in self.engines if e.host == here)
        found = {}
        for pid in pids - {-1, 0, os.getpid()}:
            try:
                p = psutil.Process(pid)
                found[pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True))
            except (psutil.Error, ValueError):
                pass
        return list(found.values())

    @staticmethod
    def _kill(procs: list) -> None:
        """SIGKILL what is still running of procs (psutil checks the start time, so a reused pid is never hit)."""
        import psutil
        alive = [p for p in procs if p.is_running()]
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)

    def _remember_processes(self) -> None:
        """Tell the reaper what to end should this process die (the file is rewritten, never appended)."""
        if not self._reaper_file:
            return
        listed = []
        if os.path.exists(self._reaper_file):
            with open(self._reaper_file) as f:
                listed = [tuple(x) for x in json.load(f)]
        merged = sorted(set(listed) | {(p.pid, p.create_time()) for p in self._processes(everything=True)})
        tmp = self._reaper_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(merged, f)
        os.replace(tmp, self._reaper_file)

    def _start_reaper(self) -> None:
        fd, self._reaper_file = tempfile.mkstemp(prefix="tutorial-cluster-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([], f)
        self._reaper = subprocess.Popen(
            [sys.executable, "-c", _REAPER, "tutorial-cluster-reaper", str(os.getpid()), self._reaper_file],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a kernel killed with its process group must not take the reaper along

    def _stop_reaper(self) -> None:
        if self._reaper_file and os.path.exists(self._reaper_file):
            os.remove(self._reaper_file)  # the reaper sees the file gone and exits without killing anything
        if self._reaper is not None:
            try:
                self._reaper.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
                self._reaper.wait()
            self._reaper = None

    def _dead_ranks(self) -> list:
        """Ranks whose engine process is gone (checked on this host) or that the controller dropped (other hosts)."""
        import psutil
        here, ids, dead = socket.gethostname(), set(self.client.ids), []
        for e in self.engines:
            if e.host == here:
                try:
                    alive = psutil.Process(e.pid).status() != psutil.STATUS_ZOMBIE
                except psutil.Error:
                    alive = False
            else:
                alive = e.engine_id in ids
            if not alive:
                dead.append(e.rank)
        return dead

    def _require_running(self) -> None:
        if self._stopped:
            raise ClusterError("this cluster was stopped; start a new one with tutorial.launch.engines.start()")

    # -------------------------------------------------------------------------------------------------- run
    def run(self, fn, *args, timeout: float | None = None, fresh: bool = False, **kwargs):
        """Run fn(*args, **kwargs) on every engine at once and return rank 0's result (03, 05).

        fn must be importable (e.g. tutorial.train_ddp.main): engines cannot see functions defined in a notebook.
        Rank 0's output streams here; every rank's result is in `self.results`. An exception on any rank raises
        EngineError with its rank and traceback; a run longer than timeout (default: start's run_timeout) raises
        EngineTimeout. After a death or a timeout the engines are restarted (or stopped) first.
        fresh=True restarts the engines before the run: brand-new processes.
        """
        self._require_running()
        self._check_function(fn)
        timeout = self.run_timeout if timeout is None else timeout
        if fresh:
            self.restart()
        rank0 = self.client[self.engines[0].engine_id]
        port, importable = rank0.apply_sync(_engine_prepare, fn.__module__)
        if not importable:
            raise ClusterError(f"{fn.__module__}.{fn.__qualname__} is in a module the engines cannot import (not on "
                               f"their sys.path); put it in a package module, like tutorial.train_ddp.main")
        result = self.view.apply_async(_engine_run, fn, port, args, kwargs)
        self.results = self._collect(result, timeout)
        sizes = {r.get("world_size") for r in self.results if isinstance(r, dict)} - {None}
        if sizes and sizes != {self.n}:
            raise EngineError(f"{fn.__module__}.{fn.__name__} ran with world size {sorted(sizes)} instead of {self.n}: "
                              f"each engine trained alone (Horovod needs engines='mpi')")
        return self.results[0]

    def new_master_port(self) -> int:
        """Give every engine a MASTER_PORT nobody listens on, for a process group made by hand in a %%px cell
        (03): a second rendezvous on the port of the previous one hangs. run() picks its own port every time."""
        self._require_running()
        port = self.client[self.engines[0].engine_id].apply_sync(_engine_prepare, "os")[0]
        self.view.apply_sync(_engine_set_environ, {"MASTER_PORT": str(port)})
        return port

    def _check_function(self, fn) -> None:
        if not callable(fn):
            raise ClusterError(f"run needs a function, got {fn!r}")
        module = getattr(fn, "__module__", None)
        if module in (None, "__main__") or getattr(fn, "__name__", "<lambda>") == "<lambda>":
            raise ClusterError(f"{getattr(fn, '__name__', fn)!r} is defined in the notebook or script, which the "
                               f"engines cannot import; put it in a module (like tutorial.train_ddp.main)")
        hvd = getattr(sys.modules.get(module), "hvd", None)
        if getattr(hvd, "__name__", "").startswith("horovod") and self.kind != "mpi":
            raise ClusterError(f"{module}.{fn.__name__} uses Horovod, which finds its ranks through MPI: start the "
                               f"cluster with engines='mpi'")

    def _collect(self, result, timeout: float) -> list:
        """Wait for every rank, streaming rank 0's output; turn failures, deaths and hangs into one clear error."""
        parts = result.split()  # one result per rank, in rank order like self.view; they keep their own output
        one = len(parts) == 1 and parts[0] is result  # split() leaves a single engine's result as a list of one
        shown = {"stdout": 0, "stderr": 0}
        deadline = time.monotonic() + timeout
        failed_at, dead, timed_out = None, [], False
        while True:
            finished = result.wait(0.2)
            self._stream(parts[0], shown)
            if finished:
                break
            now = time.monotonic()
            dead = self._dead_ranks()
            done = {r for r, part in enumerate(parts) if part.ready()}
            if failed_at is None and (dead or any(not parts[r].successful() for r in done)):
                failed_at = now
            if failed_at is not None and (set(dead) | done >= set(range(self.n)) or now - failed_at > FAILURE_GRACE_S):
                break
            if now > deadline:
                timed_out = True
                break
        if finished:
            parts[0].wait_for_output(5)  # ipyparallel may deliver the result before the last lines of output
        self._stream(parts[0], shown)
        results, errors, still_running = [], [], []
        for rank, part in enumerate(parts):
            value = None
            if not part.ready():
                if rank not in dead:
                    still_running.append(rank)
            else:
                try:
                    value = part.get(0)[0] if one else part.get(0)
                except Exception as exc:
                    completed = part["completed"]
                    errors.append((completed.timestamp() if completed else float("inf"), rank, exc))
            results.append(value)
        if not (errors or dead or timed_out):
            return results
        error = self._failure(errors, dead, still_running, timed_out, timeout)
        if dead or still_running:
            self._recover()
            error.args = (error.args[0] + self._recovered_note(),)
        raise error

    def _failure(self, errors, dead, still_running, timed_out, timeout) -> EngineError:
        others = sorted({r for _, r, _ in errors} | set(dead))
        if dead:  # a death explains the others' errors (connection closed by peer), so it comes first
            e = self.engines[dead[0]]
            others.remove(e.rank)
            message = (f"rank {e.rank} (engine {e.engine_id}, pid {e.pid} on {e.host}) died during the run: its "
                       f"process is gone (killed, out of memory, or a crash in C code)")
            error = EngineError(message, e.rank, e.host, e.pid)
        elif errors:
            _, rank, exc = min(errors, key=lambda t: (t[0], t[1]))  # the first to fail is usually the cause
            others.remove(rank)
            e = self.engines[rank]
            tb = ANSI_COLOURS.sub("", getattr(exc, "traceback", "") or "")  # IPython colours the engine's traceback
            message = (f"rank {rank} (engine {e.engine_id}, pid {e.pid} on {e.host}) raised "
                       f"{getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}\n"
                       f"Remote traceback:\n{tb}")
            error = EngineError(message, rank, e.host, e.pid, tb)
        else:
            error = EngineTimeout(f"the run did not finish within {timeout:g} s (timeout=...); ranks "
                                  f"{still_running} were still running")
        if others:
            error.args = (error.args[0].rstrip() + f"\n(ranks {others} failed too, probably as a consequence)",)
        elif (errors or dead) and still_running:
            error.args = (error.args[0].rstrip() + f"\n(ranks {still_running} were still waiting for it)",)
        return error

    def _recover(self) -> None:
        """Ranks stuck in a collective would never return: replace the engines, or stop them all."""
        if self.on_failure == "restart":
            try:
                self.restart()
                return
            except Exception as exc:  # a cluster that cannot restart is stopped, never left half alive
                log.warning("restarting the engines failed: %r", exc)
        self.stop()

    def _recovered_note(self) -> str:
        if self._stopped:
            return "\nThe engines were stopped; start a new cluster."
        return "\nThe engines were restarted (new processes); run again."

    @staticmethod
    def _stream(part, shown: dict) -> None:
        """Print what rank 0 printed since the last call (its progress lines)."""
        for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            text = part[name]
            text = (text[0] if text else "") if isinstance(text, list) else (text or "")  # one rank: a list of one
            if len(text) > shown[name]:
                stream.write(text[shown[name]:])
                stream.flush()
                shown[name] = len(text)
