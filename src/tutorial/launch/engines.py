"""Engines from a notebook cell: one process per GPU, started, used and stopped from JupyterLab (00, 03, 05, 06).

    from tutorial.launch import engines
    with engines.start(n=2) as cluster:                    # engines="local" | "mpi" | "slurm" | "pbs"
        metrics = cluster.run(train_ddp.main, cfg)         # rank 0's result; cluster.results holds every rank's

ipyparallel's Cluster and Client start, wait for, restart and stop the controller and engines. What this module adds
is what a training run needs: ranks (the MPI rank for engines started by mpiexec), torchrun's variables on every
engine (so `world_from_env()` needs no engine-specific code), a fair share of the cores, one GPU per engine, a fresh
MASTER_PORT for every run (a second rendezvous on the port of the previous one hangs), output that stays the same
between runs (strict nbval), errors that name the rank, and no process left behind, even by a killed kernel.

Attendees press Interrupt, re-run cells and restart kernels, so:
- Interrupt (a KeyboardInterrupt in the kernel) during `cluster.run` stops the engines' work too: the engines get
  SIGINT, which a run takes as the trainers take a SIGTERM (every rank stops at the same step, the checkpoint is
  saved whole); what does not stop within STOP_GRACE_S gets a KeyboardInterrupt on the engines, and what still does
  not return is restarted. One line (the KeyboardInterrupt's message) says which. During a `%%px` cell, ipyparallel's
  magic sends SIGINT to the engines itself: the cell's code gets a KeyboardInterrupt where it is (no agreed step).
- A second start() in the same kernel reuses the running cluster when asked for the same thing, and otherwise stops
  it first, with one line either way: one cluster per kernel, unless others are asked for by `name`.
- A kernel that is restarted, shut down or killed leaves nothing: the reaper stops the cluster when the kernel goes.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ..core.config import ConfigError, first_line
from ..core.process import Sigterm, Stopped, open_mpi_env, threads_per_process
from . import child_processes

ENGINE_KINDS = ("local", "mpi", "slurm", "pbs")
DEVICES = ("auto", "cuda", "cpu")
ON_FAILURE = ("restart", "stop")
BATCH_KINDS = ("slurm", "pbs")
# The program each kind of engines needs here, and where to get it.
NEEDS = {"mpi": ("mpiexec", "apt-get install openmpi-bin, or load an MPI module"),
         "slurm": ("sbatch", "run it on a login or compute node of a SLURM system"),
         "pbs": ("qsub", "run it on a login or compute node of a PBS system")}
# How long the other ranks get to finish (or fail) after one rank failed or died before they are replaced: enough for
# gloo to notice a closed connection, short enough that a rank stuck in a collective does not keep the notebook.
FAILURE_GRACE_S = 5.0
# After an Interrupt, how long the ranks get to reach the step where they all agree to stop (the trainers compare
# every log_every steps, checkpoint.stop_requested) and save; after that they get a KeyboardInterrupt where they are.
STOP_GRACE_S = 10.0
# A process group made by hand in a %%px cell waits for a missing rank for torch's default before it says anything:
# 30 minutes under gloo, 10 under NCCL, and nothing there answers an Interrupt (the wait is in C++). On the engines the
# course bounds it, rendezvous and collectives alike, unless the cell passes its own timeout=: a rank whose peer never
# comes (a mistyped rank condition, a peer that raised first) raises after this many seconds.
RENDEZVOUS_BOUND_S = 120.0
ALL_INTERFACES = ("*", "0.0.0.0")
ANSI_COLOURS = re.compile(r"\x1b\[[0-9;]*m")

log = logging.getLogger(__name__)
# ipyparallel's own log lines ("Starting 2 engines with ...") would make notebook outputs differ between runs.
_ipp_log = logging.getLogger(f"{__name__}.ipyparallel")
_ipp_log.setLevel(logging.ERROR)


class ClusterError(ConfigError):
    """A bad option for start() or run(): one line naming the value and what is allowed. Nothing is left running."""


class RankError(RuntimeError):
    """A rank raised, died, or did not finish in time. `rank`, `host` and `pid` say where (the first failure; the
    others are often its consequences); `remote_traceback` holds the engine's traceback when there is one.
    (Not ipyparallel.error.EngineError, which means that an engine process died.)"""

    def __init__(self, message, rank=None, host=None, pid=None, remote_traceback=""):
        super().__init__(message)
        self.rank, self.host, self.pid, self.remote_traceback = rank, host, pid, remote_traceback


class EngineTimeout(RankError, TimeoutError):
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


# ---------------------------------------------------------------------------------- run on the engines
def _probe() -> dict:
    """Who am I: pid, host, and the MPI rank when mpiexec started the engine (`ipengine --mpi` imports mpi4py)."""
    import torch
    mpi = sys.modules.get("mpi4py.MPI")
    world = mpi.COMM_WORLD if mpi is not None and mpi.Is_initialized() else None
    return dict(pid=os.getpid(), host=socket.gethostname(), mpi_rank=world.Get_rank() if world else None,
                mpi_size=world.Get_size() if world else None,
                gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)


def _configure(env: dict, use_cuda: bool) -> tuple[str, str, int]:
    """Become rank env['RANK']: torchrun's variables, a fair share of the node's cores, and the GPU of our local rank
    (so that nccl and .cuda() never default to GPU 0). Returns the device, the GPU's UUID and the threads."""
    import datetime

    import torch
    import torch.distributed.distributed_c10d as c10d
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = datetime.timedelta(seconds=RENDEZVOUS_BOUND_S)
    threads = threads_per_process(int(env["LOCAL_WORLD_SIZE"]))
    os.environ.update(env, OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    device, gpu = "cpu", ""
    if use_cuda and torch.cuda.is_available():
        index = int(env["LOCAL_RANK"]) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        props = torch.cuda.get_device_properties(index)
        device, gpu = f"cuda:{index} {props.name}", str(getattr(props, "uuid", "") or f"{socket.gethostname()}:{index}")
    return device, gpu, torch.get_num_threads()


def _setenv(values: dict) -> None:
    os.environ.update(values)


@dataclass
class Interrupted:
    """A rank's outcome when an Interrupt stopped its run at an agreed step (the trainer's Stopped message)."""
    message: str


def _run_interruptibly(fn, args: tuple, kwargs: dict):
    """On every engine, what run() runs: fn(*args, **kwargs), where the notebook's Interrupt (SIGINT, relayed by the
    engine's nanny) is a stop request, exactly a SIGTERM's: the flag the trainers look at every log_every steps
    (core.process.Sigterm, read by checkpoint.stop_requested), so every rank stops at the same step and rank 0 saves
    whole. A second SIGINT (the run did not stop in time, or fn never looks at the flag) is a KeyboardInterrupt."""
    def stop_request(signum, frame):
        if Sigterm.received:
            raise KeyboardInterrupt
        Sigterm.received = True

    Sigterm.received = False
    previous = signal.signal(signal.SIGINT, stop_request)
    try:
        return fn(*args, **kwargs)
    except Stopped as exc:
        if not Sigterm.received:  # fn's own Stopped, not ours
            raise
        return Interrupted(str(exc))
    finally:
        signal.signal(signal.SIGINT, previous)
        Sigterm.received = False


def visible_gpus() -> list[str]:
    """The GPUs this process may use, named as CUDA_VISIBLE_DEVICES names them (indices, UUIDs or MIG ids), or
    "0", "1", ... where it is not set. On a node shared by several attendees, each one's JupyterLab is started with
    its own CUDA_VISIBLE_DEVICES, and engines started from it take only those GPUs (start(gpus=...))."""
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    # CUDA stops at the first entry it cannot use; torch's count says how many it took.
    return [name.strip() for name in listed.split(",") if name.strip()][:count]


# ------------------------------------------------------------------------------------------ input checks
def _engine_count(n, kind: str, device: str, elsewhere: bool = False, gpus=None) -> tuple[int, bool]:
    """How many engines, and whether they use GPUs; every bad combination fails here, before anything starts.
    elsewhere: the engines may run on other nodes (batch jobs, mpiexec with a hostfile), whose GPUs count.
    gpus: the GPUs of this node the engines take (visible_gpus() names them); more engines than these share them,
    which the caller asked for by naming fewer (a lesson's ranks over gloo on one GPU, notebook.allocation)."""
    if kind not in ENGINE_KINDS:
        raise ClusterError(f"engines {kind!r} is not one of: {', '.join(ENGINE_KINDS)}")
    if device not in DEVICES:
        raise ClusterError(f"device {device!r} is not one of: {', '.join(DEVICES)}")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ClusterError(f"n (the number of engines) must be a whole number of at least 1, got {n!r}")
    if gpus is not None:
        if kind in BATCH_KINDS or elsewhere:
            raise ClusterError(f"gpus={list(gpus)} names GPUs of this node, but engines={kind!r} may run on others")
        if device == "cpu" and gpus:
            raise ClusterError(f"gpus={list(gpus)} and device='cpu' contradict each other; give one of them")
        unknown = [g for g in gpus if str(g) not in visible_gpus()]
        if unknown:
            raise ClusterError(f"GPU {unknown[0]!r} is not visible here; choose from: "
                               f"{', '.join(visible_gpus()) or 'none (no GPU visible)'}")
        if not gpus:
            if device == "cuda":
                raise ClusterError("device='cuda' needs GPUs, but gpus=[] names none")
            return (n or 2), False
        return (n or len(gpus)), True
    if kind in BATCH_KINDS or elsewhere:
        # The GPUs that count are on the engines' nodes, not here; they are checked once the engines report in.
        if n is None:
            raise ClusterError(f"engines={kind!r} on other nodes needs n, the number of engines to start there")
        return n, device != "cpu"
    import torch
    gpus = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    if device == "cuda" and gpus == 0:
        raise ClusterError("device='cuda' needs GPUs, but none is visible here (device='auto' uses the CPU)")
    if gpus == 0:
        return (n or 2), False
    if (n or gpus) > gpus:
        raise ClusterError(f"n={n} engines on this node but only {gpus} GPU(s) visible: two engines would share a "
                           f"GPU; use n<={gpus}, device='cpu' for CPU engines, or name the GPUs to share with "
                           f"gpus=[...] (gloo only; notebook.allocation decides)")
    return (n or gpus), True


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
    return ip, (socket.getfqdn() if ip in ALL_INTERFACES else ip)


def _check_ports(ports, ip: str) -> str:
    """The controller's port pool (e.g. "10000-10030" where a firewall allows only those); busy ports fail here."""
    from ipyparallel.traitlets import PortList
    text = ports if isinstance(ports, str) else ",".join(str(p) for p in ports)
    try:
        numbers = PortList.parse_port_range(text)
    except ValueError:
        raise ClusterError(f"ports {ports!r} is not a port list like '10000-10030' or [10000, 10001]") from None
    for port in numbers:
        if not 0 < port < 65536:
            raise ClusterError(f"port {port} is out of range (1-65535)")
        with socket.socket() as s:
            try:
                s.bind(("" if ip in ALL_INTERFACES else ip, port))
            except OSError:
                raise ClusterError(f"port {port} on {ip} is in use; choose other ports than {text}") from None
    return text


def _config(kind: str, n: int, gpus, mpi_args, launcher: dict, tag: str, timeout: float):
    """ipyparallel's launcher settings: the engines' environment (fixed at launch: OpenMP reads its thread count when
    it starts), mpiexec's arguments, quick kills, and the caller's own launcher options. gpus: the engines'
    CUDA_VISIBLE_DEVICES ([] hides every GPU; None leaves the variable as this process has it)."""
    from ipyparallel.cluster.launcher import find_launcher_class
    from traitlets.config import Config
    config = Config()
    env = {"PYTHONUNBUFFERED": "1", child_processes.TAG_VARIABLE: tag}  # the tag finds every process the cluster starts
    config.ControllerLauncher.environment = dict(env)
    config.ControllerLauncher.connection_info_timeout = float(timeout)
    if kind == "local" or (kind == "mpi" and not mpi_args):  # all on this node: a fair share of its cores each
        env["OMP_NUM_THREADS"] = str(threads_per_process(n))
    if gpus is not None:  # set, not inherited: engines see exactly these, local rank i takes the i-th
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    config.EngineLauncher.environment = open_mpi_env(env) if kind == "mpi" else env
    config.MPIEngineSetLauncher.mpi_args = list(mpi_args)
    # Engines keep no state worth saving: SIGKILL 1 s after SIGTERM (the default 5 s adds up over restarts).
    config.LocalProcessLauncher.stop_seconds_until_kill = 1
    if kind in BATCH_KINDS:  # the filled-in batch script goes to /tmp, not into whatever folder the notebook is in
        safe = re.sub(r"[^\w.-]", "-", tag)
        config[find_launcher_class(kind, "engine").__name__].batch_file_name = \
            os.path.join(tempfile.gettempdir(), f"tutorial-{safe}-engines.{kind}")
    config[find_launcher_class(kind, "engine").__name__].update(launcher or {})
    return config


# ------------------------------------------------------------------------------------------------ start
def start(n: int | None = None, engines: str = "local", *, device: str = "auto", gpus=None, timeout: float = 90.0,
          run_timeout: float = 3600.0, ip: str | None = None, interface: str | None = None, ports=None,
          mpi_args=(), launcher: dict | None = None, on_failure: str = "restart", activate: bool = True,
          show: bool = True, name: str = "", **ipp_options) -> "Cluster":
    """Start a controller and n engines, make them ranks 0..n-1, and return the Cluster (00_setup).

    n: engines (default: one per visible GPU, else 2). engines: local, mpi (mpiexec; MPI rank = rank), slurm or pbs.
    device: auto (GPUs if visible), cuda (GPUs required) or cpu. gpus: which of this node's GPUs, as
    CUDA_VISIBLE_DEVICES names them (default: every visible one); fewer GPUs than engines are shared (gloo only).
    timeout: seconds to wait for the engines.
    run_timeout: default limit of one run(). ip/interface: where the controller listens (engines on other nodes must
    reach it). ports: the controller's port pool. mpi_args: extra mpiexec arguments (e.g. a hostfile).
    launcher: options of ipyparallel's engine launcher (queue, account, timelimit, batch_template_file, namespace, ...).
    on_failure: restart or stop the engines after a failed run. activate: enable %%px. show: print the engine table.
    name: a kernel runs one cluster per name: start() again with the same options reuses the running one, with
    other options it stops it first (one line says which); give another name to run a second cluster beside it.
    Other keywords go to ipyparallel.Cluster (profile, controller_location, ...).
    """
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")  # read at import: no progress bar while waiting for engines
    import ipyparallel as ipp
    n, use_cuda = _engine_count(n, engines, device, elsewhere=engines == "mpi" and bool(mpi_args), gpus=gpus)
    if on_failure not in ON_FAILURE:
        raise ClusterError(f"on_failure {on_failure!r} is not one of: {', '.join(ON_FAILURE)}")
    if not timeout > 0 or not run_timeout > 0:
        raise ClusterError(f"timeouts must be positive, got timeout={timeout} and run_timeout={run_timeout}")
    unknown = sorted(set(ipp_options) - set(ipp.Cluster.class_trait_names()))
    if unknown:
        raise ClusterError(f"{unknown[0]!r} is neither an option of start() nor of ipyparallel.Cluster")
    program, how = NEEDS.get(engines, (None, ""))
    if program and not shutil.which(program):
        raise ClusterError(f"engines={engines!r} needs {program}, which is not on the PATH: {how}")
    bind, where = _bind_address(engines, ip, interface)
    request = repr(dict(n=n, engines=engines, device=device, gpus=gpus, timeout=timeout, run_timeout=run_timeout,
                        ip=ip, interface=interface, ports=ports, mpi_args=list(mpi_args), launcher=launcher,
                        on_failure=on_failure, activate=activate, options=sorted(ipp_options.items())))
    earlier = _started.pop(name, None)
    if earlier is not None and not earlier._stopped:
        if earlier._request == request and earlier._healthy():
            _started[name] = earlier
            print(f"engines: reusing the {earlier.n} {earlier.kind} engine(s) this kernel started with the same "
                  f"options (cluster.stop() first for new processes)", flush=True)
            if activate:
                earlier._activate_magics()
            if show:
                print(earlier.table(), flush=True)
            return earlier
        earlier.stop()
        print(f"engines: stopped the {earlier.n} {earlier.kind} engine(s) this kernel started before, to start "
              f"these (one cluster per kernel; name=... runs another beside it)", flush=True)
    controller_args = ["--ports", _check_ports(ports, bind)] if ports else []
    tag = child_processes.new_tag()
    ipp_options.setdefault("controller_location", where)
    ipp_cluster = ipp.Cluster(engines=engines, n=n, controller_ip=bind, controller_args=controller_args, delay=0,
                              engine_timeout=math.ceil(timeout), log=_ipp_log,
                              config=_config(engines, n, [] if device == "cpu" else gpus, mpi_args, launcher, tag,
                                             timeout),
                              **ipp_options)
    cluster = Cluster(ipp_cluster, engines, tag, use_cuda=use_cuda, device=device, timeout=timeout,
                      run_timeout=run_timeout, share_gpus=gpus is not None and 0 < len(gpus) < n,
                      on_failure=on_failure, activate=activate)
    cluster.name, cluster._request = name, request
    try:
        cluster._start()
    except BaseException:  # KeyboardInterrupt too: never leave half a cluster behind
        cluster.stop()
        raise
    _started[name] = cluster
    if show:
        print(cluster.table(), flush=True)
    return cluster


_started: dict = {}  # name -> the Cluster this process started under that name and has not stopped


class Cluster:
    """A running controller and its engines, ranks 0..n-1 (`engines`, in rank order), and `view`, a blocking
    DirectView on them in rank order. Use start() to make one."""

    def __init__(self, ipp_cluster, kind: str, tag: str, *, use_cuda: bool, device: str = "auto", timeout: float,
                 run_timeout: float, on_failure: str, activate: bool, share_gpus: bool = False):
        self._ipp, self.kind, self.tag, self.n = ipp_cluster, kind, tag, ipp_cluster.n
        self.use_cuda, self.device, self.timeout, self.run_timeout = use_cuda, device, timeout, run_timeout
        self.on_failure, self.activate = on_failure, activate
        self.share_gpus = share_gpus  # asked for: fewer GPUs named than engines (ranks over gloo on one GPU)
        self.engines: list[EngineInfo] = []
        self.results: list = []   # the last run's result per rank, in rank order
        self.client = self.view = self._reaper = None
        self.master_addr, self.master_port = "127.0.0.1", None  # the engines' rendezvous (new_master_port)
        self.env: dict = {}  # what setenv() set: every engine gets it again after a restart
        self._stopped = False
        self.name, self._request = "", None

    # ------------------------------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        # A process of its own session that outlives a killed kernel: when this process closes the pipe (stop()) or
        # dies, it stops whatever ipyparallel's cluster file still lists (see the end of this module).
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", __name__, self._ipp.cluster_file, self.tag], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, env=dict(os.environ, **{child_processes.TAG_VARIABLE: self.tag}),
            start_new_session=True)
        with self._engines_starting():
            self.client = self._ipp.start_and_connect_sync()  # the controller, n engines, a client; bounded wait
        self._assign_ranks(sorted(self.client.ids))

    @contextlib.contextmanager
    def _engines_starting(self):
        """ipyparallel's errors while engines start (they exited, or the wait timed out), said for people."""
        import ipyparallel as ipp
        try:
            yield
        except ipp.error.EngineError:
            output = "\n".join(es.get_output() for es in self._ipp.engines.values())[-3000:]
            raise RankError(f"the {self.kind} engines stopped while starting. Their output:\n{output}") from None
        except TimeoutError as exc:
            raise EngineTimeout(f"the {self.kind} engines did not start within {self.timeout:g} s (timeout=...): "
                                f"{exc}; batch engines may still wait in the queue") from None

    def _assign_ranks(self, ids: list) -> None:
        """Rank, local rank and world size for every engine; MPI engines keep their MPI rank (Horovod's)."""
        infos = dict(zip(ids, self.client[ids].apply_sync(_probe)))
        without = sorted({infos[i]["host"] for i in ids if not infos[i]["gpus"]})
        if self.use_cuda and without:  # engines on other nodes: only now do we know their GPUs
            if self.device == "cuda":
                raise RankError(f"device='cuda' but {', '.join(without)} has no GPU (device='auto' uses the CPU there)")
            self.use_cuda = False  # device='auto' on nodes without GPUs means the CPU
        mpi = {i: (infos[i]["mpi_rank"], infos[i]["mpi_size"]) for i in ids}
        if self.kind == "mpi" or all(rank is not None for rank, _ in mpi.values()):
            if set(mpi.values()) != {(rank, self.n) for rank in range(self.n)}:
                raise RankError(f"the MPI engines report (MPI rank, size) {list(mpi.values())}, not one world of "
                                f"{self.n}")
            order = sorted(ids, key=lambda i: mpi[i][0])
        else:  # engine ids follow registration order; grouping by host keeps a node's ranks together
            order = sorted(ids, key=lambda i: (infos[i]["host"], i))
        hosts = {}
        for i in order:
            hosts.setdefault(infos[i]["host"], []).append(i)
        master_addr = self.master_addr = "127.0.0.1" if len(hosts) == 1 else infos[order[0]]["host"]
        pending = []
        for host, members in hosts.items():
            for local_rank, i in enumerate(members):
                info = EngineInfo(i, order.index(i), local_rank, self.n, len(members), host, infos[i]["pid"],
                                  mpi_rank=infos[i]["mpi_rank"])
                env = dict(self.env, RANK=str(info.rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(self.n),
                           LOCAL_WORLD_SIZE=str(len(members)), MASTER_ADDR=master_addr)
                pending.append((info, self.client[i].apply_async(_configure, env, self.use_cuda)))
        for info, configured in pending:
            info.device, info.gpu, info.threads = configured.get(self.timeout)
        self.engines = sorted((info for info, _ in pending), key=lambda e: e.rank)
        seen = {}
        for e in self.engines:  # more engines than GPUs on a node, or a launcher's GPU binding gone wrong
            if e.gpu and e.gpu in seen and not self.share_gpus:
                raise RankError(f"ranks {seen[e.gpu]} and {e.rank} share GPU {e.gpu} on {e.host}: one engine per GPU "
                                f"(check n, CUDA_VISIBLE_DEVICES and the launcher's GPU binding)")
            seen[e.gpu] = e.rank
        self.view = self.client[[e.engine_id for e in self.engines]]
        self.view.block = True
        self.new_master_port()  # for process groups made by hand in %%px cells
        if self.activate:
            self._activate_magics()

    def _activate_magics(self) -> None:
        """%%px on all engines in rank order, with each engine's output at the end and no progress bar (stable
        outputs under nbval), bounded and freed like run() (_bounded_magics)."""
        from IPython import get_ipython
        shell = get_ipython()
        if shell is not None:
            shell.magics_manager.register(_bounded_magics(self)(shell, self.view))
            shell.run_line_magic("pxconfig", "--no-stream --progress-after -1")

    def table(self) -> str:
        """Rank, local rank, host, pid, device and threads of every engine (00_setup shows it)."""
        rows = [("rank", "local", "host", "pid", "device", "threads")]
        rows += [(str(e.rank), str(e.local_rank), e.host, str(e.pid), e.device, str(e.threads)) for e in self.engines]
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)

    def setenv(self, values: dict) -> None:
        """Set environment variables on every engine, now and again after every restart (restart(), run(fresh=True),
        the recovery after a rank died): for variables read when something starts later, such as the NCCL flight
        recorder's, read when a process group is made (10). Setting os.environ in a %%px cell lasts only until then."""
        self._require_running()
        values = {str(k): str(v) for k, v in values.items()}
        self.env.update(values)
        self.view.apply_sync(_setenv, values)

    def restart(self) -> None:
        """Fresh engine processes (new pids, nothing left from earlier runs), same n, same controller."""
        self._require_running()
        old = set(self.client.ids)
        self._ipp.restart_engines_sync()
        # wait_for_engines counts every registered engine and fails when one leaves: first let the old ones go.
        deadline = time.monotonic() + self.timeout
        while old & set(self.client.ids):
            if time.monotonic() > deadline:
                raise EngineTimeout(f"engines {sorted(old & set(self.client.ids))} did not leave within "
                                    f"{self.timeout:g} s of their restart")
            time.sleep(0.1)
        with self._engines_starting():
            self.client.wait_for_engines(self.n, timeout=self.timeout, interactive=False)
        self._assign_ranks(sorted(self.client.ids))

    def stop(self) -> None:
        """Stop the engines, mpiexec and the controller; safe to call twice. Leaving the `with` block calls it."""
        if self._stopped:
            return
        self._stopped = True
        if _started.get(self.name) is self:
            del _started[self.name]
        try:
            if self.client is not None:
                self.client.close()
            self._ipp.stop_cluster_sync()
        except Exception as exc:  # the reaper stops what the cluster file still lists
            log.warning("stopping the cluster: %r", exc)
        finally:
            if self._reaper is not None:
                self._reaper.stdin.close()
                try:
                    self._reaper.wait(timeout=30)
                except subprocess.TimeoutExpired:  # the sweep below ends it
                    pass
            child_processes.stop(self.leftovers())  # what ipyparallel does not track: engine nannies, a rank's children

    def leftovers(self) -> list[dict]:
        """This cluster's processes on this host that are still running (controller, engines and their nannies,
        mpiexec and its ranks, the reaper): [] once stop() has returned (00_setup, 05_horovod check it)."""
        return [p for p in child_processes.leftovers(self.tag) if not p["zombie"]]

    def _healthy(self) -> bool:
        """Every engine still registered and answering (a run in progress would not answer)."""
        try:
            ids = [e.engine_id for e in self.engines]
            if not set(ids) <= set(self.client.ids):
                return False
            self.client[ids].apply_async(os.getpid).get(min(10.0, self.timeout))
            return True
        except Exception:  # noqa: BLE001 - gone, busy or broken: any of them means start afresh
            return False

    def _require_running(self) -> None:
        if self._stopped:
            raise ClusterError("this cluster was stopped; start a new one with tutorial.launch.engines.start()")

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return f"<Cluster {self.kind}: {self.n} engine(s), {'GPU' if self.use_cuda else 'CPU'}, {state}>"

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -------------------------------------------------------------------------------------------------- run
    def new_master_port(self) -> int:
        """Give every engine a new MASTER_PORT for the next process group, made by hand in a %%px cell (03), by
        Lightning (08) or by a trainer: rank 0's engine binds it now and holds it (core.distributed.hold_port), and
        its init_process_group takes over that very server, so no other process on the node can take the port in
        between (a port that was only free when chosen could be, issue 38). A new one for every group: a second
        rendezvous on the store of the previous one would find its keys. run() calls it before every run."""
        self._require_running()
        from ..core.distributed import hold_port  # torch: not at import, the reaper imports this module too
        port = self.master_port = self.client[self.engines[0].engine_id].apply_sync(hold_port)
        self.view.apply_sync(_setenv, {"MASTER_PORT": str(port)})
        return port

    def run(self, fn, *args, timeout: float | None = None, fresh: bool = False, **kwargs):
        """Run fn(*args, **kwargs) on every engine at once and return rank 0's result (03, 05).

        ipyparallel sends fn by value: a self-contained function defined in the notebook runs too (it must import
        what it uses), and a function from a module is imported there by module and name. Rank 0's output is
        printed here; every rank's result is in `self.results`. An exception on any rank raises RankError with its
        rank and traceback; a run longer than timeout (default: start's run_timeout) raises EngineTimeout. After a
        death or a timeout the engines are restarted (or stopped) first. fresh=True restarts them before the run.
        """
        self._require_running()
        if not callable(fn):
            raise ClusterError(f"run needs a function, got {fn!r}")
        if self.engines[0].mpi_rank is None and _needs_mpi_ranks(fn):
            raise ClusterError(f"{fn.__module__}.{fn.__qualname__} uses Horovod, which finds its ranks through MPI: "
                               f"start the cluster with engines='mpi'")
        if fresh:
            self.restart()
        self.new_master_port()
        result = self.view.apply_async(_run_interruptibly, fn, args, kwargs)
        try:
            self.results = self._collect(result, self.run_timeout if timeout is None else timeout)
        except KeyboardInterrupt:  # the notebook's Interrupt: stop the engines' run too, then say what happened
            raise KeyboardInterrupt(self._interrupt(result, _name(fn))) from None
        return self.results[0]

    def _collect(self, result, timeout: float) -> list:
        """Wait for every rank, printing rank 0's output as it comes (AsyncResult.stream_output() would prefix every
        engine's lines with [stdout:N]); turn failures, deaths and hangs into one RankError."""
        printed = {"stdout": 0, "stderr": 0}
        deadline, failed_at = time.monotonic() + timeout, None
        while not result.wait(0.2):
            _print_new(result.metadata[0], printed)
            now = time.monotonic()
            if failed_at is None and any(md["status"] == "error" for md in result.metadata):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > FAILURE_GRACE_S):
                break
        if result.ready():
            result.wait_for_output(5)  # the result may arrive before the last lines of output
            outcomes = result.get(return_exceptions=True)  # in rank order; a RemoteError where a rank failed
        else:
            outcomes = [part.get(0, return_exceptions=True) if part.ready() else _RUNNING for part in result.split()]
        _print_new(result.metadata[0], printed)
        failed = {rank: o for rank, o in enumerate(outcomes) if isinstance(o, Exception)}
        running = [rank for rank, o in enumerate(outcomes) if o is _RUNNING]
        if not failed and not running:
            return outcomes
        # The Hub fails the task of an engine that died with ipyparallel's EngineError "... died while running task".
        died = [rank for rank, e in failed.items() if getattr(e, "ename", "") == "EngineError"]
        error = self._failure(failed, died, running, [md["completed"] for md in result.metadata], timeout)
        if died or running:  # ranks stuck in a collective would never return
            error.args = (f"{error}\n{self._recover()}",)
        raise error

    def _failure(self, failed: dict, died: list, running: list, completed: list, timeout: float) -> RankError:
        """One error for a failed run: a death first (it explains the others' "connection closed by peer"), else
        the first rank to fail (usually the cause), else the timeout."""
        if not failed:
            return EngineTimeout(f"the run did not finish within {timeout:g} s (timeout=...); ranks {running} were "
                                 f"still running")
        rank = died[0] if died else min(failed, key=lambda r: completed[r])
        e, exc = self.engines[rank], failed[rank]
        tb = "" if died else ANSI_COLOURS.sub("", getattr(exc, "traceback", "") or "")  # IPython colours it
        what = ("died during the run: its process is gone (killed, out of memory, or a crash in C code)" if died else
                f"raised {getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}\n"
                f"Remote traceback:\n{tb.rstrip()}")
        others = sorted(set(failed) - {rank})
        note = (f"ranks {others} failed too, probably as a consequence" if others else
                f"ranks {running} were still waiting for it" if running else "")
        return RankError(f"rank {rank} (engine {e.engine_id}, pid {e.pid} on {e.host}) {what}"
                         + (f"\n({note})" if note else ""), rank, e.host, e.pid, tb)

    def _interrupt(self, result, what: str) -> str:
        """Stop the run the notebook was interrupted in, on every engine, and return one line saying how: at an agreed
        step (SIGINT, taken as a SIGTERM), else by a KeyboardInterrupt there (a second SIGINT), else by a restart.
        Pressing Interrupt again while this waits moves on to the next of these at once."""
        ids = [e.engine_id for e in self.engines]
        waited = time.monotonic()
        for grace in (STOP_GRACE_S, FAILURE_GRACE_S):
            try:
                self.client.send_signal("SIGINT", targets=ids, block=True)
                if result.wait(grace):
                    break
            except KeyboardInterrupt:
                continue
            except Exception as exc:  # noqa: BLE001 - an engine (or its nanny) is gone: replace them below
                log.warning("signalling the engines: %r", exc)
                break
        if not result.ready():
            return f"interrupted: {what} did not stop within {time.monotonic() - waited:.0f} s on " \
                   f"{self._stuck(result)}. " + self._recover()
        outcomes = result.get(return_exceptions=True)
        self.results = outcomes
        stopped = [o for o in outcomes if isinstance(o, Interrupted)]
        if len(stopped) == len(outcomes):
            steps = sorted({m.group(1) for o in stopped for m in [re.search(r"\(step (\d+)\)", o.message)] if m})
            saved = re.search(r"saved (.*?) \(step \d+\) in (.+?); ", stopped[0].message)
            where = f"at step {steps[0]}" if len(steps) == 1 else f"at steps {', '.join(steps)}"
            return (f"interrupted: {what} stopped on all {len(outcomes)} ranks {where}, as on a SIGTERM"
                    + (f" ({saved.group(1)} saved in {saved.group(2)})" if saved else "")
                    + "; the engines are ready for the next cell")
        if all(not isinstance(o, Exception) for o in outcomes):
            return f"interrupted: {what} had just finished on every rank (cluster.results holds it); the engines " \
                   f"are ready for the next cell"
        raised = sum(isinstance(o, Exception) for o in outcomes)
        return (f"interrupted: {what} did not stop at a step within {STOP_GRACE_S:g} s: a KeyboardInterrupt ended it "
                f"on the engines ({raised} of {len(outcomes)} ranks raised); the engines are ready for the next cell")

    def _free(self, result, what: str, timed_out: bool) -> str:
        """After a %%px cell was interrupted (ipyparallel's magic has sent SIGINT to the engines) or ran past its bound:
        give the engines FAILURE_GRACE_S to stop, then replace those that did not (a rank waiting in C++, in a
        rendezvous or a collective, never sees SIGINT), naming them and what they wait for."""
        why = f"ran past run_timeout={self.run_timeout:g} s" if timed_out else "was interrupted"
        if result.wait(FAILURE_GRACE_S):
            return f"{what} {why}: SIGINT stopped it on every engine; {READY}"
        stuck, raised = self._stuck(result), self._raised(result)
        return (f"{what} {why} and did not stop within {FAILURE_GRACE_S:g} s of SIGINT on {stuck}"
                + (f" ({raised}, above)" if raised else "") + ". " + self._recover()
                + " Their variables are gone: run the cells that set them again.")

    def _raised(self, result) -> str:
        """The errors of the ranks that finished before the others got stuck (often the cause: a rank that raised
        before the rendezvous), printed with their tracebacks, and named in one short phrase."""
        said = []
        for e, part in zip(self.engines, result.split()):
            if part.ready():
                try:
                    part.get(0)
                except Exception as exc:  # noqa: BLE001 - a RemoteError: the engine's own exception
                    name, value = getattr(exc, "ename", type(exc).__name__), getattr(exc, "evalue", str(exc))
                    tb = ANSI_COLOURS.sub("", getattr(exc, "traceback", "") or "").rstrip()
                    print(f"[rank {e.rank}] {tb or f'{name}: {value}'}", file=sys.stderr, flush=True)
                    said.append(f"rank {e.rank} raised {name}: {first_line(value)}")
        return "; ".join(said)

    def _stuck(self, result) -> str:
        """The ranks still busy with `result`, each with what it waits for where this host can see it."""
        parts = result.split()
        return "; ".join(f"rank {e.rank} (engine {e.engine_id}, pid {e.pid} on {e.host}){self._waiting_for(e)}"
                         for e, part in zip(self.engines, parts) if not part.ready())

    def _waiting_for(self, e: EngineInfo) -> str:
        """What a stuck engine waits for, from its TCP connections: a rendezvous (connected to the engines' MASTER_PORT)
        or an address where nobody listens. Engines on other hosts are not visible from here: ""."""
        import psutil
        if self.master_port is None or e.host != socket.gethostname():
            return ""
        where = f"{self.master_addr}:{self.master_port}"
        try:
            connected = any(c.raddr and c.raddr.port == self.master_port
                            for c in psutil.Process(e.pid).net_connections(kind="tcp"))
        except psutil.Error:
            return ""
        if connected:
            return f", in the rendezvous at {where}: connected, waiting for ranks that never arrived"
        try:
            socket.create_connection((self.master_addr, self.master_port), timeout=1).close()
            return ""
        except OSError:
            return f", trying to reach the rendezvous at {where}, where nobody listens"

    def _recover(self) -> str:
        """Replace the engines, or stop them all; say which."""
        if self.on_failure == "restart":
            try:
                self.restart()
                return "The engines were restarted (new processes); run again."
            except Exception as exc:  # a cluster that cannot restart is stopped, never left half alive
                log.warning("restarting the engines failed: %r", exc)
        self.stop()
        return "The engines were stopped; start a new cluster."


