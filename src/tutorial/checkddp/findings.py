"""What is wrong with a DDP script, from the reports its ranks wrote: pure functions of `run`, check-ddp's analysis.

`run` is what tutorial.checkddp.run.launch returns: {"reports": rank -> the rank's report (recorder.REPORT_FILE),
"progress": rank -> its last progress record, "output": torchrun's output, "hung", "overran", "returncode",
"augment": rank -> worker -> a loader worker's first random draw, "max_seconds", "stop_grace_s", "lr_probe": the
one-process run's report or None}. Every finding is one line: what is wrong, the fix, and the script's line where
there is one. tests/test_check_ddp.py feeds these functions a correct run's reports, doctored to show a mistake.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
from dataclasses import dataclass

HANG_S = 10.0  # no live rank moved (no batch, no step, the same functions) for this long, one in a collective: a hang
BEAT_S = 3.0  # a rank whose progress thread has not written for this long holds the GIL: it is busy, not waiting
PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|timed out|Timeout|NCCL communicator|"
                       r"DistBackendError|TCPStore", re.I)
CHECKED = ("process group", "sampler and set_epoch", "shards", "replicas", "files written", "checkpoint keys",
           "learning rate", "metrics", "no_sync", "augmentation seeds", "uneven inputs", "teardown")
FATAL = {"no-process-group", "world-size-1", "uneven-inputs", "hang", "rank-died", "script-error", "launch-failed"}


@dataclass(frozen=True)
class Finding:
    name: str  # e.g. "set-epoch"; the zoo in tests/ddp_zoo names one per script
    message: str  # what is wrong, then the fix
    where: str = ""  # "script.py:41" where the script made the call, if known
    severity: str = "error"  # or "warning" (does not fail the check)

    def line(self) -> str:
        level = "" if self.severity == "error" else "warning: "
        return f"{self.where + ': ' if self.where else ''}{level}{self.name}: {self.message}"


def hanging(progress: dict[int, dict], finished: dict[int, dict], now: float) -> bool:
    """The live ranks (those with progress but no final report) stood still for HANG_S, their progress threads
    still beating, and one of them waits in a collective."""
    live = [p for r, p in progress.items() if r not in finished]
    return bool(live) and all(now - p["changed"] > HANG_S and now - p["beat"] < BEAT_S for p in live) \
        and all(now - p["still"] > HANG_S for p in live) and any(p["in_collective"] for p in live)


def analyse(run: dict, nproc: int) -> tuple[list[Finding], list[str]]:
    """Findings and notes from what the ranks reported."""
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
        notes.append(f"stopped by {stopped[0]} after {max(steps(run, r) for r in reports)} steps: the end of the "
                     "script (checkpoints, teardown) did not run; a shorter run (e.g. -- --epochs 2) checks it too")
    return findings, notes


# ------------------------------------------------------------------------------------- the run did not end as it should
def _fatal(run: dict, nproc: int) -> list[Finding]:
    """A rank that died, failed, ran out of data before the others or hung: the first of these that applies."""
    errors = {r: rep for r, rep in run["reports"].items() if rep.get("end") == "error"}
    missing = [r for r in range(nproc) if r not in run["reports"]]
    return (_killed(run, missing) + _script_errors(errors)  # the first of these that finds anything
            or _uneven_inputs(run, nproc, errors) or _stalled(run, errors, missing))


def _killed(run: dict, missing: list[int]) -> list[Finding]:
    """Ranks without a report that a signal other than torchrun's own SIGTERM ended."""
    causes = _root_causes(run["output"])
    signalled = {r: c for r, c in causes.items() if c < 0 and r in missing and c != -signal.SIGTERM}
    found = []
    for r, code in sorted(signalled.items()):
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        found.append(Finding("rank-died", f"rank {r} was killed by {name} (torchrun then stopped the others): the "
                             "out-of-memory killer or a scheduler; look at `dmesg` or the job's log, and lower the "
                             "batch size or the loader workers per rank"))
    return found


def _script_errors(errors: dict[int, dict]) -> list[Finding]:
    """One finding per error the script raised, naming the ranks that raised it."""
    found, seen = [], set()
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
    return found


def _uneven_inputs(run: dict, nproc: int, errors: dict[int, dict]) -> list[Finding]:
    """Ranks that went through different numbers of training batches."""
    reports, progress = run["reports"], run["progress"]
    forwards = {r: _forwards(run, r) for r in range(nproc) if r in reports or r in progress}
    if len(set(forwards.values())) <= 1:
        return []
    most, least = max(forwards.values()), min(forwards.values())
    early = [r for r, s in forwards.items() if s == least]
    late = [r for r, s in forwards.items() if s == most]
    where = next((progress[r]["where"] for r in late if r in progress and r not in reports),
                 next((errors[r].get("error_where") for r in late if r in errors), None))
    how = "hung" if run["hung"] else "failed" if any(r in errors for r in late) else "went on alone"
    return [Finding("uneven-inputs", f"{_ranks(early)} ran out of data after {least} training batches, "
                    f"{_ranks(late)} took {most} and {how} waiting for the others in a collective: give every "
                    "rank the same number of batches (a DistributedSampler pads to that) or train inside "
                    "`with model.join():` (torch.distributed.algorithms.Join)", _location(where))]


