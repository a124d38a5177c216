"""The text the small GPT learns (core.gpt), as characters, and its batches of windows.

The text is the Zen of Python (PEP 20), shipped in every Python 3 as the `this` module: real English, the same bytes
on every machine and Python version, no download.
"""
from __future__ import annotations

import codecs

import torch

from .config import ConfigError


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