_RUNNING = object()  # a rank's outcome while it has not finished
READY = "the engines are ready for the next cell"


def _bounded_magics(cluster: Cluster):
    """ipyparallel's %px and %%px magics on cluster.view, with the waits that run() has: a cell ends within the
    cluster's run_timeout (then it is interrupted as by the Interrupt button), and after an Interrupt the engines
    that did not stop on SIGINT are named and restarted, so the next cell (a %%px, a view[...] pull, a run) never
    queues behind them. Before (issue 38), a rank stuck in a rendezvous held its engine for gloo's 30 minutes."""
    import _thread
    import threading

    from ipyparallel.client.magics import ParallelMagics

    class BoundedMagics(ParallelMagics):
        def parallel_execute(self, cell, block=None, **kwargs):
            if not (self.view.block if block is None else block):
                return super().parallel_execute(cell, block=block, **kwargs)
            timed_out = threading.Event()
            timer = threading.Timer(cluster.run_timeout, lambda: (timed_out.set(), _thread.interrupt_main()))
            timer.daemon = True
            self.last_result = None
            timer.start()
            try:
                # On a KeyboardInterrupt (the button, nbval's cell timeout, the timer) the magic sends SIGINT to the
                # engines and shows what they printed; it does not wait for them to stop.
                return super().parallel_execute(cell, block=block, **kwargs)
            finally:
                timer.cancel()
                result = self.last_result
                if result is not None and (timed_out.is_set() or not result.done()):
                    freed = cluster._free(result, "the %%px cell", timed_out.is_set())
                    if timed_out.is_set():
                        raise EngineTimeout(freed)
                    if not freed.endswith(READY):  # stopped within the grace: as ipyparallel's magic, no error
                        raise KeyboardInterrupt(freed)

    return BoundedMagics