def _stalled(run: dict, errors: dict[int, dict], missing: list[int]) -> list[Finding]:
    """A hang, a run that reached no step to stop at, or ranks that ended without finishing."""
    reports, progress = run["reports"], run["progress"]
    if run["hung"]:
        stuck = {r: p for r, p in progress.items() if r not in reports}
        where = next((p["where"] for p in stuck.values() if p["in_collective"]), None)
        at = "; ".join(f"rank {r} at {_display_where(p['where'])}" for r, p in sorted(stuck.items()))
        done = f"; {_ranks(reports)} had finished" if reports else ""
        return [Finding("hang", f"the ranks stood still for {HANG_S:g} s, one inside a collective ({at}{done}): "
                        "every rank must reach the same collectives in the same order; one under `if rank == 0:` "
                        "or a rank waiting for another's file hangs them", _location(where))]
    if run["overran"]:
        at = "; ".join(f"rank {r} at {_display_where(p['where'])}" for r, p in sorted(progress.items())
                       if r not in reports)
        return [Finding("hang", f"the script reached no optimizer step to stop at within --max-seconds "
                        f"{run['max_seconds']:g} + {run['stop_grace_s']:g} s ({at}): raise --max-seconds if it is "
                        "just slow to start, else it waits for something that never comes")]
    if errors or missing:
        return [Finding("rank-died", f"{_ranks(set(errors) | set(missing))} ended without finishing (exit code "
                        f"{run['returncode']}); the run's output.log in the scratch folder says more")]
    return []


def _root_causes(output: str) -> dict[int, int]:
    """rank -> exit code of the failures torchrun's error summary names."""
    return {int(r): int(c) for r, c in re.findall(r"rank\s*:\s*(\d+)\s*\(local_rank[^)]*\)\s*\n\s*exitcode\s*:\s*"
                                                  r"(-?\d+)", output)}


def _forwards(run: dict, rank: int) -> int:
    """Training batches a rank went through: DDP forwards with gradients, else optimizer steps."""
    source = run["reports"].get(rank) or run["progress"].get(rank) or {}
    return int(source.get("train_forwards") or source.get("steps", 0))


def _display_where(where: str | None) -> str:
    if not where:
        return "an unknown line"
    path, line = where.split(":")[:2]
    code = _code(where)
    return f"{display(path)}:{line}" + (f" `{code}`" if code else "")


# ----------------------------------------------------------------------------------------------------------- the checks
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
    ended = [r for r in run["reports"].values() if r["end"] in ("finished", "stopped")]
    if len(ended) < nproc:
        return [], []
    first = next(iter(run["reports"].values()))
    return _ddp_replicas(first, ended) or _optimized_outside_ddp(first, ended), []


def _ddp_replicas(first: dict, ended: list[dict]) -> list[Finding]:
    """Each DDP model's weights, equal on every rank at the first step and at the end?"""
    for i, wrap in enumerate(first["ddp"]):
        starts = {json.dumps(o["first"].get(f"ddp{i}")) for r in ended for o in r["optimizers"][:1]}
        if len(starts) > 1:
            return [Finding("changed-after-wrap", "the DDP model's replicas differ before the first optimizer step "
                            "although DDP(model) made them equal: the model was changed after wrapping (a reset, a "
                            "load on one rank, a rank-dependent seed); change it before DDP(model)",
                            _location(wrap["where"]))]
        ends = {r.get("checksums", {}).get(f"ddp{i}") for r in ended}
        if len(ends) > 1:
            return [Finding("replicas-differ", "the DDP model's replicas started equal and differ at the end: its "
                            "parameters were changed outside backward and optimizer.step (e.g. an in-place update "
                            "on some ranks); change them the same way on every rank", _location(wrap["where"]))]
    return []


def _optimized_outside_ddp(first: dict, ended: list[dict]) -> list[Finding]:
    """The parameters an optimizer updates outside any DDP model (all of them without DDP), equal on every rank?"""
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
                            _location(opt["where"]))]
        if len(ends) > 1:
            fix = ("are outside the DDP model, so their gradients are never averaged: make them part of the "
                   "wrapped module" if first["ddp"] else "get gradients that no rank averages: wrap the model in DDP")
            return [Finding("replicas-differ", f"the replicas differ at the end: {what} {fix}",
                            _location(opt["where"]))]
    return []


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


# -------------------------------------------------------------------------------------------------------- where and who
def steps(run: dict, rank: int) -> int:
    """Optimizer steps a rank took, from its report or, if it left none, its last progress record."""
    source = run["reports"].get(rank) or run["progress"].get(rank) or {}
    return int(source.get("steps", 0))


def relative(f: Finding) -> Finding:
    """The finding with its script's path relative to the working directory, where the script is inside it."""
    if not f.where:
        return f
    path, _, line = f.where.rpartition(":")
    return Finding(f.name, f.message, f"{display(path)}:{line}", f.severity)


def display(path) -> str:
    path = os.path.abspath(path)
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def _location(where: str | None) -> str:
    return ":".join(where.split(":")[:2]) if where else ""


def _code(where: str | None) -> str:
    return where.split(":", 2)[2].strip() if where and where.count(":") >= 2 else ""


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
