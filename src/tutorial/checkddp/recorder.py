"""Run a training script as it is, on every rank, and write down what the rank did: `tutorial check-ddp`'s eyes.

    torchrun --standalone --nproc_per_node 2 -m tutorial.checkddp.recorder SCRIPT [ARGS...]

runs SCRIPT as `__main__` with ARGS. The patchers (tutorial.checkddp.patchers, one per API) watch the calls a DDP
script makes and call the originals, so nothing the script does changes: init/destroy_process_group, the collectives
it calls itself, DistributedSampler (its order each epoch and set_epoch), every DataLoader epoch (the indices it
drew, the dataset it read), DDP (where it wraps, each forward inside or outside no_sync), optimizer steps (counted by
a global hook; the first step's learning rate and weights), torch.save and files opened for writing, print (lines
with a loss or an accuracy), and random numbers drawn while a batch is fetched (augmentation). At the end it writes
$TUTORIAL_CHECK_DIR/rank<R>.json (REPORT_FILE); while it runs, a thread keeps rank<R>.progress.json (PROGRESS_FILE)
up to date (steps, and the line the rank is at), which is all a rank that hangs or is killed leaves. Each record
names the line of the script that made the call. tutorial.checkddp.findings reads these reports; notebook 03's
capstone checker reads the same ones.

The run is bounded: $TUTORIAL_CHECK_MAX_STEPS optimizer steps, and rank 0 asks every rank to stop at its next step
(STOP_FILE in the folder) once $TUTORIAL_CHECK_MAX_SECONDS have passed. Every rank stops after the same step, so the
collectives still pair up, and the report says the end of the script did not run.
"""
from __future__ import annotations

import builtins
import json
import os
import runpy
import sys
import threading
import time

from ..core.config import first_line
from . import patchers
from .patchers import digest, path_of

DIR_VARIABLE = "TUTORIAL_CHECK_DIR"
MAX_STEPS_VARIABLE, MAX_SECONDS_VARIABLE = "TUTORIAL_CHECK_MAX_STEPS", "TUTORIAL_CHECK_MAX_SECONDS"
LR_PROBE_VARIABLE = "TUTORIAL_CHECK_LR_PROBE"  # "1": stop before the first optimizer step (the one-process lr run)
# A folder: rank 0 forks the one-process run there before the script starts (torch is imported already, so it costs
# no interpreter start), with world size 1: its first step's learning rate is the script's rate for one process.
LR_PROBE_DIR_VARIABLE = "TUTORIAL_CHECK_LR_PROBE_DIR"
CWD_VARIABLE = "TUTORIAL_CHECK_CWD"  # the script runs there, so that its relative writes land in the scratch folder
# The files a rank writes in its folder (tutorial.checkddp.run reads them): str.format with the rank (and worker).
REPORT_FILE, PROGRESS_FILE = "rank{}.json", "rank{}.progress.json"
AUGMENTATION_FILE = "rank{}.worker{}.aug.json"  # a loader worker's first random draw while fetching
STOP_FILE = "stop"  # rank 0 writes the step after which every rank stops
PROGRESS_S = 0.5  # how often the progress file is refreshed


class StopRun(SystemExit):
    """Raised by the step hook in every rank after the same step: the bound of the check is reached."""


