"""Running a function on every engine and collecting what comes back: Cluster.run, and %%px cells with the same bounds.

A run ends in one of three ways, each said in one error or line: every rank returned (rank 0's result, every rank's in
`results`); a rank raised, died or hung (RankError or EngineTimeout naming the rank, then the engines are restarted
or stopped); or the notebook was interrupted (every rank is stopped as on a SIGTERM, else by a KeyboardInterrupt,
else by a restart). An engine still busy with another task when a run starts is named, with that task, within
engine_cluster.ENGINE_CALL_S (EngineTimeout); an Interrupt while run() waits for it stops that task. `Runs` is the
Cluster's collaborator for all of this (Cluster.runs); what a run runs on every engine is at the end.
"""
from __future__ import annotations

import contextlib
import logging
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass

from ..core.config import first_line
from ..core.process import Sigterm, Stopped
from .engine_options import ClusterError

# How long the other ranks get to finish (or fail) after one rank failed or died before they are replaced: enough for
# gloo to notice a closed connection, short enough that a rank stuck in a collective does not keep the notebook.
FAILURE_GRACE_S = 5.0
# After an Interrupt, how long the ranks get to reach the step where they all agree to stop (the trainers compare
# every log_every steps in RunLog.step's all-reduce) and save; after that they get a KeyboardInterrupt where they are.
STOP_GRACE_S = 10.0
ANSI_COLOURS = re.compile(r"\x1b\[[0-9;]*m")
READY = "the engines are ready for the next cell"
_RUNNING = object()  # a rank's outcome while it has not finished

log = logging.getLogger(__name__)


class RankError(RuntimeError):
    """A rank raised, died, or did not finish in time. `rank`, `host` and `pid` say where (the first failure; the
    others are often its consequences); `remote_traceback` holds the engine's traceback when there is one.
    (Not ipyparallel.error.EngineError, which means that an engine process died.)"""

    def __init__(self, message, rank=None, host=None, pid=None, remote_traceback=""):
        super().__init__(message)
        self.rank, self.host, self.pid, self.remote_traceback = rank, host, pid, remote_traceback


class EngineTimeout(RankError, TimeoutError):
    """A run or the start did not finish within its timeout."""


