"""`tutorial check-ddp SCRIPT [-- ARGS]`: run your own DDP training script under torchrun, unchanged, and say what is
wrong with it, from what its ranks did.

    tutorial check-ddp train.py -- --epochs 2            # 2 ranks; the CPU (gloo) unless there is a GPU per rank
    tutorial check-ddp train.py --nproc 4 --max-seconds 300 --max-steps 500 --out /tmp/check

Each rank runs under tutorial.launch.rank_recorder, which watches the calls the script makes (process group,
samplers, loaders, DDP, optimizer steps, saves, prints) without changing them. From the ranks' reports come the
findings, one line each: what is wrong, the fix, and the script's line where there is one. Exit 0: nothing wrong
(warnings are printed), 1: findings, 2: bad input. The script runs in a scratch folder (--out, else a new temporary
one, named in the report), so its relative writes land there; nothing else of yours is touched, and every process
the check started is stopped before it returns. Notebook 03b's "bring your own script" runs it.

From Python (a notebook): `check_ddp(script, args=(), nproc=2, ...) -> Report`; report.findings are Finding tuples.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core.config import OneLineErrorParser
from ..core.process import threads_per_process
from . import rank_recorder as recorder
from .child_processes import Nodes, launcher_env

HANG_S = 10.0  # no live rank moved (no batch, no step, the same functions) for this long, one in a collective: a hang
BEAT_S = 3.0  # a rank whose progress thread has not written for this long holds the GIL: it is busy, not waiting
STOP_GRACE_S = 20.0  # after --max-seconds, the ranks get this long to reach their next step and stop together
POLL_S = 0.2
PROBE_WAIT_S = 30.0  # the most the one-process run may add after the ranks have finished
MARKER = ".check-ddp"  # in a scratch folder the tool made: it may be reused
PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|timed out|Timeout|NCCL communicator|"
                       r"DistBackendError|TCPStore", re.I)
CHECKED = ("process group", "sampler and set_epoch", "shards", "replicas", "files written", "checkpoint keys",
           "learning rate", "metrics", "no_sync", "augmentation seeds", "uneven inputs", "teardown")


class BadInput(ValueError):
    """A value the check cannot run with: one line naming it and what is allowed (the CLI exits 2)."""


@dataclass(frozen=True)
class Finding:
    name: str  # e.g. "set-epoch"; the zoo in tests/ddp_zoo names one per script
    message: str  # what is wrong, then the fix
    where: str = ""  # "script.py:41" where the script made the call, if known
    severity: str = "error"  # or "warning" (does not fail the check)

    def line(self) -> str:
        level = "" if self.severity == "error" else "warning: "
        return f"{self.where + ': ' if self.where else ''}{level}{self.name}: {self.message}"


@dataclass
class Report:
    script: str
    nproc: int
    device: str
    seconds: float
    out: str
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    steps: dict[int, int] = field(default_factory=dict)  # optimizer steps per rank

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.findings]

    @property
    def exit_code(self) -> int:
        return 1 if self.errors else 0

    def text(self) -> str:
        steps = sorted(set(self.steps.values()))
        lines = [f"check-ddp: {self.script} on {self.nproc} ranks ({self.device}), "
                 f"{'/'.join(map(str, steps)) if steps else 'no'} optimizer steps per rank, {self.seconds:.1f} s"]
        lines += [f.line() for f in self.findings]
        lines += [f"note: {n}" for n in self.notes]
        if self.errors:
            lines.append(f"{len(self.errors)} finding(s); the run's output and reports are in {self.out}")
        else:
            lines.append(f"ok: nothing wrong found (checked: {', '.join(CHECKED)}); scratch folder {self.out}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------- running
def check_ddp(script, args=(), nproc: int = 2, max_seconds: float = 120.0, max_steps: int | None = None,
              out=None, lr_check: bool = True) -> Report:
    """Run `script args` under torchrun on `nproc` ranks, recorded, and return what is wrong with it.

    Bounded by max_seconds (then every rank stops after the same step) and max_steps (optimizer steps); a run that
    hangs is stopped HANG_S after its ranks stood still. lr_check=False skips the one-process run that tells
    whether the learning rate scales with the world size. Raises BadInput for a value it cannot run with."""
    script, args = Path(script), [str(a) for a in args]
    if not script.is_file():
        raise BadInput(f"script {str(script)!r} is not a file: give the path of your Python training script")
    if not isinstance(nproc, int) or nproc < 2:
        raise BadInput(f"--nproc {nproc} is not allowed: give 2 or more ranks (a check needs ranks to compare)")
    if not max_seconds > 0:
        raise BadInput(f"--max-seconds {max_seconds} is not allowed: give a number of seconds above 0")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise BadInput(f"--max-steps {max_steps} is not allowed: give 1 or more optimizer steps")
    out = _scratch(out)
    start = time.monotonic()
    gpus = _gpus() >= nproc  # one GPU per rank; otherwise the CPU, where a script picks gloo
    run = _launch(script, args, nproc, out, max_seconds, max_steps, gpus, lr_check)
    findings, notes = analyse(run, nproc)
    if lr_check and not any(f.name in FATAL for f in findings):
        findings += lr_findings(run["reports"], run["lr_probe"], nproc)
    report = Report(_display(script), nproc, "one GPU per rank" if gpus else "CPU, gloo", time.monotonic() - start,
                    str(out), [_relative(f) for f in findings], notes,
                    {r: _steps(run, r) for r in range(nproc)})
    (out / "report.txt").write_text(report.text() + "\n")
    return report


def _gpus() -> int:
    if not any(Path("/dev").glob("nvidia[0-9]*")) and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return 0  # no NVIDIA device: spare the import of torch (seconds) that would say so
    import torch
    return torch.cuda.device_count()


def _scratch(out) -> Path:
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="check-ddp-"))
    out = Path(out).absolute()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).exists())):
        raise BadInput(f"--out {out} is not an empty folder: give a new or empty one (the script's files go there)")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("a scratch folder of tutorial check-ddp; its next run may empty it\n")
    for old in (*out.glob("ranks/*"), *out.glob("lr_probe/ranks/*")):  # an earlier check's reports and stop file
        old.unlink()
    for sub in ("ranks", "run", "lr_probe/ranks", "lr_probe/run"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    return out


def _env(folder: Path, cwd: Path, gpus: bool, nproc: int, **extra) -> dict:
    env = launcher_env(threads=threads_per_process(nproc), cpu=not gpus)
    env.update({recorder.DIR_VARIABLE: str(folder), recorder.CWD_VARIABLE: str(cwd)})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _launch(script: Path, args, nproc, out: Path, max_seconds, max_steps, gpus, lr_check) -> dict:
    """torchrun SCRIPT under the recorder, watched: stopped when it hangs or overruns. The reports it left."""
    folder, probe = out / "ranks", out / "lr_probe"
    env = _env(folder, out / "run", gpus, nproc, **{recorder.MAX_SECONDS_VARIABLE: max_seconds,
                                                    recorder.MAX_STEPS_VARIABLE: max_steps or "",
                                                    recorder.LR_PROBE_DIR_VARIABLE: probe if lr_check else ""})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "tutorial.launch.rank_recorder", str(script.absolute()), *args]
    nodes = Nodes([cmd], env)
    hung = overran = False
    deadline = time.monotonic() + max_seconds + STOP_GRACE_S
    try:
        while nodes.procs[0].poll() is None:
            time.sleep(POLL_S)
            if _hanging(folder, nproc):
                hung = True
                break
            if time.monotonic() > deadline:
                overran = True
                break
        progress = _read(folder, "rank{}.progress.json", nproc)  # before the stop: where the ranks stood
        # The one-process run forked by rank 0 stops at its first step; give it the time it needs to get there.
        wait = time.monotonic() + min(max_seconds, PROBE_WAIT_S)
        while lr_check and not hung and not overran and (probe / "ranks" / "rank0.progress.json").exists() \
                and not (probe / "ranks" / "rank0.json").exists() and time.monotonic() < wait:
            time.sleep(POLL_S)
        output = nodes.text(0)
    finally:
        nodes.close()
    (out / "output.log").write_text(output)
    return {"reports": _read(folder, "rank{}.json", nproc), "progress": progress, "output": output, "hung": hung,
            "overran": overran, "returncode": nodes.procs[0].returncode, "augment": _worker_augmentation(folder),
            "max_seconds": max_seconds, "lr_probe": _read(probe / "ranks", "rank{}.json", 1).get(0)}


def _read(folder: Path, pattern: str, nproc: int) -> dict[int, dict]:
    found = {}
    for rank in range(nproc):
        path = folder / pattern.format(rank)
        try:
            found[rank] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return found


def _worker_augmentation(folder: Path) -> dict[int, dict]:
    found = {}
    for path in folder.glob("rank*.worker*.aug.json"):
        rank, worker = map(int, re.findall(r"\d+", path.name)[:2])
        found.setdefault(rank, {})[worker] = json.loads(path.read_text())
    return found


def _hanging(folder: Path, nproc: int) -> bool:
    finished = _read(folder, "rank{}.json", nproc)
    live = [p for r, p in _read(folder, "rank{}.progress.json", nproc).items() if r not in finished]
    now = time.time()
    return bool(live) and all(now - p["changed"] > HANG_S and now - p["beat"] < BEAT_S for p in live) \
        and all(now - p["still"] > HANG_S for p in live) and any(p["in_collective"] for p in live)


# -------------------------------------------------------------------------------------------------------- findings
FATAL = {"no-process-group", "world-size-1", "uneven-inputs", "hang", "rank-died", "script-error", "launch-failed"}


def _location(where: str | None) -> str:
    return ":".join(where.split(":")[:2]) if where else ""


def _code(where: str | None) -> str:
    return where.split(":", 2)[2].strip() if where and where.count(":") >= 2 else ""


def _relative(f: Finding) -> Finding:
    if not f.where:
        return f
    path, _, line = f.where.rpartition(":")
    return Finding(f.name, f.message, f"{_display(path)}:{line}", f.severity)


def _display(path) -> str:
    path = os.path.abspath(path)
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def _steps(run: dict, rank: int) -> int:
    source = run["reports"].get(rank) or run["progress"].get(rank) or {}
    return int(source.get("steps", 0))


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _root_causes(output: str) -> dict[int, int]:
    """rank -> exit code of the failures torchrun's error summary names."""
    return {int(r): int(c) for r, c in re.findall(r"rank\s*:\s*(\d+)\s*\(local_rank[^)]*\)\s*\n\s*exitcode\s*:\s*"
                                                  r"(-?\d+)", output)}


