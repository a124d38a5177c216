"""Run a training script as it is, on every rank, and write down what the rank did: `tutorial check-ddp`'s eyes.

    torchrun --standalone --nproc_per_node 2 -m tutorial.launch.rank_recorder SCRIPT [ARGS...]

runs SCRIPT as `__main__` with ARGS. Recorders watch the calls a DDP script makes and call the originals, so nothing
the script does changes: init/destroy_process_group, the collectives it calls itself, DistributedSampler (its order
each epoch and set_epoch), every DataLoader epoch (the indices it drew, the dataset it read), DDP (where it wraps,
each forward inside or outside no_sync), optimizer steps (counted by a global hook; the first step's learning rate
and weights), torch.save and files opened for writing, print (lines with a loss or an accuracy), and random numbers
drawn while a batch is fetched (augmentation). At the end it writes $TUTORIAL_CHECK_DIR/rank<R>.json; while it runs,
a thread keeps rank<R>.progress.json up to date (steps, and the line the rank is at), which is all a rank that hangs
or is killed leaves. Each record names the line of the script that made the call. tutorial.launch.check_ddp reads
these reports; notebook 03's capstone checker reads the same ones.

The run is bounded: $TUTORIAL_CHECK_MAX_STEPS optimizer steps, and rank 0 asks every rank to stop at its next step
(a file in the folder) once $TUTORIAL_CHECK_MAX_SECONDS have passed. Every rank stops after the same step, so the
collectives still pair up, and the report says the end of the script did not run.
"""
from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import re
import runpy
import sys
import threading
import time

from ..core.config import first_line

DIR_VARIABLE = "TUTORIAL_CHECK_DIR"
MAX_STEPS_VARIABLE, MAX_SECONDS_VARIABLE = "TUTORIAL_CHECK_MAX_STEPS", "TUTORIAL_CHECK_MAX_SECONDS"
LR_PROBE_VARIABLE = "TUTORIAL_CHECK_LR_PROBE"  # "1": stop before the first optimizer step (the one-process lr run)
# A folder: rank 0 forks the one-process run there before the script starts (torch is imported already, so it costs
# no interpreter start), with world size 1: its first step's learning rate is the script's rate for one process.
LR_PROBE_DIR_VARIABLE = "TUTORIAL_CHECK_LR_PROBE_DIR"
CWD_VARIABLE = "TUTORIAL_CHECK_CWD"  # the script runs there, so that its relative writes land in the scratch folder
PROGRESS_S = 0.5  # how often the progress file is refreshed
KEEP_EPOCHS = 3  # a loader's or sampler's order is kept for its first epochs (enough to compare two)
KEEP_LINES = 200  # printed metric lines kept per rank
FETCHES_WATCHED = 20  # batches per process whose fetch is watched for random draws (augmentation draws in each)
METRIC = re.compile(r"\b(loss|acc|accuracy|top-?[15]|perplexity|ppl|f1|mse|mae|rmse)\b[^\d\n]{0,16}?"
                    r"[-+]?\d*\.\d+|\b(loss|acc|accuracy)\b[^\d\n]{0,16}?\d+(\.\d+)?\s*%", re.I)
