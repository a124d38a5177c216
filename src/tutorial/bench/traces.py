"""A profile's time per step, and the ranks' traces in one file (12_performance_clinic): tools for any
torch.profiler run of a process group, not only the notebook's."""
from __future__ import annotations

import json
import os

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
    """A rank's time per profiled step, from the profiler's own events (prof.events(): name, thread, time range):
    communication = the collectives (gloo:/nccl: and c10d ops, on whatever thread runs them), compute = the ops the
    step's thread ran outside them, idle = the rest of the step; overlap = the share of communication during which
    the step's thread computed. Milliseconds, the mean over the profiled steps."""
    events = list(prof.events())
    steps = [e for e in events if e.name.startswith("ProfilerStep")]
    main = steps[0].thread
    comm_names = ("gloo:", "nccl:", "c10d::", "record_param_comms")
    comm = _union((e.time_range.start, e.time_range.end) for e in events if e.name.startswith(comm_names))
    ops = _union((e.time_range.start, e.time_range.end) for e in events
                 if e.thread == main and e.cpu_parent is not None and e.cpu_parent.name.startswith("ProfilerStep")
                 and not e.name.startswith(comm_names))
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


def slowest_rank(breakdowns: list) -> int:
    """The straggler: the rank that spends the least time in communication, because the others wait in theirs for
    it (HolisticTraceAnalysis' rule for GPU traces, applied to these)."""
    return min(range(len(breakdowns)), key=lambda r: breakdowns[r]["communication"])


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