def analyse(run: dict, nproc: int) -> tuple[list[Finding], list[str]]:
    """Findings and notes from what the ranks reported (run: what _launch returns)."""
    reports, progress = run["reports"], run["progress"]
    if not reports and not progress:
        last = [line for line in run["output"].strip().splitlines() if line.strip()][-1:] or ["no output"]
        return [Finding("launch-failed", f"torchrun started no rank that ran the script (exit code "
                                         f"{run['returncode']}): {last[0][:200]}")], []
    fatal = _fatal(run, nproc)
    if fatal:
        return fatal, []
    if not any(r["init"] for r in reports.values()):
        return [Finding("no-process-group", f"no rank called init_process_group: each of the {nproc} ranks torchrun "
                        "started trained alone on all the data; call dist.init_process_group(dist."
                        "get_default_backend_for_device(device)) first, device being where the model's tensors live "
                        "(gloo for the CPU, nccl for a GPU; torchrun's RANK/WORLD_SIZE say who is who)")], []
    if all(r["world_size"] == 1 for r in reports.values()):
        where = next(iter(reports.values()))["init"][0]["where"]
        return [Finding("world-size-1", f"every rank joined a process group of world size 1, not {nproc}: the "
                        "script overrides what torchrun sets; call init_process_group(backend) without rank, "
                        "world_size or init_method (env:// reads them)", _location(where))], []
    findings, notes = [], []
    for check in (_sampler_findings, _shard_findings, _replica_findings, _write_findings, _metric_findings,
                  _no_sync_findings, _augmentation_findings, _teardown_findings):
        found, noted = check(run, nproc)
        findings += found
        notes += noted
    stopped = [r["stop_reason"] for r in reports.values() if r.get("end") == "stopped" and r.get("stop_reason")]
    if stopped:
        notes.append(f"stopped by {stopped[0]} after {max(_steps(run, r) for r in reports)} steps: the end of the "
                     "script (checkpoints, teardown) did not run; a shorter run (e.g. -- --epochs 2) checks it too")
    return findings, notes


