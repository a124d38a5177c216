"""`tutorial doctor | train | bench | check-ddp` (also `python -m tutorial ...`).

doctor is the first cell of 00_setup: what is on this machine, and whether the workbook can run here.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import platform
import shutil
import subprocess
import sys

from .core.config import GPT_STAGES, STAGES, OneLineErrorParser, first_line

TRAINERS = (*STAGES, *GPT_STAGES)  # train_<stage>.py, every one of them: the image trainers, then the GPT ones
COMMANDS = {
    "doctor": "what is installed; exit 1 with a fix per missing piece",
    "train": "run a trainer in this process: tutorial train STAGE [options] (launch the distributed ones with "
             "torchrun, mpirun or horovodrun)",
    "bench": "throughput, all-reduce and scaling benchmarks (tutorial bench --help)",
    "check-ddp": "run your DDP script under torchrun and say what is wrong (tutorial check-ddp --help)",
}


def _version(module: str):
    try:
        return importlib.import_module(module), None
    except Exception as exc:  # noqa: BLE001 - a broken install raises anything, report it as missing
        return None, f"{type(exc).__name__}: {first_line(exc)}"


def _mpi_runtime() -> str | None:
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return first_line(out) or exe


# CUDA builds that PyTorch publishes for the pinned torch, newest first (its wheel index has one folder each).
TORCH_CUDA_BUILDS = ("13.0", "12.8", "12.6")


def _torch_build_fix(torch, driver_cuda: str) -> str:
    """What to install when the driver is older than the CUDA this torch was built for."""
    def version(v):
        return tuple(int(x) for x in v.split(".")[:2])

    built = torch.version.cuda
    if built is None:
        fits = "a CUDA build of torch"
    elif version(built) > version(driver_cuda):
        fits = f"torch is built for CUDA {built}, newer than the driver supports"
    else:
        return "torch cannot initialise CUDA although driver and build match: check CUDA_VISIBLE_DEVICES and nvidia-smi"
    usable = [b for b in TORCH_CUDA_BUILDS if version(b) <= version(driver_cuda)]
    if not usable:
        return (f"{fits}; no torch {torch.__version__.split('+')[0]} build supports CUDA {driver_cuda}: "
                "ask for a newer NVIDIA driver, or pin an older torch/torchvision pair in requirements.txt")
    from .core.accelerator import NVIDIA
    return f"{fits}; install the CUDA {usable[0]} build: {_reinstall(NVIDIA.wheels + usable[0].replace('.', ''))}"


def _reinstall(index: str) -> str:
    """The command that puts the pinned torch/torchvision pair built for another runtime (a wheel index) in place."""
    pair = " ".join(f"{name}=={v}" for name, v in _pins(("torch", "torchvision")))
    return f".venv/bin/pip install --force-reinstall {pair} --index-url {index}"


def _pins(names) -> list[tuple[str, str]]:
    import importlib.metadata
    return [(name, importlib.metadata.version(name).split("+")[0]) for name in names]


def _torch_row(torch):
    """torch's version, the runtime it is built for and its collective library: "(CUDA 13.0, NCCL 2.27.5)",
    "(ROCm 6.2, RCCL 2.20.5)", "(XPU on Level Zero, SYCL 20250101, oneCCL)"; a CPU-only build keeps the line it always
    had, "(CUDA none (CPU build), NCCL -)"."""
    from .core import accelerator
    found = accelerator.vendor()
    library = found.library if found else "NCCL"
    if found is not accelerator.INTEL:  # torch reports no oneCCL version
        library += f" {accelerator.library_version() or '-'}"
    return ("torch", f"{torch.__version__} ({accelerator.runtime() or 'CUDA none (CPU build)'}, {library})", None)


def _gpu_rows(torch, driver: tuple[str, str] | None) -> list[tuple]:
    """The GPUs row and, where torch sees GPUs, the backend row. A GPU that the machine has and torch cannot see is a
    missing piece, whoever made it: on such a node every notebook would quietly train on the CPU. driver: nvidia-smi's
    (version, CUDA) or None."""
    from .core import accelerator
    found, names = accelerator.vendor(), accelerator.device_names()
    if names:
        backend = accelerator.backend()
        library = {accelerator.AMD: " (RCCL, under NCCL's name)", accelerator.INTEL: " (oneCCL)"}.get(found, "")
        fix = None if _dist_available(backend) else \
            f"torch {torch.__version__} has no {backend} backend: install a torch built for {found.runtime} with it"
        return [("GPUs", f"{len(names)} {', '.join(sorted(set(names)))}", None), ("backend", backend + library, fix)]
    if driver:
        return [("GPUs", f"NVIDIA driver {driver[0]} (CUDA up to {driver[1]}) but torch sees no GPU",
                 _torch_build_fix(torch, driver[1]))]
    if archs := accelerator.amd_gpus():
        kinds = ", ".join(f"{arch}: {accelerator.INSTINCT[arch]}" for arch in sorted(set(archs)))
        return [("GPUs", f"{len(archs)} AMD Instinct GPU(s) ({kinds}) but torch sees no GPU",
                 _vendor_build_fix(torch, accelerator.AMD))]
    if cards := accelerator.intel_gpus():
        return [("GPUs", f"{len(cards)} Intel Data Center GPU Max card(s) but torch sees no GPU",
                 _vendor_build_fix(torch, accelerator.INTEL))]
    return [("GPUs", "none: CPU presets (gloo)", None)]


def _dist_available(backend: str) -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_backend_available(backend)


def _vendor_build_fix(torch, gpus) -> str:
    """What to do where the machine has AMD or Intel GPUs (gpus: accelerator.AMD or INTEL) and torch sees none."""
    from .core import accelerator
    if accelerator.vendor() is gpus:  # the right build: the devices are hidden or not reachable from this process
        hidden = ", ".join(f"{name}={value!r}" for name, value in accelerator.visible_devices(gpus).items())
        where = f"{hidden} (the GPUs this process may see)" if hidden else " and ".join(gpus.visible_devices)
        if gpus is accelerator.AMD:
            device = "" if accelerator.KFD_DEVICE.exists() else \
                "; /dev/kfd is missing here (a container needs --device /dev/kfd --device /dev/dri)"
            return (f"torch is built for {accelerator.runtime()} but sees no GPU: check {where}{device}, and that "
                    "you are in the render and video groups")
        return (f"torch is built for XPU but sees no GPU: check {where}, the Level Zero loader (level-zero package) "
                "and that you are in the render group")
    built = f"torch is built for {accelerator.runtime()}" if accelerator.vendor() else "torch is a CPU build"
    if gpus is accelerator.AMD:
        rocm = accelerator.node_rocm()
        which = f"ROCm {rocm} is installed here" if rocm else "X.Y: the node's ROCm"
        return (f"{built}, not ROCm; install a ROCm build: {_reinstall(gpus.wheels + (rocm or '<X.Y>'))} ({which}; "
                "pytorch.org lists the ROCm versions each torch is built for), or use the site's ROCm torch: load "
                "it, then SITE_TORCH=1 make install")
    return (f"{built}, not XPU; install the XPU build: {_reinstall(gpus.wheels)}, or use the site's XPU torch (on "
            "Aurora: module load frameworks, then SITE_TORCH=1 make install)")


def doctor_rows():
    """(name, what is there, fix or None). A fix means the workbook cannot run until it is applied."""
    rows = [("python", platform.python_version(), None if sys.version_info >= (3, 10) else "use Python 3.10-3.12")]
    reinstall = "run 'make install'"
    torch, err = _version("torch")
    if torch is None:
        return rows + [("torch", err, reinstall)]
    from .core import accelerator
    rows.append(_torch_row(torch))
    tv, err = _version("torchvision")
    rows.append(("torchvision", tv.__version__ if tv else err, None if tv else reinstall))
    driver = accelerator.nvidia_driver()
    rows += _gpu_rows(torch, driver)
    mpi = _mpi_runtime()
    rows.append(("MPI", mpi or "not found", None if mpi else
                 "install Open MPI (apt-get install openmpi-bin libopenmpi-dev) or load an MPI module"))
    mpi4py, err = _version("mpi4py")
    if mpi4py:
        rows.append(("mpi4py", mpi4py.__version__, None))
    else:
        rows.append(("mpi4py", err, "pip install mpi4py (needs MPI headers), or 'make install'"))
    hvd, err = _version("horovod.torch")
    if hvd:
        controllers = [name for name, ok in (("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built())) if ok]
        ops = [name for name, ok in (("NCCL", hvd.nccl_built()), ("MPI", hvd.mpi_built()),
                                     ("Gloo", hvd.gloo_built())) if ok]
        import horovod
        # Horovod's GPU operations are built for NVIDIA here (scripts/install_horovod.sh); ROCm and XPU nodes get none.
        nvidia = driver or (accelerator.vendor() is accelerator.NVIDIA and accelerator.device_count())
        # On a GPU node, Horovod without NCCL ops copies every gradient to the host for an MPI/Gloo all-reduce.
        fix = "HOROVOD_GPU_OPERATIONS=NCCL make install (rebuilds Horovod with NCCL all-reduce)" \
            if nvidia and not hvd.nccl_built() else None
        rows.append(("horovod", f"{horovod.__version__}: PyTorch; controllers {'+'.join(controllers)}; "
                                f"tensor ops {'+'.join(ops)}", fix))
    else:
        rows.append(("horovod", err, "bash scripts/install_horovod.sh (or 'make install')"))
    # 08_lightning and 09_sharded_training. DeepSpeed picks its accelerator when imported: the trainers' own import
    # names it for the import only (a variable left in this process would reach every trainer it starts).
    from .core.deepspeed_compat import import_deepspeed
    with contextlib.suppress(Exception):  # a broken or missing DeepSpeed is reported by _version below
        import_deepspeed()
    for module, label in (("ipyparallel", "ipyparallel"), ("nbval", "nbval"), ("tensorboard", "tensorboard"),
                          ("jupyterlab", "jupyterlab"), ("lightning", "lightning"), ("deepspeed", "deepspeed")):
        mod, err = _version(module)
        rows.append((label, getattr(mod, "__version__", "?") if mod else err, None if mod else reinstall))
    return rows


def doctor(argv=None) -> int:
    OneLineErrorParser(prog="tutorial doctor", description=COMMANDS["doctor"]).parse_args(argv)
    rows = doctor_rows()
    width = max(len(r[0]) for r in rows)
    for name, value, fix in rows:
        print(f"{name:<{width}}  {'MISSING ' if fix else ''}{value}")
    missing = [(name, fix) for name, _, fix in rows if fix]
    if missing:
        print()
        for name, fix in missing:
            print(f"missing {name}: {fix}", file=sys.stderr)
        return 1
    print("\nready: the workbook can run on this machine")
    return 0


def train(argv) -> int:
    """`tutorial train STAGE [options]`: the trainer's own main with its own options (its --help lists them)."""
    stage, options = argv[0], argv[1:]
    from .core.process import run_main
    module = importlib.import_module(f"tutorial.train_{stage}")
    if stage in GPT_STAGES:
        from .core.parallel_config import parse_parallel_args
        cfg = parse_parallel_args(f"tutorial train {stage}", options, stage=stage)
    else:
        from .core.config import parse_args
        cfg = parse_args(f"tutorial train {stage}", options, stage=stage)
    run_main(module.main, cfg)
    return 0


