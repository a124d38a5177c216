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
    import torch
    assert measure.peak_flops(torch.device("cpu")) is None  # no datasheet peak for a CPU: the notebook says so
    for name, tflops in (("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA A100-SXM4-80GB", 312),
                         ("NVIDIA H200", 989), ("NVIDIA GeForce RTX 4090", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        got = measure.peak_flops(torch.device("cuda", 0))
        assert got == (tflops * 1e12 if tflops else None), name
    assert measure.cpu_peak_estimate(2, 2.0) == 2 * 2e9 * 32
