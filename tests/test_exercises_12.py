"""12_performance_clinic's exercises and measurements: each checker accepts the package's solution and another correct
answer, and rejects the skeleton and other plausible mistakes, saying what is wrong; the planner agrees with the
measurement only when it counts the optimizer state; the merged trace is JSON that Perfetto's Chrome-trace importer
reads. The skeletons are the lesson module's SKELETONS, which the notebook's exercise cells hold."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from answers import defined
from conftest import exercise_cell

from tutorial.lessons import performance as lesson
from tutorial.lessons.ranks import on_every_rank

NOTEBOOK = "12_performance_clinic"
HEADINGS = {"states": "### Exercise 1", "predict": "### Exercise 2", "hunt": "### Exercise 3",
            "layout": "### Exercise 4"}


@pytest.mark.parametrize("name", list(HEADINGS))
def test_the_notebook_holds_the_skeletons(name):
    assert exercise_cell(NOTEBOOK, HEADINGS[name]).strip() == lesson.SKELETONS[name].strip()


# Exercise 1: the planner's states
def test_exercise_1_states():
    assert lesson.check_states(lesson.solution_states_per_rank).startswith("correct")
    verdict = lesson.check_states(defined(lesson.SKELETONS["states"]))
    assert verdict.startswith("wrong: optimizer for zero=0") and "two fp32 moments" in verdict, verdict
    grads_at_1 = defined(lesson.SKELETONS["states"].replace("optimizer = 0", "optimizer = 8 * n_params // dp")
                         .replace("gradients = n_params * 4", "gradients = n_params * 4 // (dp if zero >= 1 else 1)"))
    verdict = lesson.check_states(grads_at_1)
    assert verdict.startswith("wrong: optimizer for zero=0") and "every ZeRO stage shards" in verdict, verdict
    sharded_early = defined(
        "def states_per_rank(n_params, zero, dp):\n"
        "    d = dp if zero else 1\n"
        "    return dict(parameters=4 * n_params // d, gradients=4 * n_params // d, optimizer=8 * n_params // d)\n")
    verdict = lesson.check_states(sharded_early)
    assert verdict.startswith("wrong: parameters for zero=1") and "only ZeRO-3/FSDP2" in verdict, verdict


def test_exercise_1_accepts_the_states_written_with_a_shard_function():
    other = defined(
        "def states_per_rank(n_params, zero, dp):\n"
        "    shard = lambda stage: dp if zero >= stage else 1\n"
        "    return {'parameters': 4 * n_params / shard(3), 'gradients': 4 * n_params / shard(2),\n"
        "            'optimizer': 8 * n_params / shard(1)}\n")
    assert lesson.check_states(other).startswith("correct")


def test_the_planner_answers_the_budget_question_as_a_run_measures_it():
    cfg = lesson.GPTConfig()
    budget = 8_000_000
    best = lesson.largest_micro_batch(cfg, lesson.Layout(), budget, lesson.solution_states_per_rank)
    assert lesson.measured_total(best) <= budget < lesson.measured_total(best + 1)
    # negative control: the skeleton's planner (no optimizer state) promises a micro-batch that does not fit
    forgetful = lesson.largest_micro_batch(cfg, lesson.Layout(), budget, lesson.states_per_rank)
    assert forgetful > best and lesson.measured_total(forgetful) > budget


def test_the_measured_memory_matches_the_plan_and_a_plan_without_optimizer_state_does_not(cluster):
    cluster.run(on_every_rank, lesson.memory_runs, ("ddp", "ddp+bucket-view", "fsdp2", "tp+sp", "pp"))
    runs = [value for _, value in cluster.results]
    assert all(status == "ok" for status, _ in cluster.results), cluster.results
    table = lesson.memory_table(runs, states=lesson.solution_states_per_rank)
    assert len(table) == 10 and all(r["within"] for r in table), [r for r in table if not r["within"]]
    # sequence parallel as torch does it: what autograd saved (deterministic, where gloo's buffers make the
    # allocator's count vary by 131 kB tensors) is the planner's to the byte; the control: planned as plain TP (every
    # norm's input whole), or as Megatron's sequence parallel (every value / tp), it is not
    cfg, sp = lesson.GPTConfig(), lesson.Layout(tp=2, sequence_parallel=True)
    for m in (m for per_rank in runs for m in per_rank if m["strategy"] == "tp+sp"):
        planned = lesson.plan_memory(cfg, sp, m["micro_batch"])["activations"]
        plain = lesson.plan_memory(cfg, lesson.Layout(tp=2), m["micro_batch"])["activations"]
        megatron = plain - cfg.n_layers * (lesson.korthikanti_bytes(cfg, m["micro_batch"], 2, **FP32_NO_DROPOUT)
                                           - lesson.korthikanti_bytes(cfg, m["micro_batch"], 2, True, **FP32_NO_DROPOUT))
        assert m["saved"] == planned and plain > planned > megatron, (m["saved"], planned, plain, megatron)
    # the allocator sees DDP's buckets: a second copy of the gradients, gone with gradient_as_bucket_view=True
    for per_rank in runs:
        gradients = {m["strategy"]: m["gradients"] for m in per_rank}
        assert gradients["ddp"] == pytest.approx(2 * gradients["ddp+bucket-view"], rel=0.01), gradients
    # the control: a "measurement" that multiplies the gradients' numel by their element size (what the tensors
    # say: the parameters' bytes) sees no buckets, and DDP's rows then miss the plan
    counted = [[dict(m, gradients=m["parameters"]) for m in per_rank] for per_rank in runs]
    rows = lesson.memory_table(counted, states=lesson.solution_states_per_rank)
    assert [r["within"] for r in rows if r["strategy"] == "ddp"] == [False, False]


FP32_NO_DROPOUT = dict(value_bytes=4, dropout=False, attention_scores=False)  # what core.gpt keeps


# Exercise 2: collectives, predicted then counted
COUNTED = {"ddp": {"all_reduce": [4, 433152], "broadcast": [2, 168]},
           "fsdp2": {"all_gather": [5, 833024], "reduce_scatter": [3, 433152]},
           "tp": {"all_gather": [1, 98304], "all_reduce": [13, 1703936]}}


def test_exercise_2_prediction():
    assert lesson.check_prediction(lesson.solution_predicted(), COUNTED).startswith("correct")
    namespace: dict = {}
    exec(lesson.SKELETONS["predict"], namespace)
    verdict = lesson.check_prediction(namespace["predicted"], COUNTED)
    assert verdict.startswith("wrong: ddp: predicted {'all_reduce': 37}") and "fsdp2" in verdict and "tp:" in verdict
    once = {**lesson.solution_predicted(), "fsdp2": {"all_gather": 6, "reduce_scatter": 3}}  # the root re-gathered
    verdict = lesson.check_prediction(once, COUNTED)
    assert verdict.startswith("wrong: fsdp2:") and "keeps gathered" in verdict and "ddp" not in verdict


def test_exercise_2_accepts_a_prediction_that_also_counts_ddps_broadcasts():
    """DDP's rebuild broadcasts its bucket indices and sizes (tiny): a learner who predicts them is not wrong; TP's
    count as arithmetic."""
    layers = 2
    other = {"ddp": {"all_reduce": 4, "broadcast": 2},
             "fsdp2": {"all_gather": layers + 1 + layers, "reduce_scatter": layers + 1},
             "tp": {"all_reduce": 2 * layers + 4 * layers + 1, "all_gather": 1}}
    assert lesson.check_prediction(other, COUNTED).startswith("correct")


def test_the_counts_are_what_commdebugmode_sees_on_the_engines(cluster):
    cluster.run(on_every_rank, lesson.collective_runs)
    status, counted = cluster.results[0]
    assert status == "ok", counted
    assert lesson.check_prediction(lesson.solution_predicted(), counted).startswith("correct"), counted
    assert counted["ddp"]["all_reduce"] == [4, 433152]  # the gradients' bytes, in buckets of 0.1 MB
    # the bucket arithmetic: DDP closes a bucket once it holds at least bucket_cap_mb, in the order the gradients
    # arrive (after its rebuild: the reverse of the parameters' order here); DDP's own all-reduces carry these buckets
    model = lesson.GPT(lesson.GPTConfig())
    sizes, buckets, filled = [p.numel() * 4 for p in reversed(list(model.parameters()))], [], 0
    for size in sizes:
        filled += size
        if filled >= int(lesson.COUNTED_BUCKET_MB * 2**20):
            buckets, filled = buckets + [filled], 0
    buckets += [filled] if filled else []
    cluster.run(on_every_rank, lesson.collective_runs, 16, True)
    assert buckets == cluster.results[0][1]["ddp"]["all_reduce"][2] == [145152, 133376, 116992, 37632], buckets


# Exercise 3: the bug hunt
def test_exercise_3_bug_hunt(cluster):
    verdict = lesson.check_bug_hunt(cluster, lesson.solution_wrap, lesson.solution_train)
    assert verdict.startswith("correct: 3 all-reduce(s) for 3 steps (1 bucket(s))"), verdict
    skeleton = defined(lesson.SKELETONS["hunt"], "wrap"), defined(lesson.SKELETONS["hunt"], "train")
    verdict = lesson.check_bug_hunt(cluster, *skeleton)
    assert verdict.startswith("still wrong:"), verdict
    for symptom in ("wrap all but the last in model.no_sync()", "bucket_cap_mb is tiny", ".item() ran",
                    "give it workers"):
        assert symptom in verdict, (symptom, verdict)
    # the profile the notebook shows for the skeleton holds the evidence: all-reduces more often than micro-batches
    # (tiny buckets, every micro-batch synced), the single-process loader's __next__, the loop's .item() calls;
    # the solution's shows one all-reduce per step and no such loader
    for loop, all_reduces, loader, items in ((skeleton, lambda n: n > 12, True, lambda n: n > 3),
                                             ((lesson.solution_wrap, lesson.solution_train), lambda n: n == 3, False,
                                              lambda n: n <= 3)):  # the check's rule: at most one a step
        shown = lesson.hunt_profile(cluster, *loop)
        calls = [int(line.split()[-1]) for line in shown.splitlines() if line.strip().startswith("gloo:all_reduce")]
        assert len(calls) == 1 and all_reduces(calls[0]), shown
        assert ("_SingleProcessDataLoaderIter.__next__" in shown) == loader == \
            cluster.results[0][1]["single_process_loader"], shown
        assert items(int(shown.rsplit(": ", 1)[1])), shown


OTHER_FIX = '''
def train(model, dataset, optimizer, steps=3, accumulate=4):
    import torch
    from torch.utils.data import DataLoader
    from tutorial.core.gpt import loss_fn
    loader = iter(DataLoader(dataset, batch_size=8, num_workers=1, persistent_workers=True))
    total = torch.zeros(())
    for step in range(steps):
        for micro in range(accumulate):
            X, y = next(loader)
            model.require_backward_grad_sync = micro == accumulate - 1  # what no_sync() sets
            loss = loss_fn(model(X), y) / accumulate
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
    return total.item() / steps
'''


def test_exercise_3_accepts_other_fixes_and_names_a_loop_that_never_syncs(cluster):
    wrap = defined("def wrap(model):\n    from torch.nn.parallel import DistributedDataParallel as DDP\n"
                   "    return DDP(model, bucket_cap_mb=4)\n")
    verdict = lesson.check_bug_hunt(cluster, wrap, defined(OTHER_FIX))
    assert verdict.startswith("correct: 3 all-reduce(s)"), verdict
    never = defined(OTHER_FIX.replace("micro == accumulate - 1", "False"))
    verdict = lesson.check_bug_hunt(cluster, wrap, never)
    assert verdict.startswith("still wrong: the ranks' weights differ"), verdict
    one_left = defined(OTHER_FIX.replace("num_workers=1, persistent_workers=True", "num_workers=0"))
    verdict = lesson.check_bug_hunt(cluster, wrap, one_left)
    assert verdict.startswith("still wrong: the loader reads in the training process"), verdict
    assert not any(s in verdict for s in ("no_sync", "bucket_cap_mb", ".item()", "weights differ")), verdict


# Exercise 4: a layout for 64 GPUs
def test_exercise_4_layout():
    verdict = lesson.check_layout(lesson.solution_choose_layout)
    assert verdict.startswith("correct: 8 x 4 x 2 (zero=3) fits"), verdict
    verdict = lesson.check_layout(defined(lesson.SKELETONS["layout"]))
    assert verdict == ("wrong: tp=8 spans nodes of 4 GPUs: tensor parallel talks in every layer, keep it within a "
                       "node's fast links"), verdict
    replicas = defined("def choose_layout():\n    from tutorial.lessons.performance import Layout\n"
                       "    return Layout(dp=64)\n")
    verdict = lesson.check_layout(replicas)
    assert verdict.startswith("wrong: the planner needs") and "the GPU has 80 GB" in verdict, verdict
    uneven = defined("def choose_layout():\n    from tutorial.lessons.performance import Layout\n"
                     "    return Layout(dp=4, tp=4, pp=3, zero=3)\n")
    verdict = lesson.check_layout(uneven)
    assert "48 ranks, but the job has 16 x 4 = 64 GPUs" in verdict and "32 layers do not split into 3" in verdict


def test_exercise_4_accepts_a_layout_without_pipeline_stages():
    other = defined("def choose_layout():\n    from tutorial.lessons.performance import Layout\n"
                    "    return Layout(dp=16, tp=4, pp=1, zero=3)\n")
    assert lesson.check_layout(other).startswith("correct: 16 x 4 x 1 (zero=3) fits")
    assert lesson.check_layout(lambda: lesson.Layout(dp=4, tp=4, pp=4)).startswith("correct: 4 x 4 x 4 (zero=0) fits")
    # tp=2 does not cut micro-batches of 8 sequences enough, with sequence parallel's cut of the norms neither
    assert lesson.check_layout(lambda: lesson.Layout(dp=16, tp=2, pp=2, zero=3)).startswith(
        "wrong: the planner needs 103 GB per rank (stage 0, 2 micro-batches in flight)")
    assert lesson.check_layout(lambda: lesson.Layout(dp=16, tp=2, pp=2, zero=3, sequence_parallel=True)).startswith(
        "wrong: the planner needs 94 GB per rank")


def test_exercise_4_refuses_the_plausible_answers_that_ignore_the_activations():
    """Micro-batches of 8 sequences of 2048 tokens make the activations the budget: ZeRO-3 alone shards the states
    but not the activations; eight pipeline stages hold four layers each, but 1F1B's first stage holds eight
    micro-batches in flight, as much as the whole model's; checkpointing would fit but the job has no time for it."""
    verdict = lesson.check_layout(lambda: lesson.Layout(dp=8, tp=1, pp=8, zero=3))
    assert verdict == "wrong: the planner needs 150 GB per rank (stage 0, 8 micro-batches in flight), the GPU has 80 GB"
    assert lesson.check_layout(lambda: lesson.Layout(dp=64, zero=3)).startswith("wrong: the planner needs 147 GB")
    verdict = lesson.check_layout(lambda: lesson.Layout(dp=64, zero=3, checkpointing=True))
    assert verdict.startswith("wrong: checkpointing=True recomputes every block's forward"), verdict
    # every reason at once: checkpointing's and the layout's own
    verdict = lesson.check_layout(lambda: lesson.Layout(dp=8, tp=8, checkpointing=True))
    assert "checkpointing=True" in verdict and "tp=8 spans nodes of 4 GPUs" in verdict, verdict


