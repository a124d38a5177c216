"""What a training run really did inside its model, for checks that an option was applied, not only accepted
(tests/test_matrix.py): the dtypes its convolutions and linear layers computed in (bf16 under autocast or FSDP's
MixedPrecisionPolicy), whether their inputs were channels_last, and whether a torch.compile'd graph ran.

Global module hooks see every module of the run whatever wraps it (DDP, FSDP, DeepSpeed, Lightning) and change
nothing; under --compile they are left out (dynamo would trace them) and dynamo's own counters say what it compiled.
"""
from __future__ import annotations


def run_observed(main, cfg, compile_backend: str | None = None) -> dict:
    """main(cfg)'s metrics, plus metrics["observed"] = {"dtypes": [...], "channels_last": [...], "compiled_graphs": n}.
    channels_last lists, for every convolution whose input has more than one channel (a single channel is NCHW and
    NHWC at once), whether that input was laid out NHWC; a run that ignored the option gives [False].

    compile_backend replaces the backend of every torch.compile call of the run (e.g. "aot_eager": dynamo's graph
    capture and AOTAutograd without inductor's C++ code generation, seconds instead of minutes on a CPU); the
    trainer's other arguments to torch.compile are kept."""
    import functools

    import torch
    from torch._dynamo.utils import counters
    from torch.nn.modules.module import register_module_forward_hook

    dtypes, layouts = set(), set()

    def watch(module, args, output):
        if not isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)) or not isinstance(output, torch.Tensor):
            return
        dtypes.add(str(output.dtype).removeprefix("torch."))
        x = args[0] if args else None
        if isinstance(module, torch.nn.Conv2d) and isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[1] > 1:
            layouts.add(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())

    compile_ = torch.compile
    graphs = []  # every graph handed to the backend (under DDP one per bucket: dynamo's stats miss those)

    def counted_backend(gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend
        graphs.append(len(gm.graph.nodes))
        return lookup_backend(compile_backend)(gm, example_inputs)

    @functools.wraps(compile_)
    def compile_with_backend(*args, **kwargs):
        return compile_(*args, **{**kwargs, "backend": counted_backend})

    # A fresh start for dynamo too: code compiled by an earlier run in this process (an engine serves many) would be
    # reused, or past its recompile limit left eager, and this run would show no graphs of its own.
    torch._dynamo.reset()
    counters.clear()
    handle = None if cfg.compile else register_module_forward_hook(watch)
    if compile_backend:
        torch.compile = compile_with_backend
    try:
        metrics = main(cfg)
    finally:
        torch.compile = compile_
        if handle is not None:
            handle.remove()
    metrics["observed"] = {"dtypes": sorted(dtypes), "channels_last": sorted(layouts),
                           "compiled_graphs": max(int(counters["stats"]["unique_graphs"]), len(graphs))}
    return metrics


def fields_read(main, cfg) -> tuple[list[str], dict]:
    """The TrainConfig fields that main's own module reads, itself or through the core functions its code calls, for
    the check that every option is read or refused (tests/test_matrix.py), and main's metrics. Reads that say nothing
    of what the trainer does with an option do not count: those inside config.py and dataclasses (validate, to_dict,
    check_stage read every field), those of a constructor the trainer calls (RunLog(cfg, ...) reads the batch,
    accumulation, model and precision for its record whatever the trainer does with them), and those with no frame
    of the trainer's file."""
    import dataclasses
    import sys

    read = set()
    own = type(cfg)
    trainer = sys.modules[main.__module__].__file__

    def by_the_trainer(frame) -> bool:
        if frame.f_code.co_filename.endswith(("/core/config.py", "/dataclasses.py")):
            return False
        called = None  # the function the trainer's own frame called to get here
        while frame is not None and frame.f_code.co_filename != trainer:
            called, frame = frame, frame.f_back
        return frame is not None and (called is None or called.f_code.co_name != "__init__")

    class Noted(own):
        def __getattribute__(self, name):
            if by_the_trainer(sys._getframe(1)):
                read.add({"resume_path": "resume"}.get(name, name))
            return object.__getattribute__(self, name)

    metrics = main(Noted(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}))
    return sorted(read), metrics


# The engines cannot import tests/ (their sys.path is the package's): both functions go to them by value, as a
# notebook cell's function does. Neither reads a global of this module.
run_observed.__module__ = fields_read.__module__ = "__main__"
