"""The small GPT and the synthetic language that several examples train (not an example itself).

A GPT-2 style model (token and position embeddings, pre-norm causal self-attention and MLP
blocks, an lm head) and a learnable language: a random first token, then
``next = (5 * token + 3) % vocab``. Each example picks its own sizes.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.width, self.heads = width, heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        # no qkv bias: the key bias gets an exactly-zero gradient, which Adam would turn into noise-driven steps
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, self.width // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, self.width))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """``layers`` blocks of ``width`` (MLP ``hidden`` wide, ``heads`` heads) over ``vocab`` tokens
    and ``context`` positions."""

    def __init__(self, vocab: int, context: int, width: int, heads: int, hidden: int, layers: int = 2) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads, hidden) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def sequences(generator: torch.Generator, batch: int, vocab: int, context: int) -> torch.Tensor:
    """``batch`` sequences of ``context + 1`` tokens of the synthetic language."""
    tokens = [torch.randint(0, vocab, (batch,), generator=generator)]
    for _ in range(context):
        tokens.append((5 * tokens[-1] + 3) % vocab)
    return torch.stack(tokens, dim=1)
