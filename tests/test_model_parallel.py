"""Tensor, pipeline and 2D parallel (train_tp, train_pp, train_2d) equal one process at the same global batch.

Each technique runs in real gloo process groups (2 or 4 processes), through the trainer's own main(cfg), and is
compared with the whole GPT trained in this process on the same batches: the logits of the first batch, the loss of
every step and the weights after 3 AdamW steps. Measured on a 2-core CPU (torch 2.14.1, gloo), the largest
differences over TP (with and without sequence parallel), PP (GPipe, 1F1B) and 2D were 2.1e-7 (logits), 2.4e-7
(loss) and 1.1e-5 (weights after 3 steps; AdamW divides by the root of the squared gradient, which magnifies
float32 rounding in near-zero gradients): sums in another order (row-wise layers add partial sums across ranks,
micro-batches add their gradients). TOLERANCE leaves a margin of about 10x over them; another model (seed 1) is off by
more than 100x the tolerance.
"""
from __future__ import annotations

import io
import multiprocessing
import os

import pytest
import torch
from conftest import agent_store, run, torchrun_cmd, train_cmd

from tutorial.core.parallel_config import ParallelConfig
from tutorial.lessons import model_parallel as mp

TOLERANCE = dict(logits=2e-6, loss=2e-6, weights=1e-4)
CFG = ParallelConfig(steps=3, batch_size=8, micro_batches=4)


