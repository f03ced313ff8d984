"""Normalisation layers on our norm kernels."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..ops.norm import layer_norm, multihead_layer_norm, rms_norm


class RMSNorm(nn.Module):
    """RMS normalisation over the last axis with a learned scale. x (..., dims)."""

    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight.astype(x.dtype), self.eps)


class LayerNorm(nn.Module):
    """Layer normalisation over the last axis; `bias=False` learns only the scale (NX-AI's choice)."""

    def __init__(self, dims: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.weight = mx.ones((dims,))
        if bias:
            self.bias = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        b = self.get("bias")
        return layer_norm(x, self.weight.astype(x.dtype), None if b is None else b.astype(x.dtype), self.eps)


class MultiHeadLayerNorm(nn.Module):
    """LayerNorm of each head's slice separately (xLSTM's cell output norm / group norm).

    x (..., num_heads * head_dim); weight (and bias) cover all features.
    """

    def __init__(self, dims: int, num_heads: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        if dims % num_heads:
            raise ValueError(f"dims {dims} is not divisible by num_heads {num_heads}")
        self.weight = mx.ones((dims,))
        if bias:
            self.bias = mx.zeros((dims,))
        self.num_heads = num_heads
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        b = self.get("bias")
        return multihead_layer_norm(
            x, self.weight.astype(x.dtype), None if b is None else b.astype(x.dtype), self.num_heads, self.eps
        )