def _fatal(run: dict, nproc: int) -> list[Finding]:
    """A rank that died, failed, ran out of data before the others or hung: the run did not end as it should."""
    reports, progress = run["reports"], run["progress"]
    errors = {r: rep for r, rep in reports.items() if rep.get("end") == "error"}
    missing = [r for r in range(nproc) if r not in reports]
    causes = _root_causes(run["output"])
    found = []
    signalled = {r: c for r, c in causes.items() if c < 0 and r in missing and c != -signal.SIGTERM}
    for r, code in sorted(signalled.items()):
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        found.append(Finding("rank-died", f"rank {r} was killed by {name} (torchrun then stopped the others): the "
                             "out-of-memory killer or a scheduler; look at `dmesg` or the job's log, and lower the "
                             "batch size or the loader workers per rank"))
    seen = set()
    for r, rep in sorted(errors.items()):
        key = (rep.get("error"), rep.get("error_where"))
        if key in seen or PEER_GONE.search(rep.get("error") or ""):
            continue  # one line per error; a peer that left, seen from the ranks still in a collective, is below
        seen.add(key)
        ranks = [q for q, other in errors.items() if (other.get("error"), other.get("error_where")) == key]
        hint = ""
        if "FileNotFoundError" in (rep.get("error") or ""):
            hint = " (the script runs in the check's scratch folder: give absolute paths to your data)"
        found.append(Finding("script-error", f"{_ranks(ranks)} raised {rep['error']}{hint}",
                             _location(rep.get("error_where"))))
    if found:
        return found
    forwards = {r: _forwards(run, r) for r in range(nproc) if r in reports or r in progress}
    if len(set(forwards.values())) > 1:
        most, least = max(forwards.values()), min(forwards.values())
        early = [r for r, s in forwards.items() if s == least]
        late = [r for r, s in forwards.items() if s == most]
        where = next((progress[r]["where"] for r in late if r in progress and r not in reports),
                     next((errors[r].get("error_where") for r in late if r in errors), None))
        how = "hung" if run["hung"] else "failed" if any(r in errors for r in late) else "went on alone"
        found.append(Finding("uneven-inputs", f"{_ranks(early)} ran out of data after {least} training batches, "
                             f"{_ranks(late)} took {most} and {how} waiting for the others in a collective: give every "
                             "rank the same number of batches (a DistributedSampler pads to that) or train inside "
                             "`with model.join():` (torch.distributed.algorithms.Join)", _location(where)))
        return found
    if run["hung"]:
        stuck = {r: p for r, p in progress.items() if r not in reports}
        where = next((p["where"] for p in stuck.values() if p["in_collective"]), None)
        at = "; ".join(f"rank {r} at {_display_where(p['where'])}" for r, p in sorted(stuck.items()))
        done = f"; {_ranks(reports)} had finished" if reports else ""
        found.append(Finding("hang", f"the ranks stood still for {HANG_S:g} s, one inside a collective ({at}{done}): "
                             "every rank must reach the same collectives in the same order; one under `if rank == 0:` "
                             "or a rank waiting for another's file hangs them", _location(where)))
    elif run["overran"]:
        at = "; ".join(f"rank {r} at {_display_where(p['where'])}" for r, p in sorted(progress.items())
                       if r not in reports)
        found.append(Finding("hang", f"the script reached no optimizer step to stop at within --max-seconds "
                             f"{run['max_seconds']:g} + {STOP_GRACE_S:g} s ({at}): raise --max-seconds if it is "
                             "just slow to start, else it waits for something that never comes"))
    elif errors or missing:
        found.append(Finding("rank-died", f"{_ranks(set(errors) | set(missing))} ended without finishing (exit code "
                             f"{run['returncode']}); the run's output.log in the scratch folder says more"))
    return found


