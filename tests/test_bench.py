"""The benchmark harness is correct: formulas, the results line, real 2-process runs, clean failures.

Nothing here times anything against a threshold: performance lives in results/, measured by `tutorial bench`.
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import ROOT, env, needs_horovod
from tutorial import bench
from tutorial.core import tracking
from tutorial.core.config import TrainConfig
from tutorial.core.data import SHAPES, DataInfo, build_datasets
from tutorial.core.models import build_model

REQUIRED = {"kind", "date", "hardware", "versions", "command", "parameters", "results"}
STARTED = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)  # lines carry whole seconds


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "tutorial", "bench", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env(), cwd=ROOT)


def check_line(line: dict, kind: str) -> None:
    assert REQUIRED <= set(line) and line["kind"] == kind
    written = datetime.datetime.fromisoformat(line["date"])  # written by this test session, in UTC
    assert written.utcoffset() == datetime.timedelta(0)
    assert STARTED <= written <= datetime.datetime.now(datetime.timezone.utc), (line["date"], STARTED)
    assert {"cpu", "cores", "gpus"} <= set(line["hardware"])
    assert {"python", "torch"} <= set(line["versions"])
    assert line["command"][:2] == ["tutorial", "bench"] or line["command"][0] == "python"


def check_summary(s: dict) -> None:
    assert {"median", "min", "max", "repeats"} <= set(s)
    assert s["min"] <= s["median"] <= s["max"] and len(s["repeats"]) >= 1


# ------------------------------------------------------------------------------------------------- arithmetic
def test_bus_bandwidth_is_the_nccl_tests_formula():
    # 1 MB in 1 ms is 1 GB/s of algorithm bandwidth; a ring moves 2(n-1)/n of it over each link.
    assert bench.bus_bandwidth(1e6, 1e-3, 2) == pytest.approx(1e9)
    assert bench.bus_bandwidth(1e6, 1e-3, 4) == pytest.approx(1.5e9)
    assert bench.bus_bandwidth(1e6, 1e-3, 8) == pytest.approx(1.75e9)


def test_scaling_speedup_efficiency_and_breakdown():
    rows = bench.scaling_table([dict(nproc=1, samples_per_second=100.0), dict(nproc=2, samples_per_second=180.0),
                                dict(nproc=4, samples_per_second=300.0)])
    assert [r["speedup"] for r in rows] == pytest.approx([1, 1.8, 3])
    assert [r["efficiency"] for r in rows] == pytest.approx([1, 0.9, 0.75])
    parts = bench.breakdown(compute_s=0.010, ddp_synthetic_s=0.012, ddp_real_s=0.015)
    assert parts["communication_s"] == pytest.approx(0.002) and parts["data_loading_s"] == pytest.approx(0.003)
    assert parts["compute_s"] + parts["communication_s"] + parts["data_loading_s"] == pytest.approx(parts["step_s"])
    assert bench.nproc_ladder(1) == [1] and bench.nproc_ladder(6) == [1, 2, 4, 6] and bench.nproc_ladder(8) == [1, 2,
                                                                                                               4, 8]


def test_runlog_times_steps_only_on_request_and_counts_short_and_accumulated_batches():
    loader = DataLoader(TensorDataset(torch.zeros(70, 1), torch.zeros(70)), batch_size=32)  # 32, 32, 6
    assert "step_times" not in tracking.RunLog(TrainConfig(), "single", "cpu", rank=1).finish()
    log = tracking.RunLog(TrainConfig(time_steps=True), "single", "cpu", rank=1)
    for epoch in range(2):
        for i, (X, y) in enumerate(log.bar(loader, epoch)):
            if epoch == 0 or i % 2 == 1 or i + 1 == len(loader):  # epoch 1: two micro-batches per step
                log.step(i, torch.zeros(()), 0.1, 1.0)
    times = log.finish()["step_times"]
    assert times["samples"] == [32, 32, 6, 64, 6] and len(times["seconds"]) == 5
    assert all(s >= 0 for s in times["seconds"]) and len(times["cpu_seconds"]) == 5


def test_synthetic_data_has_the_datasets_shape():
    train, test, info = build_datasets(TrainConfig.preset("smoke", synthetic=True, max_steps=3))
    assert info == SHAPES["digits"] and train[0][0].shape == (1, 8, 8) and len(train) >= 3 * 32
    assert {int(train[i][1]) for i in range(len(train))} == set(range(10))


def test_measure_run_times_a_real_trainer_after_its_warmup():
    run = bench.measure_run("single", TrainConfig.preset("smoke", synthetic=True), warmup=2, steps=3)
    assert run["samples"] == [32, 32, 32] and len(run["seconds"]) == 3 and run["threads"] >= 1


def test_results_line_schema(tmp_path):
    path = bench.append_result(tmp_path, "train", ["tutorial", "bench", "train"], dict(a=1),
                               dict(samples_per_second=bench.summary([3, 1, 2])))
    bench.append_result(tmp_path, "allreduce", ["tutorial", "bench", "allreduce"], {}, {})
    assert path == tmp_path / "train.jsonl" and len(bench.read_results(tmp_path)) == 2
    (line,) = bench.read_results(tmp_path, "train")
    check_line(line, "train")
    assert line["results"]["samples_per_second"]["median"] == 2
    json.dumps(line)  # plain JSON all the way down
    assert [line["kind"] for line in bench.read_results(tmp_path, "allreduce")] == ["allreduce"]


# ------------------------------------------------------------------------------------------------- real runs
def test_ddp_two_processes_prints_a_table_and_appends_a_line(tmp_path):
    proc = cli("train", "--strategy", "ddp", "--nproc", 2, "--preset", "smoke", "--steps", 4, "--warmup", 1,
               "--repeats", 1, "--results-dir", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "samples/s" in proc.stdout and "ddp" in proc.stdout
    (line,) = bench.read_results(tmp_path / "train.jsonl")
    check_line(line, "train")
    assert line["parameters"]["strategy"] == "ddp" and line["parameters"]["nproc"] == 2
    assert line["parameters"]["global_batch_size"] == 64
    check_summary(line["results"]["samples_per_second"])
    assert line["results"]["samples_per_second"]["median"] > 0


def test_allreduce_gloo_two_processes(tmp_path, capsys):
    code = bench.main(["allreduce", "--backend", "gloo", "--nproc", "2", "--max-bytes", "16K", "--iters", "3",
                       "--repeats", "2", "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "busbw GB/s" in out and "16 KiB" in out
    (line,) = bench.read_results(tmp_path / "allreduce.jsonl")
    check_line(line, "allreduce")
    assert [row["bytes"] for row in line["results"]["sizes"]] == [1024, 4096, 16384]
    for row in line["results"]["sizes"]:
        check_summary(row["busbw_GBps"])
        # busbw is algbw x 2(n-1)/n = algbw for two processes
        assert row["busbw_GBps"]["median"] == pytest.approx(row["algbw_GBps"]["median"])


def load_bare_loop():
    spec = importlib.util.spec_from_file_location("bare_loop", ROOT / "benchmarks" / "bare_loop.py")
    bare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bare)
    return bare


def test_bare_loop_runs_the_package_model_without_package_code():
    bare = load_bare_loop()
    ours, theirs = bare.make_model("cnn", 1, 10, 8), build_model("cnn", DataInfo(1, 10, 8))
    assert [p.shape for p in ours.parameters()] == [p.shape for p in theirs.parameters()]
    loop_part = (ROOT / "benchmarks" / "bare_loop.py").read_text().split("def compare")[0]
    assert "from tutorial" not in loop_part and "import tutorial" not in loop_part
    seconds, cpu_seconds = bare.bare_loop(warmup=1, steps=3)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert cpu_seconds is None or len(cpu_seconds) == 3


@needs_horovod
def test_overhead_comparison_records_a_ratio_per_stage(tmp_path):
    """The reference loops of all three stages run (DDP and Horovod in 2 processes, alternated with their trainers)
    and each stage gets one overhead line."""
    proc = subprocess.run([sys.executable, "benchmarks/bare_loop.py", "--stage", "single,ddp,horovod", "--nproc", "2",
                           "--threads", "1", "--warmup", "1", "--steps", "3", "--repeats", "1",
                           "--results-dir", tmp_path], capture_output=True, text=True, timeout=300, env=env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = bench.read_results(tmp_path / "overhead.jsonl")
    assert [line["parameters"]["trainer"] for line in lines] == ["single", "ddp", "horovod"]
    assert [line["parameters"]["nproc"] for line in lines] == [1, 2, 2]
    for line in lines:
        check_line(line, "overhead")
        check_summary(line["results"]["ratio"])
        assert line["results"]["ratio"]["median"] > 0 and line["parameters"]["threads"] == 1


@pytest.mark.skipif(not shutil.which("valgrind"), reason="valgrind is not installed (only --instructions needs it)")
def test_instruction_counts_are_read_from_callgrind_dumps(tmp_path):
    """A real callgrind dump (of /bin/true: a second under valgrind) is read back as valgrind itself counted it."""
    run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp_path}/cg.0.1-01", "true"],
                         capture_output=True, text=True, timeout=120, check=True)
    collected = int(re.search(r"Collected : (\d+)", run.stderr).group(1))
    assert load_bare_loop()._callgrind_total(tmp_path, 1) == collected > 10_000
    with pytest.raises(RuntimeError, match="no dump 2 for rank 0"):
        load_bare_loop()._callgrind_total(tmp_path, 2)


@pytest.mark.parametrize("args, says", [
    (["--stage", "ddp,fsdp"], "--stage 'ddp,fsdp': choose from single, ddp, horovod"),
    (["--steps", "0"], "--steps and --repeats must be at least 1"),
    (["--instructions", "--calibrate"], "--instructions needs no --calibrate"),
    (["--instructions", "--stage", "ddp,horovod"], "Horovod waits for its background thread by polling"),
    (["--instructions", "--no-valgrind-on-path"], "needs valgrind's callgrind: apt-get install valgrind"),
])
def test_bare_loop_bad_input_is_one_line_and_exit_2(args, says, capsys, monkeypatch, tmp_path):
    if "--no-valgrind-on-path" in args:  # a PATH with python but no valgrind
        args = [a for a in args if a != "--no-valgrind-on-path"]
        monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # compare() prepends benchmarks/ to it
    assert load_bare_loop().compare([*args, "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1 and not list(tmp_path.iterdir())


# -------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("args, says", [
    (["train", "--nproc", str(os.cpu_count() + 1), "--strategy", "ddp"], "more than"),
    (["train", "--strategy", "fsdp"], "'fsdp' is not one of"),
    (["train", "--steps", "0"], "--steps: must be at least 1, got 0"),
    (["train", "--strategy", "single", "--nproc", "2"], "runs one process"),
    (["allreduce", "--nproc", "1"], "--nproc: must be at least 2"),
    (["allreduce", "--max-bytes", "12Q"], "'12Q' is not a size"),
    pytest.param(["allreduce", "--backend", "nccl"], "backend nccl needs GPUs; this machine has none",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA GPUs")),
    (["allreduce", "--nproc", "999"], "--nproc 999 is more than the"),
    (["scaling", "--max-nproc", str(os.cpu_count() + 1)], "--max-nproc"),
    (["nonsense"], "command 'nonsense' is not one of: train, allreduce, scaling"),
    ([], "required"),
])
def test_bad_input_is_one_line_and_exit_2(args, says, capsys):
    assert bench.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err


def test_bad_input_from_the_command_line_has_no_traceback():
    proc = cli("train", "--strategy", "ddp", "--nproc", os.cpu_count() + 1)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


# -------------------------------------------------------------------------------------------- no leftovers
def _fail_on_rank_1(job, rank, nproc):
    if rank == 1:
        raise RuntimeError("rank 1 broke")
    time.sleep(600)  # rank 0 would wait forever for its partner: the launcher must stop it


def _hang(job, rank, nproc):
    time.sleep(60)


def test_a_failed_or_hung_run_leaves_no_process():
    """A rank that fails stops the run at once, not at its timeout (120 s here; starting the two processes takes
    seconds, up to ~25 s on a loaded 2-core machine); a hung one is stopped at its timeout."""
    started = time.monotonic()
    with pytest.raises(bench.RunFailed, match="rank 1 broke"):
        bench.launch(_fail_on_rank_1, {}, 2, timeout=120)
    assert time.monotonic() - started < 80
    with pytest.raises(bench.RunFailed, match="did not finish"):
        bench.launch(_hang, {}, 1, timeout=3)
    assert multiprocessing.active_children() == []


def test_plots_draw_results_lines():
    """What the plots draw is the results line's numbers: speed-up and efficiency, and the stacked step times."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tutorial.lessons import plots
    points = bench.scaling_table([dict(nproc=1, samples_per_second=100.0), dict(nproc=2, samples_per_second=150.0)])
    # nproc 1: communication comes out slightly negative (noise), which is drawn as zero
    parts = [dict(nproc=1, **bench.breakdown(0.010, 0.0099, 0.012)),
             dict(nproc=2, **bench.breakdown(0.010, 0.013, 0.014))]
    line = dict(date="2026-11-21T00:00:00+00:00", parameters=dict(mode="weak", strategy="ddp", model="cnn",
                                                                  device="cpu"),
                results=dict(points=points, breakdown=parts))
    ax = plots.scaling_plot(line).axes[0]
    ideal, measured = ax.get_lines()
    assert list(ideal.get_xdata()) == list(ideal.get_ydata()) == [1, 2]
    assert list(measured.get_xdata()) == [1, 2] and list(measured.get_ydata()) == pytest.approx([1.0, 1.5])
    assert [t.get_text() for t in ax.texts] == ["100%", "75%"]
    assert ax.get_title() == "ddp cnn on cpu (2026-11-21)"
    ax = plots.breakdown_plot(line).axes[0]
    compute, communication, loading = ax.containers  # one bar per nproc in each
    assert [b.get_height() for b in compute] == pytest.approx([10.0, 10.0])  # ms per step
    assert [b.get_height() for b in communication] == pytest.approx([0.0, 3.0])
    assert [b.get_height() for b in loading] == pytest.approx([2.1, 1.0])
    assert [b.get_y() for b in loading] == pytest.approx([10.0, 13.0])  # stacked on compute + communication
    plt.close("all")


def test_the_median_interval_uses_order_statistics():
    # n = 30: P(Binomial(30, 1/2) <= 9) = 2.1 % and <= 10 is 4.9 %, so the 10th smallest and 10th largest.
    assert bench.median_ci95(list(range(30))) == [9, 20]
    assert bench.median_ci95([5.0, 1.0, 4.0, 2.0, 3.0]) is None  # 5 values cannot give 95 %
    assert bench.median_ci95([6, 1, 5, 2, 4, 3]) == [1, 6]  # 6 values: the extremes, P(all on one side) = 1/64
