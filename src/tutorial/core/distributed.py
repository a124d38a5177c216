"""Who am I, and how do the processes find each other (03a_ddp_by_hand and 03b_ddp_trainer, 06_multi_node).

The trainers never ask a launcher directly. `world_from_env()` reads rank, local_rank and world_size from whatever
started the process: torchrun (or ipyparallel engines, which `tutorial.launch.engines` gives torchrun's variables),
Open MPI's mpirun, MPICH/PMI and Cray PALS (mpiexec on ThetaGPU/Polaris-like systems), or Slurm's srun.
"""
from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import accelerator
from .config import ConfigError, first_line
from .models import checksum
from .process import threads_per_process

# (rank, local_rank, world_size, local_world_size) variable names, most specific launcher first.
LAUNCHERS = {
    "torchrun": ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "pals": ("PALS_RANKID", "PALS_LOCAL_RANKID", "PMI_SIZE", "PALS_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
    # SLURM_STEP_NUM_TASKS exists only inside an srun step, so a notebook in an salloc shell is not taken for rank 0
    # of a job step that never started.
    "slurm": ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE"),
}


@dataclass
class World:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "none"

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0


def world_from_env(env=None) -> World:
    env = os.environ if env is None else env
    for launcher, (rank, local_rank, size, local_size) in LAUNCHERS.items():
        if rank in env and size in env:
            r, n = int(env[rank]), int(env[size])
            local = int(env.get(local_rank, r))
            # Slurm writes tasks per node as "4(x2)"; the count before the parenthesis is what we need.
            local_n = int(str(env.get(local_size, n)).split("(")[0].split(",")[0])
            return World(r, local, n, local_n, launcher)
    return World()


def pick_device(local_rank: int, local_world_size: int = 1) -> torch.device:
    """One process per GPU: local rank i uses GPU i of its node, whoever made it (NVIDIA's and AMD's GPUs are torch's
    "cuda", Intel's "xpu": core.accelerator); the backend "auto" then follows the device (init_process_group).
    Without GPUs, the CPU, shared fairly: n processes with all cores' worth of threads each would fight over them
    (torchrun sets OMP_NUM_THREADS=1 for this reason; mpirun, horovodrun and engines do not)."""
    gpus = accelerator.device_count()
    if not gpus:
        if "OMP_NUM_THREADS" not in os.environ and local_world_size > 1:
            torch.set_num_threads(threads_per_process(local_world_size))
        return torch.device("cpu")
    device = torch.device(accelerator.vendor().device_type, local_rank % gpus)
    getattr(torch, device.type).set_device(device)  # so collectives and .to(device.type) never default to GPU 0
    return device


def _first_host() -> str | None:
    """The job's first node under PBS or Slurm: where rank 0 runs, so where the rendezvous listens."""
    if os.environ.get("PBS_NODEFILE"):
        with open(os.environ["PBS_NODEFILE"]) as f:
            return f.readline().strip() or None
    if os.environ.get("SLURM_JOB_NODELIST"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                                 capture_output=True, text=True, timeout=10).stdout.split()
            return out[0] if out else None
        except (OSError, subprocess.TimeoutExpired):
            return None
    return None


_held: dist.Store | None = None  # the rendezvous store this process hosts for the next process group (hold_port)


def hold_port() -> int:
    """Host a rendezvous store on a port the OS picks, keep it, and return the port: the next process group of this
    process at that port (our init_process_group, env://, Lightning) reuses this server (TCPStore's multi_tenant), so
    the port is held from the moment it is chosen. A port that is merely free when chosen and bound seconds later
    may be taken in between by any process on the node (issue 38: rank 0 then fails, its peers wait). A new call
    replaces the previous store: a second process group on one store would find the first one's keys."""
    global _held
    timeout = datetime.timedelta(seconds=60)
    refused = []  # kept open until a port is found, so that the OS does not hand the same one out again
    for _ in range(20):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                              timeout=timeout)
        try:
            # What the rendezvous will do: find this server in torch's per-process cache of multi-tenant servers.
            # That cache keeps the entry of an earlier server on the same port after it closed and does not replace
            # it, so where the OS hands out such a port again, the rendezvous would bind it anew and fail with
            # EADDRINUSE (seen in 3 of 192 holds in a row here, and once in make test).
            dist.TCPStore("127.0.0.1", store.port, is_master=True, multi_tenant=True, wait_for_workers=False,
                          timeout=timeout)
        except RuntimeError:
            refused.append(store)
            continue
        _held = store  # the previous one closes now, after this one is bound: the OS cannot give its port back here
        return store.port
    raise RuntimeError("no port could be held for the rendezvous in 20 tries (torch's multi-tenant store cache)")


