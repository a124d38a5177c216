"""The Cluster: a controller and engines, started, made ranks 0..n-1, restarted and stopped; one per name and kernel.

start() (tutorial.launch.engines) checks its options (engine_options), then reuses or launches a Cluster here. Every
process the cluster starts carries its tag (child_processes), and a reaper (tutorial.launch.reaper) stops them when the
kernel goes. run() hands the run, and what follows a failed one, to its collaborator engine_runs.Runs (`runs`); the
functions at the end run on the engines. Every call the Cluster makes on its engines for itself (not run()'s
function, which Runs bounds) goes through Cluster._ask, which bounds it and names an engine that does not answer,
with what keeps it busy.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass

from ..core.process import threads_per_process
from . import child_processes, reaper
from .engine_options import ClusterError, Request, ipp_cluster
from .engine_runs import EngineTimeout, RankError, Runs, bounded_magics

# A process group made by hand in a %%px cell waits for a missing rank for torch's default before it says anything:
# 30 minutes under gloo, 10 under NCCL, and nothing there answers an Interrupt (the wait is in C++). On the engines the
# course bounds it, rendezvous and collectives alike, unless the cell passes its own timeout=: a rank whose peer never
# comes (a mistyped rank condition, a peer that raised first) raises after this many seconds.
RENDEZVOUS_BOUND_S = 120.0
# The course's own calls on the engines (a port, an environment variable, a ping) take milliseconds on an idle engine:
# one that has not answered within this many seconds is busy with something else (a %%px --noblock cell, a
# view.apply_async left running), and waiting longer would only hide that (a 280-s task once held run() for 278 s
# without a word). 10 s leaves room for a loaded 2-core CI machine. The start's own calls (_probe imports torch, a
# minute on a slow network file system) have the start's timeout instead.
ENGINE_CALL_S = 10.0

log = logging.getLogger(__name__)


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


class Cluster:
    """A running controller and its engines, ranks 0..n-1 (`engines`, in rank order), and `view`, a blocking
    DirectView on them in rank order. Use start() to make one."""

    running: dict = {}  # name -> the Cluster this process started under that name and has not stopped

    def __init__(self, ipp_cluster, request: Request, tag: str, name: str = ""):
        self._ipp, self.request, self.tag, self.name = ipp_cluster, request, tag, name
        self.kind, self.n = request.kind, request.n
        self.use_cuda = request.use_cuda  # False once engines on other nodes report no GPU (device='auto')
        self.engines: list[EngineInfo] = []
        self.results: list = []   # the last run's result per rank, in rank order
        self.client = self.view = self._reaper = None
        self.master_addr, self.master_port = "127.0.0.1", None  # the engines' rendezvous (new_master_port)
        self.env: dict = {}  # what setenv() set: every engine gets it again after a restart
        self._withdrawn: set = set()  # our calls that a busy engine did not take in time (_ask), still in its queue
        self._stopped = False
        self.runs = Runs(self)  # run() and what follows a run or a call that failed, hung or was interrupted

    # ------------------------------------------------------------------------------------------ lifecycle
    @classmethod
    def reuse(cls, name: str, request: Request) -> "Cluster | None":
        """The cluster this process runs under `name`, if it was asked for with an equal request and still answers.
        Otherwise None, once that cluster (if any) is stopped: one cluster per name. One line says which."""
        earlier = cls.running.get(name)
        if earlier is None:
            return None
        if earlier.request == request and earlier._healthy():
            print(f"engines: reusing the {earlier.n} {earlier.kind} engine(s) this kernel started with the same "
                  f"options (cluster.stop() first for new processes)", flush=True)
            if request.activate:
                earlier._activate_magics()
            return earlier
        earlier.stop()
        print(f"engines: stopped the {earlier.n} {earlier.kind} engine(s) this kernel started before, to start "
              f"these (one cluster per kernel; name=... runs another beside it)", flush=True)
        return None

    @classmethod
    def launch(cls, name: str, request: Request) -> "Cluster":
        """Start the controller, the reaper and the engines that `request` asks for, and make the engines ranks."""
        tag = child_processes.new_tag()
        cluster = cls(ipp_cluster(request, tag), request, tag, name)
        try:
            # A process of its own session that outlives a killed kernel: when this process closes the pipe (stop())
            # or dies, it stops whatever ipyparallel's cluster file still lists and every process with the tag.
            cluster._reaper = reaper.start(cluster._ipp.cluster_file, tag)
            with cluster._engines_starting():
                cluster.client = cluster._ipp.start_and_connect_sync()  # the controller, n engines; bounded wait
            cluster._assign_ranks(sorted(cluster.client.ids))
        except BaseException:  # KeyboardInterrupt too: never leave half a cluster behind
            cluster.stop()
            raise
        cls.running[name] = cluster
        return cluster

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
            raise EngineTimeout(f"the {self.kind} engines did not start within {self.request.timeout:g} s "
                                f"(timeout=...): {exc}; batch engines may still wait in the queue") from None

    def _assign_ranks(self, ids: list) -> None:
        """Rank, local rank and world size for every engine; MPI engines keep their MPI rank (Horovod's)."""
        infos = dict(zip(ids, self._ask(_probe, [(i, ()) for i in ids], "pid, host and GPUs", self.request.timeout)))
        without = sorted({infos[i]["host"] for i in ids if not infos[i]["gpus"]})
        if self.use_cuda and without:  # engines on other nodes: only now do we know their GPUs
            if self.request.device == "gpu":
                raise RankError(f"device='gpu' but {', '.join(without)} has no GPU (device='auto' uses the CPU there)")
            self.use_cuda = False  # device='auto' on nodes without GPUs means the CPU
        order = self._rank_order(infos)
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
                pending.append((info, (env, self.use_cuda)))
        configured = self._ask(_configure, [(info.engine_id, args) for info, args in pending], "their rank and GPU",
                               self.request.timeout)
        for (info, _), answer in zip(pending, configured):
            info.device, info.gpu, info.threads = answer
        self.engines = sorted((info for info, _ in pending), key=lambda e: e.rank)
        seen = {}
        for e in self.engines:  # more engines than GPUs on a node, or a launcher's GPU binding gone wrong
            if e.gpu and e.gpu in seen and not self.request.share_gpus:
                from tutorial.core.accelerator import visible_variable
                raise RankError(f"ranks {seen[e.gpu]} and {e.rank} share GPU {e.gpu} on {e.host}: one engine per GPU "
                                f"(check n, {visible_variable()} and the launcher's GPU binding)")
            seen[e.gpu] = e.rank
        self.view = self.client[[e.engine_id for e in self.engines]]
        self.view.block = True
        self.new_master_port()  # for process groups made by hand in %%px cells
        if self.request.activate:
            self._activate_magics()

    def _rank_order(self, infos: dict) -> list:
        """The engine ids in rank order: by MPI rank where mpiexec started them, else node by node."""
        mpi = {i: (info["mpi_rank"], info["mpi_size"]) for i, info in infos.items()}
        if self.kind == "mpi" or all(rank is not None for rank, _ in mpi.values()):
            if set(mpi.values()) != {(rank, self.n) for rank in range(self.n)}:
                raise RankError(f"the MPI engines report (MPI rank, size) {list(mpi.values())}, not one world of "
                                f"{self.n}")
            return sorted(infos, key=lambda i: mpi[i][0])
        # engine ids follow registration order; grouping by host keeps a node's ranks together
        return sorted(infos, key=lambda i: (infos[i]["host"], i))

    def _activate_magics(self) -> None:
        """%%px on all engines in rank order, with each engine's output at the end and no progress bar (stable
        outputs under nbval), bounded and freed like run() (bounded_magics)."""
        from IPython import get_ipython
        shell = get_ipython()
        if shell is not None:
            shell.magics_manager.register(bounded_magics(self)(shell, self.view))
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
        self._ask(_setenv, [(e.engine_id, (values,)) for e in self.engines], f"setenv({', '.join(values)})")

    def new_master_port(self) -> int:
        """Give every engine a new MASTER_PORT for the next process group, made by hand in a %%px cell (03), by
        Lightning (08) or by a trainer: rank 0's engine binds it now and holds it (core.distributed.hold_port), and
        its init_process_group takes over that very server, so no other process on the node can take the port in
        between (a port that was only free when chosen could be, issue 38). A new one for every group: a second
        rendezvous on the store of the previous one would find its keys. run() calls it before every run."""
        self._require_running()
        from ..core.distributed import hold_port  # imports torch: not before a cluster runs
        [port] = self._ask(hold_port, [(self.engines[0].engine_id, ())], "a port to hold for the next process group")
        self.master_port = port
        self._ask(_setenv, [(e.engine_id, ({"MASTER_PORT": str(port)},)) for e in self.engines],
                  "the MASTER_PORT of the next process group")
        return port

    def restart(self) -> None:
        """Fresh engine processes (new pids, nothing left from earlier runs), same n, same controller."""
        self._require_running()
        old = set(self.client.ids)
        self._ipp.restart_engines_sync()
        # wait_for_engines counts every registered engine and fails when one leaves: first let the old ones go.
        deadline = time.monotonic() + self.request.timeout
        while old & set(self.client.ids):
            if time.monotonic() > deadline:
                raise EngineTimeout(f"engines {sorted(old & set(self.client.ids))} did not leave within "
                                    f"{self.request.timeout:g} s of their restart")
            time.sleep(0.1)
        with self._engines_starting():
            self.client.wait_for_engines(self.n, timeout=self.request.timeout, interactive=False)
        self._assign_ranks(sorted(self.client.ids))

    def stop(self) -> None:
        """Stop the engines, mpiexec and the controller; safe to call twice. Leaving the `with` block calls it."""
        if self._stopped:
            return
        self._stopped = True
        if Cluster.running.get(self.name) is self:
            del Cluster.running[self.name]
        try:
            if self.client is not None:
                self.client.close()
            self._ipp.stop_cluster_sync()
        except Exception as exc:  # the reaper stops what the cluster file still lists
            log.warning("stopping the cluster: %r", exc)
        finally:
            if self._reaper is not None:
                reaper.release(self._reaper)
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
            self._ask(os.getpid, [(i, ()) for i in ids], "a ping")
            return True
        except Exception:  # noqa: BLE001 - gone, busy or broken: any of them means start afresh
            return False

    # ------------------------------------------------------------------------------------------ calls to the engines
    def _ask(self, fn, calls: list, what: str, timeout: float | None = None) -> list:
        """fn(*args) on each engine of `calls` ([(engine id, args), ...]) at once; their answers, in that order. Every
        call the Cluster makes on its engines for itself comes here (a run's own function has run_timeout, in
        _collect), so that none waits without a bound: an engine that has not answered within `timeout` (default
        ENGINE_CALL_S, at most the start's timeout) raises EngineTimeout naming it and what keeps it busy (`what` says
        what it was asked for; the call is withdrawn from its queue). An Interrupt while this waits stops what keeps
        it busy (SIGINT, else a restart) and says so (Runs.free_busy)."""
        import ipyparallel as ipp
        timeout = min(ENGINE_CALL_S, self.request.timeout) if timeout is None else timeout
        asked = [(i, self.client[i].apply_async(fn, *args)) for i, args in calls]
        deadline = time.monotonic() + timeout
        try:
            return [answer.get(max(0.0, deadline - time.monotonic())) for _, answer in asked]
        except ipp.error.TimeoutError:
            waiting = [(i, answer) for i, answer in asked if not answer.ready()]
            busy, ids = self.runs.busy(waiting), [i for i, _ in waiting]
            with contextlib.suppress(Exception):  # an engine that is gone has no queue to withdraw it from
                self.client.abort([answer for _, answer in waiting], targets=ids, block=False)
            self._withdrawn.update(msg_id for _, answer in waiting for msg_id in answer.msg_ids)
            it = "it" if len(ids) == 1 else "them"
            error = EngineTimeout(f"engines did not answer within {timeout:g} s (asked: {what}): {busy}. Wait for {it} "
                                  f"to end, stop {it} with cluster.client.send_signal('SIGINT', targets={ids}) (or "
                                  f"Interrupt while this waits), or cluster.restart() for fresh engines (their "
                                  f"variables are lost)")
            first = self.runs.engine(ids[0])
            if first is not None:
                error.rank, error.host, error.pid = first.rank, first.host, first.pid
            raise error from None
        except KeyboardInterrupt:
            raise KeyboardInterrupt(self.runs.free_busy([(i, a) for i, a in asked if not a.ready()], what)) from None

    def run(self, fn, *args, timeout: float | None = None, fresh: bool = False, **kwargs):
        """Run fn(*args, **kwargs) on every engine at once and return rank 0's result (03, 05); every rank's is in
        `results` (Runs.run says how a run ends: a RankError or EngineTimeout naming the rank, or an Interrupt)."""
        return self.runs.run(fn, *args, timeout=timeout, fresh=fresh, **kwargs)

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


# ------------------------------------------------------------------------------------------ on the engines
def _probe() -> dict:
    """Who am I: pid, host, and the MPI rank when mpiexec started the engine (`ipengine --mpi` imports mpi4py)."""
    from tutorial.core import accelerator
    mpi = sys.modules.get("mpi4py.MPI")
    world = mpi.COMM_WORLD if mpi is not None and mpi.Is_initialized() else None
    return dict(pid=os.getpid(), host=socket.gethostname(), mpi_rank=world.Get_rank() if world else None,
                mpi_size=world.Get_size() if world else None, gpus=accelerator.device_count())


def _configure(env: dict, use_cuda: bool) -> tuple[str, str, int]:
    """Become rank env['RANK']: torchrun's variables, a fair share of the node's cores, and the GPU of our local rank
    (so that nccl and .cuda() never default to GPU 0). Returns the device, the GPU's UUID and the threads."""
    import datetime

    import torch
    import torch.distributed.distributed_c10d as c10d

    from tutorial.core import accelerator
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = datetime.timedelta(seconds=RENDEZVOUS_BOUND_S)
    threads = threads_per_process(int(env["LOCAL_WORLD_SIZE"]))
    os.environ.update(env, OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    device, gpu, gpus = "cpu", "", accelerator.device_module()  # torch.cuda (NVIDIA, AMD) or torch.xpu (Intel)
    if use_cuda and gpus is not None:
        index = int(env["LOCAL_RANK"]) % gpus.device_count()
        gpus.set_device(index)
        props = gpus.get_device_properties(index)
        device = f"{accelerator.gpu_type()}:{index} {props.name}"
        gpu = str(getattr(props, "uuid", "") or f"{socket.gethostname()}:{index}")
    return device, gpu, torch.get_num_threads()


def _setenv(values: dict) -> None:
    os.environ.update(values)

