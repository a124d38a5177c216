"""01_single_device: what the notebook needs around the code it types.

The training step, the profiler (`profile`, `record_function`, `schedule`, `key_averages`) and the DataLoader are
typed in the notebook's cells. Here: a dataset that is slow to read, a timeline drawn from an exported trace, and the
exercises' checkers and solutions.
"""
from __future__ import annotations

import json
import time

import torch
from torch.utils.data import Dataset

from .measure import _native_stderr_silenced

PHASES = ("data", "forward", "backward", "optimizer")


# ---------------------------------------------------------------------------------------- 01: slow storage
class SlowDataset(Dataset):
    """`dataset`, but every sample first waits `cost_ms`, like a file read from a shared (network) file system: the
    process sleeps and its core is free, as while waiting for storage."""

    def __init__(self, dataset, cost_ms: float = 1.0):
        self.dataset, self.cost = dataset, cost_ms / 1e3

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        time.sleep(self.cost)
        return self.dataset[i]


# --------------------------------------------------------------------------------------------- 01: the trace
def draw_trace(path: str, phases=PHASES, steps: int = 3):
    """The record_function ranges of the last `steps` profiled steps of a Chrome trace (prof.export_chrome_trace),
    as a timeline: one row per phase, time in ms. What ui.perfetto.dev shows, reduced to the phases."""
    import matplotlib.pyplot as plt
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("ph") == "X" and e.get("name") in phases and e.get("cat") == "user_annotation"]
    events.sort(key=lambda e: e["ts"])
    starts = [e["ts"] for e in events if e["name"] == phases[0]]
    if len(starts) > steps:
        events = [e for e in events if e["ts"] >= starts[-steps]]
    t0 = events[0]["ts"]
    fig, ax = plt.subplots(figsize=(9, 2.2))
    colours = dict(zip(phases, plt.cm.tab10.colors))
    for e in events:
        ax.barh(phases.index(e["name"]), e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, color=colours[e["name"]])
    ax.set_yticks(range(len(phases)), phases)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"the last {steps} profiled steps, from the exported trace (record_function ranges)", fontsize=10)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------- 01: exercises
def _tiny_setup(seed: int = 0, batches: int = 5):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    data = []
    for _ in range(batches):  # labels a model can learn: which of the first three inputs is largest
        X = torch.randn(16, 8)
        data.append((X, X[:, :3].argmax(1)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), data


def _accumulating(model, optimizer, batches):  # the loop without zero_grad, to recognise that mistake
    import torch.nn.functional as F
    for X, y in batches:
        F.cross_entropy(model(X), y).backward()
        optimizer.step()


def _same(a, b) -> bool:
    return all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a.parameters(), b.parameters()))


def check_train(train) -> str:
    """Exercise 1: train(model, optimizer, batches) must take one correct SGD step per batch and return the losses."""
    reference, ref_opt, data = _tiny_setup()
    expected = solution_train(reference, ref_opt, data)
    model, optimizer, _ = _tiny_setup()
    losses = train(model, optimizer, data)
    if _same(model, reference):
        if not (isinstance(losses, list) and len(losses) == len(data)
                and all(abs(a - b) < 1e-5 for a, b in zip(losses, expected))):
            return f"wrong: the weights are right, but train returned {losses!r}: one loss.item() per batch"
        return f"correct: the same weights as the reference after {len(data)} steps"
    accumulated, acc_opt, _ = _tiny_setup()
    _accumulating(accumulated, acc_opt, data)
    if _same(model, accumulated):
        return ("wrong: every step used the sum of all gradients so far: loss.backward() adds to each parameter's "
                ".grad, so step 2 also applies step 1's gradient again; call optimizer.zero_grad() before backward")
    return ("wrong: the weights differ from the reference (zero_grad, forward, cross-entropy loss, backward, step "
            "once per batch)")


