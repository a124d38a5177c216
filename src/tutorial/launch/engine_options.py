"""What engines.start() may be asked for, checked before anything starts, and the ipyparallel cluster it becomes.

`check` turns start()'s keywords into a Request, or fails with one ClusterError line naming the value and what is
allowed (tests/test_cluster.py's table of bad input), so that a bad option never leaves half a cluster behind. Equal
Requests ask for the same cluster: start() reuses a running one for an equal Request. `Where` gathers the options that
only engines on other nodes need. `ipp_cluster` makes the Request an ipyparallel.Cluster, not started yet.
"""
from __future__ import annotations

import logging
import math
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass, field, fields

from ..core.config import ConfigError
from ..core.process import open_mpi_env, threads_per_process
from ..core.visible import GPU_DEVICE_TYPES
from . import child_processes

ENGINE_KINDS = ("local", "mpi", "slurm", "pbs")
DEVICES = ("auto", "gpu", "cpu")  # and torch's names of a GPU (visible.GPU_DEVICE_TYPES), which mean "gpu"
ON_FAILURE = ("restart", "stop")
BATCH_KINDS = ("slurm", "pbs")
# The program each kind of engines needs here, and where to get it.
NEEDS = {"mpi": ("mpiexec", "apt-get install openmpi-bin, or load an MPI module"),
         "slurm": ("sbatch", "run it on a login or compute node of a SLURM system"),
         "pbs": ("qsub", "run it on a login or compute node of a PBS system")}
ALL_INTERFACES = ("*", "0.0.0.0")

# ipyparallel's own log lines ("Starting 2 engines with ...") would make notebook outputs differ between runs.
IPP_LOG = logging.getLogger("tutorial.launch.engines.ipyparallel")
IPP_LOG.setLevel(logging.ERROR)


class ClusterError(ConfigError):
    """A bad option for start() or run(): one line naming the value and what is allowed. Nothing is left running."""


@dataclass(frozen=True)
class Where:
    """Where the controller listens and how the engines are launched: start()'s options for engines on other nodes
    (06_multi_node, appendix_job_scripts; scripts/slurm/engines.sh and scripts/pbs/*/engines.sh show whole calls).
    Engines on the notebook's own node need none of them.

    ip, interface: the address the controller listens on, or the network interface (ib0, hsn0, eth0) whose IPv4
        address it takes; engines on other nodes must reach it. Default: 127.0.0.1, every interface for slurm and pbs.
    ports: the controller's port pool ("10000-10030" or [10000, 10001]) where a firewall allows only those.
    mpi_args: extra mpiexec arguments for engines="mpi", e.g. ["--hostfile", "hosts"] for ranks on other nodes.
    launcher: options of ipyparallel's engine launcher of that kind (queue, account, timelimit, batch_template_file,
        namespace, engine_cmd, ...).
    ipp: any other keyword of start(), an option of ipyparallel.Cluster (profile, controller_location, ...).
    """
    ip: str | None = None
    interface: str | None = None
    ports: str | list | None = None
    mpi_args: tuple | list = ()
    launcher: dict | None = None
    ipp: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    """start()'s options, checked (see start() for what each means)."""
    n: int
    kind: str          # start's engines=: local, mpi, slurm or pbs
    device: str
    gpus: tuple | None  # this node's GPUs the engines take, as visible_gpus() names them (None: as it is here)
    use_cuda: bool
    timeout: float
    run_timeout: float
    on_failure: str
    activate: bool
    where: Where
    bind: str          # the address the controller listens on
    reach: str         # the one engines connect to (they differ when it listens on every interface)

    @property
    def share_gpus(self) -> bool:
        """Fewer GPUs named than engines: the ranks share them over gloo (notebook.allocation asks for that)."""
        return self.gpus is not None and 0 < len(self.gpus) < self.n


