"""Infrastructure, measurements, plots and checks for 11_model_parallelism; the parallel code itself is typed there.

Here: each technique (train_tp, train_pp, train_2d) compared with the one-process GPT at the same global batch
(logits, losses, weights after a few AdamW steps), the pipeline's timeline and bubble measured from timed step
events and drawn, and the exercises' checkers with their solutions (tests/test_exercises_11.py checks each checker
against its solution, its skeleton and other answers).
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from .. import train_2d, train_gpt, train_pp, train_tp
from ..core.corpus import CharCorpus, batches
from ..core.gpt import GPT, loss_fn, parameter_bytes
from ..core.parallel_config import ParallelConfig
from .ranks import describe, first_error, on_every_rank

TRAINERS = {"tp": train_tp, "pp": train_pp, "2d": train_2d}


# ------------------------------------------------------------------------------------- equal to one process
def one_process(cfg: ParallelConfig) -> dict:
    """The reference: train_gpt, the whole GPT in this process on the CPU, the whole global batch, cfg.steps AdamW
    steps (train_gpt's build and fit, not its main, whose setup would take this node's first GPU). Returns the logits of the first batch before any step, the loss of every step, the weights after the last
    and their bytes."""
    device = torch.device("cpu")
    model, optimizer, corpus = train_gpt.build(cfg, device)
    X, _ = next(batches(corpus, cfg.batch_size, cfg.context, 1, seed=cfg.seed))
    with torch.no_grad():
        logits = model(X)
    metrics = train_gpt.fit(cfg, device, model, optimizer, corpus)
    return dict(logits=logits, losses=metrics["losses"], state=train_gpt.full_state(model),
                parameter_bytes=metrics["parameter_bytes"])


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
            if device.type != "cpu":
                torch.accelerator.synchronize(device)  # kernels run asynchronously: time them, not their launch
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
    """Each stage's idle fraction of the step, measured (1 - its busy time / the step's length, the median over the
    steps, so that one step slowed down by another program does not decide it), next to the formula (p-1)/(m+p-1)
    for p equal stages and m micro-batches; and the most micro-batches a stage held at once (forwards done whose
    backward had not run yet): GPipe m, 1F1B about p."""
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
        idle.append(statistics.median(fractions))
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


# ------------------------------------------------------------------------------------------------------- exercises
# The skeletons the notebook's exercise cells hold (tests/test_exercises_11.py checks that they fail).
SKELETONS = {
    "tp": '''\
def mlp_plan():
    """How to cut GPT's MLP (fc: 64 -> 256, GELU, proj: 256 -> 64) over 2 tensor-parallel ranks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {
        "fc": ColwiseParallel(),
        "proj": ColwiseParallel(),
    }
''',
    "pp": '''\
