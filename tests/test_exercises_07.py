"""07_scaling_study's exercises: each checker accepts the package's solution and rejects the notebook's unedited
skeleton with the verdict that names the mistake (no engines needed: plain arithmetic on fixed tables)."""
from __future__ import annotations

from conftest import skeleton as notebook_skeleton

from tutorial.lessons import measure


def skeleton(heading: str):
    return notebook_skeleton("07_scaling_study", heading)


def test_exercise_1_checker_accepts_the_solution_and_names_per_rank_throughput():
    assert measure.check_scaling(measure.solution_scaling) == (
        "correct: weak scaling 5.00x at 8 processes (62% efficiency), strong scaling 2.22x at 4 (56%)")
    verdict = measure.check_scaling(skeleton("### Exercise 1"))
    assert verdict.startswith("wrong: at 2 processes of the weak-scaling table")
    assert "you compared one rank's samples/s" in verdict and "summed over all processes" in verdict


def test_exercise_1_checker_names_the_other_mistakes():
    def step_time_ratio(rows):  # right for strong scaling only
        return [dict(nproc=r["nproc"], speedup=rows[0]["step_s"] / r["step_s"],
                     efficiency=rows[0]["step_s"] / r["step_s"] / r["nproc"]) for r in rows]

    def efficiency_is_speedup(rows):
        return [dict(r, efficiency=r["speedup"]) for r in measure.solution_scaling(rows)]

    assert "one rank's samples/s" in measure.check_scaling(step_time_ratio)
    assert "efficiency equals the speed-up" in measure.check_scaling(efficiency_is_speedup)
    assert measure.check_scaling(lambda rows: 1 / 0).startswith("wrong: scaling() failed")


def test_exercise_2_checker_accepts_the_solution_and_names_algbw():
    assert measure.check_bus_bandwidth(measure.solution_bus_bandwidth).startswith("correct: busbw = algbw x 2(n-1)/n")
    verdict = measure.check_bus_bandwidth(skeleton("### Exercise 2"))
    assert verdict.startswith("wrong: 1.67772e+07 bytes in 20 ms on 4 processes") and "That is algbw" in verdict


def test_exercise_2_checker_names_the_other_factors():
    assert "not 2" in measure.check_bus_bandwidth(lambda size, s, n: 2 * size / s / 1e9)
    assert "reduce-scatter plus an all-gather" in measure.check_bus_bandwidth(
        lambda size, s, n: size / s / 1e9 * (n - 1) / n)
    assert "Units" in measure.check_bus_bandwidth(lambda size, s, n: size / s * 2 * (n - 1) / n)


def test_exercise_1_accepts_global_batch_over_step_time():
    def global_batches(rows):  # the same throughput, written with the global batch
        first = rows[0]["nproc"] * rows[0]["batch_per_process"] / rows[0]["step_s"]
        table = []
        for r in rows:
            global_batch = r["nproc"] * r["batch_per_process"]
            speedup = (global_batch / r["step_s"]) / first
            table.append({"nproc": r["nproc"], "speedup": speedup, "efficiency": speedup / (r["nproc"] / rows[0]["nproc"])})
        return table
    assert measure.check_scaling(global_batches).startswith("correct: weak scaling 5.00x")


def test_exercise_2_accepts_bytes_moved_per_rank_over_time():
    def moved(size, seconds, nproc):  # each rank sends 2(n-1)/n of the data in a ring
        return (2 * (nproc - 1) / nproc * size) / seconds / 1e9
    assert measure.check_bus_bandwidth(moved).startswith("correct: busbw = algbw x 2(n-1)/n")


def test_exercise_3_checker_accepts_two_correct_answers_and_names_the_forward_only_mistake():
    assert measure.check_mfu(measure.solution_mfu) == (
        "correct: MFU = 3 x forward FLOPs per sample x samples/s / peak (the H100 case: 36%)")

    def one_fraction(batch_forward_flops, batch_size, samples_per_second, peak):  # written another way, also right
        achieved = (batch_forward_flops * 3) * (samples_per_second / batch_size)  # FLOP/s of the training steps
        return achieved / peak

    assert measure.check_mfu(one_fraction).startswith("correct:")
    verdict = measure.check_mfu(skeleton("### Exercise 3"))
    assert verdict.startswith("wrong: 10 GFLOP forward per sample") and "forward pass only" in verdict