class Recorder:
    """One rank's report, and the state the patchers share while the script runs."""

    def __init__(self, script: str, folder: str):
        self.script, self.folder = os.path.abspath(script), folder
        self.script_dir = os.path.dirname(self.script)
        self.rank = int(os.environ.get("RANK", "0"))
        self.started = time.monotonic()
        self.max_steps = int(os.environ.get(MAX_STEPS_VARIABLE) or 0) or None
        self.max_seconds = float(os.environ.get(MAX_SECONDS_VARIABLE) or 0) or None
        self.lr_probe = os.environ.get(LR_PROBE_VARIABLE) == "1"
        self.stop_file = os.path.join(folder, STOP_FILE)
        self.report = {"rank": self.rank, "pid": os.getpid(), "world_size_env": int(os.environ.get("WORLD_SIZE", 1)),
                       "end": None, "init": [], "world_size": None, "destroyed": 0, "pg_alive_at_end": None,
                       "samplers": {}, "loaders": {}, "ddp": [], "optimizers": [], "steps": 0, "train_forwards": 0,
                       "lrs": [],
                       "sync_forwards": [], "forward_where": None, "writes": [], "write_paths": [],
                       "wrapper_saves": [], "metric_lines": [], "reductions": 0, "aug": None}
        self.ddp_models, self.optimizers, self.sampler_keys, self.loader_keys = [], {}, {}, {}
        self.forwards_since_step, self.batches, self.last_loader, self.reductions_at_batch = 0, 0, None, 0
        self.fetches_left = patchers.FETCHES_WATCHED
        self.keep = []  # the samplers and loaders recorded, kept alive so that their ids stay theirs
        self.stop_at = None
        self.lock = threading.Lock()
        self.original_open = builtins.open  # the original, for the recorder's own files (the script's open is recorded)
        self.augmentation_written = False

    def install(self) -> None:
        patchers.install(self)
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        register_optimizer_step_pre_hook(self.before_step)
        register_optimizer_step_post_hook(self.after_step)

    # ---------------------------------------------------------------------------------------------- where in the script
    def where(self, frame=None) -> str | None:
        """'line N: code' of the innermost frame of the script (or of a file beside it) on the current stack."""
        f = frame or sys._getframe(1)
        fallback = None
        while f is not None:
            name = f.f_code.co_filename
            if name == self.script:
                return self.describe(name, f.f_lineno)
            if fallback is None and os.path.dirname(name) == self.script_dir:
                fallback = self.describe(name, f.f_lineno)
            f = f.f_back
        return fallback

    def describe(self, filename: str, lineno: int) -> str:
        import linecache
        return f"{filename}:{lineno}: {linecache.getline(filename, lineno).strip()}"

    def user_called(self) -> bool:
        """The caller of the recorded function is not torch itself (DDP's own collectives are not the script's)."""
        return f"{os.sep}torch{os.sep}" not in sys._getframe(2).f_code.co_filename

    # ------------------------------------------------------------------------------------------- what the patchers note
    def key(self, keys: dict, obj) -> str:
        if id(obj) not in keys:
            keys[id(obj)] = str(len(keys))
            self.keep.append(obj)
        return keys[id(obj)]

    def note_augmentation(self, before: str) -> None:
        from torch.utils.data import get_worker_info
        info = get_worker_info()
        record = {"state": before, "worker": info.id if info else None, "where": self.where()}
        if info is None:
            if self.report["aug"] is None:
                self.report["aug"] = record
            return
        if not self.augmentation_written:  # a worker process: its own file, once
            self.augmentation_written = True
            self.write(os.path.join(self.folder, AUGMENTATION_FILE.format(self.rank, info.id)), record)

    def note_write(self, f, mode) -> None:
        path = path_of(f)
        if path is None or not any(m in mode for m in "wax+") or path.startswith("/dev/"):  # (ours: the original open)
            return
        where = self.where()
        if where is None:  # written by a library on its own, not by the script
            return
        with self.lock:
            if path not in (w["path"] for w in self.report["write_paths"]):
                self.report["write_paths"].append({"path": path, "where": where})
                self.report["writes"].append(os.path.basename(path))

    # -------------------------------------------------------------------------------------------------- optimizer steps
    def before_step(self, optimizer, args, kwargs) -> None:
        entry = self.optimizers.setdefault(id(optimizer), {"where": None, "object": optimizer, "index": None})
        if entry["index"] is not None:
            return
        entry["index"] = len(self.report["optimizers"])
        group = optimizer.param_groups[0]
        lr = float(group.get("initial_lr", group.get("lr", float("nan"))))  # a scheduler's warm-up starts lower
        inside = self._ddp_parameters()
        outside = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in inside]
        if any(type(p).__name__ in ("FlatParameter", "DTensor") or getattr(p, "_is_sharded", False) for p in outside):
            outside = []  # FSDP's or a DeviceMesh's shards: different on every rank by design, not compared
        self.report["lrs"].append(float(group.get("lr", float("nan"))))
        record = {"where": entry["where"], "type": type(optimizer).__name__, "lr": lr, "outside_ddp": len(outside),
                  "outside_shapes": [list(p.shape) for p in outside[:3]]}
        self.report["optimizers"].append(record)
        record["first"] = self._checksums()  # the weights the first step starts from
        if self.lr_probe:
            self.report["end"] = "lr-probe"
            raise StopRun(0)

    def after_step(self, optimizer, args, kwargs) -> None:
        self.report["steps"] += 1
        steps = self.report["steps"]
        if len(self.report["sync_forwards"]) < 100:
            self.report["sync_forwards"].append(self.forwards_since_step)
        self.forwards_since_step = 0
        if self.last_loader is not None:  # the loader that gave the last batch is a training loader
            self.report["loaders"][self.last_loader]["trained"] = True
        if self.max_steps and steps >= self.max_steps:
            self._stop(f"--max-steps {self.max_steps}")
        if self.stop_at is None and os.path.exists(self.stop_file):
            with self.original_open(self.stop_file) as f:
                self.stop_at = int(f.read().strip() or 0)
        if self.stop_at is not None and steps >= self.stop_at:
            self._stop(f"--max-seconds {self.max_seconds:g}")
        if self.rank == 0 and self.max_seconds and self.stop_at is None \
                and time.monotonic() - self.started > self.max_seconds:
            # The other ranks are at most one step ahead (their next backward waits for ours): all stop after the next.
            self.stop_at = steps + 1
            self.write(self.stop_file, self.stop_at, raw=True)

    def _stop(self, reason: str) -> None:
        self.report["end"] = "stopped"
        self.report["stop_reason"] = reason
        raise StopRun(0)

    def _ddp_parameters(self) -> set[int]:
        return {id(p) for model in self.ddp_models for p in model.module.parameters()}

    def _checksums(self) -> dict:
        """Digests of every DDP model's parameters, and of the parameters the optimizers update outside DDP."""
        inside = self._ddp_parameters()
        sums = {f"ddp{i}": digest(list(model.module.parameters())) for i, model in enumerate(self.ddp_models)}
        for entry in self.optimizers.values():
            if entry["index"] is None:
                continue
            outside = [p for g in entry["object"].param_groups for p in g["params"] if id(p) not in inside]
            if outside and self.report["optimizers"][entry["index"]]["outside_ddp"]:
                sums[f"optimizer{entry['index']}"] = digest(outside)
        return sums

    # --------------------------------------------------------------------------------------------- reports and progress
    def write(self, path: str, data, raw: bool = False) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with self.original_open(tmp, "w") as f:
            f.write(str(data) if raw else json.dumps(data))
        os.replace(tmp, path)

    def progress(self) -> None:
        """Every PROGRESS_S: steps, batches and where the main thread is. `changed`: when the counts last moved;
        `still`: since when the chain of functions has not moved (a rank waiting in a collective stands still, and
        so does one polling in a loop; one importing modules does not); `in_collective`: the innermost frame is in
        torch.distributed or autograd (a backward waits there for DDP's all-reduce)."""
        main_id, counts, stack, changed, still = threading.main_thread().ident, None, None, time.time(), time.time()
        path = os.path.join(self.folder, PROGRESS_FILE.format(self.rank))
        while True:
            frame = sys._current_frames().get(main_id)
            now_stack, f = [], frame
            while f is not None and len(now_stack) < 60:
                now_stack.append((f.f_code.co_filename, f.f_code.co_name))  # a polling loop's lines move, not it
                f = f.f_back
            now_counts = (self.report["steps"], self.report["train_forwards"], self.batches)
            if now_counts != counts:
                counts, changed = now_counts, time.time()
            if now_stack != stack:
                stack, still = now_stack, time.time()
            inner = stack[0][0] if stack else ""
            try:  # written every time: `beat` shows that this thread runs (a C call holding the GIL stops it)
                self.write(path, {"rank": self.rank, "pid": os.getpid(), "steps": self.report["steps"],
                                  "train_forwards": self.report["train_forwards"], "changed": changed,
                                  "still": still, "beat": time.time(), "where": self.where(frame) if frame else None,
                                  "in_collective": any(f"{os.sep}torch{os.sep}{room}{os.sep}" in inner
                                                       for room in ("distributed", "autograd"))})
            except OSError:
                pass
            time.sleep(PROGRESS_S)

    def finish(self, end: str, error: str | None = None, error_where: str | None = None) -> None:
        if self.report["end"] is None or end == "error":
            self.report["end"] = end
        if error:
            self.report["error"], self.report["error_where"] = error, error_where
        try:
            import torch.distributed as dist
            self.report["pg_alive_at_end"] = dist.is_available() and dist.is_initialized()
            self.report["checksums"] = self._checksums()
        except Exception as exc:  # noqa: BLE001 - the report is written whatever the script left behind
            self.report["checksums_error"] = f"{type(exc).__name__}: {exc}"
        self.write(os.path.join(self.folder, REPORT_FILE.format(self.rank)), self.report)


