"""The process plumbing every layer shares, written once: how a trainer process ends, a free port, a fair share of
the cores, and the environment Open MPI needs. Standard library only, so anything may import it."""
from __future__ import annotations

import os
import random
import signal
import socket
import sys
import threading
import traceback

from .config import ConfigError


def usable_cores() -> int:
    """The cores this process may run on (a batch job or `taskset` may allow fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_process(processes: int) -> int:
    """Each of `processes` processes on this node gets an equal share of the cores. Without it, n processes with
    all cores' worth of threads each fight over them (torchrun sets OMP_NUM_THREADS=1 for this reason; mpirun,
    horovodrun and notebook engines do not)."""
    return max(1, usable_cores() // max(1, processes))


# Ports the system hands out by itself (bind to port 0, every outgoing connection) come from its ephemeral range;
# a port chosen there and bound seconds later can be taken in between by any process on the node (issue 38).
LOWEST_PORT = 20000  # below it: well-known services (Jupyter's 8888, TensorBoard's 6006, torch's 29500 is above)


def ephemeral_ports() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):  # not Linux: the IANA range
        return range(49152, 65536)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody uses right now, for a port that another process must bind (node 0 of a torchrun or DeepSpeed
    launch, rank 0 of a tcp:// init, a server). Where the process that binds it is ours to run, hold the port instead
    (core.distributed.hold_port, or a store the launcher hosts): nothing can take a held port. This one is drawn at
    random from below the ephemeral range, which the system never hands out by itself, so only another explicit
    choice of the same number (1 in about 12,000) could take it before it is bound."""
    ephemeral = ephemeral_ports()
    candidates = range(LOWEST_PORT, max(LOWEST_PORT + 1000, ephemeral.start))
    for _ in range(100):
        port = random.SystemRandom().choice(candidates)
        if port in ephemeral or port == 29500:  # 29500: torch's default, which other jobs use without asking
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found in {candidates.start}-{candidates.stop - 1} (100 tries)")


def open_mpi_env(env: dict | None = None) -> dict:
    """`env` (default: this process's) plus what Open MPI needs to start here: as root it refuses to run without
    both ALLOW variables, and on a small machine it refuses more ranks than cores unless oversubscription is on."""
    env = dict(os.environ if env is None else env)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    return env


class Stopped(Exception):
    """A SIGTERM stopped training after a whole step and the checkpoint was saved: exit 143 (128 + SIGTERM)."""


class Sigterm:
    """A scheduler ends a job at its walltime with SIGTERM and, some seconds later, SIGKILL (Slurm's KillWait, 30 s
    by default; torchrun passes both on to its workers). run_main arms this; the training loop's first look at it
    installs the handler, so a SIGTERM during start-up still ends the process at once, and from then on a SIGTERM
    only sets `received`: the ranks agree on it at the next logged step (RunLog.step returns their agreement), and
    the loop stops after that step and the trainer saves (checkpoint.stop_requested)."""
    armed = False
    received = False

    @classmethod
    def check(cls) -> bool:
        if cls.armed and threading.current_thread() is threading.main_thread():
            cls.armed = False
            signal.signal(signal.SIGTERM, cls._handler)
        return cls.received

    @classmethod
    def request(cls) -> bool:
        """Ask for the stop a SIGTERM asks for (the engines' Interrupt does); True if one was asked already."""
        already, cls.received = cls.received, True
        return already

    @classmethod
    def clear(cls) -> None:
        cls.received = False

    @classmethod
    def _handler(cls, signum, frame):
        cls.request()


def run_main(main, cfg) -> None:
    """`python -m tutorial.train_<stage>`: run main(cfg); a bad option or missing data is one line and exit 2."""
    Sigterm.armed = True  # only a trainer run as a command saves on SIGTERM; engines keep their own handling
    # Every way out goes through exit_process, failures included: the loader workers ignore SIGTERM (see
    # core.data), and the interpreter's own exit would SIGTERM them and wait for them forever.
    code = 0
    try:
        main(cfg)
    except ConfigError as exc:
        code = _one_line(exc, 2)
    except Stopped as exc:
        code = _one_line(exc, 128 + signal.SIGTERM, "stopped")
    except (TimeoutError, FloatingPointError) as exc:  # a missing rank, a diverged loss: who and where, in a line
        code = _one_line(exc, 1)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug or Ctrl-C: the traceback, then the same exit as any other
        traceback.print_exc()
        code = 1
    exit_process(code)  # not a plain return: see exit_process for the gloo thread that can abort a finished run


def _one_line(exc: BaseException, code: int, prefix: str = "error") -> int:
    """The line in one write: every rank of a job writes its line into the same pipe, and a line written in two
    parts (print writes the text, then the newline) can be split by another rank's."""
    sys.stderr.write(f"{prefix}: {exc}\n")
    sys.stderr.flush()
    return code


def exit_process(code: int = 0):
    """End a launched training process without Python's interpreter teardown.

    Why: after DDP on gloo, torch 2.14 keeps gloo's worker threads alive past destroy_process_group. If one of them
    drops the last reference to a tensor while the interpreter is shutting down, the process aborts with "terminate
    called without an active exception" (SIGABRT, pytorch issue 190489; seen in about 1 run in 8 on a busy 2-core
    machine), and torchrun or mpirun report a failed job after a successful run. Skipping the teardown avoids it;
    remove this once torch fixes that issue. Output is flushed and Horovod and MPI are shut down first, so launchers
    see a clean exit.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        hvd.shutdown()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(code)
