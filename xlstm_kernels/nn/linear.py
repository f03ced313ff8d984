"""Linear layers: a drop-in ``nn.Linear`` on our GEMM kernel, and a headwise projection."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..ops._validate import check_layer_input
from ..ops.gemm import linear


class Linear(nn.Module):
    """``y = activation(x W^T + b)``, like ``mlx.nn.Linear``, on the fused GEMM kernel.

    Args:
        input_dims, output_dims: feature sizes; weight is (output_dims, input_dims).
        bias: learn an additive bias.
        activation: None, "relu", "gelu", "gelu_approx" or "silu" (fused epilogue).
    """

    def __init__(self, input_dims: int, output_dims: int, bias: bool = True, activation: str | None = None):
        super().__init__()
        scale = math.sqrt(1.0 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((output_dims,))
        self.activation = activation

    def _extra_repr(self) -> str:
        return f"input_dims={self.weight.shape[1]}, output_dims={self.weight.shape[0]}, bias={'bias' in self}"

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """x (..., input_dims) -> (..., output_dims); `residual` is added after the activation."""
        return linear(x, self.weight, self.get("bias"), activation=self.activation, residual=residual)


class HeadwiseLinear(nn.Module):
    """Block-diagonal projection: the features split into `num_heads` blocks, each mapped by
    its own (block, block) matrix (NX-AI's LinearHeadwiseExpand with expand factor 1).

    x (..., dim) -> (..., dim).
    """

    def __init__(self, dim: int, num_heads: int, bias: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        block = dim // num_heads
        self.num_heads = num_heads
        self.weight = mx.random.normal((num_heads, block, block)) * math.sqrt(2.0 / (5 * block))
        if bias:
            self.bias = mx.zeros((dim,))

    def __call__(self, x: mx.array) -> mx.array:
        check_layer_input("HeadwiseLinear", x, "(..., dim)", None, self.num_heads * self.weight.shape[-1])
        lead = x.shape[:-1]
        xh = x.reshape(*lead, self.num_heads, 1, -1)  # (..., NH, 1, block)
        y = (xh @ self.weight.swapaxes(-1, -2)).reshape(*lead, -1)
        return y + self.bias if "bias" in self else y