def rendezvous(world: World) -> tuple[str, int]:
    """Where the ranks meet: MASTER_ADDR and MASTER_PORT if the launcher set them (torchrun, tutorial.launch.engines,
    the user), else an address and port every rank derives alike. The environment is left as it was, so a second run
    in the same process (a notebook kernel) chooses again instead of finding the first run's port.

    Under MPI, rank 0 holds a port (hold_port) and broadcasts it with mpi4py, so two jobs on one node never collide;
    a lone process holds its own. Otherwise all ranks derive the same port from the job's environment.
    """
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    single_node = world.local_world_size == world.world_size
    addr = "127.0.0.1" if single_node else (_first_host() or socket.gethostname())
    if world.launcher in ("openmpi", "pals", "mpich"):
        from mpi4py import MPI
        mine = (addr if single_node else socket.gethostname(), hold_port()) if world.rank == 0 else None
        return MPI.COMM_WORLD.bcast(mine, root=0)
    if world.world_size == 1:
        return addr, hold_port()
    if os.environ.get("SLURM_JOB_ID"):  # a job's own port: two jobs on a node differ unless 20000 ids apart
        return addr, 20000 + int(os.environ["SLURM_JOB_ID"]) % 20000
    return addr, 29500  # torch's own default, which every rank can derive


class RendezvousTimeout(TimeoutError):
    """Not every rank arrived (or rank 0 could not be reached) within the timeout; the message names who is missing."""


def init_process_group(world: World, device: torch.device, timeout: float = 300.0, backend: str = "auto") -> bool:
    """Join the process group (backend "auto": nccl on GPUs, gloo on CPUs), waiting at most `timeout` seconds for
    the other ranks, and bounding every later collective by the same timeout. Returns False when one already
    existed (a %%px cell made it), so the caller knows not to destroy what it did not create."""
    if dist.is_initialized():
        return False
    backend = dist.get_default_backend_for_device(device) if backend == "auto" else backend
    store = rendezvous_store(world, *rendezvous(world), timeout)
    if backend in ("nccl", "xccl"):  # NCCL (RCCL on AMD) and oneCCL: one rank per GPU
        if device.type not in accelerator.GPU_DEVICE_TYPES:
            raise ConfigError(f"backend {backend} needs a GPU per rank and this rank has none; use --backend gloo")
        refuse_shared_gpus(store, world, gpu_identity(device), backend)
    # device_id binds the group to this rank's GPU: NCCL connects now, not at the first collective, and never
    # has to guess the device (a barrier's "devices used by this process are currently unknown" warning).
    dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.world_size,
                            timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if backend == "nccl" else None)
    return True


def gpu_identity(device: torch.device) -> str:
    """Which physical GPU this is: its host and UUID. An index says nothing across ranks: where a launcher binds one
    GPU per task (Slurm --gpus-per-task=1, --gpu-bind), every rank sees its own GPU as cuda:0."""
    props = getattr(torch, device.type).get_device_properties(device)
    return f"{socket.gethostname()}/{getattr(props, 'uuid', None) or getattr(props, 'pci_bus_id', device.index)}"


def refuse_shared_gpus(store: dist.Store, world: World, identity: str, backend: str = "nccl") -> None:
    """NCCL cannot put two ranks of a group on one GPU (nor RCCL; oneCCL is held to the same rule, one rank per GPU
    or tile, as Aurora runs it). Every rank writes the identity of its GPU into the store and
    reads the others', so all ranks refuse together, naming the ranks that would share one; ranks that each see
    only their own GPU are fine, however many GPUs each of them sees."""
    store.set(f"tutorial/gpu/{world.rank}", identity)
    found: dict[str, list[int]] = {}
    for r in range(world.world_size):
        found.setdefault(store.get(f"tutorial/gpu/{r}").decode(), []).append(r)
    shared = next((ranks for ranks in found.values() if len(ranks) > 1), None)
    if shared:
        found = accelerator.INTEL if backend == "xccl" else accelerator.vendor() or accelerator.NVIDIA
        raise ConfigError(f"ranks {', '.join(map(str, shared))} would use the same GPU: {found.library} cannot put two "
                          "ranks on one GPU; start at most one process per GPU, or use --backend gloo (slower) to "
                          "share GPUs")