REDUCING = ("all_reduce", "reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "gather",
            "gather_object", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced")


class StopRun(SystemExit):
    """Raised by the step hook in every rank after the same step: the bound of the check is reached."""


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Recorder:
    def __init__(self, script: str, folder: str):
        self.script, self.folder = os.path.abspath(script), folder
        self.script_dir = os.path.dirname(self.script)
        self.rank = int(os.environ.get("RANK", "0"))
        self.started = time.monotonic()
        self.max_steps = int(os.environ.get(MAX_STEPS_VARIABLE) or 0) or None
        self.max_seconds = float(os.environ.get(MAX_SECONDS_VARIABLE) or 0) or None
        self.lr_probe = os.environ.get(LR_PROBE_VARIABLE) == "1"
        self.stop_file = os.path.join(folder, "stop")
        self.report = {"rank": self.rank, "pid": os.getpid(), "world_size_env": int(os.environ.get("WORLD_SIZE", 1)),
                       "end": None, "init": [], "world_size": None, "destroyed": 0, "pg_alive_at_end": None,
                       "samplers": {}, "loaders": {}, "ddp": [], "optimizers": [], "steps": 0, "train_forwards": 0,
                       "lrs": [],
                       "sync_forwards": [], "forward_where": None, "writes": [], "write_paths": [],
                       "wrapper_saves": [], "metric_lines": [], "reductions": 0, "aug": None}
        self._ddp, self._optimizers, self._samplers, self._loaders = [], {}, {}, {}
        self._forwards_since_step, self._batches, self._last_loader, self._reductions_at_batch = 0, 0, None, 0
        self._fetches_left = FETCHES_WATCHED
        self._keep = []  # the samplers and loaders recorded, kept alive so that their ids stay theirs
        self._stop_at = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ where in the script
    def where(self, frame=None) -> str | None:
        """'line N: code' of the innermost frame of the script (or of a file beside it) on the current stack."""
        f = frame or sys._getframe(1)
        fallback = None
        while f is not None:
            name = f.f_code.co_filename
            if name == self.script:
                return self._describe(name, f.f_lineno)
            if fallback is None and os.path.dirname(name) == self.script_dir:
                fallback = self._describe(name, f.f_lineno)
            f = f.f_back
        return fallback

    def _describe(self, filename: str, lineno: int) -> str:
        import linecache
        return f"{filename}:{lineno}: {linecache.getline(filename, lineno).strip()}"

    def user_called(self) -> bool:
        """The caller of the recorded function is not torch itself (DDP's own collectives are not the script's)."""
        return f"{os.sep}torch{os.sep}" not in sys._getframe(2).f_code.co_filename

    # ------------------------------------------------------------------------------------------------- recorders
    def install(self) -> None:
        import torch
        import torch.distributed as dist
        import torch.utils.data._utils.fetch as fetch
        from torch.nn.parallel import DistributedDataParallel
        from torch.optim.optimizer import (Optimizer, register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        from torch.utils.data import DataLoader
        from torch.utils.data.dataloader import _BaseDataLoaderIter
        from torch.utils.data.distributed import DistributedSampler
        rec, report = self, self.report

        def wrap(owner, name, make):
            setattr(owner, name, make(getattr(owner, name)))

        def init_process_group(original):
            def recording(*args, **kwargs):
                where = rec.where()
                result = original(*args, **kwargs)
                report["init"].append({"where": where, "backend": str(dist.get_backend())})
                report["world_size"] = dist.get_world_size()
                return result
            return recording

        def destroy_process_group(original):
            def recording(*args, **kwargs):
                report["destroyed"] += 1
                return original(*args, **kwargs)
            return recording

        for module in (dist, dist.distributed_c10d):
            wrap(module, "init_process_group", init_process_group)
            wrap(module, "destroy_process_group", destroy_process_group)

        def collective(original):
            def recording(*args, **kwargs):
                if rec.user_called():
                    report["reductions"] += 1
                return original(*args, **kwargs)
            return recording

        for name in REDUCING:
            if hasattr(dist, name):
                wrap(dist, name, collective)

        def sampler_iter(original):
            def recording(self):
                order = list(original(self))
                key = rec._key(rec._samplers, self)
                entry = report["samplers"].setdefault(key, {
                    "shuffle": bool(self.shuffle), "orders": [], "epochs": 0, "set_epoch_calls": 0,
                    "iterations": [], "where": []})
                entry["epochs"] += 1
                entry["set_epoch_calls"] = getattr(self, "_check_ddp_set_epoch_calls", 0)
                if len(entry["orders"]) < KEEP_EPOCHS:
                    entry["orders"].append(order)
                if len(entry["iterations"]) >= 50:
                    return iter(order)
                # An iteration that reaches its end is an epoch; a peek (next(iter(loader))) is not.
                this = {"epoch": self.epoch, "order": hash(tuple(order)), "complete": False, "where": rec.where()}
                entry["iterations"].append(this)

                def watched():
                    yield from order
                    this["complete"] = True
                return watched()
            return recording

        def set_epoch(original):
            def recording(self, epoch):
                self._check_ddp_set_epoch_calls = getattr(self, "_check_ddp_set_epoch_calls", 0) + 1
                return original(self, epoch)
            return recording

        wrap(DistributedSampler, "__iter__", sampler_iter)
        wrap(DistributedSampler, "set_epoch", set_epoch)

        def loader_iter(original):
            def recording(self):
                it = original(self)
                key = rec._key(rec._loaders, self)
                entry = report["loaders"].get(key)
                if entry is None:
                    entry = report["loaders"][key] = {
                        "sampler": type(self.sampler).__name__,
                        "dataset": rec._fingerprint(self.dataset), "epochs": [], "n_epochs": 0, "trained": False,
                        "where": rec.where(), **rec._sharding(self)}
                entry["n_epochs"] += 1
                indices = [] if len(entry["epochs"]) < KEEP_EPOCHS else None
                if indices is not None:
                    entry["epochs"].append(indices)
                it._check_ddp = (key, indices)
                return it
            return recording

        def next_index(original):
            def recording(self):
                index = original(self)
                _, indices = getattr(self, "_check_ddp", (None, None))
                if indices is not None:
                    indices.extend(index if isinstance(index, list) else [index])
                return index
            return recording

        def loader_next(original):
            def recording(self):
                batch = original(self)
                key, _ = getattr(self, "_check_ddp", (None, None))
                rec._last_loader, rec._batches, rec._reductions_at_batch = key, rec._batches + 1, report["reductions"]
                return batch
            return recording

        wrap(DataLoader, "__iter__", loader_iter)
        wrap(_BaseDataLoaderIter, "_next_index", next_index)
        wrap(_BaseDataLoaderIter, "__next__", loader_next)

        def fetch_batch(original):  # a random draw while fetching a batch is augmentation
            def recording(self, index):
                if rec._fetches_left <= 0:  # seen (or augmentation would have drawn in the first batches)
                    return original(self, index)
                rec._fetches_left -= 1
                before = rec._rng_states()
                data = original(self, index)
                after = rec._rng_states()
                if before != after:  # the states of the generators it drew from, before the draw
                    rec._fetches_left = 0
                    rec._note_augmentation("/".join(hashlib.sha256(repr(b).encode()).hexdigest()[:16]
                                                    for b, a in zip(before, after) if a != b))
                return data
            return recording

        wrap(fetch._MapDatasetFetcher, "fetch", fetch_batch)

        def ddp_init(original):
            def recording(self, module, *args, **kwargs):
                original(self, module, *args, **kwargs)
                rec._ddp.append(self)
                report["ddp"].append({"where": rec.where(), "parameters": sum(1 for _ in module.parameters())})
            return recording

        def ddp_forward(original):
            def recording(self, *args, **kwargs):
                if torch.is_grad_enabled() and self.training:
                    report["train_forwards"] += 1
                if torch.is_grad_enabled() and self.training and self.require_backward_grad_sync:
                    rec._forwards_since_step += 1
                    if report["forward_where"] is None:
                        report["forward_where"] = rec.where()
                return original(self, *args, **kwargs)
            return recording

        wrap(DistributedDataParallel, "__init__", ddp_init)
        wrap(DistributedDataParallel, "forward", ddp_forward)

        def optimizer_init(original):
            def recording(self, *args, **kwargs):
                original(self, *args, **kwargs)
                rec._optimizers[id(self)] = {"where": rec.where(), "object": self, "index": None}
            return recording

        wrap(Optimizer, "__init__", optimizer_init)
        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._after_step)

        save, open_, io_open = torch.save, builtins.open, io.open

        def recording_save(obj, f, *args, **kwargs):
            rec._note_write(f, "w")
            if rec._wrapper_keys(obj):
                report["wrapper_saves"].append({"path": rec._path(f), "where": rec.where()})
            return save(obj, f, *args, **kwargs)

        def recording_open(file, mode="r", *args, **kwargs):
            rec._note_write(file, mode)
            return open_(file, mode, *args, **kwargs)

        def recording_io_open(file, mode="r", *args, **kwargs):  # pathlib's write_text goes through io.open
            rec._note_write(file, mode)
            return io_open(file, mode, *args, **kwargs)

        torch.save, builtins.open, io.open = recording_save, recording_open, recording_io_open
        import logging
        logging.FileHandler._builtin_open = staticmethod(recording_open)
        self._open = open_
        print_ = builtins.print

        def recording_print(*args, **kwargs):
            if kwargs.get("file") in (None, sys.stdout, sys.stderr) and len(report["metric_lines"]) < KEEP_LINES:
                text = " ".join(str(a) for a in args)
                if METRIC.search(text):  # from a shard of the data (the last batch was), not reduced since?
                    loader = report["loaders"].get(rec._last_loader) or {}
                    report["metric_lines"].append({
                        "text": text[:200], "where": rec.where(), "sharded": bool(loader.get("distributed")),
                        "reduced_since_batch": report["reductions"] > rec._reductions_at_batch})
            return print_(*args, **kwargs)

        builtins.print = recording_print

    # ------------------------------------------------------------------------------------------------- details
    def _key(self, keys: dict, obj) -> str:
        if id(obj) not in keys:
            keys[id(obj)] = str(len(keys))
            self._keep.append(obj)
        return keys[id(obj)]

    def _sharding(self, loader) -> dict:
        """A DistributedSampler's rank and world size, and how many samples it repeats to even out the ranks."""
        from torch.utils.data.distributed import DistributedSampler
        s = next((s for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
                  if isinstance(s, DistributedSampler)), None)
        if s is None:
            return {"distributed": False, "padding": 0}
        return {"distributed": True, "padding": max(0, s.total_size - len(s.dataset)), "sampler_rank": s.rank,
                "num_replicas": s.num_replicas}

    def _fingerprint(self, dataset) -> list:
        """What tells the ranks' datasets apart without reading a sample (which could draw random numbers)."""
        from torch.utils.data import Subset
        try:
            size = len(dataset)
        except TypeError:
            size = None
        if isinstance(dataset, Subset):
            indices = list(dataset.indices)
            return ["Subset", size, hashlib.sha256(repr(indices).encode()).hexdigest()[:16],
                    self._fingerprint(dataset.dataset)]
        tensors = getattr(dataset, "tensors", None)
        if tensors is None and hasattr(dataset, "data") and hasattr(dataset.data, "__len__"):
            tensors = (dataset.data,)
        digest = None
        try:
            import torch
            if tensors is not None:
                tensors = [torch.as_tensor(t) for t in tensors]
                digest = _digest([t[:: max(1, len(t) // 64)] for t in tensors])
        except Exception:  # noqa: BLE001 - a dataset we cannot read cheaply is told apart by type and size only
            digest = None
        return [type(dataset).__name__, size, digest]

    def _rng_states(self) -> tuple:
        """The global generators' states (torch, random, numpy if imported), compared raw: hashed only on a draw."""
        import random

        import torch
        states = [torch.random.get_rng_state().numpy().tobytes(), random.getstate()]
        if "numpy" in sys.modules:
            state = sys.modules["numpy"].random.get_state()
            states.append((state[1].tobytes(), state[2]))
        return tuple(states)

    def _note_augmentation(self, before: str) -> None:
        from torch.utils.data import get_worker_info
        info = get_worker_info()
        record = {"state": before, "worker": info.id if info else None, "where": self.where()}
        if info is None:
            if self.report["aug"] is None:
                self.report["aug"] = record
            return
        path = os.path.join(self.folder, f"rank{self.rank}.worker{info.id}.aug.json")
        if not getattr(self, "_aug_written", False):  # a worker process: its own file, once
            self._aug_written = True
            self._write(path, record)

    def _path(self, f) -> str | None:
        return os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else None

    def _note_write(self, f, mode) -> None:
        path = self._path(f)
        if path is None or not any(m in mode for m in "wax+") or path.startswith("/dev/"):  # (ours: the original open)
            return
        where = self.where()
        if where is None:  # written by a library on its own, not by the script
            return
        with self._lock:
            if path not in (w["path"] for w in self.report["write_paths"]):
                self.report["write_paths"].append({"path": path, "where": where})
                self.report["writes"].append(os.path.basename(path))

    def _wrapper_keys(self, obj, depth: int = 0) -> bool:
        """A state_dict of the DDP wrapper (every key starts with 'module.'), or a dict holding one."""
        if not isinstance(obj, dict) or not obj or depth > 2:
            return False
        if all(isinstance(k, str) and k.startswith("module.") for k in obj):
            return True
        return any(self._wrapper_keys(v, depth + 1) for v in obj.values())

    def _ddp_parameters(self) -> set[int]:
        return {id(p) for model in self._ddp for p in model.module.parameters()}

    def _checksums(self) -> dict:
        """Digests of every DDP model's parameters, and of the parameters the optimizers update outside DDP."""
        inside = self._ddp_parameters()
        sums = {f"ddp{i}": _digest(list(model.module.parameters())) for i, model in enumerate(self._ddp)}
        for entry in self._optimizers.values():
            if entry["index"] is None:
                continue
            outside = [p for g in entry["object"].param_groups for p in g["params"] if id(p) not in inside]
            if outside and self.report["optimizers"][entry["index"]]["outside_ddp"]:
                sums[f"optimizer{entry['index']}"] = _digest(outside)
        return sums

    def _before_step(self, optimizer, args, kwargs) -> None:
        entry = self._optimizers.setdefault(id(optimizer), {"where": None, "object": optimizer, "index": None})
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

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.report["steps"] += 1
        steps = self.report["steps"]
        if len(self.report["sync_forwards"]) < 100:
            self.report["sync_forwards"].append(self._forwards_since_step)
        self._forwards_since_step = 0
        if self._last_loader is not None:  # the loader that gave the last batch is a training loader
            self.report["loaders"][self._last_loader]["trained"] = True
        if self.max_steps and steps >= self.max_steps:
            self._stop(f"--max-steps {self.max_steps}")
        if self._stop_at is None and os.path.exists(self.stop_file):
            with self._open(self.stop_file) as f:
                self._stop_at = int(f.read().strip() or 0)
        if self._stop_at is not None and steps >= self._stop_at:
            self._stop(f"--max-seconds {self.max_seconds:g}")
        if self.rank == 0 and self.max_seconds and self._stop_at is None \
                and time.monotonic() - self.started > self.max_seconds:
            # The other ranks are at most one step ahead (their next backward waits for ours): all stop after the next.
            self._stop_at = steps + 1
            self._write(self.stop_file, self._stop_at, raw=True)

    def _stop(self, reason: str) -> None:
        self.report["end"] = "stopped"
        self.report["stop_reason"] = reason
        raise StopRun(0)

    # ----------------------------------------------------------------------------------------- reports and progress
    def _write(self, path: str, data, raw: bool = False) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with self._open(tmp, "w") as f:
            f.write(str(data) if raw else json.dumps(data))
        os.replace(tmp, path)

    def progress(self) -> None:
        """Every PROGRESS_S: steps, batches and where the main thread is. `changed`: when the counts last moved;
        `still`: since when the chain of functions has not moved (a rank waiting in a collective stands still, and
        so does one polling in a loop; one importing modules does not); `in_collective`: the innermost frame is in
        torch.distributed or autograd (a backward waits there for DDP's all-reduce)."""
        main_id, counts, stack, changed, still = threading.main_thread().ident, None, None, time.time(), time.time()
        path = os.path.join(self.folder, f"rank{self.rank}.progress.json")
        while True:
            frame = sys._current_frames().get(main_id)
            now_stack, f = [], frame
            while f is not None and len(now_stack) < 60:
                now_stack.append((f.f_code.co_filename, f.f_code.co_name))  # a polling loop's lines move, not it
                f = f.f_back
            now_counts = (self.report["steps"], self.report["train_forwards"], self._batches)
            if now_counts != counts:
                counts, changed = now_counts, time.time()
            if now_stack != stack:
                stack, still = now_stack, time.time()
            inner = stack[0][0] if stack else ""
            try:  # written every time: `beat` shows that this thread runs (a C call holding the GIL stops it)
                self._write(path, {"rank": self.rank, "pid": os.getpid(), "steps": self.report["steps"],
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
        self._write(os.path.join(self.folder, f"rank{self.rank}.json"), self.report)


def _error_where(rec: Recorder, exc: BaseException) -> str | None:
    tb, found = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == rec.script:
            found = rec._describe(rec.script, tb.tb_lineno)
        tb = tb.tb_next
    return found


def run(argv: list[str], folder: str) -> None:
    """Run argv[0] as __main__ with argv[1:], recorded; write the rank's report into `folder` at the end."""
    if not argv:
        raise SystemExit("usage: python -m tutorial.launch.rank_recorder SCRIPT [ARGS...]")
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
