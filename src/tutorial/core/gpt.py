"""A small GPT and the text it learns, for the model-parallel stage (11_model_parallelism).

Every stage before 11 trains an image model that fits on one GPU. Tensor and pipeline parallelism split one model
over several ranks, and the model they are usually taught on is a transformer: attention and MLP layers are a few
large matrix products that can be cut column- or row-wise, and a stack of identical blocks can be cut into stages.

The model is nanoGPT's shape at toy size: token and position embeddings, pre-norm blocks of causal self-attention and
an MLP, a final LayerNorm and a linear head. Two choices serve the parallel trainers:
- attention keeps q, k, v and the output projection as four separate Linear layers, so that a tensor-parallel plan
  can name each one (ColwiseParallel for q/k/v, RowwiseParallel for the output);
- the blocks live in a ModuleDict keyed "0", "1", ...: a pipeline stage deletes the blocks it does not run and keeps
  the others' names, so its parameters are named exactly as in the whole model (comparisons by name just work).
Attention derives the number of heads from the tensor it gets (`-1` in view), because under tensor parallelism each
rank holds only n_heads / tp of them.

The text is the Zen of Python (PEP 20), shipped in every Python 3 as the `this` module: real English, the same bytes
on every machine and Python version, no download.
"""
from __future__ import annotations

import argparse
import codecs
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import BACKENDS, ConfigError, OneLineErrorParser, fail


@dataclass
class GPTConfig:
    vocab_size: int = 48   # the corpus's 45 characters, padded to a multiple of 8 so tensor parallel can split it
    context: int = 32      # tokens per sequence (block_size in nanoGPT)
    d_model: int = 64      # width of the residual stream
    n_heads: int = 4       # attention heads; tensor parallel gives each rank n_heads / tp of them
    n_layers: int = 2      # transformer blocks; pipeline parallel gives each stage n_layers / pp of them
    mlp_ratio: int = 4     # the MLP's hidden width is mlp_ratio x d_model

    def validate(self) -> "GPTConfig":
        for name in ("vocab_size", "context", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d-model {self.d_model} is not a multiple of n-heads {self.n_heads}: each head "
                              "gets d_model / n_heads channels")
        return self


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: all of them in one process, n_heads / tp of them on a tensor-parallel rank (its q columns)
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)) (GPT-2)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    """Token plus position embedding, one module so that a tensor-parallel plan can lay out its output once."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class GPT(nn.Module):
    """idx (B, T) int64 -> logits (B, T, vocab). A pipeline stage sets `embed`, `norm` or `head` to None and deletes
    blocks; forward skips what is missing, so stage 0 maps tokens to activations and the last maps them to logits."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):  # the same weights from the same seed, whatever ran before
            torch.manual_seed(seed)
            self.embed = Embedding(cfg)
            self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
            self.norm = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            self.apply(self._init)
            for name, p in self.named_parameters():  # GPT-2: residual projections scaled down with depth
                if name.endswith(("attn.out.weight", "mlp.proj.weight")):
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-character cross-entropy, the mean over every position of every sequence."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def pipeline_stage(model: GPT, stage: int, stages: int) -> GPT:
    """Cut `model` in place into pipeline stage `stage` of `stages`: consecutive blocks, n_layers / stages each;
    stage 0 keeps the embedding, the last keeps the final norm and the head."""
    n = model.cfg.n_layers
    if stages < 1 or n % stages:
        raise ConfigError(f"{n} layers cannot be cut into {stages} equal pipeline stages: use a divisor of {n}")
    per = n // stages
    for i in range(n):
        if not stage * per <= i < (stage + 1) * per:
            del model.blocks[str(i)]
    if stage > 0:
        model.embed = None
    if stage < stages - 1:
        model.norm = model.head = None
    return model


# ----------------------------------------------------------------------------------------------- the trainers' config
SCHEDULES = ("gpipe", "1f1b")


