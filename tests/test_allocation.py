"""launch.allocation (the notebooks' notebook.allocation) on each allocation an attendee may land on, faked on this
CPU machine by what torch reports (the decision only; make gpu-check runs the GPU paths themselves): no GPU, fewer GPUs
than ranks (one GPU per attendee), enough GPUs (a full node), and a shared node's CUDA_VISIBLE_DEVICES subset. Then
that the engines and the notebooks take what it decided."""
from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import ROOT

from tutorial.core.config import ConfigError, TrainConfig, to_argv
from tutorial.core.parallel_config import ParallelConfig
from tutorial.launch import allocation as policy
from tutorial.launch import engine_options, engines
from tutorial.lessons import notebook

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))


@pytest.fixture
def gpus(monkeypatch):
    """fake(n, visible=None): torch reports n GPUs; visible sets CUDA_VISIBLE_DEVICES (None: unset)."""
    def fake(n: int, visible: str | None = None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return fake


def engine_env(alloc, n: int) -> dict:
    """What engines.start(n, device=alloc.device, gpus=alloc.gpus) would start: (n, use_cuda) and the engines' env."""
    request = engine_options.check(n, "local", device=alloc.device, gpus=alloc.gpus, timeout=30, run_timeout=30,
                                   on_failure="restart", activate=False, where={})
    config = engine_options.ipp_config(request, "t")
    return dict(count=(request.n, request.use_cuda), env=dict(config.EngineLauncher.environment))


def test_no_gpu_runs_the_cpu_preset_over_gloo(gpus, capsys):
    gpus(0)
    smoke = TrainConfig.preset("smoke")
    alloc = policy.allocation(2, smoke)
    assert (alloc.device, alloc.backend, alloc.gpus, alloc.cfg, alloc.env) == ("cpu", "gloo", (), smoke, "")
    assert capsys.readouterr().out == "allocation: 2 rank(s) on the CPU with gloo (no GPU visible); preset smoke\n"
    started = engine_env(alloc, 2)
    assert started["count"] == (2, False) and started["env"]["CUDA_VISIBLE_DEVICES"] == ""


def test_one_gpu_for_two_ddp_ranks_shares_it_over_gloo(gpus, capsys):
    gpus(1)
    alloc = policy.allocation(2, TrainConfig.preset("workshop"))
    assert (alloc.device, alloc.backend, alloc.gpus) == ("gpu", "gloo", ("0",))
    assert alloc.cfg.backend == "gloo" and alloc.cfg.preset_name == "workshop"  # the trainer gets --backend gloo
    assert alloc.env == "CUDA_VISIBLE_DEVICES=0"
    assert "--backend gloo" in " ".join(to_argv(alloc.cfg))
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and "share 1 GPU(s)" in line and "gloo with CUDA tensors" in line
    # The engines accept sharing only because the allocation named fewer GPUs than engines; asked plainly, they refuse.
    assert engine_env(alloc, 2)["count"] == (2, True)
    assert engine_env(alloc, 2)["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    with pytest.raises(engines.ClusterError, match="n=2 engines on this node but only 1 GPU"):
        engine_options.engine_count(2, "local", "auto")


@pytest.mark.parametrize("trainer, sync_bn", [("horovod", False), ("fsdp", False), ("deepspeed", False),
                                              ("lightning", False), ("ddp", True)])
def test_one_gpu_where_ranks_cannot_share_it_runs_them_on_the_cpu_sized_for_it(gpus, capsys, trainer, sync_bn):
    """The ranks go to the CPU and train the smoke sizes on the real digits, so that learning shows (workshop-cpu's
    8 generated images learn nothing); SyncBatchNorm, which needs a GPU per rank, is turned off and the line says so.
    Whatever it returns, the trainer accepts."""
    gpus(1)
    cfg = TrainConfig.preset("workshop", sync_bn=sync_bn, out="runs/x")
    alloc = policy.allocation(2, cfg, trainer)
    assert (alloc.device, alloc.backend, alloc.gpus, alloc.env) == ("cpu", "gloo", (), "CUDA_VISIBLE_DEVICES=")
    smoke = TrainConfig.preset("smoke")
    assert alloc.cfg.preset_name == "smoke" and alloc.cfg.out == "runs/x" and not alloc.cfg.sync_bn
    assert (alloc.cfg.dataset, alloc.cfg.model, alloc.cfg.epochs, alloc.cfg.batch_size, alloc.cfg.generated) == \
        (smoke.dataset, smoke.model, smoke.epochs, smoke.batch_size, 0)
    assert notebook.expected_accuracy(alloc.cfg) >= 0.95  # the notebooks' accuracy checks hold there
    alloc.cfg.check_stage(trainer, torch.device("cpu"))  # not refused
    line = capsys.readouterr().out
    assert f"train_{trainer}" in line and "real digits" in line
    assert ("SyncBatchNorm off" in line) == sync_bn
    assert engine_env(alloc, 2)["env"]["CUDA_VISIBLE_DEVICES"] == ""  # the engines see no GPU


def test_enough_gpus_one_rank_per_gpu_over_nccl(gpus, capsys):
    gpus(8)
    cfg = TrainConfig.preset("workshop")
    for trainer in ("ddp", "horovod", "fsdp", "deepspeed", "lightning", None):
        alloc = policy.allocation(2, cfg, trainer)
        assert (alloc.device, alloc.backend, alloc.gpus, alloc.cfg) == ("gpu", "nccl", ("0", "1"), cfg)
    assert policy.allocation(8, cfg).gpus == tuple("01234567")
    assert "8 rank(s) on GPU(s) 0,1,2,3,4,5,6,7, one per GPU, NCCL" in capsys.readouterr().out
    started = engine_env(policy.allocation(2, cfg), 2)
    assert started["count"] == (2, True) and started["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_a_shared_node_uses_only_the_attendees_gpus(gpus, capsys):
    gpus(2, visible="4,5")  # the instructor started this attendee's JupyterLab with CUDA_VISIBLE_DEVICES=4,5
    assert engines.visible_gpus() == ["4", "5"]
    alloc = policy.allocation(2, TrainConfig.preset("workshop"))
    assert (alloc.device, alloc.backend, alloc.gpus, alloc.env) == ("gpu", "nccl", ("4", "5"),
                                                                    "CUDA_VISIBLE_DEVICES=4,5")
    assert "GPU(s) 4,5" in capsys.readouterr().out
    assert engine_env(alloc, 2)["env"]["CUDA_VISIBLE_DEVICES"] == "4,5"  # not 0 and 1, another attendee's
    # One GPU given, two ranks: they share GPU 5, not GPU 0.
    gpus(1, visible="GPU-5f1e,GPU-0aa")  # UUIDs too; CUDA took only the first
    alloc = policy.allocation(2, TrainConfig.preset("workshop"))
    assert (alloc.device, alloc.backend, alloc.gpus) == ("gpu", "gloo", ("GPU-5f1e",))
    with pytest.raises(engines.ClusterError, match="GPU '3' is not visible here; choose from: GPU-5f1e"):
        engine_options.engine_count(2, "local", "auto", gpus=["3"])


VISIBLE = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")


def test_amd_and_intel_nodes_take_hide_and_name_their_gpus_with_their_own_variables(monkeypatch, capsys):
    """An AMD node's engines and launches get ROCR_VISIBLE_DEVICES (HIP_VISIBLE_DEVICES, or its alias
    CUDA_VISIBLE_DEVICES, where the lab was given one: HIP counts in ROCR's list), an Intel node's ZE_AFFINITY_MASK
    and xccl; ranks moved to the CPU are hidden in each runtime's own spelling (core.visible), and gloo never gets
    XPU tensors: Intel ranks that cannot have a GPU each, and Lightning and Horovod there, run on the CPU. Control:
    f7f8195 set CUDA_VISIBLE_DEVICES on every vendor, which Intel's runtime ignores."""
    from test_accelerator import simulate_rocm, simulate_xpu

    from tutorial.launch import child_processes
    for name in VISIBLE:
        monkeypatch.delenv(name, raising=False)
    simulate_rocm(monkeypatch, gpus=2)
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "4,5")  # a shared node: this attendee's two of eight
    alloc = policy.allocation(2, TrainConfig.preset("workshop"))
    assert (alloc.backend, alloc.gpus, alloc.env) == ("nccl", ("4", "5"), "ROCR_VISIBLE_DEVICES=4,5")
    assert "one per GPU, RCCL" in capsys.readouterr().out
    started = engine_env(alloc, 2)["env"]
    assert started["ROCR_VISIBLE_DEVICES"] == "4,5" and not set(VISIBLE[:1] + VISIBLE[2:]) & set(started)
    for alias in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):  # one GPU of the two, named in ROCR's list
        monkeypatch.setenv(alias, "1")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        shared = policy.allocation(2, TrainConfig.preset("workshop"))
        assert (shared.gpus, shared.env) == (("1",), f"{alias}=1")
        assert shared.script_env == "ROCR_VISIBLE_DEVICES= HIP_VISIBLE_DEVICES=-1"
        assert "over gloo with CUDA tensors (RCCL needs a GPU per rank)" in capsys.readouterr().out

    for name in VISIBLE:
        monkeypatch.delenv(name, raising=False)
    simulate_xpu(monkeypatch, tiles=2)
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0.0,0.1")  # the two tiles of Aurora's first card
    alloc = policy.allocation(2, TrainConfig.preset("workshop"))
    assert (alloc.backend, alloc.gpus, alloc.env) == ("xccl", ("0.0", "0.1"), "ZE_AFFINITY_MASK=0.0,0.1")
    assert alloc.cfg.backend == "auto" and "one per GPU, oneCCL" in capsys.readouterr().out
    assert engine_env(alloc, 2)["env"]["ZE_AFFINITY_MASK"] == "0.0,0.1"
    for ranks, trainer in ((3, "ddp"), (2, "lightning"), (2, "horovod")):
        moved = policy.allocation(ranks, TrainConfig.preset("workshop"), trainer=trainer)
        assert (moved.device, moved.backend, moved.env) == ("cpu", "gloo", "ONEAPI_DEVICE_SELECTOR=opencl:cpu"), trainer
        assert "on the CPU with gloo" in capsys.readouterr().out
    hidden = engine_env(moved, 2)["env"]
    assert hidden["ONEAPI_DEVICE_SELECTOR"] == "opencl:cpu" and "CUDA_VISIBLE_DEVICES" not in hidden
    monkeypatch.setenv("ZE_AFFINITY_MASK", "")  # an empty mask hides nothing: both tiles
    assert engine_options.visible_gpus() == ["0", "1"]


def test_launches_that_must_not_see_a_gpu_hide_every_vendors_without_importing_torch():
    """check-ddp and the rehearsal launches hide the GPUs before anything asks torch (a second's import on a CPU)."""
    import subprocess
    import sys
    code = ("import sys; from tutorial.launch.child_processes import launcher_env; env = launcher_env(); "
            "print('torch' in sys.modules, [env[k] for k in ('CUDA_VISIBLE_DEVICES', 'ROCR_VISIBLE_DEVICES', "
            "'HIP_VISIBLE_DEVICES', 'ONEAPI_DEVICE_SELECTOR')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False ['', '', '-1', 'opencl:cpu']"


def test_bad_input_is_one_line(gpus):
    gpus(0)
    for ranks in (0, 1.5, True):
        with pytest.raises(ConfigError, match="ranks must be a whole number"):
            policy.allocation(ranks, TrainConfig.preset("smoke"))
    with pytest.raises(ConfigError, match="trainer 'torch' is not one of"):
        policy.allocation(2, TrainConfig.preset("smoke"), "torch")
    with pytest.raises(engines.ClusterError, match="contradict"):
        engine_options.engine_count(2, "local", "cpu", gpus=["0"])
    with pytest.raises(engines.ClusterError, match="may run on others"):
        engine_options.engine_count(2, "slurm", "auto", gpus=["0"])


def test_the_gpt_trainers_get_their_own_config_with_the_backend_and_no_preset(gpus, capsys):
    """train_tp/pp/2d read a ParallelConfig, never a TrainConfig: the allocation hands back the one given with the
    backend (None where none was given), and its line names no image preset; the controls: a TrainConfig for a GPT
    trainer, or a ParallelConfig for an image trainer, is refused in one line."""
    assert notebook.allocation is policy.allocation and notebook.sized_for_cpu is policy.sized_for_cpu
    pcfg = ParallelConfig(steps=3)
    for n, device, backend in ((0, "cpu", "gloo"), (1, "cpu", "gloo"), (8, "gpu", "nccl")):
        gpus(n)
        alloc = policy.allocation(2, pcfg, trainer="tp")
        assert (alloc.device, alloc.backend, alloc.cfg) == (device, backend, pcfg.replace(backend=backend))
        assert policy.allocation(4, trainer="2d").cfg is None
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 2 and not any("preset" in line or "digits" in line for line in lines), lines
    with pytest.raises(ConfigError, match="train_tp reads a ParallelConfig"):
        policy.allocation(2, TrainConfig.preset("smoke"), trainer="tp")
    with pytest.raises(ConfigError, match="train_ddp reads a TrainConfig, not a ParallelConfig"):
        policy.allocation(2, pcfg)


def _code(nb) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_engine_start_and_launch_in_the_notebooks_takes_the_allocation(nb):
    """Every engines.start(...) in a code cell passes the allocation's device and GPUs, and every torchrun launch
    typed as a ! command or a subprocess list that trains on GPUs gets the allocation's CUDA_VISIBLE_DEVICES."""
    code = "\n".join(_code(nb))
    assert "engine_device" not in code
    for call in re.findall(r"engines\.start\((.*)", code):
        assert "device=alloc.device" in call and "gpus=alloc.gpus" in call, call
    for cell in _code(nb):
        launches = [line for line in cell.splitlines() if line.lstrip().startswith("!")
                    and "torch.distributed.run" in line and "tutorial.train_" in line]
        assert not launches or "alloc.env" in cell, launches
    # Launches through the lessons' helpers hide the GPUs: they get a config sized for the CPU.
    for cell in _code(nb):
        if re.search(r"(sharded|lesson)\.(launch|torchrun_losing_a_worker)\(", cell):
            assert "notebook.sized_for_cpu(cfg)" in code, cell


def test_00s_readiness_check_holds_on_a_gpu_node_whose_horovod_lacks_nccl_ops(gpus, monkeypatch, capsys):
    """00's cell, executed as it stands, on a faked GPU node: doctor marks Horovod's missing NCCL operations (exit 1),
    and the cell's check still holds, because nothing else is missing."""
    from tutorial import cli
    from tutorial.core.deepspeed_compat import import_deepspeed
    import_deepspeed()  # DeepSpeed keeps the accelerator it finds at import: let it find this machine's, not the fake
    gpus(1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100")
    cell = next(c for c in _code(ROOT / "notebooks" / "00_setup.ipynb") if "cli.doctor(" in c)
    namespace = dict(cli=cli, notebook=notebook)
    exec(cell.replace("# NBVAL_IGNORE_OUTPUT", ""), namespace)
    out = capsys.readouterr()
    if namespace["exit_code"] == 1:  # this machine's Horovod has no NCCL ops (the CI build): the case of the issue
        assert "missing horovod: HOROVOD_GPU_OPERATIONS=NCCL" in out.err
    assert namespace["blocking"] == [] and "everything the notebooks need is installed: True" in out.out


def test_03s_equivalence_check_trains_on_unaugmented_data_under_every_preset():
    """03's 2 x 16 = 1 x 32 check printed False under workshop: CIFAR-10's random crops and flips are drawn in the
    loader workers, differently for one process and two. The cell now derives its config from any preset as the
    digits without workers, fp32 and the plain CNN: the config the smoke preset checks, which matches to 1e-5."""
    cell = next(c for c in _code(ROOT / "notebooks" / "03b_ddp_trainer.ipynb") if "2 ranks x 16" in c)
    statement = cell[cell.index("same = "):cell.index("\n", cell.index("warmup_epochs=0)"))]
    derived = {}
    for preset in ("smoke", "workshop-cpu", "workshop"):
        namespace = dict(cfg=TrainConfig.preset(preset))
        exec(statement, namespace)
        same = namespace["same"]
        derived[preset] = same
        assert (same.dataset, same.generated, same.workers, same.model, same.precision, same.channels_last) == \
            ("digits", 0, 0, "cnn", "fp32", False), preset
    assert derived["smoke"] == TrainConfig.preset("smoke").replace(epochs=1, max_steps=12, schedule="constant",
                                                                   lr_scaling="none", warmup_epochs=0)


# ------------------------------------------------------------------ no cell decides a backend, device or GPUs
# The allocation is decided once per notebook and tested above for every allocation (no GPU, one GPU for 2 ranks,
# 2 and 8 GPUs, a CUDA_VISIBLE_DEVICES subset); per-task binding is test_distributed's identity rule. A cell stays
# right on every allocation only if it takes what was decided instead of deciding again, so each rule below is a way
# a cell could decide for itself. On 984c965 they found 03a [9] ("nccl" if cuda) and 11 [10] and [20] (the
# project's init_process_group without the allocation's backend), 09 [8] likewise, 10 [16] and 03b [42] (launches
# that inherit a GPU their ranks would share). 10 [32] and [49] had the same fault in forms the rules do not parse (a
# lone rank started by hand, a command joined from a list); they hide the GPUs now too.
LAUNCH = re.compile(r"!.*\b(torch\.distributed\.run|torchrun|mpirun|horovodrun|deepspeed)\b.*"
                    r"(tutorial\.train_|\.py\b|\{script\})")
HIDDEN_FOR_LAUNCHES = re.compile(r"os\.environ\.update\(child_processes\.launcher_env\(")


def own_decisions(cells: list[tuple[int, str]]) -> list[str]:
    """Cells (index, source) that pick a backend or a launch's GPUs themselves, one line each."""
    found, hidden = [], False
    for index, cell in cells:
        px = cell.lstrip().startswith("%%px")
        for line in cell.splitlines():
            code = line.split("  #")[0]
            hidden = hidden or bool(HIDDEN_FOR_LAUNCHES.search(code))  # from here on, launches see no GPU
            if "init_process_group(" in code and re.search(r"[\"']nccl[\"']|\bif\b.*\belse\b", code):
                found.append(f"[{index}] chooses a backend itself: {line.strip()}")
            if px and re.search(r"\binit_process_group\(world\b", code) and "backend=" not in code:
                found.append(f"[{index}] leaves the backend to the device (nccl on a shared GPU): {line.strip()}")
            hides = re.search(r"alloc\.(script_)?env|CUDA_VISIBLE_DEVICES=|\{cpu_only\}", cell)
            if LAUNCH.search(code) and not (hidden or hides):
                found.append(f"[{index}] launches with whatever GPUs the kernel sees: {line.strip()[:100]}")
    return found


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem[:3])
def test_no_cell_decides_a_backend_or_a_launchs_gpus_itself(nb):
    cells = [(i, "".join(c["source"])) for i, c in enumerate(json.loads(nb.read_text())["cells"])
             if c["cell_type"] == "code"]
    assert own_decisions(cells) == []


def test_the_cell_rules_find_what_984c965_did():
    assert len(own_decisions([(9, 'dist.init_process_group("nccl" if device.type == "cuda" else "gloo", '
                                   'init_method="env://")')])) == 1
    assert len(own_decisions([(10, "%%px\ninit_process_group(world, device)")])) == 1
    assert own_decisions([(10, "%%px\ninit_process_group(world, device, backend=backend)")]) == []
    assert own_decisions([(8, "init_process_group(world, pick_device(0, 1))")]) == []  # the kernel alone, world 1
    assert len(own_decisions([(49, '!{" ".join(command)} --resume')])) == 0  # a joined command: see the next line
    assert len(own_decisions([(42, "!OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 {script}")])) == 1
    assert own_decisions([(42, "!{alloc.script_env} python -m torch.distributed.run {script}")]) == []
    assert own_decisions([(1, "os.environ.update(child_processes.launcher_env())"),
                          (2, "!mpirun -np 2 python -m tutorial.train_ddp")]) == []