class Runs:
    """Cluster.run and what follows a run that failed, hung or was interrupted, or a call that an engine busy with
    another task did not answer (busy, free_busy, for Cluster._ask). A collaborator of one engine_cluster.Cluster,
    through this interface: it reads the cluster's engines (in rank order), client, view, request (run_timeout,
    on_failure), master_addr, master_port and _withdrawn, writes its results, and calls its new_master_port(),
    restart(), stop() and _require_running()."""

    def __init__(self, cluster):
        self.cluster = cluster

    def run(self, fn, *args, timeout: float | None = None, fresh: bool = False, **kwargs):
        """Run fn(*args, **kwargs) on every engine at once and return rank 0's result (03, 05).

        ipyparallel sends fn by value: a self-contained function defined in the notebook runs too (it must import
        what it uses), and a function from a module is imported there by module and name. Rank 0's output is
        printed here; every rank's result is in the cluster's `results`. An exception on any rank raises RankError
        with its rank and traceback; a run longer than timeout (default: start's run_timeout) raises EngineTimeout.
        After a death or a timeout the engines are restarted (or stopped) first. fresh=True restarts them before the
        run.
        An engine still busy with another task raises EngineTimeout within engine_cluster.ENGINE_CALL_S, naming it
        and that task, before anything runs.
        """
        self.cluster._require_running()
        if not callable(fn):
            raise ClusterError(f"run needs a function, got {fn!r}")
        if self.cluster.engines[0].mpi_rank is None and _needs_mpi_ranks(fn):
            raise ClusterError(f"{fn.__module__}.{fn.__qualname__} uses Horovod, which finds its ranks through MPI: "
                               f"start the cluster with engines='mpi'")
        if fresh:
            self.cluster.restart()
        result = None
        try:
            # Every engine takes the new port first: one still busy with another task (a %%px --noblock cell, an
            # apply_async) is named within Cluster._ask's bound, and an Interrupt while it waits frees it there.
            self.cluster.new_master_port()
            result = self.cluster.view.apply_async(_run_interruptibly, fn, args, kwargs)
            bound = self.cluster.request.run_timeout if timeout is None else timeout
            self.cluster.results = self._collect(result, bound)
        except KeyboardInterrupt:  # the notebook's Interrupt: stop the engines' run too, then say what happened
            if result is None:  # while the engines were asked for the port: _ask has freed them and says how
                raise
            raise KeyboardInterrupt(self._interrupt(result, _name(fn))) from None
        except (RankError, ClusterError):  # _collect has replaced the ranks it named, where any were left running
            raise
        except BaseException as exc:
            # Anything else that ends the wait while ranks still run (a caller's own time limit such as
            # pytest-timeout's, SystemExit) would leave them busy, and every later run would find them so:
            # replace them first, and say so on the way out.
            if result is not None and not result.ready() and not self.cluster._stopped:
                exc.add_note(f"{_name(fn)} was still running on the engines: {self._recover()}")
            raise
        return self.cluster.results[0]

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
        e, exc = self.cluster.engines[rank], failed[rank]
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
        ids = [e.engine_id for e in self.cluster.engines]
        waited = time.monotonic()
        for grace in (STOP_GRACE_S, FAILURE_GRACE_S):
            try:
                self.cluster.client.send_signal("SIGINT", targets=ids, block=True)
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
        self.cluster.results = outcomes
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

    def free(self, result, what: str, timed_out: bool) -> str:
        """After a %%px cell was interrupted (ipyparallel's magic has sent SIGINT to the engines) or ran past its bound:
        give the engines FAILURE_GRACE_S to stop, then replace those that did not (a rank waiting in C++, in a
        rendezvous or a collective, never sees SIGINT), naming them and what they wait for."""
        why = f"ran past run_timeout={self.cluster.request.run_timeout:g} s" if timed_out else "was interrupted"
        if result.wait(FAILURE_GRACE_S):
            return f"{what} {why}: SIGINT stopped it on every engine; {READY}"
        stuck, raised = self._stuck(result), self._raised(result)
        return (f"{what} {why} and did not stop within {FAILURE_GRACE_S:g} s of SIGINT on {stuck}"
                + (f" ({raised}, above)" if raised else "") + ". " + self._recover()
                + " Their variables are gone: run the cells that set them again.")

    def free_busy(self, waiting: list, what: str) -> str:
        """After an Interrupt while _ask waited for `waiting` ([(engine id, our call)]): SIGINT stops what keeps those
        engines busy (as ipyparallel's %%px magic does), and they take our call; those that do not within
        FAILURE_GRACE_S are replaced (_recover). One line says which."""
        if not waiting:  # the answers had just come
            return f"interrupted while the engines were asked for {what}; they had answered: {READY}"
        busy, ids = self.busy(waiting), [i for i, _ in waiting]
        deadline = time.monotonic() + FAILURE_GRACE_S
        try:
            self.cluster.client.send_signal("SIGINT", targets=ids, block=False)
            stopped = all(answer.wait(max(0.0, deadline - time.monotonic())) for _, answer in waiting)
        except KeyboardInterrupt:  # pressed again: replace them at once
            stopped = False
        except Exception as exc:  # noqa: BLE001 - an engine (or its nanny) is gone: replace them below
            log.warning("signalling the engines: %r", exc)
            stopped = False
        said = f"interrupted while waiting for the engines (asked: {what}): {busy}"
        it = "it" if len(waiting) == 1 else "them"
        if stopped:
            return f"{said}; SIGINT stopped {it}: {READY}"
        return f"{said}; SIGINT did not stop {it} within {FAILURE_GRACE_S:g} s. " + self._recover()

    def busy(self, waiting: list) -> str:
        """The engines of `waiting` ([(engine id, our call)]), each with what keeps it busy: the oldest task the
        controller has queued on it besides ours (a %%px cell's code, a function's name), how long ago it was sent,
        and how many wait behind it. From ipyparallel's queue_status and its task database (a controller
        started with NoDB keeps no tasks: then only how many)."""
        self.cluster._withdrawn &= self.cluster.client.outstanding  # those still queued behind a task
        ours = self.cluster._withdrawn | {msg_id for _, answer in waiting for msg_id in answer.msg_ids}
        ids = [i for i, _ in waiting]
        try:
            queues = self.cluster.client.queue_status(targets=ids, verbose=True)
            pending = {i: [m for m in queues[i]["queue"] + queues[i]["tasks"] if m not in ours] for i in ids}
        except Exception as exc:  # noqa: BLE001 - the description is a courtesy; the timeout stands without it
            log.warning("asking the controller for the engines' queues: %r", exc)
            pending = {i: [] for i in ids}
        records = {}
        first = [queue[0] for queue in pending.values() if queue]
        if first:
            with contextlib.suppress(Exception):
                records = {r["msg_id"]: r for r in self.cluster.client.db_query(
                    {"msg_id": {"$in": first}}, keys=["header", "content", "buffers", "submitted"])}
        parts = []
        for i in ids:
            e = self.engine(i)
            who = f"rank {e.rank} (engine {i}, pid {e.pid} on {e.host})" if e else f"engine {i}"
            queue = pending[i]
            if not queue:
                parts.append(f"{who}, which runs no other task: stuck in this call, or its process is stopped")
                continue
            behind = f", {len(queue) - 1} more queued behind it" if len(queue) > 1 else ""
            parts.append(f"{who} is busy with {_task(records.get(queue[0]))}{behind}")
        return "; ".join(parts)

    def engine(self, engine_id: int):
        """The EngineInfo of an engine id; None for one that has no rank yet (while the engines start)."""
        return next((e for e in self.cluster.engines if e.engine_id == engine_id), None)

    def _raised(self, result) -> str:
        """The errors of the ranks that finished before the others got stuck (often the cause: a rank that raised
        before the rendezvous), printed with their tracebacks, and named in one short phrase."""
        said = []
        for e, part in zip(self.cluster.engines, result.split()):
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
                         for e, part in zip(self.cluster.engines, parts) if not part.ready())

    def _waiting_for(self, e) -> str:
        """What a stuck engine waits for, from its TCP connections: a rendezvous (connected to the engines' MASTER_PORT)
        or an address where nobody listens. Engines on other hosts are not visible from here: ""."""
        import psutil
        if self.cluster.master_port is None or e.host != socket.gethostname():
            return ""
        where = f"{self.cluster.master_addr}:{self.cluster.master_port}"
        try:
            connected = any(c.raddr and c.raddr.port == self.cluster.master_port
                            for c in psutil.Process(e.pid).net_connections(kind="tcp"))
        except psutil.Error:
            return ""
        if connected:
            return f", in the rendezvous at {where}: connected, waiting for ranks that never arrived"
        try:
            socket.create_connection((self.cluster.master_addr, self.cluster.master_port), timeout=1).close()
            return ""
        except OSError:
            return f", trying to reach the rendezvous at {where}, where nobody listens"

    def _recover(self) -> str:
        """Replace the engines, or stop them all; say which."""
        if self.cluster.request.on_failure == "restart":
            try:
                self.cluster.restart()
                return "The engines were restarted (new processes); run again."
            except Exception as exc:  # a cluster that cannot restart is stopped, never left half alive
                log.warning("restarting the engines failed: %r", exc)
        self.cluster.stop()
        return "The engines were stopped; start a new cluster."


