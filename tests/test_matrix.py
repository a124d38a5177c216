"""Every option in every distributed trainer, checked by equivalence (issue 20's matrix) and by what the model
really computed (issue 31).

CPU, gloo, 2 ranks on shared notebook engines (MPI engines for Horovod), one epoch of the real digits set on the small
CNN without BatchNorm, constant lr without warm-up or scaling so that the only difference between runs is how the
global batch of 64 is computed. Each distributed run is compared with one process at that global batch and the same
option (parameters after the epoch's 23 optimizer steps, and the test loss, Lightning's included):

- schedule: 2 ranks x 16 x 2 micro-batches under warm-up (0.9 of the epoch) and cosine decay. 719 samples per rank
  leave a last group of ONE micro-batch of 15 samples, so the weighting of an uneven last group is under test
  (1 / grad_accum would halve its gradient), and the lr of optimizer step k must be the one process's lr of step k
  (Lightning's LambdaLR steps once per optimizer step, the others map the micro-batch). The warm-up is long so that
  the last step, the uneven group's, still has 40 % of the peak lr: after half an epoch of warm-up the cosine is at 2 %
  there, and a wrong weighting moved the parameters only 5.5e-5, too close to FP32_TOL to be a control. (A separate
  constant-lr grad_accum case ran the same accumulation against the same reference; its control runs on this case.)
- clip_grad 0.1 (below the gradient norm of every step, so every step clips), channels_last: 2 ranks x 32.
- bf16: 2 ranks x 32. Autocast's bf16 rounds differently for a batch of 32 than for 64, so DDP is held to a looser
  tolerance against one process, and every other trainer to DDP's bf16 run at the same 2 x 32.
- compile: every trainer that accepts --compile, with dynamo's aot_eager backend (the same graph capture and
  AOTAutograd, no code generation): what the cases test is that the trainer hands its model to torch.compile and
  trains with what comes back. Inductor's C++ took 147 s for one process on 2 cores (2026-11-26), so its code
  generation is left to make gpu-check (single-compile, ddp-nccl-N-compile, on a GPU). These cases found that
  torch.compile(DDP(model)) compiled nothing (it graph-breaks at DDP's forward), and FSDP's whole-model compile too.

Numbers alone cannot tell an option that was ignored (channels_last and compile give the same weights as plain fp32),
so every run is observed from inside (tests/observe.py): bf16 runs must compute in bfloat16 and fp32 runs in
float32, channels_last runs must feed their convolutions NHWC tensors (for the trainers that convert the inputs only,
on 3-channel images: a 1-channel digit is NCHW and NHWC at once), compile runs must run compiled graphs.
test_the_matrix_can_fail shows each of these checks failing on a run without the option, and the weighting and the
schedule failing when done the way they used to be.

Tolerances, measured on this 2-core CPU on 2026-11-25: every fp32 option within 1e-7 of one process (9e-8, float
summation order), asserted at FP32_TOL; bf16 per trainer in BF16_TOL below.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import needs_horovod, needs_mpi

from tutorial import train_ddp, train_single
from observe import run_observed
from tutorial.core.config import TrainConfig
from tutorial.core.optim import micro_batch_weight
from tutorial.launch import engines
from tutorial.lessons.sharded import max_difference

BASE = TrainConfig.preset("smoke", epochs=1, schedule="constant", warmup_epochs=0, lr_scaling="none", lr=0.05)
GLOBAL_BATCH = 64
FP32_TOL = 1e-5
# bf16, measured: DDP 2 x 32 vs one process x 64: 0.0095 (loss 0.0015); Horovod, Lightning, DeepSpeed (all autocast)
# and FSDP (MixedPrecisionPolicy: the same bf16 operations, gradients reduced in fp32) vs DDP: 0, bitwise. fp32 vs
# bf16 (both DDP 2 x 32): 0.0154 (0.0153 on an AVX-512 BF16 CPU), above every tolerance.
BF16_TOL = {"ddp": 0.012, "horovod": 1e-5, "lightning": 1e-5, "fsdp": 1e-5, "deepspeed": 1e-5}
# The test loss of DDP bf16 2 x 32 against one process bf16 x 64 moved 0.0015 on an AVX2 CPU (bf16 emulated) and
# 0.0083 on an AVX-512 BF16 one (2026-11-25), more than fp32 against bf16 moves it (0.0022): for DDP the loss is a
# sanity bound only, and what tells bf16 from fp32 is the computed dtype (observed) and the parameters. The other
# trainers are held to DDP's bf16 loss as tightly as in fp32.
BF16_LOSS = {"ddp": 0.02, "horovod": 1e-4, "lightning": 1e-4, "fsdp": 1e-4, "deepspeed": 1e-4}

# option -> (config changes of every run, per-rank batch, accumulation)
OPTIONS = {
    "schedule": (dict(schedule="cosine", warmup_epochs=0.9), 16, 2),
    "clip_grad": (dict(clip_grad=0.1), 32, 1),
    "channels_last": (dict(channels_last=True), 32, 1),
    "bf16": (dict(precision="bf16"), 32, 1),
    "compile": (dict(compile=True), 32, 1),
}
TRAINERS = ("ddp", "fsdp", "deepspeed", "lightning", "horovod")  # tutorial.train_<name>; Horovod on MPI engines
CASES = [pytest.param(t, o, id=f"{t}-{o}", marks=[needs_mpi, needs_horovod] if t == "horovod" else [])
         for t in TRAINERS for o in OPTIONS]


# FSDP, DeepSpeed and Horovod convert only the inputs under --channels-last (FSDP2 and ZeRO take contiguous
# parameters, Horovod 0.28's all-reduce rejects NHWC gradients): on 3-channel images the first convolution then runs
# NHWC and hands NHWC on, but a 1-channel digit is NCHW and NHWC at once, so on the digits nothing changes for them
# (measured: every convolution NCHW). Their case compares the numbers on the digits and observes the layout in 2
# steps on random 3-channel 8x8 images (THREE_CHANNELS). DDP and Lightning convert the model: NHWC on the digits too.
INPUTS_ONLY = ("fsdp", "deepspeed", "horovod")
THREE_CHANNELS = BASE.replace(dataset="cifar10", synthetic=True, image_size=8, max_steps=2, batch_size=8, quiet=True)


def expected_observation(cfg, stage: str = "ddp") -> dict:
    """What a run of cfg must have computed, by the hooks of tests/observe.py."""
    if cfg.compile:
        return {"compiled": True}
    return {"dtypes": ["bfloat16" if cfg.precision == "bf16" else "float32"],
            "channels_last": [cfg.channels_last and stage not in INPUTS_ONLY], "compiled": False}


def observation(metrics: dict) -> dict:
    seen = metrics["observed"]
    found = {"compiled": seen["compiled_graphs"] > 0}
    if not seen["compiled_graphs"]:
        found.update(dtypes=seen["dtypes"], channels_last=seen["channels_last"])
    return found


@pytest.fixture(scope="module")
def mpi_engines():
    c = engines.start(n=2, engines="mpi", show=False)
    try:
        yield c
    finally:
        c.stop()
        assert c.leftovers() == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cluster):
    """What each option is compared with, run once per option for the module: one process at the global batch, and
    for bf16 DDP at the same 2 x 32 (autocast rounds a batch of 32 differently from one of 64)."""
    runs = {}

    def run(option: str, stage: str = "single"):
        if (option, stage) not in runs:
            out = tmp_path_factory.mktemp(f"{stage}_{option}")
            changes, batch, accum = OPTIONS[option]
            changes = {k: v for k, v in changes.items() if k != "compile"}  # compiled runs match eager ones
            if stage == "single":
                m = train_single.main(BASE.replace(batch_size=GLOBAL_BATCH, out=str(out), **changes))
            else:
                m = cluster.run(train_ddp.main, BASE.replace(batch_size=batch, out=str(out), **changes))
            runs[option, stage] = out, m
        return runs[option, stage]
    return run


def run_distributed(request, stage: str, cfg) -> dict:
    engines_ = request.getfixturevalue("mpi_engines" if stage == "horovod" else "cluster")
    backend = "aot_eager" if cfg.compile else None  # inductor is gpu-check's (docstring)
    main = importlib.import_module(f"tutorial.train_{stage}").main
    return engines_.run(run_observed, main, cfg, backend)


def three_channel_layouts(request, stage: str, channels_last: bool) -> list:
    """Whether the convolutions of train_<stage> saw NHWC inputs in 2 steps on 3-channel images (observe.py)."""
    return run_distributed(request, stage, THREE_CHANNELS.replace(channels_last=channels_last))["observed"][
        "channels_last"]


def case_config(option: str, out) -> TrainConfig:
    changes, batch, accum = OPTIONS[option]
    return BASE.replace(batch_size=batch, grad_accum=accum, out=str(out), **changes)


@pytest.mark.parametrize("stage, option", CASES)
def test_trainer_option_matches_one_process_at_the_global_batch(stage, option, reference, request, tmp_path):
    single, single_metrics = reference(option)
    cfg = case_config(option, tmp_path)
    m = run_distributed(request, stage, cfg)
    assert m["world_size"] == 2 and m["global_batch_size"] == GLOBAL_BATCH and m["steps"] == 23
    assert m["replicas_identical"], m["replica_checksums"]
    assert 1.0 >= m["test_top5_accuracy"] >= m["test_accuracy"] > 0.5  # seed 001's top-5, in every trainer
    assert observation(m) == expected_observation(cfg, stage), m["observed"]
    if option == "channels_last" and stage in INPUTS_ONLY:  # the digits cannot show it (INPUTS_ONLY above)
        assert three_channel_layouts(request, stage, True) == [True]
    difference = max_difference(tmp_path, single)
    loss_gap = abs(m["test_loss"] - single_metrics["test_loss"])
    if option == "bf16" and stage != "ddp":
        ddp, ddp_metrics = reference(option, "ddp")
        difference = max_difference(tmp_path, ddp)
        loss_gap = abs(m["test_loss"] - ddp_metrics["test_loss"])
    print(f"{stage} {option}: max parameter difference {difference:.3g}, test loss gap {loss_gap:.3g}, "
          f"observed {m['observed']}")
    if option == "bf16":
        assert difference < BF16_TOL[stage] and loss_gap < BF16_LOSS[stage], (difference, loss_gap)
    else:
        assert difference < FP32_TOL and loss_gap < 1e-4, (difference, loss_gap)


def the_old_ways(main, cfg, what: str):
    """On an engine: main(cfg) with one mechanism done as it used to be, for the negative controls: "weighting",
    every micro-batch's loss divided by grad_accum (an uneven last group under-weighted); "schedule", the lr read at
    the micro-batch's place in the epoch instead of the optimizer step's."""
    import importlib
    module = importlib.import_module(main.__module__)
    name, old = {"weighting": ("micro_batch_weight", lambda loader, i, batch, grad_accum: 1 / grad_accum),
                 "schedule": ("epoch_progress", lambda loader, i, grad_accum: i / len(loader))}[what]
    kept = getattr(module, name)
    setattr(module, name, old)
    try:
        return main(cfg)
    finally:
        setattr(module, name, kept)


the_old_ways.__module__ = "__main__"  # sent to the engines by value, as a notebook cell's function is


def test_the_matrix_can_fail(reference, cluster, request, tmp_path):
    """Negative controls: a run that ignored --clip-grad, --precision bf16, --channels-last (DDP's model, or FSDP's
    inputs on 3 channels) or --compile, weighted an uneven accumulation group by 1 / grad_accum, or read the lr per
    micro-batch would fail its case."""
    assert three_channel_layouts(request, "fsdp", False) == [False]
    single, _ = reference("clip_grad")
    fp32 = cluster.run(run_observed, train_ddp.main, BASE.replace(batch_size=32, out=str(tmp_path / "fp32")))
    print(f"no clipping: {max_difference(tmp_path / 'fp32', single):.3g}, observed {fp32['observed']}")
    assert max_difference(tmp_path / "fp32", single) > 100 * FP32_TOL
    for option in ("bf16", "channels_last", "compile"):
        assert observation(fp32) != expected_observation(case_config(option, tmp_path)), option
    bf16, bf16_metrics = reference("bf16", "ddp")
    loss_gap = abs(fp32["test_loss"] - bf16_metrics["test_loss"])
    print(f"fp32 vs bf16 (DDP 2 x 32): {max_difference(tmp_path / 'fp32', bf16):.3g}, test loss gap {loss_gap:.3g}")
    assert max_difference(tmp_path / "fp32", bf16) > max(BF16_TOL.values())
    for what in ("weighting", "schedule"):
        out = tmp_path / what
        cluster.run(the_old_ways, train_ddp.main, case_config("schedule", out), what)
        difference = max_difference(out, reference("schedule")[0])
        print(f"accumulation done the old way ({what}): {difference:.3g}")
        assert difference > 100 * FP32_TOL, what


# Every option is read or refused (issue 31), and --patience stops every trainer: test_every_option_is_read_or_refused
# runs each trainer once with a config that notes which fields the trainer's own code reads, itself or through the
# core functions it calls (observe.fields_read in tests/observe.py: RunLog's reads for its record do not count), asks
# ignored_options, and checks from the same run's metrics that --patience 1 stopped it (one engine run per trainer).
NOT_READ_BY_DESIGN = {
    "data_dir": "read by core.data for the datasets on disk (mnist, cifar10, imagefolder), not for digits",
    "generated": "read by core.data for the datasets on disk, in place of their files",
    "image_size": "read by core.data for synthetic and imagefolder images",
    "preset_name": "a label in metrics.json, set by TrainConfig.preset",
    "lr_scaling": "a rule for N ranks: at world size 1 both settings give the same lr (single, dp)",
}
EVERY_TRAINER = ["single", "dp", *(pytest.param(c.values[0], marks=c.marks, id=c.values[0])
                                   for c in CASES if c.values[1] == "clip_grad")]
# Both lr branches (warm-up, then cosine), and seed 000's early stopping: an lr of 1e-30 leaves every weight as it was
# (far below a float32 step of any of them), so epoch 1's test loss equals epoch 0's and --patience 1 stops the run
# after 2 of its 3 epochs (of 6 steps each, or 3 on 2 ranks).
OPTION_CHECK = BASE.replace(schedule="cosine", warmup_epochs=0.5, epochs=3, patience=1, lr=1e-30, batch_size=256,
                            quiet=True)


def ignored_options(stage: str, read: set) -> set:
    """Fields train_<stage> neither reads nor refuses (nor are unread by design); a field it refuses yet reads is
    reported too (the refusal would be wrong)."""
    import dataclasses

    from tutorial.core.config import ONLY_IN
    refused = {name for name, stages in ONLY_IN.items() if stage not in stages}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return (fields - read - refused - set(NOT_READ_BY_DESIGN)) | (read & refused)


def where_it_runs(request, stage: str, fn, *args):
    """fn(*args) where train_<stage> runs: in this process (single, dp), else on the two engines (MPI's for Horovod)."""
    if stage in ("single", "dp"):
        return fn(*args)
    return request.getfixturevalue("mpi_engines" if stage == "horovod" else "cluster").run(fn, *args)


def doctored(stage: str, changes: dict, folder: Path, monkeypatch):
    """The main of a copy of train_<stage> with some of its code changed ({old: new}, each old text once in the
    file), imported from `folder` as the module tutorial.train_<stage>_doctored (the package's relative imports hold)
    for this test only."""
    source = Path(train_single.__file__).with_name(f"train_{stage}.py").read_text()
    for old, new in changes.items():
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    name = f"tutorial.train_{stage}_doctored"
    (folder / f"train_{stage}_doctored.py").write_text(source)
    spec = importlib.util.spec_from_file_location(name, folder / f"train_{stage}_doctored.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module.main


def test_the_option_check_can_fail(tmp_path, monkeypatch):
    """The checks of test_every_option_is_read_or_refused on a copy of train_single that builds the cnn whatever
    --model says (the core's RunLog still reads the model for its record: the old check counted that read),
    iterates its loader without the run log's --progress bar, reads --zero-stage, which it refuses (a wrong refusal),
    and skips its patience check (so it runs all 3 epochs)."""
    from observe import fields_read
    main = doctored("single", {"build_model(cfg.model, info)": 'build_model("cnn", info)',
                               "enumerate(loop.log.bar(loader, epoch))": "enumerate(loader)",
                               "torch.manual_seed(cfg.seed)": "torch.manual_seed(cfg.seed + 0 * cfg.zero_stage)",
                               'if patience_exhausted(cfg, log.metrics["epochs"]):': "if False:"},
                    tmp_path, monkeypatch)
    read, metrics = fields_read(main, OPTION_CHECK.replace(out=str(tmp_path / "out")))
    assert ignored_options("single", set(read)) == {"model", "patience", "progress", "zero_stage"}
    assert len(metrics["epochs"]) == 3  # the patience part of the check fails too


@pytest.mark.parametrize("stage", EVERY_TRAINER)
def test_every_option_is_read_or_refused(stage, request, tmp_path):
    """Each trainer runs with a config that notes which fields its own code reads: every field is read, refused by
    the trainer (config.ONLY_IN) or unread by design (NOT_READ_BY_DESIGN above, with the reason). train_lightning
    accepted --time-steps and left it unused, train_dp --compile for nothing. The same run checks --patience 1 (seed
    000's early stopping): it stopped after its first epoch without a lower test loss."""
    from observe import fields_read
    cfg = OPTION_CHECK.replace(out=str(tmp_path))
    main = importlib.import_module(f"tutorial.train_{stage}").main
    read, m = where_it_runs(request, stage, fields_read, main, cfg)
    assert ignored_options(stage, set(read)) == set(), f"train_{stage} accepts and never reads these"
    losses = [e["test_loss"] for e in m["epochs"]]
    assert len(losses) == 2 and losses[0] == losses[1], losses


def test_micro_batch_weight_counts_samples_in_the_group():
    sampler = range(719)  # one rank's share of digits' 1,438 training samples
    loader = torch.utils.data.DataLoader(sampler, batch_size=16, sampler=sampler)
    weights = [micro_batch_weight(loader, i, len(batch), 2) for i, batch in enumerate(loader)]
    assert weights[:2] == [0.5, 0.5] and len(weights) == 45
    assert weights[-1] == 1.0  # 719 = 22 x 32 + 15: the last group is one micro-batch of 15 samples
    groups = [sum(weights[i:i + 2]) for i in range(0, 45, 2)]
    assert groups == [1.0] * 23  # every group's loss is a mean over its own samples
    no_accum = torch.utils.data.DataLoader(sampler, batch_size=32, sampler=sampler)
    assert {micro_batch_weight(no_accum, i, len(b), 1) for i, b in enumerate(no_accum)} == {1.0}


NAN_ON_RANK_1 = """
import pathlib, sys, torch, torch.distributed as dist
from tutorial.core.config import TrainConfig
from tutorial.core.tracking import DivergedError, RunLog
dist.init_process_group("gloo")
log = RunLog(TrainConfig.preset("smoke", log_every=2), "ddp", "cpu", dist.get_rank(), 2)
said = "went on"
try:
    for step in (1, 2, 3, 4):  # rank 1's loss is NaN from step 3 on; the check runs at steps 2 and 4
        bad = dist.get_rank() == 1 and step >= 3
        log.step(step, torch.tensor(float("nan") if bad else 1.0), 0.1, 1.0)
except DivergedError as exc:
    said = f"stopped: {exc}"
pathlib.Path(sys.argv[1], f"rank{dist.get_rank()}").write_text(said)  # a file each: the ranks share stdout
dist.destroy_process_group()
"""


def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """One rank's loss diverges: every rank stops at the same check, naming that rank, instead of rank 1 stopping
    alone while rank 0 waits in the next all-reduce."""
    from conftest import PYTHON, run
    script = tmp_path / "nan.py"
    script.write_text(NAN_ON_RANK_1)
    run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, tmp_path])
    lines = [(tmp_path / f"rank{r}").read_text() for r in (0, 1)]
    assert all(line.startswith("stopped: rank 1: the training loss is ") for line in lines), lines
    assert "is nan at step 4" in lines[1] and "is not finite at step 4" in lines[0]