def check(n, engines: str, *, device: str, gpus, timeout: float, run_timeout: float, on_failure: str,
          activate: bool, where: dict) -> Request:
    """start()'s options as a Request; the first bad one raises ClusterError. `where`: start()'s other keywords."""
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")  # read at import: no progress bar while waiting for engines
    import ipyparallel as ipp
    named = {f.name for f in fields(Where)} - {"ipp"}  # the rest are ipyparallel.Cluster's
    place = Where(**{k: v for k, v in where.items() if k in named},
                  ipp={k: v for k, v in where.items() if k not in named})
    device = "gpu" if device in GPU_DEVICE_TYPES else device
    n, use_cuda = engine_count(n, engines, device, elsewhere=engines == "mpi" and bool(place.mpi_args), gpus=gpus)
    if on_failure not in ON_FAILURE:
        raise ClusterError(f"on_failure {on_failure!r} is not one of: {', '.join(ON_FAILURE)}")
    if not timeout > 0 or not run_timeout > 0:
        raise ClusterError(f"timeouts must be positive, got timeout={timeout} and run_timeout={run_timeout}")
    unknown = sorted(set(place.ipp) - set(ipp.Cluster.class_trait_names()))
    if unknown:
        raise ClusterError(f"{unknown[0]!r} is neither an option of start() nor of ipyparallel.Cluster")
    program, how = NEEDS.get(engines, (None, ""))
    if program and not shutil.which(program):
        raise ClusterError(f"engines={engines!r} needs {program}, which is not on the PATH: {how}")
    bind, reach = bind_address(engines, place.ip, place.interface)
    return Request(n, engines, device, None if gpus is None else tuple(str(g) for g in gpus), use_cuda, timeout,
                   run_timeout, on_failure, activate, place, bind, reach)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, named as the vendor's variable names them (CUDA_VISIBLE_DEVICES: indices,
    UUIDs or MIG ids; ROCR_VISIBLE_DEVICES; ZE_AFFINITY_MASK: cards or card.tile), or "0", "1", ... where it is not
    set. On a node shared by several attendees, each one's JupyterLab is started with its own variable set, and
    engines started from it take only those GPUs (start(gpus=...))."""
    from tutorial.core import accelerator
    count = accelerator.device_count()
    variable = accelerator.visible_variable()
    listed = os.environ.get(variable)
    # An empty HIP_VISIBLE_DEVICES or ZE_AFFINITY_MASK is no mask at all (core.visible), as if it were not set
    if listed is None or (not listed.strip() and variable in ("HIP_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")):
        return [str(i) for i in range(count)]
    # CUDA stops at the first entry it cannot use; torch's count says how many it took.
    return [name.strip() for name in listed.split(",") if name.strip()][:count]


def engine_count(n, kind: str, device: str, elsewhere: bool = False, gpus=None) -> tuple[int, bool]:
    """How many engines, and whether they use GPUs; every bad combination fails here, before anything starts.
    elsewhere: the engines may run on other nodes (batch jobs, mpiexec with a hostfile), whose GPUs count.
    gpus: the GPUs of this node the engines take (visible_gpus() names them); more engines than these share them,
    which the caller asked for by naming fewer (a lesson's ranks over gloo on one GPU, notebook.allocation)."""
    if kind not in ENGINE_KINDS:
        raise ClusterError(f"engines {kind!r} is not one of: {', '.join(ENGINE_KINDS)}")
    if device not in DEVICES:
        raise ClusterError(f"device {device!r} is not one of: {', '.join(DEVICES)} (cuda and xpu mean gpu)")
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
            if device == "gpu":
                raise ClusterError("device='gpu' needs GPUs, but gpus=[] names none")
            return (n or 2), False
        return (n or len(gpus)), True
    if kind in BATCH_KINDS or elsewhere:
        # The GPUs that count are on the engines' nodes, not here; they are checked once the engines report in.
        if n is None:
            raise ClusterError(f"engines={kind!r} on other nodes needs n, the number of engines to start there")
        return n, device != "cpu"
    from tutorial.core import accelerator
    gpus = accelerator.device_count() if device != "cpu" else 0
    if device == "gpu" and gpus == 0:
        raise ClusterError("device='gpu' needs GPUs, but none is visible here (device='auto' uses the CPU)")
    if gpus == 0:
        return (n or 2), False
    if (n or gpus) > gpus:
        raise ClusterError(f"n={n} engines on this node but only {gpus} GPU(s) visible: two engines would share a "
                           f"GPU; use n<={gpus}, device='cpu' for CPU engines, or name the GPUs to share with "
                           f"gpus=[...] (gloo only; notebook.allocation decides)")
    return (n or gpus), True


def bind_address(kind: str, ip, interface) -> tuple[str, str]:
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


def free_ports(ports, ip: str) -> str:
    """The controller's port pool (e.g. "10000-10030" where a firewall allows only those); busy ports fail here.
    Checked when the cluster starts, not in check(): a running cluster that start() reuses holds its own ports."""
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


def ipp_cluster(request: Request, tag: str):
    """The ipyparallel.Cluster for `request`, not started; every process it starts carries `tag`."""
    import ipyparallel as ipp
    where = request.where
    controller_args = ["--ports", free_ports(where.ports, request.bind)] if where.ports else []
    # The hub finishes an engine's registration at its first heartbeat: ipyparallel's 3 s period made every start wait
    # up to 3 s more per round (a 2-engine start took 8.4 s here, 4.3 s at 0.5 s). A dead engine is still declared
    # after the same 30 s of silence (60 missed beats instead of 10), which a loaded machine needs; the engines keep
    # their own 175 s (ipp_config).
    controller_args += ["--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=60"]
    return ipp.Cluster(engines=request.kind, n=request.n, controller_ip=request.bind, controller_args=controller_args,
                       delay=0, engine_timeout=math.ceil(request.timeout), log=IPP_LOG,
                       config=ipp_config(request, tag), **{"controller_location": request.reach, **where.ipp})


def ipp_config(request: Request, tag: str):
    """ipyparallel's launcher settings: the engines' environment (fixed at launch: OpenMP reads its thread count when
    it starts), mpiexec's arguments, quick kills, and the caller's own launcher options. The engines see the
    request's GPUs, none for device='cpu', and this process's where none were named (accelerator.showing: the
    vendor's variable)."""
    from ipyparallel.cluster.launcher import find_launcher_class
    from traitlets.config import Config
    kind, mpi_args = request.kind, request.where.mpi_args
    config = Config()
    env = {"PYTHONUNBUFFERED": "1", child_processes.TAG_VARIABLE: tag}  # the tag finds every process the cluster starts
    config.ControllerLauncher.environment = dict(env)
    config.ControllerLauncher.connection_info_timeout = float(request.timeout)
    if kind == "local" or (kind == "mpi" and not mpi_args):  # all on this node: a fair share of its cores each
        env["OMP_NUM_THREADS"] = str(threads_per_process(request.n))
    gpus = () if request.device == "cpu" else request.gpus
    if gpus is not None:  # set, not inherited: engines see exactly these, local rank i takes the i-th
        from tutorial.core import accelerator
        env.update(accelerator.showing(gpus))
    config.EngineLauncher.environment = open_mpi_env(env) if kind == "mpi" else env
    config.MPIEngineSetLauncher.mpi_args = list(mpi_args)
    # Engines keep no state worth saving: SIGKILL 1 s after SIGTERM (the default 5 s adds up over restarts).
    config.LocalProcessLauncher.stop_seconds_until_kill = 1
    # An engine stops itself after this many missed checks of the hub's heartbeat, each the hub's period + 0.5 s: at
    # ipp_cluster's 0.5 s period, 175 keeps ipyparallel's own 175 s of silence (50 checks of 3.5 s) before it gives up.
    config.EngineLauncher.engine_args = ["--IPEngine.max_heartbeat_misses=175"]
    if kind in BATCH_KINDS:  # the filled-in batch script goes to /tmp, not into whatever folder the notebook is in
        safe = re.sub(r"[^\w.-]", "-", tag)
        config[find_launcher_class(kind, "engine").__name__].batch_file_name = \
            os.path.join(tempfile.gettempdir(), f"tutorial-{safe}-engines.{kind}")
    config[find_launcher_class(kind, "engine").__name__].update(request.where.launcher or {})
    return config