def _forwards(run: dict, rank: int) -> int:
    """Training batches a rank went through: DDP forwards with gradients, else optimizer steps."""
    source = run["reports"].get(rank) or run["progress"].get(rank) or {}
    return int(source.get("train_forwards") or source.get("steps", 0))


def _display_where(where: str | None) -> str:
    if not where:
        return "an unknown line"
    path, line = where.split(":")[:2]
    code = _code(where)
    return f"{_display(path)}:{line}" + (f" `{code}`" if code else "")


def _training_loaders(run: dict) -> dict[str, dict[int, dict]]:
    """loader key -> rank -> record, for the loaders whose batches the ranks trained on."""
    loaders = {}
    for rank, rep in run["reports"].items():
        for key, loader in rep["loaders"].items():
            if loader["trained"]:
                loaders.setdefault(key, {})[rank] = loader
    return loaders


def _sampler_findings(run: dict, nproc: int):
    findings, notes = [], []
    for rank, rep in sorted(run["reports"].items()):
        for sampler in rep["samplers"].values():
            epochs = [i for i in sampler["iterations"] if i["complete"]]
            if not sampler["shuffle"]:
                continue
            if len(epochs) > 1 and len({(i["epoch"], i["order"]) for i in epochs}) == 1:
                findings.append(Finding("set-epoch", f"rank {rank} read its samples in the same order in all "
                                        f"{len(epochs)} epochs (set_epoch called {sampler['set_epoch_calls']} times, "
                                        f"epoch {epochs[0]['epoch']} every time): the DistributedSampler shuffles "
                                        "with seed + epoch; call sampler.set_epoch(epoch) at the start of every "
                                        "epoch, before this loop", _location(epochs[1]["where"])))
                return findings, notes
            if len(epochs) < 2 and rank == 0:
                notes.append("set_epoch: the run ended within one epoch, so a second epoch's order was not "
                             "compared (give the script 2 short epochs after --)")
    return findings, notes


