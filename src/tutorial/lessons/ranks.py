"""What the exercise checkers of 00, 03, 05 and 10 share: run the learner's function on every engine, and say in one
line what went wrong.

A checker calls `cluster.run(on_every_rank, fn, ...)`. On each engine that joins the ranks (a fresh gloo group whose
collectives give up after a few seconds, or Horovod), calls the learner's fn with this rank's inputs, and turns
whatever the learner's code raises into text the verdict can quote: a mistake in an exercise is a verdict, not a
traceback from an engine.
"""
from __future__ import annotations

from ..core.config import first_line

LIMIT = 160  # characters of an error a verdict quotes: one line of a notebook's output


def describe(exc: BaseException, limit: int | None = LIMIT) -> str:
    """`Type: first line`, e.g. "AttributeError: 'NoneType' object has no attribute 'item'"."""
    return f"{type(exc).__name__}: {first_line(exc, limit)}"


def on_every_rank(fn, *args, inputs=None, join: str = "gloo", seconds: float = 10.0, detail: bool = False):
    """On an engine: fn(*args, *inputs(rank, world_size)) (or fn(*args) without inputs) after joining the ranks.

    join="gloo": a fresh gloo process group whose collectives give up after `seconds` (so a collective that only
    some ranks call ends with an error instead of hanging the checker), destroyed afterwards; an existing group is
    used as it is and kept. join="horovod": hvd.init() (Horovod stays initialised: it cannot start twice in one
    process). detail=True runs with TORCH_DISTRIBUTED_DEBUG=DETAIL, so collectives of mismatched shapes raise on
    every rank instead of aborting the process.

    Returns ("ok", value) or ("error", "Type: first line of the message").
    """
    import os
    if join == "horovod":
        import horovod.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        try:
            return "ok", fn(*args, *(inputs(rank, size) if inputs else ()))
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything; the verdict names it
            return "error", describe(exc)
    if join != "gloo":
        raise ValueError(f"join={join!r} is not one of: gloo, horovod")
    import datetime
    import torch.distributed as dist
    if detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
    try:
        rank, size = dist.get_rank(), dist.get_world_size()
        return "ok", fn(*args, *(inputs(rank, size) if inputs else ()))
    except Exception as exc:  # noqa: BLE001 - as above
        return "error", describe(exc)
    finally:
        if created:
            dist.destroy_process_group()
        if detail:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = "OFF"
            dist.set_debug_level_from_env()


def first_error(results) -> tuple[int, str] | None:
    """(rank, error) of the first rank whose on_every_rank reported an error, or None."""
    for rank, (status, value) in enumerate(results):
        if status == "error":
            return rank, value
    return None
