"""How the GPT is cut over ranks, and the one check of whether a cut fits: the GPT trainers' setup (train_tp,
train_pp, train_2d, core.gpt.pipeline_stage), 12's memory planner and its dry run of a large job all ask
layout_problems, so a rule is worded once wherever it is applied. Each asks the rules its cut needs: the planner also
the job's nodes and the vocabulary (the head's columns split over tp), the trainers the ranks and the batch."""
from __future__ import annotations

from dataclasses import dataclass

from .config import ConfigError


@dataclass(frozen=True)
class Layout:
    """How a job is cut: dp data-parallel replicas (zero: 0 = DDP, 1/2/3 = ZeRO stage, 3 is FSDP2), tp ranks per
    tensor-parallel group, pp pipeline stages; checkpointing = each block recomputed in backward; buckets = DDP's
    reducer keeps its buckets beside the gradients, a flat copy of them (DDP's default; gradient_as_bucket_view=True
    makes the gradients views into the buckets instead); sequence_parallel = with tp, the norms and the residual
    stream between the cut layers split along the sequence (train_tp's default)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    checkpointing: bool = False
    buckets: bool = False
    sequence_parallel: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


def layout_problems(layout: Layout, heads: int, layers: int, *, context: int | None = None,
                    vocabulary: int | None = None, batch: int | None = None, micro_batches: int | None = None,
                    ranks: int | None = None, job: tuple[int, int] | None = None) -> list[str]:
    """Every reason `layout` cannot cut a GPT of `heads` and `layers` ([]: none). Given, also: the context (sequence
    parallel splits its positions over tp), the vocabulary (the head's columns over tp), the global batch (over dp,
    and into micro_batches for a pipeline), the ranks there are (tp x pp must divide them), and the job's
    (nodes, GPUs per node), which must hold dp x tp x pp ranks with each tensor-parallel group inside a node."""
    reasons = []
    uneven_ranks = ranks is not None and ranks % (layout.tp * layout.pp)
    if uneven_ranks:
        reasons.append(f"{ranks} ranks do not split into groups of tp x pp = {layout.tp} x {layout.pp}")
    if job is not None:
        nodes, per_node = job
        if layout.world != nodes * per_node:
            reasons.append(f"dp x tp x pp = {layout.dp} x {layout.tp} x {layout.pp} = {layout.world} ranks, but the "
                           f"job has {nodes} x {per_node} = {nodes * per_node} GPUs")
        if layout.tp > per_node:
            reasons.append(f"tp={layout.tp} spans nodes of {per_node} GPUs: tensor parallel talks in every layer, "
                           "keep it within a node's fast links")
    # Tensor parallel gives each rank whole heads and equal slices; a pipeline equal stages
    for what, size, parts in (("heads", heads, layout.tp), ("positions of the context", context, layout.tp),
                              ("vocabulary entries", vocabulary, layout.tp), ("layers", layers, layout.pp)):
        if size is not None and size % parts:
            reasons.append(f"{size} {what} do not split into {parts} equal parts")
    if batch is None or uneven_ranks:  # without whole groups there is no dp to split the batch over
        return reasons
    if batch % layout.dp:
        reasons.append(f"batch-size {batch} does not split into {layout.dp} equal data-parallel parts")
    elif micro_batches is not None and (batch // layout.dp) % micro_batches:
        part = f"batch-size {batch}" if layout.dp == 1 else f"each data-parallel part ({batch // layout.dp})"
        reasons.append(f"{part} does not split into {micro_batches} equal micro-batches")
    return reasons


def check_layout(layout: Layout, heads: int, layers: int, **given) -> None:
    """layout_problems as one ConfigError naming every reason (a trainer's bad option: one line, exit 2)."""
    problems = layout_problems(layout, heads, layers, **given)
    if problems:
        raise ConfigError("; ".join(problems))