def parser() -> argparse.ArgumentParser:
    """`tutorial COMMAND ...`: the commands and, under train, every trainer. What follows a command (or a trainer) is
    the command's own (main passes on what this parser does not know), so `tutorial train ddp --help` is train_ddp's
    help."""
    top = OneLineErrorParser(prog="tutorial", description="The workbook's command line (also python -m tutorial).")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineErrorParser)
    for name, summary in COMMANDS.items():
        command = commands.add_parser(name, help=summary, description=summary, add_help=name == "train")
        if name == "train":
            stages = command.add_subparsers(dest="stage", required=True, metavar="STAGE",
                                            parser_class=OneLineErrorParser)
            for stage in TRAINERS:
                stages.add_parser(stage, help=_summary(stage), add_help=False)
    return top


def _summary(stage: str) -> str:
    """The first line of train_<stage>.py's docstring, read (not imported: train_horovod needs Horovod)."""
    import ast
    path = importlib.util.find_spec("tutorial").submodule_search_locations[0] + f"/train_{stage}.py"
    with open(path) as f:
        return (ast.get_docstring(ast.parse(f.read())) or "").split("\n")[0]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, options = parser().parse_known_args(argv)
    except SystemExit as exc:  # --help (0), or a bad command or stage (2, its one line already printed)
        return exc.code if isinstance(exc.code, int) else 0
    if args.command == "bench":
        from . import bench
        return bench.main(options)
    if args.command == "check-ddp":
        from .checkddp import command
        return command.main(options)
    if args.command == "train":
        return train([args.stage, *options])
    return doctor(options)

if __name__ == "__main__":
    sys.exit(main())