def make_schedule(stage, batch_size, loss_fn):
    """A schedule for 2 pipeline stages and a batch of `batch_size` sequences that keeps the bubble under 20 %."""
    from torch.distributed.pipelining import ScheduleGPipe
    n_microbatches = 6
    return ScheduleGPipe(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
''',
    "2d": '''\
def parallelize_2d(model, plan):
    """4 ranks: tensor parallel (plan) within pairs of consecutive ranks, FSDP across the pairs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh
''',
    "ddp": '''\
class BucketedDDP:
    """Average the gradients over the ranks as DDP does: buckets of parameters, each all-reduced asynchronously as
    soon as backward has produced all of its gradients, while backward goes on."""

    def __init__(self, model, params_per_bucket=2):
        import torch.distributed as dist
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        # backward produces the gradients roughly in reverse order of the parameters
        self.buckets = [params[::-1][i:i + params_per_bucket] for i in range(0, len(params), params_per_bucket)]
        self.pending = []

    def finish_gradient_sync(self):
        """Called after loss.backward(): every gradient must be the mean over the ranks when this returns."""
        import torch.distributed as dist
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
''',
}


def _errors(results) -> str | None:
    failed = first_error(results)
    return f"rank {failed[0]} failed ({failed[1]})" if failed else None


# Exercise 1: a row-wise layer placed column-wise
def _mlp_trial(mlp_plan) -> dict:
    """On an engine, in a group: GPT's MLP cut by the learner's plan over all ranks, against the whole MLP."""
    import copy
    import logging
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module
    from ..core.gpt import MLP, GPTConfig
    torch.manual_seed(0)
    mlp = MLP(GPTConfig())
    whole = copy.deepcopy(mlp)
    X = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(mlp, mesh, mlp_plan())
    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs a wrong plan's shape error at length
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with CommDebugMode() as forward:
            out = mlp(X)
    finally:
        quiet.setLevel(level)
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    out.square().sum().backward()
    whole(X).square().sum().backward()
    full = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in mlp.named_parameters()}
    return dict(out=(out - whole(X)).abs().max().item(),
                grad=max((full[n] - p.grad).abs().max().item() for n, p in whole.named_parameters()),
                forward={str(op).split(".")[-1]: n for op, n in forward.get_comm_counts().items()},
                local={n: (p.to_local() if hasattr(p, "to_local") else p).numel() for n, p in mlp.named_parameters()},
                whole={n: p.numel() for n, p in whole.named_parameters()})


def check_mlp_plan(cluster, mlp_plan) -> str:
    """Exercise 1: the MLP cut over the engines' ranks must compute what the whole MLP does (output and gradients),
    with each rank holding a share of both weight matrices, and one all-reduce in the forward."""
    cluster.run(on_every_rank, _mlp_trial, mlp_plan, seconds=20.0)
    failed = _errors(cluster.results)
    if failed:
        return (f"wrong: {failed}: proj receives fc's output columns, a slice of the 256 hidden units on each rank; "
                "a column-wise proj wants all of them. Cut proj row-wise (RowwiseParallel): its rows are exactly "
                "that slice, and the ranks' partial products are summed by one all-reduce")
    r = cluster.results[0][1]
    n = len(cluster.results)
    if r["out"] > 1e-5 or r["grad"] > 1e-5:
        return (f"wrong: the output differs from the whole MLP's by {r['out']:.2g} (gradients {r['grad']:.2g}): "
                "fc must take the whole input (column-wise) and proj its output slice (row-wise)")
    unsplit = [name for name in ("fc.weight", "proj.weight") if r["local"][name] == r["whole"][name]]
    if unsplit:
        return (f"wrong: every rank holds the whole {' and '.join(unsplit)}: nothing saved; each of the {n} ranks "
                f"should hold 1/{n} of both weight matrices")
    forward = ", ".join(f"{k} x{v}" for k, v in sorted(r["forward"].items())) or "none"
    if r["forward"] != {"all_reduce": 1}:
        return (f"wrong: the output is right, but the forward communicates ({forward}): with fc column-wise and "
                "proj row-wise the hidden activations never leave their rank, and one all-reduce sums proj's "
                "partial products")
    return (f"correct: output and gradients equal the whole MLP's, each of the {n} ranks holds 1/{n} of fc and proj, "
            "and the forward needs one all-reduce")


def solution_mlp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {
        "fc": ColwiseParallel(),  # whole input, this rank's hidden units (output columns)
        "proj": RowwiseParallel(),  # this rank's hidden units in (input rows), partial sums all-reduced
    }


# Exercise 2: micro-batches that divide the batch
PP_BATCH = 16


def _pipeline_trial(make_schedule) -> dict:
    """On an engine, in a group of 2: the learner's schedule for this rank's stage of GPT, one step on a batch of
    PP_BATCH; its gradients by name, its loss and its number of micro-batches (or the error it raised)."""
    from torch.distributed.pipelining import PipelineStage
    from ..core.gpt import GPTConfig, pipeline_stage
    rank, n = dist.get_rank(), dist.get_world_size()
    model = pipeline_stage(GPT(GPTConfig()), rank, n)
    stage = PipelineStage(model, rank, n, torch.device("cpu"))
    schedule = make_schedule(stage, PP_BATCH, loss_fn)
    m = getattr(schedule, "_n_microbatches", None)
    X, y = next(batches(CharCorpus(), PP_BATCH, 32, 1))
    losses = []
    try:
        if rank == 0:
            schedule.step(X)
        elif rank == n - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
    except Exception as exc:  # noqa: BLE001 - the verdict names it
        return dict(error=describe(exc), micro_batches=m)
    return dict(error=None, micro_batches=m, grads={k: p.grad.clone() for k, p in model.named_parameters()},
                losses=[loss.item() for loss in losses])


def check_schedule(cluster, make_schedule) -> str:
    """Exercise 2: make_schedule(stage, batch_size, loss_fn) on 2 stages; the step's gradients must equal one
    process's on the whole batch, and the bubble (p-1)/(m+p-1) must stay under 20 %."""
    cluster.run(on_every_rank, _pipeline_trial, make_schedule, seconds=20.0)
    failed = _errors(cluster.results)
    if failed:
        return f"wrong: {failed}"
    results = [value for _, value in cluster.results]
    m, p = results[0]["micro_batches"], len(results)
    # the last stage's error first: it is the cause; the others then only see their neighbour hang up
    errors = [r["error"] for r in results[::-1] if r["error"]]
    if m and PP_BATCH % m:
        return (f"wrong: {m} micro-batches do not divide the batch of {PP_BATCH} "
                f"({errors[0] if errors else 'uneven micro-batches'}): the stages size their buffers from the "
                f"first micro-batch, so all must have the same size; choose a divisor of {PP_BATCH}")
    if errors:
        return f"wrong: the step failed ({errors[0]})"
    model = GPT(ParallelConfig().gpt())
    X, y = next(batches(CharCorpus(), PP_BATCH, 32, 1))
    loss_fn(model(X), y).backward()
    grads = {k: g for r in results for k, g in r["grads"].items()}
    worst = max((grads[k] - q.grad).abs().max().item() for k, q in model.named_parameters())
    if worst > 1e-5:
        ratio = sum(g.abs().sum() for g in grads.values()) / sum(q.grad.abs().sum() for q in model.parameters())
        return (f"wrong: the gradients differ from one process's by {worst:.2g} (about {ratio:.3g} times as large): "
                "each micro-batch's loss is a mean over its own sequences, so the schedule must divide the summed "
                "gradients by the number of micro-batches (leave scale_grads=True)")
    b = (p - 1) / (m + p - 1)
    if b >= 0.2:
        return (f"wrong: right gradients, but with {m} micro-batches on {p} stages each stage is idle (p-1)/(m+p-1) "
                f"= {b:.0%} of the step: use more micro-batches (a divisor of {PP_BATCH})")
    return (f"correct: {m} micro-batches of {PP_BATCH // m} sequences, the gradients of the whole batch, and a "
            f"bubble of {b:.0%} on {p} stages")


def solution_make_schedule(stage, batch_size, loss_fn):
    from torch.distributed.pipelining import ScheduleGPipe
    n_microbatches = 8  # divides 16; bubble (2-1)/(8+2-1) = 11 %
    return ScheduleGPipe(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)


# Exercise 3: the mesh's dimensions
def _mesh_trial(parallelize_2d, rank: int, world_size: int = 4) -> dict:
    """In this process, as rank `rank` of a fake 4-rank world (torch's fake process group: no communication, the
    layout only): the learner's parallelize_2d on a whole GPT; which ranks share this rank's TP slices, and how
    attention's q weight is laid out."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from ..core.gpt import GPTConfig
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        model = GPT(GPTConfig())
        parallelize_2d(model, train_tp.tp_plan(model))
        w = model.blocks["0"].attn.q.weight
        names = w.device_mesh.mesh_dim_names or ()
        mesh = w.device_mesh.mesh
        tp_dim = next((i for i, pl in enumerate(w.placements) if pl.is_shard() and type(pl).__name__ == "Shard"),
                      None)  # the tensor-parallel cut (FSDP's is a _StridedShard once TP cut the same dim)
        peers = None
        if tp_dim is not None and mesh.ndim == 2:
            row = mesh if tp_dim == 1 else mesh.T
            peers = next(r for r in row.tolist() if rank in r)
        return dict(error=None, names=list(names), placements=[str(pl) for pl in w.placements],
                    local=w.to_local().shape[0] if hasattr(w, "to_local") else w.shape[0], tp_peers=peers,
                    tp_name=names[tp_dim] if tp_dim is not None and names else None)
    except Exception as exc:  # noqa: BLE001 - the verdict names it
        return dict(error=describe(exc))
    finally:
        dist.destroy_process_group()


def check_mesh(parallelize_2d) -> str:
    """Exercise 3: on 4 ranks, TP must pair consecutive ranks (0, 1) and (2, 3), the GPUs of one node, and FSDP
    shard each TP slice once more across the pairs: q's weight (64 rows) in 4 pieces of 16 rows."""
    if dist.is_initialized():
        return "cannot check here: this process already has a process group (the check simulates 4 ranks itself)"
    trials = [_mesh_trial(parallelize_2d, rank) for rank in range(4)]
    errors = [(rank, t["error"]) for rank, t in enumerate(trials) if t["error"]]
    if errors:
        return f"wrong: rank {errors[0][0]} failed ({errors[0][1]})"
    t = trials[0]
    if len(t["names"]) != 2:
        return (f"wrong: q's weight is cut over {len(t['names'])} mesh dimension ({', '.join(t['placements'])}), not "
                f"2: rank 0 holds {t['local']} of its 64 rows. Apply TP on mesh['tp'] and then FSDP on mesh['dp'] "
                "of one 2-D mesh: 16 rows per rank")
    expected = [[0, 1], [0, 1], [2, 3], [2, 3]]  # rank r's tensor-parallel pair
    peers = [tr["tp_peers"] for tr in trials]
    if peers != expected:
        pairs = sorted({tuple(q) for q in peers if q}) or "none"
        if t["tp_name"] == "dp":
            return (f"wrong: the tensor-parallel pairs are ranks {pairs}: the TP plan went onto mesh['dp'] and FSDP "
                    "onto mesh['tp']; parallelize_module takes mesh['tp'] (the inner dimension, consecutive ranks) "
                    "and fully_shard mesh['dp']")
        return (f"wrong: the tensor-parallel pairs are ranks {pairs}, not (0, 1) and (2, 3): TP talks in every "
                "layer, so it belongs on the inner mesh dimension (consecutive ranks: the GPUs of one node); the "
                "first size in init_device_mesh is the outer dimension, so mesh_dim_names=('dp', 'tp')")
    if t["local"] != 16:
        return (f"wrong: rank 0 holds {t['local']} of q's 64 rows, not 16: TP halves them over mesh['tp'] and FSDP "
                "halves that over mesh['dp']; apply both")
    return "correct: TP pairs (0, 1) and (2, 3) on the inner dimension, FSDP across them: 16 of q's 64 rows per rank"


def solution_parallelize_2d(model, plan):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # outer: dp (across nodes), inner: tp
    parallelize_module(model, mesh["tp"], plan)  # TP first: within the pairs (0, 1) and (2, 3)
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh["dp"])  # then FSDP shards each slice across the pairs
    fully_shard(model, mesh=mesh["dp"])
    return mesh