def _shard_findings(run: dict, nproc: int):
    for key, by_rank in _training_loaders(run).items():
        if len(by_rank) < 2 or len({json.dumps(r["dataset"]) for r in by_rank.values()}) > 1:
            continue  # each rank reads its own dataset: sharded by hand
        first = {rank: set(r["epochs"][0]) for rank, r in by_rank.items() if r["epochs"]}
        if len(first) < 2:
            continue
        size = next(iter(by_rank.values()))["dataset"][1] or 0
        allowed = next(iter(by_rank.values())).get("padding", 0)  # a DistributedSampler repeats a few to even out
        ranks = sorted(first)
        shared = max(len(first[a] & first[b]) for i, a in enumerate(ranks) for b in ranks[i + 1:])
        if shared <= allowed:
            continue
        where = next(iter(by_rank.values()))["where"]
        if not next(iter(by_rank.values()))["distributed"]:
            whole = all(len(s) >= size for s in first.values())
            return [Finding("no-distributed-sampler", f"every rank read {'all ' if whole else ''}{size} samples of "
                            f"the same dataset in epoch 0 ({shared} in common): give the training DataLoader "
                            "sampler=DistributedSampler(dataset) (instead of shuffle=True) so that each rank reads "
                            "its 1/world_size share", _location(where))], []
        given = sorted({(r["sampler_rank"], r["num_replicas"]) for r in by_rank.values()})
        return [Finding("overlapping-shards", f"the ranks' DistributedSamplers share {shared} of "
                        f"{len(first[ranks[0]])} samples in epoch 0 (rank, num_replicas given: "
                        f"{', '.join(f'{r}/{n}' for r, n in given)}): each rank needs its own rank; leave rank and "
                        "num_replicas out (the process group supplies them) or pass dist.get_rank()",
                        _location(where))], []
    return [], []


