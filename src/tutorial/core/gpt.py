"""A small GPT, the model of the model-parallel stage (11_model_parallelism).

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

The text it learns is core.corpus; what the trainers read and write is core.parallel_config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ConfigError
from .layout import Layout, check_layout


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
    if stages < 1:
        raise ConfigError(f"stages must be at least 1, got {stages}")
    check_layout(Layout(pp=stages), model.cfg.n_heads, n)
    per = n // stages
    for i in range(n):
        if not stage * per <= i < (stage + 1) * per:
            del model.blocks[str(i)]
    if stage > 0:
        model.embed = None
    if stage < stages - 1:
        model.norm = model.head = None
    return model


def parameter_bytes(model: nn.Module) -> int:
    """The bytes of parameters this rank holds: a DTensor (tensor parallel, FSDP2) counts its local shard only."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total