def _error_where(rec: Recorder, exc: BaseException) -> str | None:
    tb, found = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == rec.script:
            found = rec.describe(rec.script, tb.tb_lineno)
        tb = tb.tb_next
    return found


def run(argv: list[str], folder: str) -> None:
    """Run argv[0] as __main__ with argv[1:], recorded; write the rank's report into `folder` at the end."""
    if not argv:
        raise SystemExit("usage: python -m tutorial.checkddp.recorder SCRIPT [ARGS...]")
    import torch  # noqa: F401 - before the fork below, so that the one-process run starts with it imported
    probe = os.environ.get(LR_PROBE_DIR_VARIABLE)
    if probe and os.environ.get("RANK", "0") == "0" and os.fork() == 0:
        _lr_probe(argv, probe)
    rec = Recorder(argv[0], os.path.abspath(folder))
    rec.install()
    threading.Thread(target=rec.progress, daemon=True, name="check-ddp-progress").start()
    if os.environ.get(CWD_VARIABLE):
        os.chdir(os.environ[CWD_VARIABLE])
    sys.argv = [rec.script, *argv[1:]]
    sys.path.insert(0, rec.script_dir)  # as `python SCRIPT` would: the script's own modules import
    try:
        runpy.run_path(rec.script, run_name="__main__")
    except StopRun:
        rec.finish(rec.report["end"] or "stopped")
        return
    except SystemExit as exc:
        if exc.code not in (None, 0):
            rec.finish("error", f"SystemExit: {exc.code}", _error_where(rec, exc))
            raise
        rec.finish("finished")
        raise
    except BaseException as exc:
        rec.finish("error", f"{type(exc).__name__}: {first_line(exc, 200)}", _error_where(rec, exc))
        raise
    rec.finish("finished")