def _replica_findings(run: dict, nproc: int):
    reports = run["reports"]
    ended = [r for r in reports.values() if r["end"] in ("finished", "stopped")]
    if len(ended) < nproc:
        return [], []
    first = next(iter(reports.values()))
    for i, wrap in enumerate(first["ddp"]):
        starts = {json.dumps(o["first"].get(f"ddp{i}")) for r in ended for o in r["optimizers"][:1]}
        if len(starts) > 1:
            return [Finding("changed-after-wrap", "the DDP model's replicas differ before the first optimizer step "
                            "although DDP(model) made them equal: the model was changed after wrapping (a reset, a "
                            "load on one rank, a rank-dependent seed); change it before DDP(model)",
                            _location(wrap["where"]))], []
        ends = {r.get("checksums", {}).get(f"ddp{i}") for r in ended}
        if len(ends) > 1:
            return [Finding("replicas-differ", "the DDP model's replicas started equal and differ at the end: its "
                            "parameters were changed outside backward and optimizer.step (e.g. an in-place update "
                            "on some ranks); change them the same way on every rank", _location(wrap["where"]))], []
    for j, opt in enumerate(first["optimizers"]):
        if not opt["outside_ddp"] or any(len(r["optimizers"]) <= j for r in ended):
            continue
        starts = {json.dumps(r["optimizers"][j]["first"].get(f"optimizer{j}")) for r in ended}
        ends = {r.get("checksums", {}).get(f"optimizer{j}") for r in ended}
        what = (f"{opt['outside_ddp']} parameter(s) (shapes {opt['outside_shapes']}) the optimizer updates"
                if first["ddp"] else "the parameters")
        if len(starts) > 1:
            return [Finding("unbroadcast-initial-weights", f"the ranks start from different weights: {what} differ "
                            "at the first step and nothing broadcasts them; wrap the model in DDP (it broadcasts "
                            "rank 0's weights) or seed every rank the same before building it",
                            _location(opt["where"]))], []
        if len(ends) > 1:
            fix = ("are outside the DDP model, so their gradients are never averaged: make them part of the "
                   "wrapped module" if first["ddp"] else "get gradients that no rank averages: wrap the model in DDP")
            return [Finding("replicas-differ", f"the replicas differ at the end: {what} {fix}",
                            _location(opt["where"]))], []
    return [], []


def _write_findings(run: dict, nproc: int):
    findings, writers = [], {}
    for rank, rep in run["reports"].items():
        for w in rep["write_paths"]:
            writers.setdefault(w["path"], []).append((rank, w["where"]))
    for path, who in writers.items():
        if len(who) > 1:
            findings.append(Finding("every-rank-writes", f"{_ranks(r for r, _ in who)} all wrote "
                                    f"{os.path.basename(path)}: the replicas are identical, so rank 0 alone writes "
                                    "(`if dist.get_rank() == 0:`, then dist.barrier() before anyone reads it); several "
                                    "writers on one path can corrupt it", _location(who[0][1])))
            break
    for rank, rep in sorted(run["reports"].items()):
        for save in rep["wrapper_saves"]:
            findings.append(Finding("wrapper-checkpoint", f"rank {rank} saved a state_dict whose keys start with "
                                    "'module.' (the DDP wrapper's): it will not load into the plain model; save "
                                    "model.module.state_dict()", _location(save["where"])))
            return findings, []
    return findings, []


def lr_findings(reports: dict, probe: dict | None, nproc: int) -> list[Finding]:
    """A warning when the first step's learning rate is the same with nproc ranks as with one."""
    ours = (reports.get(0) or {}).get("optimizers") or []
    theirs = (probe or {}).get("optimizers") or []
    if not ours or not theirs:
        return []
    lr, alone = ours[0]["lr"], theirs[0]["lr"]
    if not (math.isfinite(lr) and math.isclose(lr, alone, rel_tol=1e-9)):
        return []
    return [Finding("lr-not-scaled", f"the learning rate is {lr:g} with {nproc} ranks, the same as with one: the "
                    f"global batch is {nproc}x larger, so an epoch has {nproc}x fewer steps; the linear scaling rule "
                    f"(SGD): lr = base_lr * world_size, with a warm-up (Adam: often sqrt(world_size))",
                    _location(ours[0]["where"]), "warning")]


