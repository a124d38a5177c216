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
    a stage before the last its output (BTC); a stage after the first received its input (one BTC less).
    Sequence parallel as torch does it (train_tp.tp_plan): the norms' inputs and statistics and a block's input are
    the rank's slice of the sequence (/ tp), but each linear after a norm keeps the all-gathered whole input for its
    backward (Megatron keeps the slice and gathers again in backward: korthikanti_bytes' / t)."""
    B, T, C, V = micro_batch, cfg.context, cfg.d_model, cfg.vocab_size
    cut = layout.tp if layout.sequence_parallel else 1  # what sequence parallel splits along the sequence
    values = cfg.n_layers // layout.pp * block_activations(cfg, layout, micro_batch) // FLOAT
    extra = 0
    if stage == layout.pp - 1:  # the final norm's input and statistics, its output (the head's input), the logits
        values += B * T * C // cut + B * T * C + 2 * B * T // cut + B * T * V
        extra += FLOAT  # the loss
    if stage < layout.pp - 1:
        values += B * T * C // cut  # the stage's output: sent on, and kept for its own backward
    if stage > 0:
        values -= B * T * C // cut  # its first block's input arrived from the previous stage before the forward
    if stage == 0:
        extra += 8 * T  # the position indices, int64
    return values * FLOAT + extra


def block_activations(cfg: GPTConfig, layout: Layout, micro_batch: int) -> int:
    """One block's part of activation_bytes: what its forward keeps for its backward, in bytes."""
    B, T, C, tp = micro_batch, cfg.context, cfg.d_model, layout.tp
    cut = tp if layout.sequence_parallel else 1  # what sequence parallel splits along the sequence
    if layout.checkpointing:
        return B * T * C // cut * FLOAT
    # the norms' inputs, the linears' (gathered) inputs, q k v and attention's output, the MLP's hidden before and
    # after GELU, the norms' mean and 1/std, attention's log-sum-exp
    return (2 * B * T * C // cut + 2 * B * T * C + 12 * B * T * C // tp + 4 * B * T // cut
            + B * cfg.n_heads * T // tp) * FLOAT


def korthikanti_bytes(cfg: GPTConfig, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
                      recompute: str = "none", value_bytes: int = 2, dropout: bool = True,
                      attention_scores: bool = True) -> int:
    """One transformer layer's activation bytes in the closed form of Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models", Table 2): s b h (34 + 5 a s / h) for 16-bit values, 1-byte dropout
    masks and attention's scores kept (softmax's output, its dropout's output and mask: 5 a s^2 b); under tensor
    parallel t, s b h (10 + 24 / t + 5 a s / (h t)); with sequence parallel everything / t; "selective" recompute
    drops the scores, "full" keeps the layer's input (2 s b h, the table's; / t with sequence parallel, as Megatron
    keeps it). The 34: sixteen values of s b h (the LayerNorms'
    inputs 2, q/k/v's input 1, q, k, v 3, the out projection's input 1, the MLP's input 1, GELU's input and output
    4 + 4) and two dropout masks; TP leaves four values and the masks whole and cuts the other twelve. value_bytes,
    dropout and attention_scores set what a model keeps: core.gpt keeps fp32 values (4), no dropout, and no scores
    (SDPA's fused attention keeps a log-sum-exp per row instead), where this count equals activation_bytes' per
    block but for the norms' and attention's per-row statistics, which the paper leaves out."""
    s, b, h, a = cfg.context, micro_batch, cfg.d_model, cfg.n_heads
    if recompute == "full":  # the layer's input; with sequence parallel each rank keeps its slice (Megatron's)
        return s * b * h * value_bytes // (tp if sequence_parallel else 1)
    masks = 2 if dropout else 0
    whole = 4 * value_bytes + masks  # 10 for 16-bit values with dropout
    cut = 12 * value_bytes           # 24
    scores = (2 * value_bytes + 1 if dropout else value_bytes) if attention_scores and recompute == "none" else 0
    if sequence_parallel:
        return (s * b * h * (whole + cut) + scores * a * s * s * b) // tp
    return s * b * h * whole + (s * b * h * cut + scores * a * s * s * b) // tp


def in_flight(schedule: str, micro_batches: int, pp: int, stage: int) -> int:
    """Micro-batches whose activations a pipeline stage holds at once: GPipe runs every forward before the first
    backward (all of them); 1F1B starts backward as soon as the last stage can, so stage s holds at most pp - s
    (the first stage pp, the last 1), whatever the number of micro-batches (Narayanan et al. 2021); torch's
    Schedule1F1B needs at least pp of them."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        if micro_batches < pp:
            raise ValueError(f"1F1B needs at least as many micro-batches as stages: {micro_batches} < {pp}")
        return pp - stage
    raise ValueError(f"schedule {schedule!r}: give 'gpipe' or '1f1b'")


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


def plan_memory(cfg: GPTConfig, layout: Layout, micro_batch: int, stage: int = 0, states=None,
                in_flight: int = 1) -> dict:
    """Bytes per rank of pipeline stage `stage`: parameters, gradients (with DDP's buckets where the layout has
    them), optimizer state (from `states`, the function 12's learner completes: zero_states by default) and
    activations, of `in_flight` micro-batches at once (a pipeline schedule's: the function in_flight); FSDP2 also
    keeps the root module's gathered weights (embedding, final norm, head: not resharded after forward, backward
    needs them at once) until backward, and three block units' buffers at its peak (under pipeline stages the
    stage's whole weights and gradients)."""
    states = states or zero_states
    n = stage_parameters(cfg, layout, stage)
    plan = dict(states(n, layout.zero, layout.dp))
    if layout.buckets and layout.zero == 0:  # DDP's reducer: a second copy of the fp32 gradients, all-reduced
        # bucket by bucket (ZeRO's stages keep buckets of their own, which this planner leaves out)
        plan["gradients"] += n * FLOAT
    plan["activations"] = in_flight * activation_bytes(cfg, layout, micro_batch, stage)
    if layout.zero >= 3 and layout.dp > 1 and layout.pp == 1:
        counts = parameter_counts(cfg)
        plan["activations"] += (counts["embed"] + counts["norm"] + counts["head"] // layout.tp) * FLOAT
    if layout.zero >= 3 and layout.dp > 1 and layout.pp == 1:
        # FSDP's buffers at a step's peak, each a block unit's worth: its weights gathered for its compute, the next
        # unit's being gathered meanwhile (prefetch), and a unit's whole gradients before their reduce-scatter.
        counts = parameter_counts(cfg)
        plan["unit_buffers"] = 3 * (counts["block_split"] // layout.tp + counts["block_whole"]) * FLOAT
    elif layout.zero >= 3 and layout.dp > 1:
        # Under pipeline stages torch's schedule keeps the stage's units gathered and their gradients whole across
        # its micro-batches (PipelineStage: reshard_after_backward and gradient sync off until the last one): the
        # stage's weights and gradients, unsharded over dp
        plan["unit_buffers"] = 2 * n * FLOAT
    plan["total"] = sum(plan.values())
    return plan


def largest_micro_batch(cfg: GPTConfig, layout: Layout, budget: int, states=None, limit: int = 1 << 16) -> int:
    """The most sequences per micro-batch whose planned total fits in `budget` bytes on every stage (0: none), one
    micro-batch in flight per stage (12 asks it without pipeline stages; refuse() plans a schedule's)."""
    best = 0
    for b in range(1, limit + 1):
        if any(plan_memory(cfg, layout, b, s, states)["total"] > budget for s in range(layout.pp)):
            break
        best = b
    return best


def refuse(cfg: GPTConfig, layout: Layout, nodes: int, gpus_per_node: int, gpu_bytes: float,
           micro_batch: int = 1, schedule: str = "1f1b") -> list:
    """Every reason this layout cannot run `cfg` on nodes x gpus_per_node GPUs of gpu_bytes each ([]: none): the
    trainers' reasons (core.layout), then the planner's bytes per rank against the GPU's, each stage holding the
    micro-batches of `micro_batch` sequences its pipeline schedule keeps in flight (a full pipeline: pp of them)."""
    reasons = layout_problems(layout, cfg.n_heads, cfg.n_layers, vocabulary=cfg.vocab_size,
                              context=cfg.context if layout.sequence_parallel else None, job=(nodes, gpus_per_node))
    if not reasons:
        held = [in_flight(schedule, layout.pp, layout.pp, s) for s in range(layout.pp)]  # a full pipeline's
        need, stage = max((plan_memory(cfg, layout, micro_batch, s, in_flight=held[s])["total"], s)
                          for s in range(layout.pp))
        if need > gpu_bytes:
            where = f" (stage {stage}, {held[stage]} micro-batches in flight)" if layout.pp > 1 else ""
            reasons.append(f"the planner needs {need / 1e9:.0f} GB per rank{where}, the GPU has "
                           f"{gpu_bytes / 1e9:.0f} GB")
    return reasons


def forward_collectives(cfg: GPTConfig, layout: Layout, stage: int) -> dict:
    """A stage's forward collectives by section 2's counts: with TP one all-reduce after each row-wise layer (2 per
    block) and the head's logits all-gathered on the last stage; with sequence parallel each all-reduce a
    reduce-scatter, each norm's slices all-gathered for the layer after it (2 per block, and the head's input); with
    FSDP2 one all-gather per unit (each block and the stage's root)."""
    blocks = cfg.n_layers // layout.pp
    last = stage == layout.pp - 1
    counts = {}
    if layout.tp > 1 and layout.sequence_parallel:
        counts.update(reduce_scatter=2 * blocks, all_gather=2 * blocks + 2 * last)
    elif layout.tp > 1:
        counts["all_reduce"] = 2 * blocks
        if last:
            counts["all_gather"] = 1
    if layout.zero >= 3 and layout.dp > 1:
        counts["all_gather"] = counts.get("all_gather", 0) + blocks + 1
    return counts