AUGMENTED_SAMPLE = """
import hashlib, pathlib, sys, torch
from tutorial import train_ddp
from tutorial.core.config import TrainConfig
from tutorial.core.distributed import init_process_group, world_from_env
from tutorial.core.models import checksum
cfg = TrainConfig.preset("workshop-cpu", workers=0, precision="fp32", channels_last=False, model="cnn_bn")
device, precision = train_ddp.setup(cfg)
created = init_process_group(world_from_env(), device)
model, optimizer, train_loader, test_loader, lr = train_ddp.build(cfg, device)
image, label = train_loader.dataset[0]  # sample 0 through CIFAR-10's random crop and flip, on both ranks
sample = hashlib.sha256(image.numpy().tobytes()).hexdigest()[:12]
worker_seed = torch.empty((), dtype=torch.int64).random_().item()  # what a DataLoader draws for its workers
pathlib.Path(sys.argv[1], f"rank{torch.distributed.get_rank()}").write_text(f"{checksum(model)} {sample} {worker_seed}")
train_ddp.teardown(created)
"""


def test_ranks_share_the_initial_weights_but_draw_their_own_augmentation(tmp_path):
    """Model init is seeded alike on every rank, the data's random crops and flips (and the loader workers' seeds,
    drawn from the same generator) per rank: otherwise sample k on every rank gets the same crop."""
    from conftest import PYTHON, run
    script = tmp_path / "augment.py"
    script.write_text(AUGMENTED_SAMPLE)
    runs = []
    for attempt in ("a", "b"):
        (tmp_path / attempt).mkdir()
        run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, tmp_path / attempt])
        runs.append([(tmp_path / attempt / f"rank{r}").read_text().split() for r in (0, 1)])
    assert runs[0] == runs[1], "the same seed gives the same draws in a second run"
    (w0, s0, k0), (w1, s1, k1) = runs[0]
    assert w0 == w1 and s0 != s1 and k0 != k1, runs[0]