def test_the_dry_run_lays_out_what_the_planner_plans():
    run = lesson.dry_run(lesson.BIG, lesson.Layout(dp=8, tp=4, pp=2, zero=3), 37, **lesson.LAYOUT_JOB)
    assert run["coordinates"] == {"pp": 1, "dp": 1, "tp": 1} and run["q_local"] == (128, 4096)
    assert run["parameter_bytes"] == run["planned"]["parameters"]
    no_fsdp = lesson.dry_run(lesson.BIG, lesson.Layout(dp=8, tp=4, pp=2, zero=0), 37, **lesson.LAYOUT_JOB)
    assert no_fsdp["parameter_bytes"] == 8 * run["parameter_bytes"]  # the negative control: nothing sharded over dp


# The merged trace
def _trace(path, seconds_of_work: int):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(seconds_of_work):
            torch.randn(64, 64) @ torch.randn(64, 64)
    prof.export_chrome_trace(str(path))


def test_the_merged_trace_is_one_chrome_trace_with_a_process_per_rank(tmp_path):
    paths = [tmp_path / "trace_rank0.json", tmp_path / "trace_rank1.json"]
    for i, p in enumerate(paths):
        _trace(p, 3 + i)
    merged = lesson.merge_traces([str(p) for p in paths], str(tmp_path / "merged.json"))
    trace = json.loads((tmp_path / "merged.json").read_text())  # valid JSON, as Perfetto's importer needs
    events = trace["traceEvents"]
    assert merged["ranks"] == [0, 1] and merged["events"] == len(events)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert names == {"rank 0": "rank 0", "rank 1": "rank 1"}
    ops = [e for e in events if e.get("ph") == "X"]
    assert ops and all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 and e["pid"] in names for e in ops)
    mm = [sum(e["name"] == "aten::mm" and e["pid"] == f"rank {r}" for e in ops) for r in (0, 1)]
    assert mm == [3, 4]  # each rank's own events, none lost or doubled
    # negative control: the traces as the profiler wrote them share one pid, so Perfetto would show one process
    pids = {e["pid"] for p in paths for e in json.loads(p.read_text())["traceEvents"] if e.get("cat") == "cpu_op"}
    assert len(pids) == 1