def _rank(rank, world_size, rendezvous, fn, args, queue):
    """One process of a group: torchrun's variables, then fn(*args); its result (or error) goes back by queue."""
    os.environ.update(rendezvous, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    try:
        buffer = io.BytesIO()  # as bytes: a tensor itself would be shared by a file descriptor that dies with us
        torch.save(fn(*args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - the test reports it
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}"))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)  # skip interpreter teardown: gloo's threads can abort it (see core.process.exit_process)


def spawn(world_size: int, fn, *args, timeout: float = 120.0) -> list:
    """fn(*args) on `world_size` fresh processes joined as torchrun would join them; their results by rank. The
    processes fork from a server that has imported torch once (importing it 4 times on 2 busy cores takes long)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tutorial.lessons.model_parallel"])
    queue = ctx.Queue()
    with agent_store() as rendezvous:
        procs = [ctx.Process(target=_rank, args=(r, world_size, rendezvous, fn, args, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            results = dict((r, (status, value)) for r, status, value in (queue.get(timeout=timeout) for _ in procs))
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s == "error"]
    assert not errors, "\n".join(errors)
    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world_size)]


@pytest.fixture(scope="module")
def reference():
    return mp.one_process(CFG)


@pytest.mark.parametrize("technique, world_size, changes", [
    ("tp", 2, {}), ("tp", 2, {"sequence_parallel": False}),
    ("pp", 2, {"schedule": "gpipe"}), ("pp", 2, {"schedule": "1f1b"}),
    ("2d", 4, {"tp": 2})])
def test_equals_one_process(technique, world_size, changes, reference, tmp_path):
    cfg = CFG.replace(**changes)
    results = spawn(world_size, mp.parallel_run, technique, cfg, str(tmp_path))
    diff = mp.compare(reference, results, str(tmp_path))
    print(technique, changes, {k: v for k, v in diff.items()})
    assert diff["same_names"]
    for what, limit in TOLERANCE.items():
        assert diff[what] <= limit, f"{technique} {changes}: {what} differ by {diff[what]:.2e} > {limit}"
    if technique == "tp" and not changes:  # the comparison can fail: another seed's model is far outside it
        other = mp.compare(mp.one_process(CFG.replace(seed=1)), results, str(tmp_path))
        assert other["logits"] > 100 * TOLERANCE["logits"] and other["weights"] > 100 * TOLERANCE["weights"]
    # every rank holds less than the whole model: its slices (TP, 2D) or its stage (PP)
    assert max(diff["parameter_bytes"]) < diff["whole_model_bytes"]


def test_tensor_parallel_collectives_and_memory():
    """Per rank, on 2 ranks: the same slices with and without sequence parallel, and sequence parallel turns each
    block's all-reduces into reduce-scatters and all-gathers."""
    counts = spawn(2, mp.tp_communication, CFG)[0]
    print(counts)
    assert "reduce_scatter_tensor" not in counts["plain"]
    assert counts["sequence_parallel"]["reduce_scatter_tensor"] >= 2 * 2 * CFG.n_layers  # 2 blocks x (attn, mlp)


def bubble_in_slots(timeline: dict, step: int) -> list[float]:
    """Each stage's idle fraction of one step in units of one forward or backward of a micro-batch, from the order
    in which the stages really ran them (the events' order on each stage is measured; their durations are not
    used): every event starts as soon as its stage is free and its input is there (a forward needs the previous
    stage's forward of its micro-batch, a backward the next stage's backward, or on the last stage its own forward).
    The formula (p-1)/(m+p-1) is this fraction for equal F and B slots; a stage order that serializes the pipeline
    gives more, whatever the machine's load."""
    p = timeline["stages"]
    order = [sorted((e for e in timeline["events"] if e["stage"] == s and e["step"] == step), key=lambda e: e["start"])
             for s in range(p)]
    done, slot, position = {}, [0] * p, [0] * p  # (stage, kind, micro-batch) -> its slot; each stage's last slot
    while any(position[s] < len(order[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while position[s] < len(order[s]):
                e = order[s][position[s]]
                needs = ((s - 1, "F") if e["kind"] == "F" else (s + 1, "B") if s < p - 1 else (s, "F"))
                if s > 0 or e["kind"] == "B":
                    if (*needs, e["micro_batch"]) not in done:
                        break
                    slot[s] = max(slot[s], done[(*needs, e["micro_batch"])])
                slot[s] += 1
                done[s, e["kind"], e["micro_batch"]] = slot[s]
                position[s], moved = position[s] + 1, True
        assert moved, f"step {step}: the stages' orders wait on each other"
    total = max(slot)
    return [1 - len(order[s]) / total for s in range(p)]


def test_pipeline_bubble_follows_the_formula():
    """The bubble of both schedules, from the forward and backward events each of p = 2 stages really ran, in slots
    of one micro-batch's F or B (bubble_in_slots): (p-1)/(m+p-1) for m = 2 and 8, so it falls as m grows. GPipe holds
    all m micro-batches' activations at once, 1F1B at most p. The idle fractions in seconds are only bounded: on CPUs
    they mostly measure gloo and Python overheads (results/pipeline_bubble.jsonl: GPipe's first stage idled 32 % at
    m = 2 and 27 % at m = 8 against a formula of 33 % and 11 %), and how they approach the formula on a GPU is a
    benchmark (benchmarks/pipeline_bubble.py). Negative control: the same events run one micro-batch at a time
    (F and B of micro-batch k on both stages before k + 1, model parallelism without a pipeline) idle 1/2."""
    cfg = ParallelConfig(batch_size=32, d_model=128, context=64)
    timelines = spawn(2, mp.bubble_sweep, cfg, ("gpipe", "1f1b"), (2, 8), 3)[0]
    by = {(t["schedule"], t["micro_batches"]): mp.bubble(t) for t in timelines}
    assert by["gpipe", 8]["in_flight"] == [8, 8] and max(by["1f1b", 8]["in_flight"]) <= 2
    for t in timelines:
        p, m = t["stages"], t["micro_batches"]
        slots = [bubble_in_slots(t, step) for step in range(t["steps"])]
        print(t["schedule"], m, "slots", slots[0], "seconds", by[t["schedule"], m]["idle"])
        assert all(b == pytest.approx([(p - 1) / (m + p - 1)] * p) for b in slots), (t["schedule"], m, slots)
        assert all(0 <= x < 1 for x in by[t["schedule"], m]["idle"])  # a fraction of the step, on both stages

    gpipe = timelines[0]
    one_at_a_time = [dict(e, start=e["micro_batch"] * 10 + (e["kind"] == "B")) for e in gpipe["events"]]
    assert bubble_in_slots(dict(gpipe, events=one_at_a_time), 0) == [0.5, 0.5]


def test_trainers_run_under_torchrun_and_refuse_bad_options(tmp_path):
    run(torchrun_cmd(2, "pp", "--steps", "2", "--micro-batches", "2", "--out", tmp_path / "pp"))
    assert (tmp_path / "pp" / "model.pt").exists()
    bad = run(torchrun_cmd(2, "pp", "--batch-size", "10", "--micro-batches", "4"), check=False)
    assert bad.returncode != 0 and "batch-size 10 does not split into 4 equal micro-batches" in bad.stderr
    bad = run(train_cmd("tp", "--schedule", "zigzag"), check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: schedule 'zigzag' is not one of: gpipe, 1f1b"


@pytest.mark.parametrize("stage, flag", [("tp", "--micro-batches"), ("pp", "--tp"), ("2d", "--schedule")])
def test_an_option_the_trainer_would_ignore_is_refused_in_one_line(stage, flag):
    value = "gpipe" if flag == "--schedule" else "8"
    proc = run(train_cmd(stage, flag, value), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"error: {flag} {value} is not used by train_{stage}; it works in train_")


def test_the_one_process_trainer_runs_and_learns(tmp_path):
    """train_gpt, the file train_tp and train_pp are diffs of, runs on its own (python -m) and lowers the loss; it
    refuses what only the parallel trainers read."""
    run(train_cmd("gpt", "--steps", "30", "--out", tmp_path / "gpt"))
    import json
    metrics = json.loads((tmp_path / "gpt" / "metrics.json").read_text())
    assert metrics["strategy"] == "gpt" and len(metrics["losses"]) == 30
    assert metrics["losses"][-1] < 0.8 * metrics["losses"][0], metrics["losses"]
    assert (tmp_path / "gpt" / "model.pt").exists()
    bad = run(train_cmd("gpt", "--tp", "4"), check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --tp 4 is not used by train_gpt")


def test_one_layout_check_words_every_refusal(monkeypatch):
    """core.layout says why a cut does not fit, in the same words wherever it is tried: the trainers' setup (before any
    process group), pipeline_stage and 12's planner (test_exercises_12 holds refuse's whole sentence)."""
    from tutorial import train_2d, train_pp, train_tp
    from tutorial.bench.plan import refuse
    from tutorial.core.config import ConfigError
    from tutorial.core.gpt import GPT, GPTConfig, pipeline_stage
    from tutorial.core.layout import Layout, layout_problems

    assert layout_problems(Layout(dp=2, tp=3, pp=2), 4, 3, context=32, vocabulary=48, batch=9, micro_batches=3,
                           ranks=10, job=(1, 8)) == [
        "10 ranks do not split into groups of tp x pp = 3 x 2",
        "dp x tp x pp = 2 x 3 x 2 = 12 ranks, but the job has 1 x 8 = 8 GPUs",
        "4 heads do not split into 3 equal parts", "32 positions of the context do not split into 3 equal parts",
        "3 layers do not split into 2 equal parts"]  # no dp without whole groups: the batch is not checked
    assert layout_problems(Layout(dp=2), 4, 2, batch=9, micro_batches=3) == [
        "batch-size 9 does not split into 2 equal data-parallel parts"]
    assert layout_problems(Layout(dp=2), 4, 2, batch=8, micro_batches=3) == [
        "each data-parallel part (4) does not split into 3 equal micro-batches"]
    assert layout_problems(Layout(dp=2, tp=2, pp=2), 4, 4, context=32, vocabulary=48, batch=8, micro_batches=2,
                           ranks=8, job=(2, 4)) == []
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="3", LOCAL_WORLD_SIZE="3",
                            OMP_NUM_THREADS="1").items():
        monkeypatch.setenv(name, value)  # rank 0 of 3 under torchrun: setup refuses before it waits for the others
    for trainer, cfg, said in [
            (train_tp, ParallelConfig(), "4 heads do not split into 3 equal parts; 32 positions of the context do not "
                                         "split into 3 equal parts"),
            (train_tp, ParallelConfig(sequence_parallel=False), "4 heads do not split into 3 equal parts"),
            (train_pp, ParallelConfig(batch_size=10, micro_batches=4),
             "2 layers do not split into 3 equal parts; batch-size 10 does not split into 4 equal micro-batches"),
            (train_2d, ParallelConfig(tp=2), "3 ranks do not split into groups of tp x pp = 2 x 1")]:
        with pytest.raises(ConfigError) as refused:
            trainer.setup(cfg)
        assert str(refused.value) == said, trainer.__name__
    with pytest.raises(ConfigError, match=r"^2 layers do not split into 3 equal parts$"):
        pipeline_stage(GPT(GPTConfig(n_layers=2)), 0, 3)
    assert refuse(GPTConfig(n_layers=2), Layout(pp=3), 1, 3, 80e9) == ["2 layers do not split into 3 equal parts"]


def _train_and_say(trainer: str, cfg: ParallelConfig, sigterm_on: int | None) -> str:
    """One rank of a GPT trainer's run, given a SIGTERM first if it is rank `sigterm_on`: how the run ended."""
    import importlib

    from tutorial.core.process import Sigterm, Stopped
    from tutorial.core.tracking import DivergedError
    if os.environ.get("RANK", "0") == str(sigterm_on):
        Sigterm.request()  # what the handler does when the walltime's SIGTERM arrives
    try:
        return f"finished {importlib.import_module(f'tutorial.train_{trainer}').main(cfg)['steps']} steps"
    except (DivergedError, Stopped) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        Sigterm.clear()


def test_gpt_trainers_read_the_loss_at_log_steps_where_a_nan_or_a_sigterm_stops_every_rank(tmp_path):
    """The GPT trainers read their loss on the host every log_every steps (not at every step: a read waits for the
    GPU) and agree there, as the image trainers do (core.tracking.agree_at_log_step): a loss gone NaN stops every rank
    at that step naming the first rank; a SIGTERM on one rank stops every rank after the same step, the steps so
    far saved. Control: the same runs at a sane lr and without the SIGTERM finish."""
    blown_up = CFG.replace(lr=1e4, steps=12)
    said = spawn(2, _train_and_say, "tp", blown_up, None)
    assert [s.split(":")[0] for s in said] == ["DivergedError"] * 2, said
    assert all("rank 0: the training loss is " in s and " at step 5 (lr 10000; checked every 5 steps): lower --lr"
               in s for s in said), said
    assert _train_and_say("gpt", blown_up, None).startswith("DivergedError: rank 0: the training loss is nan at step 5")
    assert spawn(2, _train_and_say, "tp", CFG.replace(steps=12), None) == ["finished 12 steps"] * 2

    out = tmp_path / "pp"
    said = spawn(2, _train_and_say, "pp", CFG.replace(steps=12, out=str(out)), 1)
    assert said == [f"Stopped: SIGTERM: stopped after step 5 of 12 on every rank; the steps so far are in {out}"] * 2
    import json
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == len(metrics["losses"]) == 5 and (out / "model.pt").exists()
    assert _train_and_say("gpt", CFG.replace(steps=12), None) == "finished 12 steps"
