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

This module is what notebooks import; the work is done in four modules beside it:
- engine_options: start()'s options checked before anything starts, and the ipyparallel cluster they become;
- engine_cluster: the Cluster's lifecycle (start, ranks, restart, stop, leftovers, the engine table);
- engine_runs: Cluster.run and %%px cells, their errors, time limits and Interrupts;
- reaper: the process that stops a cluster when its kernel goes.
"""
from __future__ import annotations

from . import engine_options
from .engine_cluster import RENDEZVOUS_BOUND_S, Cluster, EngineInfo
from .engine_options import ClusterError, visible_gpus
from .engine_runs import FAILURE_GRACE_S, STOP_GRACE_S, EngineTimeout, Interrupted, RankError

# What notebooks, lessons and tests use: start() and its Cluster, the errors, what a rank's result may be after an
# Interrupt, visible_gpus() for notebook.allocation, and the waits the README quotes.
__all__ = ["start", "Cluster", "EngineInfo", "ClusterError", "RankError", "EngineTimeout", "Interrupted",
           "visible_gpus", "FAILURE_GRACE_S", "STOP_GRACE_S", "RENDEZVOUS_BOUND_S"]


def start(n: int | None = None, engines: str = "local", *, device: str = "auto", gpus=None, timeout: float = 90.0,
          run_timeout: float = 3600.0, on_failure: str = "restart", name: str = "", show: bool = True,
          activate: bool = True, **where) -> Cluster:
    """Start a controller and n engines, make them ranks 0..n-1, and return the Cluster (00_setup).

    What to start:
      n: how many engines (default: one per visible GPU, else 2). engines: local, mpi (mpiexec; MPI rank = rank),
      slurm or pbs. device: auto (GPUs if visible), gpu (GPUs required, any vendor's; cuda and xpu say the same) or
      cpu. gpus: which of this node's GPUs, as the vendor's variable names them (CUDA_VISIBLE_DEVICES,
      ROCR_VISIBLE_DEVICES, ZE_AFFINITY_MASK; default: every visible one); fewer GPUs than engines are shared (gloo
      only).
    How long to wait, and after a failure:
      timeout: seconds for the engines to start. run_timeout: the limit of one run() (unless it gives its own) or
      %%px cell. on_failure: restart or stop the engines after a run that failed.
    In the kernel:
      name: one cluster per name and kernel: start() again with the same options reuses the running one, with other
      options it stops it first (one line says which); another name runs a second cluster beside it.
      show: print the engine table. activate: enable %%px on these engines.
    Where, for engines on other nodes only (keywords, engine_options.Where says what each means):
      ip, interface, ports, mpi_args, launcher, and the options of ipyparallel.Cluster (profile, ...).
    """
    request = engine_options.check(n, engines, device=device, gpus=gpus, timeout=timeout, run_timeout=run_timeout,
                                   on_failure=on_failure, activate=activate, where=where)
    cluster = Cluster.reuse(name, request) or Cluster.launch(name, request)
    if show:
        print(cluster.table(), flush=True)
    return cluster
