"""The memory planner of 12_performance_clinic, a tool for any layout of core.gpt's GPT: what one rank holds under
DDP, ZeRO/FSDP2, tensor and pipeline parallel and activation checkpointing, by arithmetic (fp32 weights, AdamW;
mixed_states: ZeRO's 2 + 2 + 12 bytes), the largest micro-batch that fits a budget, a forward's collectives by
count, and refuse(): core.layout's reasons plus the memory a GPU does not have. lessons.performance measures the
same bytes on the engines and holds the exercises.
"""
from __future__ import annotations

from ..core.gpt import GPTConfig
from ..core.layout import Layout, layout_problems

FLOAT = 4  # bytes of an fp32 value: weights, gradients, AdamW's two moments and the activations here

def parameter_counts(cfg: GPTConfig) -> dict:
    """The GPT's parameters by where they live: the embedding, one block (split: the q/k/v/out/fc/proj weights and
    the column-wise biases tensor parallel cuts; whole: the norms and the row-wise biases it keeps), the final norm
    and the head (no bias; cut column-wise under TP)."""
    C, H = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    split = 4 * C * C + 3 * C + 2 * C * H + H  # q, k, v, out weights; q, k, v biases; fc, proj weights; fc bias
    whole = 4 * C + C + C  # two LayerNorms (weight, bias); out's and proj's biases
    return dict(embed=(cfg.vocab_size + cfg.context) * C, block_split=split, block_whole=whole, norm=2 * C,
                head=cfg.vocab_size * C)