def _print_new(metadata, printed: dict) -> None:
    """Print what one engine printed since the last call (rank 0's progress lines)."""
    for name in printed:
        text = metadata[name]
        if len(text) > printed[name]:
            getattr(sys, name).write(text[printed[name]:])
            getattr(sys, name).flush()
            printed[name] = len(text)


def _name(fn) -> str:
    module = getattr(fn, "__module__", "") or ""
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    return qualname if module == "__main__" else f"{module.rsplit('.', 1)[-1]}.{qualname}"


def _needs_mpi_ranks(fn) -> bool:
    """Whether fn's module says it finds its ranks through MPI (train_horovod's RANKS_FROM_MPI = True)."""
    return getattr(sys.modules.get(getattr(fn, "__module__", None) or ""), "RANKS_FROM_MPI", False) is True


if __name__ == "__main__":
    # The reaper, `python -m tutorial.launch.engines CLUSTER_FILE TAG`: stdin ends when the process that started the
    # cluster closes it in stop() or dies (a killed kernel). Whatever ipyparallel's cluster file still lists is then
    # stopped, and any process that carries the cluster's tag (stop() has already removed the file).
    sys.stdin.read()
    cluster_file, tag = sys.argv[1:]
    if os.path.exists(cluster_file):
        try:
            import ipyparallel as ipp
            ipp.Cluster.from_file(cluster_file, log=_ipp_log).stop_cluster_sync()
        finally:
            child_processes.stop(child_processes.leftovers(tag))
