"""A profile's time per step, and the ranks' traces in one file (12_performance_clinic): tools for any
torch.profiler run of a process group, not only the notebook's."""
from __future__ import annotations

import json
import os

from torch.autograd import DeviceType

# NCCL's kernels (RCCL's keep the names): on a GPU a collective is a kernel; the CPU op only launches it and returns,
# and the kernel waits on the device for the other ranks.
COLLECTIVE_KERNELS = ("nccl",)
COLLECTIVE_OPS = ("gloo:", "nccl:", "c10d::", "record_param_comms")  # the CPU side: what a rank calls and gloo runs

def _union(intervals) -> list:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _intersect(a, b) -> list:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append([start, end])
        i, j = (i + 1, j) if a[i][1] < b[j][1] else (i, j + 1)
    return out


def breakdown(prof) -> dict:
    """A rank's time per profiled step, from the profiler's own events (prof.events(): name, thread, device, time
    range). Where a GPU ran the step, its kernels: communication = the collective kernels, compute = the other
    kernels (the CPU's NCCL ops are launches of a few microseconds; a rank's wait is inside its kernel). Without
    kernels, the CPU's: communication = the collectives (gloo:/nccl: and c10d ops, on whatever thread runs them),
    compute = the ops the step's thread ran outside them. Idle = the rest of the step; overlap = the share of
    communication during which compute ran. Milliseconds, the mean over the profiled steps."""
    events = list(prof.events())
    on_cpu = [e for e in events if e.device_type == DeviceType.CPU]
    steps = [e for e in on_cpu if e.name.startswith("ProfilerStep")]
    # the device's own work: kernels and copies, not the profiler's device-side copies of record_function ranges
    kernels = [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    cpu_collectives = any(e.name.startswith(COLLECTIVE_OPS) for e in on_cpu)
    # a GPU's kernels, unless its collectives show on the CPU only (an XPU's are not NCCL's kernels): the CPU's ops
    if kernels and (any(e.name.startswith(COLLECTIVE_KERNELS) for e in kernels) or not cpu_collectives):
        comm = _union((e.time_range.start, e.time_range.end) for e in kernels if e.name.startswith(COLLECTIVE_KERNELS))
        ops = _union((e.time_range.start, e.time_range.end) for e in kernels
                     if not e.name.startswith(COLLECTIVE_KERNELS))
        # the steps as the device ran them (the CPU runs ahead of it), where the profiler recorded them there
        steps = [e for e in events if e.device_type != DeviceType.CPU and e.is_user_annotation
                 and e.name.startswith("ProfilerStep")] or steps
    else:
        main = steps[0].thread
        comm = _union((e.time_range.start, e.time_range.end) for e in on_cpu if e.name.startswith(COLLECTIVE_OPS))
        ops = _union((e.time_range.start, e.time_range.end) for e in on_cpu
                     if e.thread == main and e.cpu_parent is not None
                     and e.cpu_parent.name.startswith("ProfilerStep") and not e.name.startswith(COLLECTIVE_OPS))
    totals = dict(step=0.0, compute=0.0, communication=0.0, idle=0.0, overlap=0.0)
    for s in steps:
        window = [[s.time_range.start, s.time_range.end]]
        c, busy = _intersect(comm, window), _intersect(ops, window)
        exposed = _length(_union(c + busy))
        totals["step"] += _length(window)
        totals["communication"] += _length(c)
        totals["compute"] += _length(busy) - _length(_intersect(busy, c))
        totals["idle"] += _length(window) - exposed
        totals["overlap"] += _length(_intersect(busy, c))
    mean = {k: v / len(steps) / 1e3 for k, v in totals.items()}
    mean["overlap"] = mean["overlap"] / mean["communication"] if mean["communication"] else 0.0
    return mean


def collective_starts(trace: dict) -> dict:
    """Each rank's collectives in a merged trace (merge_traces), in the order it entered them: their start times
    (microseconds, the node's clock). Where the rank's trace has collective kernels, their starts (a rank's kernel
    starts when its stream reaches it); else the starts of the c10d ops it called. Ranks: {rank: [start, ...]}."""
    kernels, calls = {}, {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or not str(e.get("pid", "")).startswith("rank "):
            continue
        rank = int(e["pid"].split()[1])
        if e.get("cat") == "kernel" and e["name"].startswith(COLLECTIVE_KERNELS):
            kernels.setdefault(rank, []).append(e["ts"])
        elif e.get("cat") == "cpu_op" and e["name"].startswith("c10d::"):
            calls.setdefault(rank, []).append(e["ts"])
    ranks = sorted(kernels.keys() | calls.keys())
    return {r: sorted(kernels.get(r) or calls[r]) for r in ranks}


def late_starts(trace: dict) -> list:
    """Per rank: of the collectives every rank entered (the n-th of each rank is the same collective: they must
    call them in one order), how many it entered last, the others already waiting in theirs, and how many
    milliseconds after the first rank it entered them on average."""
    starts = collective_starts(trace)
    n = min(map(len, starts.values()))
    rows = {r: dict(rank=r, entered_last=0, behind_ms=0.0) for r in starts}
    for i in range(n):
        first = min(s[i] for s in starts.values())
        last = max(starts, key=lambda r: starts[r][i])
        rows[last]["entered_last"] += 1
        for r, s in starts.items():
            rows[r]["behind_ms"] += (s[i] - first) / 1e3 / n
    return [rows[r] for r in sorted(rows)]


def straggler(trace: dict) -> int:
    """The rank the others wait for: the one that enters the collectives last most often (then the furthest
    behind), HolisticTraceAnalysis' rule for GPU traces. Not the rank that communicates least: on a GPU the CPU side
    of a collective is a launch, and a rank's wait lands in its kernel or in a later copy."""
    return max(late_starts(trace), key=lambda row: (row["entered_last"], row["behind_ms"]))["rank"]


def merge_traces(paths: list, out: str) -> dict:
    """One Chrome-trace JSON of several ranks' profiler traces (export_chrome_trace), which Perfetto and
    chrome://tracing open: each rank becomes a process named "rank N" (its events' pid replaced), on the clock the
    ranks share on one node. Returns what it wrote: ranks and events."""
    merged, ranks = [], []
    for path in paths:
        with open(path) as f:
            trace = json.load(f)
        rank = trace.get("distributedInfo", {}).get("rank", len(ranks))
        ranks.append(rank)
        for e in trace["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index"):
                continue  # replaced by the rank's own below
            merged.append({**e, "pid": f"rank {rank}"})
        merged.append({"ph": "M", "name": "process_name", "pid": f"rank {rank}", "args": {"name": f"rank {rank}"}})
        merged.append({"ph": "M", "name": "process_sort_index", "pid": f"rank {rank}", "args": {"sort_index": rank}})
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
    return dict(path=out, ranks=ranks, events=len(merged))