def stage_parameters(cfg: GPTConfig, layout: Layout, stage: int = 0) -> int:
    """Parameters one rank of pipeline stage `stage` holds before data-parallel sharding: its blocks (their cut
    part / tp), the embedding on the first stage, the final norm and the head (/ tp) on the last."""
    n = parameter_counts(cfg)
    blocks = cfg.n_layers // layout.pp
    total = blocks * (n["block_split"] // layout.tp + n["block_whole"])
    if stage == 0:
        total += n["embed"]
    if stage == layout.pp - 1:
        total += n["norm"] + n["head"] // layout.tp
    return total


def activation_bytes(cfg: GPTConfig, layout: Layout, micro_batch: int, stage: int = 0) -> int:
    """What one rank's forward leaves for its backward (fp32), counted tensor by tensor for core.gpt on CPU:
    per block the LayerNorms' inputs and outputs (4 x BTC, whole under TP), q, k, v and attention's output
    (4 x BTC / tp), the MLP's hidden pre- and post-GELU (8 x BTC / tp), the norms' mean and 1/std (4 x BT) and
    attention's log-sum-exp (BHT / tp); checkpointing keeps only each block's input (BTC). The last stage adds the
    final norm (2 x BTC + 2 x BT), the log-softmax of the logits (BTV), the loss; the first the positions (int64);
    a stage before the last its output (BTC); a stage after the first received its input (one BTC less)."""
    B, T, C, V = micro_batch, cfg.context, cfg.d_model, cfg.vocab_size
    tp = layout.tp
    if layout.checkpointing:
        block = B * T * C
    else:
        block = 4 * B * T * C + 12 * B * T * C // tp + 4 * B * T + B * cfg.n_heads * T // tp
    values = cfg.n_layers // layout.pp * block
    extra = 0
    if stage == layout.pp - 1:
        values += 2 * B * T * C + 2 * B * T + B * T * V
        extra += FLOAT  # the loss
    if stage < layout.pp - 1:
        values += B * T * C  # the stage's output: sent on, and kept for its own backward
    if stage > 0:
        values -= B * T * C  # its first block's input arrived from the previous stage before the forward
    if stage == 0:
        extra += 8 * T  # the position indices, int64
    return values * FLOAT + extra


def zero_states(n_params: int, zero: int, dp: int) -> dict:
    """Bytes of parameters, gradients and optimizer state one rank holds for n_params fp32 parameters trained with
    AdamW over dp data-parallel ranks: zero=0 DDP (every rank all of it), 1 ZeRO-1, 2 ZeRO-2, 3 ZeRO-3/FSDP2."""
    parameters = n_params * FLOAT // (dp if zero >= 3 else 1)  # ZeRO-3/FSDP: each rank keeps 1/dp of the weights
    gradients = n_params * FLOAT // (dp if zero >= 2 else 1)  # ZeRO-2: reduce-scatter, keep your 1/dp
    optimizer = 2 * n_params * FLOAT // (dp if zero >= 1 else 1)  # AdamW: exp_avg and exp_avg_sq per parameter
    return dict(parameters=parameters, gradients=gradients, optimizer=optimizer)


def mixed_states(n_params: int, zero: int, dp: int) -> dict:
    """zero_states in mixed precision as 09 teaches it, ZeRO's accounting: bf16 weights and gradients (2 + 2 bytes
    per parameter) and, for the optimizer, fp32 master weights with AdamW's two moments (12 bytes: ZeRO's K = 12),
    sharded over dp by the same stages."""
    parameters = 2 * n_params // (dp if zero >= 3 else 1)
    gradients = 2 * n_params // (dp if zero >= 2 else 1)
    optimizer = 12 * n_params // (dp if zero >= 1 else 1)
    return dict(parameters=parameters, gradients=gradients, optimizer=optimizer)


def plan_memory(cfg: GPTConfig, layout: Layout, micro_batch: int, stage: int = 0, states=None) -> dict:
    """Bytes per rank of pipeline stage `stage`: parameters, gradients (with DDP's buckets where the layout has
    them), optimizer state (from `states`, the function 12's learner completes: zero_states by default) and
    activations; FSDP2 also keeps the root module's gathered weights (embedding, final norm, head: not resharded
    after forward, backward needs them at once) until backward, and (without pipeline stages) three block units'
    buffers at its peak."""
    states = states or zero_states
    n = stage_parameters(cfg, layout, stage)
    plan = dict(states(n, layout.zero, layout.dp))
    if layout.buckets and layout.zero == 0:  # DDP's reducer: a second copy of the fp32 gradients, all-reduced
        # bucket by bucket (ZeRO's stages keep buckets of their own, which this planner leaves out)
        plan["gradients"] += n * FLOAT
    plan["activations"] = activation_bytes(cfg, layout, micro_batch, stage)
    if layout.zero >= 3 and layout.dp > 1 and layout.pp == 1:
        counts = parameter_counts(cfg)
        plan["activations"] += (counts["embed"] + counts["norm"] + counts["head"] // layout.tp) * FLOAT
    if layout.zero >= 3 and layout.dp > 1 and layout.pp == 1:
        # FSDP's buffers at a step's peak, each a block unit's worth: its weights gathered for its compute, the next
        # unit's being gathered meanwhile (prefetch), and a unit's whole gradients before their reduce-scatter. Not
        # planned under pipeline stages, where torch's schedule keeps a stage's units gathered, with their whole
        # gradients, across its micro-batches (and the stage's embedding or head with them).
        counts = parameter_counts(cfg)
        plan["unit_buffers"] = 3 * (counts["block_split"] // layout.tp + counts["block_whole"]) * FLOAT
    plan["total"] = sum(plan.values())
    return plan


def largest_micro_batch(cfg: GPTConfig, layout: Layout, budget: int, states=None, limit: int = 1 << 16) -> int:
    """The most sequences per micro-batch whose planned total fits in `budget` bytes on every stage (0: none)."""
    best = 0
    for b in range(1, limit + 1):
        if any(plan_memory(cfg, layout, b, s, states)["total"] > budget for s in range(layout.pp)):
            break
        best = b
    return best


def refuse(cfg: GPTConfig, layout: Layout, nodes: int, gpus_per_node: int, gpu_bytes: float,
           micro_batch: int = 1) -> list:
    """Every reason this layout cannot run `cfg` on nodes x gpus_per_node GPUs of gpu_bytes each ([]: none): the
    trainers' reasons (core.layout), then the planner's bytes per rank against the GPU's."""
    reasons = layout_problems(layout, cfg.n_heads, cfg.n_layers, vocabulary=cfg.vocab_size,
                              job=(nodes, gpus_per_node))
    if not reasons:
        need = max(plan_memory(cfg, layout, micro_batch, s)["total"] for s in range(layout.pp))
        if need > gpu_bytes:
            reasons.append(f"the planner needs {need / 1e9:.0f} GB per rank, the GPU has {gpu_bytes / 1e9:.0f} GB")
    return reasons


def forward_collectives(cfg: GPTConfig, layout: Layout, stage: int) -> dict:
    """A stage's forward collectives by section 2's counts: with TP one all-reduce after each row-wise layer (2 per
    block) and the head's logits all-gathered on the last stage; with FSDP2 one all-gather per unit (each block and
    the stage's root)."""
    blocks = cfg.n_layers // layout.pp
    counts = {}
    if layout.tp > 1:
        counts["all_reduce"] = 2 * blocks
        if stage == layout.pp - 1:
            counts["all_gather"] = 1
    if layout.zero >= 3 and layout.dp > 1:
        counts["all_gather"] = counts.get("all_gather", 0) + blocks + 1
    return counts