def _lr_probe(argv: list[str], folder: str) -> None:
    """In the forked child: the script alone (world size 1, its own rendezvous), up to its first optimizer step."""
    from ..core.distributed import hold_port
    code = 1
    try:
        for name in ("TORCHELASTIC_USE_AGENT_STORE", LR_PROBE_DIR_VARIABLE, MAX_STEPS_VARIABLE, MAX_SECONDS_VARIABLE):
            os.environ.pop(name, None)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                          ROLE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(hold_port()),
                          **{LR_PROBE_VARIABLE: "1", CWD_VARIABLE: os.path.join(folder, "run")})
        run(argv, os.path.join(folder, "ranks"))
        code = 0
    except BaseException:  # noqa: BLE001 - the probe's own failure is in its report; it never returns to the rank
        pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    # The script's own exit code, without the interpreter's teardown (core.process.exit_process): a rank that
    # finished and was recorded could still abort there (SIGABRT, pytorch issue 190489; seen in CI on 2026-11-27
    # under load), and torchrun then stops the other ranks mid-run, which check-ddp would read as their mistake.
    from ..core.process import exit_process
    code = 0
    try:
        run(sys.argv[1:], os.environ.get(DIR_VARIABLE, "."))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the script's error: its traceback, as Python would print it
        import traceback
        traceback.print_exc()
        code = 1
    exit_process(code)