def current_rank() -> int:
    """This process's rank: from the process group or Horovod once they exist, else from the launcher's variables."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        return hvd.rank()
    return int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0)))


def collective_device() -> torch.device:
    """Where this rank's collectives take their tensors: its GPU under NCCL (RCCL on AMD) or XCCL, whose collectives
    take GPU tensors only, the CPU under gloo."""
    if dist.get_backend() in ("nccl", "xccl"):
        return torch.device(accelerator.gpu_type(), accelerator.device_module().current_device())
    return torch.device("cpu")


def max_over_ranks(values: list[float]) -> list[float]:
    """The element-wise maximum of `values` over all ranks (one small all-reduce), or `values` in a lone process:
    how every rank learns the same thing at the same step (a SIGTERM, a diverged loss) and acts on it together."""
    t = torch.tensor([float(v) for v in values])
    if dist.is_available() and dist.is_initialized():  # DDP, FSDP, DeepSpeed, Lightning
        t = t.to(collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        return hvd.allreduce(t, op=hvd.Max, name="max_over_ranks").tolist()
    return t.tolist()


def gather_over_ranks(value) -> list:
    """Every rank's `value` (a small picklable object), in rank order, on every rank; [value] in a lone process."""
    if dist.is_available() and dist.is_initialized():  # DDP, FSDP, DeepSpeed, Lightning
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        return values
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        return hvd.allgather_object(value, name="gather_over_ranks")
    return [value]


def rendezvous_store(world: World, addr: str, port: int, timeout: float) -> dist.Store:
    """The rendezvous torch's env:// does, with a bounded wait that says whom it waits for.

    Rank 0 hosts a key-value store at addr:port (under torchrun its agent already does, so every rank is a client);
    each rank writes its name into it, and all wait until every rank has. Instead of hanging, a rank gives up after
    `timeout` seconds with one line: which ranks never arrived, or that rank 0 could not be reached."""
    where, n = f"{addr}:{port}", world.world_size
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    deadline = time.monotonic() + timeout
    unreachable = RendezvousTimeout(f"rank {world.rank} could not reach rank 0's rendezvous at {where} within "
                                    f"{timeout:g} s: is rank 0 running, and is {addr} reachable from this node?")
    # Wait for the port in Python first: torch's own connection retries log a C++ backtrace each.
    if (world.rank != 0 or agent_store) and not _listening(addr, port, deadline):
        raise unreachable
    try:
        # multi_tenant: rank 0 reuses the server it may already hold on this port (hold_port, engines' MASTER_PORT)
        store = dist.TCPStore(addr, port, n, is_master=world.rank == 0 and not agent_store, multi_tenant=True,
                              timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, ValueError) as exc:  # DistStoreError is a RuntimeError
        if world.rank == 0 and not agent_store:
            raise RendezvousTimeout(f"rank 0 cannot host the rendezvous on {where}: "
                                    f"{first_line(exc)}") from None
        raise unreachable from None
    if agent_store:  # torchrun's store outlives restarts: keep each attempt's keys apart, as torch itself does
        store = dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    keys = [f"tutorial/arrived/{r}" for r in range(n)]
    store.set(keys[world.rank], socket.gethostname())
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [str(r) for r, key in enumerate(keys) if not store.check([key])]
            raise RendezvousTimeout(f"rendezvous at {where}: {n - len(missing)} of {n} ranks arrived within "
                                    f"{timeout:g} s; missing rank(s): {', '.join(missing)}")
        time.sleep(0.05)
    return store


def _listening(addr: str, port: int, deadline: float) -> bool:
    """Whether something accepts connections on addr:port before the deadline."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def teardown(created: bool) -> None:
    if created and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_mean(value: float, device: torch.device) -> float:
    """The mean of a per-rank number over all ranks (e.g. the training loss each rank saw)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def replica_checksums(model) -> list[str]:
    """Every rank's checksum, gathered on every rank (the replica sync check)."""
    return gather_over_ranks(checksum(model))