def bounded_magics(cluster):
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
            timer = threading.Timer(cluster.request.run_timeout, lambda: (timed_out.set(), _thread.interrupt_main()))
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
                    freed = cluster.runs.free(result, "the %%px cell", timed_out.is_set())
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


def _task(record: dict | None) -> str:
    """A task of the controller's database in a few words: a %%px cell's code (its start) or the function's name,
    and how long ago it was sent. The function is unpickled here, where it was pickled, not called."""
    if record is None:
        return "a task sent before"
    header = record.get("header") or {}
    if header.get("msg_type") == "execute_request":
        code = "; ".join(line.strip() for line in (record.get("content") or {}).get("code", "").splitlines()
                         if line.strip())
        what = f"the cell `{code if len(code) <= 60 else code[:57] + '...'}`"
    else:
        try:
            from ipyparallel.serialize import deserialize_object
            what = _name(deserialize_object(record["buffers"])[0])
        except Exception:  # noqa: BLE001 - a function this process cannot import, a database without buffers
            what = "a function sent by apply"
    try:
        from ipyparallel.util import utcnow
        return f"{what}, sent {(utcnow() - record['submitted']).total_seconds():.0f} s ago"
    except Exception:  # noqa: BLE001 - no date: the name alone
        return what


def _needs_mpi_ranks(fn) -> bool:
    """Whether fn's module says it finds its ranks through MPI (train_horovod's RANKS_FROM_MPI = True)."""
    return getattr(sys.modules.get(getattr(fn, "__module__", None) or ""), "RANKS_FROM_MPI", False) is True


# ------------------------------------------------------------------------------------------ on the engines
@dataclass
class Interrupted:
    """A rank's outcome when an Interrupt stopped its run at an agreed step (the trainer's Stopped message)."""
    message: str


def _run_interruptibly(fn, args: tuple, kwargs: dict):
    """On every engine, what run() runs: fn(*args, **kwargs), where the notebook's Interrupt (SIGINT, relayed by the
    engine's nanny) is a stop request, exactly a SIGTERM's: the flag the trainers look at every log_every steps
    (core.process.Sigterm, all-reduced by RunLog.step into the step's agreement), so every rank stops at the same
    step and rank 0 saves whole. A second SIGINT (the run did not stop in time, or fn never looks at the flag) is a
    KeyboardInterrupt."""
    def stop_request(signum, frame):
        if Sigterm.request():
            raise KeyboardInterrupt

    Sigterm.clear()
    previous = signal.signal(signal.SIGINT, stop_request)
    try:
        return fn(*args, **kwargs)
    except Stopped as exc:
        if not Sigterm.received:  # fn's own Stopped, not ours
            raise
        return Interrupted(str(exc))
    finally:
        signal.signal(signal.SIGINT, previous)
        Sigterm.clear()