# Exercise 4: DDP by hand
def _ddp_trial(BucketedDDP) -> dict:
    """On an engine, in a group: a 4-layer MLP with the learner's BucketedDDP, one backward on this rank's data, its
    gradients against torch's DDP on the same data; every all-reduce counted, and whether backward was still
    running when it started."""
    import copy
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference = DDP(copy.deepcopy(model))
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    X, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    torch.nn.functional.cross_entropy(reference(X), y).backward()
    calls, state, real = [], {"backward": False}, dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(dict(during_backward=state["backward"], async_op=bool(kwargs.get("async_op")),
                          numel=tensor.numel()))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        wrapped = BucketedDDP(model, params_per_bucket=2)
        loss = torch.nn.functional.cross_entropy(model(X), y)
        state["backward"] = True
        loss.backward()
        state["backward"] = False
        wrapped.finish_gradient_sync()
    finally:
        dist.all_reduce = real
    mine = [p.grad for p in model.parameters()]
    theirs = [p.grad for p in reference.module.parameters()]
    own = copy.deepcopy(reference.module)  # this rank's gradient alone, for the verdict
    for p in own.parameters():
        p.grad = None
    torch.nn.functional.cross_entropy(own(X), y).backward()
    return dict(calls=calls, params=len(mine),
                diff=max((a - b).abs().max().item() for a, b in zip(mine, theirs)) if all(
                    a is not None for a in mine) else float("inf"),
                ratio=(sum(a.abs().sum() for a in mine) / sum(b.abs().sum() for b in theirs)).item(),
                own=max((a - p.grad).abs().max().item() for a, p in zip(mine, own.parameters())))