def _gpu_shaped_trace(late_rank: int, steps: int = 3) -> dict:
    """A merged trace as two ranks on GPUs write it: each step's all-reduce is a CPU launch (tens of microseconds)
    and an NCCL kernel; the late rank launches 30 ms after the other, whose kernel waits the 30 ms for it."""
    events = []
    for step in range(steps):
        t0 = step * 100_000.0
        for rank in (0, 1):
            late = 30_000.0 if rank == late_rank else 0.0
            launch = 80.0 if rank == late_rank else 40.0  # the late rank's launches are the slower ones here
            events += [
                {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": f"rank {rank}", "tid": 1,
                 "ts": t0 + late, "dur": launch},
                {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": f"rank {rank}",
                 "tid": 7, "ts": t0 + late + 10, "dur": 31_000.0 - late},
            ]
    return {"traceEvents": events}


def test_the_straggler_is_the_rank_that_enters_the_collectives_last():
    for late_rank in (0, 1):
        trace = _gpu_shaped_trace(late_rank)
        assert lesson.straggler(trace) == late_rank
        rows = lesson.late_starts(trace)
        assert [row["entered_last"] for row in rows] == [3 * (r == late_rank) for r in (0, 1)]
        assert rows[late_rank]["behind_ms"] == pytest.approx(30.0) and rows[1 - late_rank]["behind_ms"] == 0.0


