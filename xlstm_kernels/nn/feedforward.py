"""Gated feed-forward block: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import FeedForwardConfig
from .linear import Linear


class FeedForward(nn.Module):
    """x (..., E) -> (..., E) with hidden size `config.hidden_dim`; the activation runs fused
    in the gate projection's epilogue."""

    def __init__(self, config: FeedForwardConfig):
        super().__init__()
        if config.act_fn not in ("gelu", "gelu_approx", "silu", "relu"):
            raise ValueError(f"act_fn must be gelu, gelu_approx, silu or relu, got {config.act_fn!r}")
        e, h = config.embedding_dim, config.hidden_dim
        self.gate = Linear(e, h, bias=False, activation=config.act_fn)
        self.up = Linear(e, h, bias=False)
        self.down = Linear(h, e, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(self.gate(x) * self.up(x))