@dataclass
class ParallelConfig:
    """What train_tp, train_pp and train_2d read (TrainConfig is about images). Unlike the data-parallel stages,
    `batch_size` is the global batch: tensor-parallel ranks all see the same batch, pipeline stages cut it into
    micro-batches, and 2D gives each data-parallel group batch_size / dp of it."""
    # model (GPTConfig's fields)
    context: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    # training
    steps: int = 20               # optimizer steps
    batch_size: int = 16          # the global batch, in sequences of `context` characters
    lr: float = 3e-3              # AdamW
    seed: int = 0                 # the weights and the batches: every rank and the one-process run use the same
    # parallelism
    tp: int = 2                   # train_2d: ranks per tensor-parallel group (the "tp" mesh dim); dp = world / tp
    sequence_parallel: bool = True  # TP: the norms and the residual stream split along the sequence between layers
    micro_batches: int = 4        # PP: micro-batches per step; batch_size must be a multiple of it
    schedule: str = "1f1b"        # PP: gpipe (all forwards, then all backwards) or 1f1b (interleaved)
    backend: str = "auto"         # auto: nccl on GPUs, gloo on CPUs
    timeout: float = 300.0        # seconds a rank waits for the others
    out: str = ""                 # rank 0 writes metrics.json and the whole model's model.pt here ("": nothing)

    def gpt(self, vocab_size: int = 48) -> GPTConfig:
        return GPTConfig(vocab_size=vocab_size, context=self.context, d_model=self.d_model, n_heads=self.n_heads,
                         n_layers=self.n_layers).validate()

    def validate(self) -> "ParallelConfig":
        for name in ("steps", "batch_size", "tp", "micro_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule {self.schedule!r} is not one of: {', '.join(SCHEDULES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not one of: {', '.join(BACKENDS)}")
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {self.timeout}")
        self.gpt()
        return self

    def replace(self, **changes) -> "ParallelConfig":
        return dataclasses.replace(self, **changes).validate()


# The fields only some of the four trainers read; the others refuse a value other than the default in one line.
PARALLEL_ONLY_IN = {"tp": ("2d",), "sequence_parallel": ("tp", "2d"), "micro_batches": ("pp",), "schedule": ("pp",),
                    "backend": ("tp", "pp", "2d"), "timeout": ("tp", "pp", "2d")}  # train_gpt has no process group


def parse_parallel_args(description: str, argv=None, stage: str | None = None) -> ParallelConfig:
    """--flag value for every ParallelConfig field; a bad value, or one train_<stage> would ignore, is one line and
    exit 2."""
    parser = OneLineErrorParser(description=description)
    for f in dataclasses.fields(ParallelConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, metavar=f.name.upper())
    try:
        cfg = ParallelConfig(**vars(parser.parse_args(argv))).validate()
        for name, stages in PARALLEL_ONLY_IN.items():
            if stage and stage not in stages and getattr(cfg, name) != getattr(ParallelConfig(), name):
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)} is not used by train_{stage}; it "
                                  f"works in {', '.join('train_' + s for s in stages)}")
        return cfg
    except ConfigError as exc:
        fail(exc)


# ------------------------------------------------------------------------------------------------------- the text
def corpus() -> str:
    """The Zen of Python: `this.s` holds it ROT13-encoded (reading it is what `import this` prints)."""
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` the first time prints the poem
        import this
    return codecs.decode(this.s, "rot13")


class CharCorpus:
    """Characters to ids and back, and the whole text as one int64 tensor."""

    def __init__(self, text: str | None = None, vocab_size: int = 48):
        self.text = corpus() if text is None else text
        self.chars = sorted(set(self.text))
        if len(self.chars) > vocab_size:
            raise ConfigError(f"vocab-size {vocab_size} is smaller than the text's {len(self.chars)} characters")
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.ids = torch.tensor([self.index[c] for c in self.text], dtype=torch.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else "?" for i in ids)


def batches(data: CharCorpus | torch.Tensor, batch_size: int, context: int, steps: int, seed: int = 0):
    """`steps` batches (x, y) of random windows of the text: x (batch_size, context) int64, y the same shifted by one
    character (the next character at every position). The same seed gives the same batches on every machine, so
    every rank of a model-parallel run, and the one-process run it is compared with, see the same global batch."""
    ids = data.ids if isinstance(data, CharCorpus) else data
    if len(ids) <= context:
        raise ConfigError(f"context {context} needs a text longer than {context} characters, got {len(ids)}")
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - context, (batch_size,), generator=g)
        window = torch.stack([ids[s:s + context + 1] for s in starts.tolist()])
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()


def save_run(out: str, state: dict, metrics: dict) -> None:
    """Rank 0's record of a run: the whole model's weights (out/model.pt) and the metrics (out/metrics.json)."""
    import json
    import os
    os.makedirs(out, exist_ok=True)
    torch.save(state, os.path.join(out, "model.pt"))
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)


def parameter_bytes(model: nn.Module) -> int:
    """The bytes of parameters this rank holds: a DTensor (tensor parallel, FSDP2) counts its local shard only."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total