def test_a_cpu_trace_without_kernels_is_read_by_its_c10d_calls():
    trace = _gpu_shaped_trace(late_rank=1)
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["cat"] == "cpu_op"]
    assert lesson.straggler(trace) == 1
    assert lesson.late_starts(trace)[1]["behind_ms"] == pytest.approx(30.0)


class _Profile:
    """What breakdown reads of a torch.profiler.profile: its events (torch's own FunctionEvent objects)."""

    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def _event(name, start, end, device=None, annotation=False):
    """A profiler event: an op or kernel from start to end (microseconds) on the CPU or `device`; annotation: the
    profiler's device-side copy of a record_function range."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent
    e = FunctionEvent(id=0, name=name, thread=1, start_us=start, end_us=end, device_type=device or DeviceType.CPU)
    e.is_user_annotation = annotation
    return e


def test_a_gpu_profile_is_broken_down_by_its_kernels():
    from torch.autograd import DeviceType

    def annotation(name, start, end):
        return _event(name, start, end, DeviceType.CUDA, annotation=True)

    step = [_event("ProfilerStep#1", 0, 50_000), _event("aten::mm", 100, 200), _event("c10d::allreduce_", 300, 340)]
    kernels = [_event("ampere_sgemm_128x64_nn", 1_000, 11_000, DeviceType.CUDA),
               _event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 5_000, 35_000, DeviceType.CUDA),
               annotation("ProfilerStep#1", 500, 50_500), annotation("nccl:all_reduce", 4_000, 36_000)]
    gpu = lesson.breakdown(_Profile(step + kernels))
    assert gpu["step"] == pytest.approx(50.0)  # one step, on the device's clock
    assert gpu["communication"] == pytest.approx(30.0) and gpu["compute"] == pytest.approx(4.0)
    assert gpu["overlap"] == pytest.approx(6.0 / 30.0) and gpu["idle"] == pytest.approx(50.0 - 34.0)
    # a device whose collectives are not NCCL's kernels (Intel's): read from the CPU's ops, not as no communication
    xpu = [_event("ProfilerStep#1", 0, 50_000), _event("c10d::allreduce_", 300, 30_300),
           _event("gemm_kernel", 1_000, 11_000, DeviceType.XPU)]
    assert lesson.breakdown(_Profile(xpu))["communication"] == pytest.approx(30.0)


def test_the_rule_before_names_the_wrong_rank_on_a_gpu():
    """The control: f7f8195's rule (the rank that communicates least, by the CPU's ops) on two GPU ranks whose CPU
    side of each all-reduce is a launch: the late rank's launch (80 us) is no shorter than the waiting rank's (40 us),
    so it names the rank that waits; the late start names the right one."""
    def cpu_side(launch_us):  # a step's CPU events: the step and the all-reduce's launch
        return _Profile([_event("ProfilerStep#1", 0, 50_000), _event("c10d::allreduce_", 300, 300 + launch_us)])

    old_rule = [lesson.breakdown(cpu_side(launch))["communication"] for launch in (40, 80)]  # rank 0 waits, 1 late
    assert min((0, 1), key=old_rule.__getitem__) == 0  # f7f8195's slowest_rank: the wrong rank
    assert lesson.straggler(_gpu_shaped_trace(late_rank=1)) == 1


def test_the_planner_agrees_with_torchs_fsdp_memory_tracker_in_fake_mode():
    """FSDPMemTracker (torch.distributed._tools) follows one step of rank 3 of 8 FSDP2 ranks on fake tensors: the
    weights it holds are the planner's to the byte, the activations within 10% (the planner's without the root's
    gathered weights, which the tracker counts as gathered), and the planner's three units of buffers bound the two
    or three the peak holds (two where it falls at the forward's end, three in backward). Control: a plan without
    FSDP's buffers falls short of the tracker's peak."""
    cfg = lesson.GPTConfig(vocab_size=256, context=128, d_model=512, n_heads=8, n_layers=4)
    tracked = lesson.tracked_fsdp(cfg, dp=8, rank=3, micro_batch=4)
    plan = lesson.plan_memory(cfg, lesson.Layout(dp=8, zero=3), 4)
    unit = plan["unit_buffers"] // 3
    assert tracked["parameters"] == plan["parameters"]
    assert tracked["activations"] == pytest.approx(plan["activations"] - tracked["root"], rel=0.10)
    assert 2 * unit <= tracked["unit_buffers"] <= 3 * unit
    assert plan["total"] >= tracked["total"] > plan["total"] - plan["unit_buffers"]


def test_mixed_precision_states_are_zeros_own_figures():
    """ZeRO's paper (Rajbhandari et al. 2020, Figure 1): 7.5 billion parameters on 64 GPUs in mixed precision with
    Adam (2 + 2 + 12 bytes per parameter) need 120 GB per GPU as DDP, 31.4 GB with optimizer states partitioned,
    16.6 GB with gradients too and 1.9 GB with parameters too. Control: the fp32 accounting (4 + 4 + 8) gives other
    figures for the sharded stages."""
    n, dp = 7_500_000_000, 64
    per_gpu = [sum(lesson.mixed_states(n, zero, dp).values()) / 1e9 for zero in (0, 1, 2, 3)]
    assert [round(gb, 1) for gb in per_gpu] == [120.0, 31.4, 16.6, 1.9]
    fp32 = [sum(lesson.zero_states(n, zero, dp).values()) / 1e9 for zero in (0, 1, 2, 3)]
    assert fp32[0] == per_gpu[0] and [round(gb, 1) for gb in fp32[1:]] != [31.4, 16.6, 1.9]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("micro_batch", [1, 3])
def test_the_tensor_count_is_korthikantis_closed_form_for_what_the_gpt_keeps(tp, micro_batch):
    """Korthikanti et al. 2022, Table 2, as printed: per layer s b h (34 + 5 a s / h) without parallelism,
    s b h (10 + 24 / t + 5 a s / (h t)) under tensor parallel, s b h / t (34 + 5 a s / h) with sequence parallel,
    s b h (10 + 24 / t) and 34 s b h / t with selective recompute, 2 s b h with full recompute: bench.plan's form (the
    sixteen values and two masks it names) gives the same bytes. Taking out what core.gpt does not keep (dropout's
    masks, attention's scores) and counting fp32, it is activation_bytes' block but for the per-row statistics (the
    norms' mean and 1/std, attention's log-sum-exp), to the byte. Control: with the scores left in, it is not."""
    cfg = lesson.BIG
    s, b, h, a, t = cfg.context, micro_batch, cfg.d_model, cfg.n_heads, tp
    printed = {("none", False): s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
               ("none", True): s * b * h / t * (34 + 5 * a * s / h),
               ("selective", False): s * b * h * (10 + 24 / t),
               ("selective", True): 34 * s * b * h / t,
               ("full", False): 2 * s * b * h}
    printed[("full", True)] = 2 * s * b * h / t  # not in the table: Megatron keeps each rank's slice of the input
    for (recompute, sp), expected in printed.items():
        assert lesson.korthikanti_bytes(cfg, b, t, sp, recompute) == pytest.approx(expected, rel=1e-12), (recompute, sp)
    layout = lesson.Layout(tp=t)
    one_block = lesson.block_activations(cfg, layout, b)
    assert one_block == lesson.activation_bytes(cfg, layout, b) - lesson.activation_bytes(
        dataclasses.replace(cfg, n_layers=cfg.n_layers - 1), layout, b)
    statistics = (4 * b * s + b * a * s // t) * lesson.FLOAT
    ours = lesson.korthikanti_bytes(cfg, b, t, value_bytes=4, dropout=False, attention_scores=False)
    assert ours == one_block - statistics
    assert lesson.korthikanti_bytes(cfg, b, t, value_bytes=4, dropout=False) != one_block - statistics


@pytest.mark.parametrize("schedule, expected", [("gpipe", [8, 8, 8, 8]), ("1f1b", [4, 3, 2, 1])])
def test_a_stage_holds_the_micro_batches_its_schedule_keeps_in_flight(schedule, expected):
    assert [lesson.in_flight(schedule, 8, 4, stage) for stage in range(4)] == expected
    assert [lesson.in_flight(schedule, 4, 4, stage) for stage in range(4)] == [min(4, e) for e in expected]
    if schedule == "1f1b":  # torch's Schedule1F1B refuses fewer micro-batches than stages
        with pytest.raises(ValueError, match="1F1B needs at least as many micro-batches as stages: 2 < 4"):
            lesson.in_flight(schedule, 2, 4, 0)


def test_a_pipeline_stage_holds_what_its_schedule_keeps_in_flight(cluster):
    """Measured on 2 stages (rank 0 the first): GPipe's first stage keeps all 4, then all 8 micro-batches' forwards
    for their backward, 1F1B's 2 whatever their number (the stage's own record), as lesson.in_flight says; the
    allocator's peak grows with GPipe's and stays well below it with 1F1B's. Control: a GPipe in-flight rule of one
    micro-batch (what the planner assumed before) misses."""
    cluster.run(on_every_rank, lesson.pipeline_peaks)
    assert all(status == "ok" for status, _ in cluster.results), cluster.results
    runs = cluster.results[0][1]
    assert {k: r["held"] for k, r in runs.items()} == {
        f"{s} {m}": lesson.in_flight(s, m, 2, 0) for s in ("gpipe", "1f1b") for m in (4, 8)} != {
        f"{s} {m}": 1 for s in ("gpipe", "1f1b") for m in (4, 8)}
    one = lesson.activation_bytes(lesson.GPTConfig(), lesson.Layout(pp=2), 4, 0)
    assert runs["gpipe 8"]["peak"] - runs["gpipe 4"]["peak"] > 2 * one, (runs, one)
    assert runs["gpipe 8"]["peak"] > 2 * runs["1f1b 8"]["peak"], runs


def test_a_memory_snapshot_is_replayed_as_memory_viz_replays_it():
    """snapshot_peak on a snapshot in the GPU allocator's format (frames innermost first, with file and line): an
    alloc adds its bytes and a completed free takes them away, a free only requested does not yet (so the peak is
    4,500 B with A, B and C live; freeing at the request would give 4,000); what was live is sorted by the innermost
    frame outside torch (not an outer one), with the call's text read from its line."""
    import inspect
    here = inspect.currentframe().f_lineno + 1
    ours = {"filename": __file__, "line": here, "name": "the_test"}  # the line below: its text is the call's
    inside = {"filename": "/site-packages/torch/nn/functional.py", "line": 2, "name": "linear"}
    outer = {"filename": "/somewhere/runner.py", "line": 7, "name": "main"}  # outside torch too, but not innermost
    mine, theirs = [inside, ours, outer], [inside]
    trace = [dict(action="alloc", addr=1, size=1000, frames=mine), dict(action="alloc", addr=2, size=3000, frames=mine),
             dict(action="free_requested", addr=1, size=1000, frames=mine),
             dict(action="alloc", addr=3, size=500, frames=theirs),
             dict(action="free_completed", addr=1, size=1000, frames=mine),
             dict(action="alloc", addr=4, size=200, frames=mine)]
    got = lesson.snapshot_peak({"segments": [], "device_traces": [trace]})
    assert got["peak"] == 4500 and got["events"] == 6 and got["categories"] is None, got
    call = 'ours = {"filename": __file__, "line": here, "name": "the_test"}  # the line below: its text is the call\'s'
    assert got["places"] == [{"where": f"test_exercises_12.py:{here} the_test", "call": call, "MB": 0.004, "blocks": 2},
                             {"where": "(inside torch)", "call": "", "MB": 0.0005, "blocks": 1}], got["places"]


def test_a_cpu_snapshot_from_the_profiler_holds_the_lone_ranks_states_by_category():
    """torch's snapshot of the profiler's memory events (the CPU's, in the allocator's format) at the lone rank's
    peak: the GPT's parameters (433,152 B) and AdamW's two moments and step counts (2 x 433,152 + 37 x 4 B) by the
    profiler's categories, and places named by function (the profiler's frames carry no call's line)."""
    got = lesson.snapshot_peak(lesson.profiled_snapshot(lambda: lesson.train_alone(torch.device("cpu"))))
    assert got["categories"]["parameter"] == 433_152, got["categories"]
    assert got["categories"]["optimizer_state"] == 2 * 433_152 + 37 * 4, got["categories"]
    assert all("call" not in row for row in got["places"]) and any("gpt.py" in r["where"] for r in got["places"])
