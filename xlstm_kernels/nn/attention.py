"""Multi-head attention with RoPE and grouped KV heads, and a pre-norm transformer block,
so a stack can mix attention and xLSTM blocks.

State for decoding: the KV cache (keys (B, Hkv, T, Dh), values (B, Hkv, T, Dh)).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..ops._validate import check_layer_input
from ..ops.attention import scaled_dot_product_attention
from ..ops.rope import rope
from .config import AttentionBlockConfig
from .feedforward import FeedForward
from .linear import Linear
from .norm import RMSNorm


class MultiHeadAttention(nn.Module):
    """x (B, S, E) -> (B, S, E); causal; `num_kv_heads` divides `num_heads` (GQA)."""

    def __init__(self, dims: int, num_heads: int, num_kv_heads: int | None = None, rope_base: float = 10000.0):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if dims % num_heads or num_heads % num_kv_heads:
            raise ValueError(
                f"dims ({dims}) must divide by num_heads ({num_heads}) and num_heads by num_kv_heads ({num_kv_heads})"
            )
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = dims // num_heads
        self.rope_base = rope_base
        self.q_proj = Linear(dims, num_heads * self.head_dim, bias=False)
        self.k_proj = Linear(dims, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(dims, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(num_heads * self.head_dim, dims, bias=False)

    def __call__(self, x: mx.array, cache=None, return_state: bool = False):
        check_layer_input("MultiHeadAttention", x, "(B, S, E)", 3, self.q_proj.weight.shape[1])
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.num_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = 0 if cache is None else cache[0].shape[2]
        q = rope(q, self.head_dim, base=self.rope_base, offset=offset)
        k = rope(k, self.head_dim, base=self.rope_base, offset=offset)
        if cache is not None:
            k = mx.concatenate([cache[0], k], axis=2)
            v = mx.concatenate([cache[1], v], axis=2)
        o = scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5, mask="causal")
        y = self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, s, -1))
        return (y, (k, v)) if return_state else y

    def step(self, x: mx.array, cache):
        """x (B, E) -> (y (B, E), cache)."""
        check_layer_input("MultiHeadAttention.step", x, "(B, E)", 2, self.q_proj.weight.shape[1])
        y, cache = self(x[:, None], cache, return_state=True)
        return y[:, 0], cache


class AttentionBlock(nn.Module):
    """x + attention(RMSNorm(x)), then x + FFN(RMSNorm(x))."""

    def __init__(self, dims: int, config: AttentionBlockConfig):
        super().__init__()
        self.norm = RMSNorm(dims)
        self.attention = MultiHeadAttention(dims, config.num_heads, config.num_kv_heads, config.rope_base)
        self.ffn_norm = RMSNorm(dims)
        self.ffn = FeedForward(config.feedforward)

    def __call__(self, x: mx.array, state=None, return_state: bool = False):
        y, state = self.attention(self.norm(x), state, return_state=True)
        h = x + y
        out = h + self.ffn(self.ffn_norm(h))
        return (out, state) if return_state else out

    def step(self, x: mx.array, state):
        y, state = self.attention.step(self.norm(x), state)
        h = x + y
        return h + self.ffn(self.ffn_norm(h)), state
