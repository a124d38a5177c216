"""Running a measurement: one trainer run timed in this process, or a job in N fresh processes started by torch's
elastic launcher (what torchrun runs), or by Horovod's own launcher for Horovod."""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import importlib
import io
import logging
import os
import time
import uuid

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ..core import accelerator
from ..core.config import ConfigError, TrainConfig, first_line
from ..core.process import exit_process, threads_per_process, usable_cores


class BenchError(ConfigError):
    """A bad benchmark option: one line on stderr, exit code 2."""


class RunFailed(RuntimeError):
    """A benchmark process failed or hung: one line on stderr, exit code 1."""


def available_processes(backend: str) -> tuple[int, str]:
    """How many processes fit on this machine: one per GPU, or one per CPU core with gloo."""
    if backend in ("nccl", "xccl") or accelerator.device_count():
        return accelerator.device_count(), "GPUs"
    return usable_cores(), "CPU cores"


def measure_run(strategy: str, cfg: TrainConfig, warmup: int, steps: int, verbose: bool = False) -> dict:
    """Run one trainer unchanged in this process (one rank of it) with its step timing on (cfg.time_steps); the
    seconds, samples and CPU seconds of the steps after the first `warmup` (allocator, cuDNN autotuning,
    torch.compile). Called inside every benchmark process, and directly by benchmarks/bare_loop.py."""
    module = importlib.import_module(f"tutorial.train_{strategy}")
    # max_steps ends the run; epochs only has to be large enough not to end it first.
    cfg = cfg.replace(max_steps=warmup + steps, epochs=10 ** 6, progress=False, out="", resume="",
                      target_accuracy=0.0, time_steps=True)
    with contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO()):
        times = module.main(cfg)["step_times"]
    after = {key: None if values is None else values[warmup:] for key, values in times.items()}
    return dict(after, threads=torch.get_num_threads())


def share_cores(nproc: int, threads: int = 0) -> None:
    """n processes on one CPU: each gets `threads` threads, by default its share of the cores, or they fight over
    them. Done for every strategy so that runs without communication compare fairly with DDP; OMP_NUM_THREADS also
    tells the trainers' pick_device to leave the choice alone."""
    if not accelerator.device_count():
        threads = threads or int(os.environ.get("OMP_NUM_THREADS") or threads_per_process(nproc))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def _run_rank(fn, job: dict, rank: int, nproc: int, timeout: float):
    """One benchmark process, under either launcher: its share of the cores, the time limit, then fn(job, rank, n)."""
    share_cores(nproc, job.get("threads", 0))
    # The outer timeout: a rank still busy after `timeout` seconds prints where it hangs and exits, and the launcher
    # then stops the others.
    faulthandler.dump_traceback_later(timeout, exit=True)
    result = fn(job, rank, nproc)
    faulthandler.cancel_dump_traceback_later()
    atexit.register(exit_process, 0)  # the result is handed over: skip the teardown that can abort (exit_process)
    return result


@record
def _elastic_rank(fn, job: dict, nproc: int, timeout: float):
    return _run_rank(fn, job, int(os.environ["RANK"]), nproc, timeout)


def launch(fn, job: dict, nproc: int, timeout: float = 900, verbose: bool = False):
    """Run fn(job, rank, nproc) in nproc fresh processes and return rank 0's result. When a rank fails, the launcher
    stops the others and the first failure (from the error file @record writes) becomes one line."""
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"bench-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    started, logging_off = time.monotonic(), logging.root.manager.disable
    if not verbose:  # the launcher logs every start and stop; the failure is reported below in one line
        logging.disable(logging.CRITICAL)
    try:
        return elastic_launch(config, _elastic_rank)(fn, job, nproc, timeout)[0]
    except ChildFailedError as exc:
        if time.monotonic() - started > timeout:
            raise RunFailed(f"a benchmark run did not finish within {timeout:.0f} s (raise --timeout?)") from None
        rank, failure = exc.get_first_failure()
        message = failure.message["message"] if isinstance(failure.message, dict) else str(failure.message)
        kind, _, text = message.partition(": ")
        if kind in ("ConfigError", "DataError", "BenchError"):  # e.g. the real data is not there
            raise BenchError(text) from None
        raise RunFailed(f"rank {rank}: {message.strip().splitlines()[-1]}") from None
    finally:
        logging.disable(logging_off)


def launch_horovod(fn, job: dict, nproc: int, timeout: float = 900, verbose: bool = False):
    """Horovod ranks come from its own launcher (horovod.run with gloo, as horovodrun -np N --gloo)."""
    import horovod
    try:
        with contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO()):
            results = horovod.run(_horovod_rank, args=(fn, job, nproc, timeout), np=nproc, hosts=f"localhost:{nproc}",
                                  use_gloo=True, verbose=0)
    except Exception as exc:  # noqa: BLE001 - horovod.run wraps any rank's failure; report its first line
        raise RunFailed(f"horovod run failed: {first_line(exc, None) or type(exc).__name__}") from None
    return results[0]


def _horovod_rank(fn, job: dict, nproc: int, timeout: float):
    # horovod.run (0.28.1) exports HOROVOD_CYCLE_TIME and HOROVOD_CACHE_CAPACITY as "(None,)", a stray comma in
    # horovod/runner/__init__.py. Read as 0, the background thread polls without pause (half a core per rank, taken
    # from training on a small machine) and the response cache is off. Unset, Horovod uses its defaults, as horovodrun.
    for key in ("HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY"):
        if os.environ.get(key) == "(None,)":
            del os.environ[key]
    import horovod.torch as hvd
    hvd.init()
    return _run_rank(fn, job, hvd.rank(), nproc, timeout)