def test_exercise_3_checker_names_the_other_mistakes():
    def per_batch(f, b, r, p):
        return 3 * f * r / p

    def percent(f, b, r, p):
        return 100 * measure.solution_mfu(f, b, r, p)

    def macs(f, b, r, p):
        return measure.solution_mfu(f, b, r, p) / 2

    assert "divide by the batch size" in measure.check_mfu(per_batch)
    assert "not a percentage" in measure.check_mfu(percent)
    assert "2 FLOPs per multiply-add" in measure.check_mfu(macs)
    assert measure.check_mfu(lambda *a: 1 / 0).startswith("wrong: mfu(")


def test_peak_flops_is_known_for_datasheet_gpus_only(monkeypatch):
    """Dense datasheet peaks per device torch sees, on every vendor: an AMD GPU is a "cuda" device (its name says AMD),
    an Intel one "xpu". A GPU missing from the table gets None and a line asking for its peak, never a CPU core's
    estimate. Controls: f7f8195's peak_flops answered None for an xpu device and for MI250X, MI300X, V100, L40S and
    H200 NVL (so 07 divided their runs by one core's peak), and would have given H200 NVL the SXM's 989."""
    import torch
    assert measure.peak_flops(torch.device("cpu")) is None  # no datasheet peak for a CPU: the notebook says so
    assert measure.peak_missing(torch.device("cpu")) == \
        "peak: no datasheet peak for this device; exercise 3 uses an estimate for one CPU core"  # 07's stored line
    cuda = (("NVIDIA H100 80GB HBM3", 989, 495), ("NVIDIA H100 PCIe", 756, 378), ("NVIDIA A100-SXM4-80GB", 312, 156),
            ("NVIDIA H200", 989, 495), ("NVIDIA H200 NVL", 835, 418), ("NVIDIA L40S", 362, 183),
            ("Tesla V100-SXM2-32GB", None, None), ("AMD Instinct MI250X", 191.5, None),
            ("AMD Instinct MI300X", 1307.4, 653.7), ("NVIDIA GeForce RTX 4090", None, None))
    for name, bf16, tf32 in cuda:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        gpu = torch.device("cuda", 0)
        assert measure.peak_flops(gpu) == (bf16 * 1e12 if bf16 else None), name
        assert measure.peak_flops(gpu, "tf32") == (tf32 * 1e12 if tf32 else None), name
    # V100: no bf16 and no TF32 (None above), fp16 tensor cores; fp16 elsewhere is the bf16 figure
    for name, fp16 in (("Tesla V100-SXM2-32GB", 125), ("Tesla V100-PCIE-16GB", 112), ("Tesla V100S-PCIE-32GB", 130),
                       ("NVIDIA A100-SXM4-80GB", 312), ("AMD Instinct MI250X", 191.5)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert measure.peak_flops(torch.device("cuda", 0), "fp16") == fp16 * 1e12, name
    assert measure.peak_flops(torch.device("cuda", 0), "fp32") == 47.85e12  # MI250X has FP32 matrix cores, no TF32
    # a GPU with no figure asks for one, names itself and the dtype, and says nothing of a CPU core
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    ask = measure.peak_missing(torch.device("cuda", 0), "bf16")
    assert "NVIDIA GeForce RTX 4090" in ask and "dense bf16 TFLOP/s" in ask and "CPU" not in ask and "\n" not in ask
    # Intel: an xpu device, named by torch.xpu (no XPU build here: its name query is the one part faked)
    monkeypatch.setattr(torch.xpu, "get_device_name", lambda device=None: "Intel(R) Data Center GPU Max 1550")
    assert measure.peak_flops(torch.device("xpu", 0)) == 419.5e12
    assert measure.peak_flops(torch.device("xpu", 0), "tf32") == 209.5e12
    assert measure.cpu_peak_estimate(2, 2.0) == 2 * 2e9 * 32