def check_profile_phases(profile_phases) -> str:
    """Exercise 2: with schedule(wait=1, warmup=1, active=3) and 5 batches, each phase must be recorded 3 times."""
    model, optimizer, data = _tiny_setup()
    with _native_stderr_silenced():
        prof = profile_phases(model, optimizer, data)
        try:
            counts = {e.key: e.count for e in prof.key_averages() if e.key in PHASES}
        except Exception:  # noqa: BLE001 - a profiler that never recorded has no results to read
            counts = {}
    if not counts:
        return ("wrong: the profiler recorded nothing: with a schedule it only starts recording after prof.step() "
                "was called wait + warmup times; call prof.step() at the end of every step")
    wrong = {k: v for k, v in counts.items() if v != 3}
    if wrong or set(counts) != {"forward", "backward", "optimizer"}:
        return (f"wrong: recorded {counts}, expected forward, backward and optimizer 3 times each (the 3 active "
                "steps of the schedule): one prof.step() per step, at its end")
    return "correct: forward, backward and optimizer recorded in each of the 3 active steps"


def _gpu_stand_in(X, y):
    time.sleep(0.03)  # 30 ms of work per batch, as a GPU would do while the training process waits for it


FEED_BATCH = 32  # the batch size of exercise 3, which the learner must keep


def check_feed(feed) -> str:
    """Exercise 3: feed(dataset, step) profiles 10 steps; the model must no longer wait for the loader."""
    dataset = SlowDataset(torch.utils.data.TensorDataset(torch.randn(2048, 4), torch.randint(0, 3, (2048,))), 1.0)
    sizes = []

    def step(X, y):  # the stand-in, noting the batch sizes: a smaller batch also waits less, but trains differently
        sizes.append(len(X))
        _gpu_stand_in(X, y)

    with _native_stderr_silenced():
        prof = feed(dataset, step)
        ms = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages() if e.key in ("data", "compute")}
    if set(ms) != {"data", "compute"}:
        return f"wrong: the profile should hold the ranges 'data' and 'compute', it has {sorted(ms)}"
    if any(n != FEED_BATCH for n in sizes):
        return (f"wrong: the model got batches of {sorted(set(sizes))} samples, not {FEED_BATCH}: a smaller batch "
                "is read faster, but it changes the training (more, noisier steps) and leaves the GPU half idle; "
                f"keep batch_size={FEED_BATCH} and let loader workers read ahead instead (num_workers)")
    share = ms["data"] / (ms["data"] + ms["compute"])
    # Judged against what the training process itself would wait, reading every sample in turn: at least the samples'
    # sleeps, whatever the load, so num_workers=0 never passes. A loader whose workers read ahead waits far less; on a
    # busy 2-core machine (a test run beside the notebooks) their hand-over alone has reached half of that.
    reading_itself_ms = len(sizes) * FEED_BATCH * dataset.cost * 1e3
    if ms["data"] > 0.75 * reading_itself_ms:
        return (f"wrong: 'data' took {share:.0%} of the profiled time ({ms['data']:.0f} ms against "
                f"{ms['compute']:.0f} ms of compute): the model waits for the loader. With num_workers=0 the "
                "training process reads every sample itself; let worker processes prepare the next batches "
                "meanwhile: DataLoader(..., num_workers=2) or more")
    return (f"correct: 'data' took only {share:.0%} of the profiled time: the workers read the next batches while "
            "the model computes")


# The solutions; tests/test_exercises_01.py checks that each checker accepts its solution and rejects the skeleton
# the notebook starts from.
def solution_train(model, optimizer, batches):
    import torch.nn.functional as F
    model.train()
    losses = []
    for X, y in batches:
        optimizer.zero_grad()  # backward adds to .grad: clear the previous step's gradients first
        loss = F.cross_entropy(model(X), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def solution_profile_phases(model, optimizer, batches):
    import torch.nn.functional as F
    from torch.profiler import profile, record_function, schedule
    with profile(schedule=schedule(wait=1, warmup=1, active=3)) as prof:
        for X, y in batches:
            with record_function("forward"):
                loss = F.cross_entropy(model(X), y)
            with record_function("backward"):
                optimizer.zero_grad()
                loss.backward()
            with record_function("optimizer"):
                optimizer.step()
            prof.step()  # the end of a step: the schedule moves on
    return prof


def solution_feed(dataset, step, steps=10):
    from torch.profiler import profile, record_function
    from torch.utils.data import DataLoader
    loader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2)  # two processes read ahead
    batches = iter(loader)
    next(batches)  # the first batch also starts the workers: not profiled
    with profile() as prof:
        for _ in range(steps):
            with record_function("data"):
                X, y = next(batches)
            with record_function("compute"):
                step(X, y)
    return prof