def check_bucketed_ddp(cluster, BucketedDDP) -> str:
    """Exercise 4: gradients equal DDP's after finish_gradient_sync(), from fewer all-reduces than parameters (the
    buckets), launched asynchronously while backward still runs."""
    cluster.run(on_every_rank, _ddp_trial, BucketedDDP, seconds=20.0)
    failed = _errors(cluster.results)
    if failed:
        return f"wrong: {failed}"
    r = cluster.results[0][1]
    calls, n = r["calls"], r["params"]
    if r["diff"] > 1e-6:
        if abs(r["ratio"] - len(cluster.results)) < 0.05:
            return (f"wrong: the gradients are {r['ratio']:.2g} times DDP's: all_reduce sums over the ranks; divide by "
                    "the world size for the mean")
        if r["own"] < 1e-7:
            return ("wrong: the gradients are this rank's own, not averaged: an async all-reduce is finished only "
                    "after work.wait(); wait for every bucket before copying its result back into the gradients")
        return f"wrong: the gradients differ from DDP's by {r['diff']:.2g}"
    during = sum(c["during_backward"] for c in calls)
    if len(calls) >= n:
        return (f"wrong: right gradients, but {len(calls)} all-reduces for {n} parameters: put a bucket's gradients "
                "into one flat tensor (torch.cat) and all-reduce that once")
    if not during or not all(c["async_op"] for c in calls if c["during_backward"]):
        return (f"wrong: right gradients from {len(calls)} all-reduces, but none overlaps backward: start each "
                "bucket's all-reduce (async_op=True) from a hook (register_post_accumulate_grad_hook) as soon as "
                "its last gradient is there, and only wait in finish_gradient_sync()")
    return (f"correct: DDP's gradients, from {len(calls)} bucketed all-reduces for {n} parameters, {during} of them "
            "started while backward was still running")


