"""The notebooks' helper functions teach facts; these tests check that the facts are true (the notebooks also
execute them under nbval, but a wrong helper there would print a wrong 'True' that nobody re-derives)."""
from __future__ import annotations

import json
import os
import re
import time

import torch
import torch.multiprocessing as mp

from tutorial import train_single
from conftest import ROOT, agent_store

from tutorial.core.config import TrainConfig
from tutorial.core.data import SHAPES
from tutorial.core.models import build_model, checksum
from tutorial.core.optim import lr_at, scaled_lr
from tutorial.core.distributed import hold_port
from tutorial.lessons import data_parallel, ddp, horovod as lessons_horovod, mixed_precision, notebook


def test_data_parallel_by_hand_gives_the_full_batch_gradient():
    torch.manual_seed(0)
    model, X, y = data_parallel.model_and_batch(TrainConfig.preset("smoke"), batch_size=16, device=torch.device("cpu"))
    dp = data_parallel.data_parallel_by_hand(model, X, y, replicas=2)
    full = data_parallel.batch_gradient(model, X, y)
    # DP sums the replicas' gradients of a loss averaged over the whole batch: the full-batch gradient.
    assert torch.allclose(dp["gradient"], full, atol=1e-6)
    assert dp["processes"] == 1 and dp["threads"] == 2 and dp["batch slices"] == [8, 8]


def test_grad_scaler_skips_overflowing_steps_and_halves_the_scale():
    rows = mixed_precision.scaler_demo(("ok", "inf", "ok", "ok", "nan"), init_scale=1024.0, growth_interval=2)
    assert [r["weight updated"] for r in rows] == [True, False, True, True, False]
    assert rows[1]["next scale"] == rows[1]["scale"] / 2
    assert rows[3]["next scale"] == rows[3]["scale"] * 2  # two good steps in a row: the scale grows


def seed_002_prose_errors(prose: str) -> list[str]:
    """Where 05's prose under seed 002's table quotes a figure that the table (lessons.horovod.seed002_scaling, the
    seed's seconds with their speed-up and efficiency) does not give."""
    mnist = {r["GPUs"]: r for r in lessons_horovod.seed002_scaling("MNIST")}
    cifar = {r["GPUs"]: r for r in lessons_horovod.seed002_scaling("cifar10")}
    c = re.search(r"CIFAR-10 scales alike: ([\d.]+) s on 1 GPU, ([\d.]+) s on 8 \(([\d.]+)x\)", prose)
    m = re.search(r"MNIST scales at (\d+) % efficiency on 2 GPUs and above 100 % on 4 and 8 \(([\d.]+)x on 8 GPUs\)"
                  r".*at 8 GPUs an epoch lasts under (\d+) s", prose, re.S)
    quoted = {"CIFAR-10 s on 1": float(c[1]), "CIFAR-10 s on 8": float(c[2]), "CIFAR-10 speed-up on 8": float(c[3]),
              "MNIST efficiency % on 2": int(m[1]), "MNIST speed-up on 8": float(m[2])}
    table = {"CIFAR-10 s on 1": cifar[1]["seconds"], "CIFAR-10 s on 8": cifar[8]["seconds"],
             "CIFAR-10 speed-up on 8": cifar[8]["speed-up"], "MNIST efficiency % on 2": mnist[2]["efficiency %"],
             "MNIST speed-up on 8": mnist[8]["speed-up"]}
    errors = [f"{k}: the prose says {v}, the table {table[k]}" for k, v in quoted.items() if v != table[k]]
    errors += [f"MNIST efficiency on {g} GPUs is {mnist[g]['efficiency %']} %, not above 100 %"
               for g in (4, 8) if mnist[g]["efficiency %"] <= 100]
    if mnist[8]["seconds"] / 32 >= int(m[3]):  # the table's seconds are for 32 epochs
        errors.append(f"an MNIST epoch on 8 GPUs lasts {mnist[8]['seconds'] / 32:.2f} s, not under {m[3]} s")
    return errors