def _metric_findings(run: dict, nproc: int):
    for rank, rep in sorted(run["reports"].items()):
        # A line printed right after batches of a DistributedSampler's shard, by a rank that never reduces anything
        # (logging a batch's loss on rank 0 is fine where the epoch's metrics are reduced; so is rank 0 alone
        # evaluating on a loader of all the data).
        lines = [m for m in rep["metric_lines"] if m["sharded"] and not m["reduced_since_batch"]]
        if lines and rep["reductions"] == 0:
            line = lines[0]
            return [Finding("unreduced-metrics", f"rank {rank} printed {line['text'].strip()[:60]!r} after batches of "
                            "its shard, and the script never reduces a value across the ranks: it is this rank's "
                            "own share of the data; sum the metric and its count with dist.all_reduce before "
                            "printing it",
                            _location(line["where"]))], []
    return [], []


def _no_sync_findings(run: dict, nproc: int):
    rep = run["reports"].get(0)
    counts = [c for c in (rep or {}).get("sync_forwards", [])[1:] if c]  # the first step may follow a warm-up
    if not counts:
        return [], []
    typical = sorted(counts)[len(counts) // 2]
    if typical <= 1:
        return [], []
    return [Finding("no-sync", f"{typical} gradient all-reduces per optimizer step: gradient accumulation over "
                    f"{typical} micro-batches all-reduces each one; run the first {typical - 1} forward+backward "
                    "inside `with model.no_sync():`", _location(rep["forward_where"]))], []


def _augmentation_findings(run: dict, nproc: int):
    draws = {r: rep["aug"] for r, rep in run["reports"].items() if rep.get("aug")}
    if len(draws) > 1 and len({a["state"] for a in draws.values()}) == 1:
        where = next(iter(draws.values()))["where"]
        return [_same_augmentation(where)], []
    for worker in {w for ws in run["augment"].values() for w in ws}:
        states = [ws[worker]["state"] for ws in run["augment"].values() if worker in ws]
        if len(states) > 1 and len(set(states)) == 1:
            return [_same_augmentation(None)], []
    return [], []


def _same_augmentation(where) -> Finding:
    return Finding("same-augmentation", "the ranks drew the same random numbers while loading their batches (the "
                   "same seed everywhere): every rank augments its samples identically; seed with seed + rank (the "
                   "model's initial weights come from DDP's broadcast anyway)", _location(where))


def _teardown_findings(run: dict, nproc: int):
    reports = run["reports"].values()
    if reports and all(r["end"] == "finished" and r["pg_alive_at_end"] and not r["destroyed"] for r in reports):
        where = next(iter(reports))["init"][0]["where"]
        return [Finding("no-destroy", "the script ended with its process group still up: call "
                        "dist.destroy_process_group() at the end (NCCL leaks resources and warns, and a job "
                        "running several trainings in one process cannot start the next)", _location(where))], []
    return [], []


# ------------------------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = OneLineErrorParser(prog="tutorial check-ddp", usage="tutorial check-ddp SCRIPT [options] [-- SCRIPT_ARGS...]",
                            description="Run your DDP training script, unchanged, under torchrun and say what is "
                            "wrong with it, from what its ranks did. Exit 0: nothing wrong, 1: findings, 2: bad input.")
    parser.add_argument("script", help="your training script, run unchanged")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--max-seconds", type=float, default=120.0,
                        help="then every rank stops after the same step (default 120)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--out", default=None, help="scratch folder for the run (default: a new temporary one)")
    parser.add_argument("--no-lr-check", action="store_true",
                        help="skip the one-process run that compares the learning rate")
    try:
        opts = parser.parse_args(own)
    except SystemExit as exc:
        return 0 if exc.code == 0 else 2
    try:
        report = check_ddp(opts.script, script_args, opts.nproc, opts.max_seconds, opts.max_steps, opts.out,
                           lr_check=not opts.no_lr_check)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.text())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
