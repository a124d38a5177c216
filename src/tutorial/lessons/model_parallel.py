"""Infrastructure, measurements, plots and checks for 11_model_parallelism; the parallel code itself is typed there.

Here: each technique (train_tp, train_pp, train_2d) compared with the one-process GPT at the same global batch
(logits, losses, weights after a few AdamW steps), the pipeline's timeline and bubble measured from timed step
events and drawn, and the exercises' checkers with their solutions (tests/test_exercises_11.py checks each checker
against its solution, its skeleton and other answers).
"""
from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist

from .. import train_2d, train_pp, train_tp
from ..core.gpt import GPT, CharCorpus, ParallelConfig, batches, loss_fn, parameter_bytes
from .ranks import describe, first_error, first_line, on_every_rank

TRAINERS = {"tp": train_tp, "pp": train_pp, "2d": train_2d}


# ------------------------------------------------------------------------------------- equal to one process
def one_process(cfg: ParallelConfig) -> dict:
    """The reference: the whole GPT in this process, the whole global batch, cfg.steps AdamW steps. Returns the
    logits of the first batch before any step, the loss of every step, the weights after the last and their bytes."""
    model = GPT(cfg.gpt(), seed=cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses, logits = [], None
    for X, y in batches(CharCorpus(), cfg.batch_size, cfg.context, cfg.steps, seed=cfg.seed):
        out = model(X)
        if logits is None:
            logits = out.detach().clone()
        loss = loss_fn(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return dict(logits=logits, losses=losses, state=state, parameter_bytes=parameter_bytes(model))


def first_logits(technique: str, cfg: ParallelConfig):
    """On every rank of a group: the technique's logits for the first batch before any step (None on pipeline
    stages other than the last, which alone computes them)."""
    trainer = TRAINERS[technique]
    X, y = next(batches(CharCorpus(), cfg.batch_size, cfg.context, 1, seed=cfg.seed))
    if technique == "pp":
        device, world, created = trainer.setup(cfg)
        model, optimizer, corpus, schedule = trainer.build(cfg, device, world)
        if world.rank == 0:
            schedule.step(X.to(device))
        elif world.rank == world.world_size - 1:
            return schedule.step(target=y.to(device), losses=[]).detach().cpu()  # the merged micro-batches
        else:
            schedule.step()
        return None
    device, world, mesh, created = trainer.setup(cfg)
    model, optimizer, corpus = trainer.build(cfg, device, mesh)
    with torch.no_grad():
        return model(X.to(device)).detach().cpu()


def parallel_run(technique: str, cfg: ParallelConfig, out: str) -> dict:
    """On every rank of a group (made here unless it exists): first_logits, then the trainer's own main(cfg), which
    writes the whole model's weights to out/model.pt on rank 0. Returns this rank's logits and metrics."""
    cfg = cfg.replace(out=out)
    logits = first_logits(technique, cfg)
    metrics = TRAINERS[technique].main(cfg)
    return dict(logits=logits, metrics=metrics)


def compare(reference: dict, results: list[dict], out: str) -> dict:
    """The largest differences between one process and every rank's run: logits, losses, weights (from out/)."""
    state = torch.load(os.path.join(out, "model.pt"), weights_only=True)
    logits = [r["logits"] for r in results if r["logits"] is not None]
    return dict(
        logits=max((lg - reference["logits"]).abs().max().item() for lg in logits),
        loss=max(abs(a - b) for r in results for a, b in zip(r["metrics"]["losses"], reference["losses"])),
        weights=max((state[k] - v).abs().max().item() for k, v in reference["state"].items()),
        same_names=sorted(state) == sorted(reference["state"]),
        parameter_bytes=[r["metrics"]["parameter_bytes"] for r in results],
        whole_model_bytes=reference["parameter_bytes"])


# ------------------------------------------------------------------------------------------ the pipeline bubble
def pipeline_timeline(cfg: ParallelConfig, steps: int = 3) -> dict:
    """On every rank of a pipeline (train_pp's setup and build): time every forward and backward of a micro-batch
    this stage runs, over `steps` steps after one warm-up step, and count the tensors it sends to its neighbours.

    Returns, on every rank, every stage's events (stage, step, kind F/B, micro-batch, start and end in seconds from
    the step's start, a barrier every rank leaves together), the steps' lengths and the bytes sent per step."""
    device, world, created = train_pp.setup(cfg)
    model, optimizer, corpus, schedule = train_pp.build(cfg, device, world)
    stage = schedule._stage  # the PipelineStage the schedule drives (the one the trainer made)
    events, sent, clock = [], {"tensors": 0, "bytes": 0}, {"t0": 0.0, "step": -1}

    def timed(method, kind):
        def wrapper(chunk, *args, **kwargs):
            start = time.perf_counter()
            result = method(chunk, *args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # kernels run asynchronously: time them, not their launch
            if clock["step"] >= 0:
                events.append(dict(stage=world.rank, step=clock["step"], kind=kind, micro_batch=chunk,
                                   start=start - clock["t0"], end=time.perf_counter() - clock["t0"]))
            return result
        return wrapper

    def counted(method):
        def wrapper(chunk):
            ops = method(chunk)
            if clock["step"] >= 0:
                sent["tensors"] += len(ops)
                sent["bytes"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops
        return wrapper

    stage.forward_one_chunk = timed(stage.forward_one_chunk, "F")
    stage.backward_one_chunk = timed(stage.backward_one_chunk, "B")
    stage.get_fwd_send_ops = counted(stage.get_fwd_send_ops)
    stage.get_bwd_send_ops = counted(stage.get_bwd_send_ops)
    lengths = []
    try:
        for step, (X, y) in enumerate(batches(corpus, cfg.batch_size, cfg.context, steps + 1, seed=cfg.seed)):
            dist.barrier()
            clock.update(t0=time.perf_counter(), step=step - 1)  # step -1 is the warm-up, not recorded
            train_pp.train_step(schedule, optimizer, world, X.to(device), y.to(device), device)
            if step:
                lengths.append(time.perf_counter() - clock["t0"])
        every = [None] * world.world_size
        dist.all_gather_object(every, dict(events=events, lengths=lengths, sent_bytes=sent["bytes"] / steps,
                                           sent_tensors=sent["tensors"] / steps,
                                           parameter_bytes=parameter_bytes(model)))
    finally:
        train_pp.teardown(created)
    return dict(stages=world.world_size, micro_batches=cfg.micro_batches, schedule=cfg.schedule, steps=steps,
                events=[e for r in every for e in r["events"]],
                sent_bytes=[r["sent_bytes"] for r in every], sent_tensors=[r["sent_tensors"] for r in every],
                parameter_bytes=[r["parameter_bytes"] for r in every],
                step_seconds=[max(r["lengths"][s] for r in every) for s in range(steps)])


def bubble_sweep(cfg: ParallelConfig, schedules=("gpipe", "1f1b"), micro_batches=(2, 4, 8), steps: int = 2) -> list:
    """On every rank: pipeline_timeline for each schedule and number of micro-batches, in one process group."""
    device, world, created = train_pp.setup(cfg)  # the group every timeline below joins, made once
    try:
        return [pipeline_timeline(cfg.replace(schedule=s, micro_batches=m), steps) for s in schedules
                for m in micro_batches]
    finally:
        train_pp.teardown(created)


def tp_communication(cfg: ParallelConfig) -> dict:
    """On every rank: the collectives of train_tp's first step (CommDebugMode), without and with sequence parallel,
    and this rank's parameter bytes."""
    device, world, mesh, created = train_tp.setup(cfg)  # one group for both runs
    try:
        runs = {sp: train_tp.main(cfg.replace(steps=1, sequence_parallel=sp)) for sp in (False, True)}
        return dict(plain=runs[False]["collectives"], sequence_parallel=runs[True]["collectives"],
                    parameter_bytes=runs[True]["parameter_bytes"])
    finally:
        train_tp.teardown(created)


def bubble(timeline: dict) -> dict:
    """Each stage's idle fraction of the step, measured (1 - its busy time / the step's length, the mean over the
    steps), next to the formula (p-1)/(m+p-1) for p equal stages and m micro-batches; and the most micro-batches
    a stage held at once (forwards done whose backward had not run yet): GPipe m, 1F1B about p."""
    p, m = timeline["stages"], timeline["micro_batches"]
    idle, in_flight = [], []
    for s in range(p):
        fractions, peak = [], 0
        for step, length in enumerate(timeline["step_seconds"]):
            mine = [e for e in timeline["events"] if e["stage"] == s and e["step"] == step]
            fractions.append(1 - sum(e["end"] - e["start"] for e in mine) / length)
            held = 0
            for e in sorted(mine, key=lambda e: e["start"]):
                held += 1 if e["kind"] == "F" else -1
                peak = max(peak, held)
        idle.append(sum(fractions) / len(fractions))
        in_flight.append(peak)
    return dict(schedule=timeline["schedule"], stages=p, micro_batches=m, idle=idle,
                formula=(p - 1) / (m + p - 1), in_flight=in_flight)


def draw_timeline(timeline: dict, step: int = 0, ax=None):
    """A Gantt chart of one step: a lane per stage, forwards and backwards as bars labelled with their micro-batch;
    the gaps are the bubble."""
    import matplotlib.pyplot as plt
    p = timeline["stages"]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.8 + 0.6 * p), layout="constrained")
    colors = {"F": "tab:blue", "B": "tab:orange"}
    for e in timeline["events"]:
        if e["step"] != step:
            continue
        ms = (e["start"] * 1e3, (e["end"] - e["start"]) * 1e3)
        ax.barh(e["stage"], ms[1], left=ms[0], height=0.6, color=colors[e["kind"]], edgecolor="black", linewidth=0.3)
        ax.text(ms[0] + ms[1] / 2, e["stage"], f"{e['kind']}{e['micro_batch']}", ha="center", va="center",
                fontsize=7)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    b = bubble(timeline)
    ax.set(xlabel="ms since the step started",
           title=f"{timeline['schedule']}: {p} stages, {timeline['micro_batches']} micro-batches; idle "
                 f"{', '.join(f'{x:.0%}' for x in b['idle'])} (formula {b['formula']:.0%})")
    return ax.figure


def draw_bubbles(rows: list[dict], ax=None):
    """Measured idle fraction (the mean over stages) against the number of micro-batches, per schedule, with the
    formula's curve: rows are bubble() results."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.4), layout="constrained")
    for schedule in sorted({r["schedule"] for r in rows}):
        mine = sorted((r for r in rows if r["schedule"] == schedule), key=lambda r: r["micro_batches"])
        ax.plot([r["micro_batches"] for r in mine], [sum(r["idle"]) / len(r["idle"]) for r in mine], "o-",
                label=f"{schedule}, measured")
    p = rows[0]["stages"]
    ms = sorted({r["micro_batches"] for r in rows})
    grid = [ms[0] + (ms[-1] - ms[0]) * i / 50 for i in range(51)]
    ax.plot(grid, [(p - 1) / (m + p - 1) for m in grid], "k--", label="(p-1)/(m+p-1)")
    ax.set(xlabel="micro-batches m", ylabel="idle fraction of the step", ylim=(0, None),
           title=f"The pipeline bubble with p = {p} stages")
    ax.legend()
    return ax.figure