def test_seed_002_figures_in_05_are_its_tables(monkeypatch):
    """The figures 05 quotes under seed 002's table (8.5x and 88 % on MNIST, above 100 % on 4 and 8 GPUs, CIFAR-10's
    7.1x) are what the table computes from the seed's seconds. Negative controls: prose that misquotes the table, and
    a seed time mistyped in the table (MNIST on 8 GPUs 62.0 s instead of 58.8, 8.1x) under the same prose."""
    cells = json.loads((ROOT / "notebooks" / "05_horovod.ipynb").read_text())["cells"]
    prose = next("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"
                 and "Source: seed 002" in "".join(c["source"]))
    assert seed_002_prose_errors(prose) == []
    assert seed_002_prose_errors(prose.replace("88 %", "90 %")) == [
        "MNIST efficiency % on 2: the prose says 90, the table 88"]
    monkeypatch.setitem(lessons_horovod.SEED_002_SECONDS, 8, (73.5, 62.0))
    assert seed_002_prose_errors(prose) == ["MNIST speed-up on 8: the prose says 8.5, the table 8.1"]


def test_warmup_reaches_the_scaled_peak():
    cfg = TrainConfig.preset("smoke", warmup_epochs=1, epochs=4)
    peak = scaled_lr(cfg, 8)
    assert peak == 8 * cfg.lr
    assert lr_at(cfg, 0.0, peak) < 0.01 * peak
    assert abs(lr_at(cfg, 1.0, peak) - peak) < 1e-9
    assert lr_at(cfg, 4.0, peak) < 1e-9  # cosine decays to zero at the end


# ---------------------------------------------------------------------------------- what the helpers reuse
def test_diff_shows_a_whole_trainer_or_one_function(capsys):
    notebook.diff("train_single", "train_ddp")
    whole = capsys.readouterr().out
    assert whole.startswith("--- train_single.py\n+++ train_ddp.py\n") and "+import torch.distributed as dist" in whole
    notebook.diff("train_single", "train_ddp", "evaluate")
    one = capsys.readouterr().out.splitlines()
    assert one[:2] == ["--- train_single.evaluate", "+++ train_ddp.evaluate"]
    assert [line for line in one if line.startswith(("+", "-"))][2:] == \
        ["+    dist.all_reduce(sums)  # DDP: sum the shards' loss, correct and count over all ranks"]


def test_global_batchnorm_keeps_the_tensors_ddp_and_the_optimizer_hold():
    model = build_model("cnn_bn", SHAPES["digits"])
    before = model.state_dict(keep_vars=True)
    X = torch.randn(4, 1, 8, 8)
    expected = model(X)
    ddp.GlobalBatchNorm2d.convert(model)  # in place, as compare_replicas converts a model already wrapped in DDP
    assert [type(m).__name__ for m in model if "Norm" in type(m).__name__] == ["GlobalBatchNorm2d"] * 2
    assert all(t is before[name] for name, t in model.state_dict(keep_vars=True).items())
    assert torch.allclose(model(X), expected, atol=1e-6)  # in one process it is BatchNorm2d


def _compare_replicas_on_rank(rank: int, rendezvous: dict, out: str) -> None:
    os.environ.update(rendezvous, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    cfg = TrainConfig.preset("smoke", model="cnn_bn", epochs=1, max_steps=3)
    rows = {}
    for attempt, global_bn in enumerate((False, True)):  # a fresh group each time, as on the engines
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
        rows[str(global_bn)] = ddp.compare_replicas(cfg, global_bn=global_bn)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def test_compare_replicas_runs_the_trainer_and_finds_the_batchnorm_buffers(tmp_path):
    out = str(tmp_path / "rows.json")
    with agent_store() as rendezvous:
        mp.spawn(_compare_replicas_on_rank, args=(rendezvous, out), nprocs=2)
    results = json.loads(open(out).read())
    for global_bn, buffers_differ in (("False", ["1.running_mean", "1.running_var", "4.running_mean", "4.running_var"]),
                                      ("True", [])):  # each rank's own batch statistics, or the global batch's
        rows = results[global_bn]
        assert all(r["identical"] for r in rows if r["kind"] == "parameter")
        assert sorted(r["tensor"] for r in rows if not r["identical"]) == buffers_differ


def test_load_checkpoint_rebuilds_the_saved_model(tmp_path):
    metrics = train_single.main(TrainConfig.preset("smoke", epochs=1, max_steps=3, out=str(tmp_path)))
    model, ckpt = ddp.load_checkpoint(str(tmp_path))
    assert checksum(model) == metrics["replica_checksums"][0] and ckpt["step"] == 3


def test_measurements_keep_the_columns_the_notebooks_print():
    cfg = TrainConfig.preset("smoke")
    assert [list(r) for r in data_parallel.dp_throughput(cfg, steps=2)] == [["model", "gpus", "batch", "samples/s"]] * 2
    rows = mixed_precision.precision_benchmark(cfg, ("fp32", "bf16"), steps=2)
    assert [r["precision"] for r in rows] == ["fp32", "bf16"] and all(r["samples/s"] > 0 for r in rows)


def test_an_error_is_quoted_as_its_first_line_without_gloo_source_prefix():
    from tutorial.lessons import ranks
    exc = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\nmore")
    assert ranks.first_line(exc) == "Connection closed by peer"
    assert ranks.describe(ValueError("x" * 500)) == "ValueError: " + "x" * ranks.LIMIT
    assert ranks.describe(KeyError()) == "KeyError: " and ranks.first_line("", None) == ""
    assert ranks.first_error([("ok", 1), ("error", "TypeError: no"), ("error", "later")]) == (1, "TypeError: no")


def test_on_every_rank_turns_the_learners_error_into_text_and_leaves_no_group():
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(hold_port()), RANK="0", WORLD_SIZE="1")
    try:
        from tutorial.lessons.ranks import on_every_rank
        assert on_every_rank(lambda a, r, n: (a, r, n), "x", inputs=lambda rank, size: (rank, size)) == \
            ("ok", ("x", 0, 1))
        assert on_every_rank(lambda: {}["missing"]) == ("error", "KeyError: 'missing'")
        assert not dist.is_initialized()
    finally:
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            os.environ.pop(name, None)