class solution_BucketedDDP:  # noqa: N801 - named as the learner's class, which the checker receives
    """Average the gradients over the ranks as DDP does: buckets of parameters, each all-reduced asynchronously as
    soon as backward has produced all of its gradients, while backward goes on."""

    def __init__(self, model, params_per_bucket=2):
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = [params[::-1][i:i + params_per_bucket] for i in range(0, len(params), params_per_bucket)]
        self.pending = []  # (work, flat tensor, bucket) of every all-reduce in flight
        self.ready = {id(p): 0 for p in params}
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, bucket=bucket: self._grad_ready(p, bucket))

    def _grad_ready(self, p, bucket):
        import torch
        import torch.distributed as dist
        self.ready[id(p)] += 1
        if all(self.ready[id(q)] for q in bucket):  # the bucket's last gradient: send it while backward goes on
            flat = torch.cat([q.grad.reshape(-1) for q in bucket])
            self.pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))

    def finish_gradient_sync(self):
        import torch.distributed as dist
        for work, flat, bucket in self.pending:
            work.wait()
            flat /= dist.get_world_size()  # all_reduce sums; DDP averages
            offset = 0
            for q in bucket:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
                offset += q.numel()
        self.pending = []
        self.ready = dict.fromkeys(self.ready, 0)
