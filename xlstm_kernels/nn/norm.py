"""Normalisation layers on our norm kernels."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..ops._validate import FLOAT_DTYPES
from ..ops.norm import layer_norm, multihead_layer_norm, rms_norm


def _like(p: mx.array | None, x: mx.array) -> mx.array | None:
    """Parameter `p` in x's dtype, where that is a supported float dtype (else as it is, and
    the op rejects x: a float64 cast would fail on the GPU before the op could say why)."""
    if p is None or not isinstance(x, mx.array) or x.dtype not in FLOAT_DTYPES:
        return p
    return p.astype(x.dtype)


class RMSNorm(nn.Module):
    """RMS normalisation over the last axis with a learned scale. x (..., dims)."""

    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, _like(self.weight, x), self.eps)


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
        return layer_norm(x, _like(self.weight, x), _like(b, x), self.eps)


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
        return multihead_layer_norm(x, _like(self.weight, x), _like(b, x), self.num_heads, self.eps)