def test_memory_table_puts_a_gpu_ranks_peak_beside_the_tensor_bytes():
    """09's table: tensor bytes on every rank; on GPU ranks also torch.cuda.max_memory_allocated's peak (review 5,
    item 8). CPU ranks' tables keep their columns (the stored output of 09 stays as it is)."""
    from tutorial.lessons import sharded
    row = dict(strategy="ddp", parameters=4e6, gradients=4e6, optimizer_state=4e6, master_copy=0)
    assert "GPU peak MB" not in sharded.memory_table([dict(row, gpu_peak=None)])[0]
    on_gpu = sharded.memory_table([dict(row, gpu_peak=30e6)])[0]
    assert on_gpu["GPU peak MB"] == 30 and on_gpu["total MB"] == 12


def test_a_notebooks_runs_folder_starts_empty_so_no_cell_reads_an_earlier_execution(tmp_path, monkeypatch):
    """06 on a torch without a working Horovod (2026-11-27): horovodrun failed, and the next cell checked the
    metrics.json of the run before as its own (world size 2, accuracy, replicas identical: all passed)."""
    from tutorial.lessons import failures, notebook
    monkeypatch.setenv("TUTORIAL_RUNS", str(tmp_path))
    first = notebook.runs_dir("06_multi_node")
    os.makedirs(os.path.join(first, "horovodrun"))
    with open(os.path.join(first, "horovodrun", "metrics.json"), "w") as f:
        f.write('{"world_size": 2}')
    assert notebook.runs_dir("06_multi_node") == first and os.listdir(first) == []
    with open(os.path.join(first, "checkpoint.pt"), "w") as f:
        f.write("an earlier run's")
    assert failures.fresh_dir("06_multi_node") == os.path.abspath(first) and os.listdir(first) == []
    # 03b's capstone keeps the learner's edited script across executions of its cell
    capstone = notebook.runs_dir("03_capstone", empty=False)
    with open(os.path.join(capstone, "train_ddp.py"), "w") as f:
        f.write("# my DDP edits")
    assert os.listdir(notebook.runs_dir("03_capstone", empty=False)) == ["train_ddp.py"]
    # a runs folder that links to scratch is emptied, not replaced
    scratch = tmp_path / "scratch"
    (scratch / "old").mkdir(parents=True)
    os.symlink(scratch, os.path.join(str(tmp_path), "12_performance_clinic"))
    emptied = notebook.runs_dir("12_performance_clinic")
    assert os.listdir(emptied) == [] and os.path.islink(emptied)


def test_timings_repeat_and_take_as_many_calls_as_fit_their_time():
    """04's comparison: every repeat times the same number of calls, 10 of a fast call, 1 of a slow one (a bf16 step
    on a CPU without bf16 units takes 1.5 s), after the warm-up calls."""
    from tutorial.lessons.mixed_precision import seconds_per_call

    for pause, calls_per_repeat in ((0.0, 10), (0.3, 1)):
        calls = []
        seconds = seconds_per_call(lambda: (calls.append(1), time.sleep(pause)), torch.device("cpu"), repeats=3,
                                   warmup=2)
        assert len(seconds) == 3 and len(calls) == 2 + 3 * calls_per_repeat, (pause, len(calls))
        assert all(pause <= s < 2 * pause + 0.05 for s in seconds), seconds  # seconds per call, not per repeat
