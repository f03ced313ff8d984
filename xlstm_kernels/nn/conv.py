"""Causal depthwise 1-D convolution with a carried state for step-by-step decoding."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..ops._validate import check_layer_input


class CausalConv1d(nn.Module):
    """Depthwise causal convolution over time: y[t] = b + sum_j w[j] * x[t - K + 1 + j].

    x (B, S, C) -> (B, S, C). The state is the last K - 1 inputs, (B, K - 1, C).
    """

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = True):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        self.kernel_size = kernel_size
        self.weight = mx.random.normal((kernel_size, channels)) * math.sqrt(1.0 / kernel_size)
        if bias:
            self.bias = mx.zeros((channels,))

    def initial_state(self, batch: int, channels: int, dtype=mx.float32) -> mx.array:
        return mx.zeros((batch, self.kernel_size - 1, channels), dtype=dtype)

    def __call__(self, x: mx.array, state: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """Returns (y, new_state); `state` None means zeros before the sequence."""
        k = self.kernel_size
        check_layer_input("CausalConv1d", x, "(B, S, C)", 3, self.weight.shape[1])
        if state is not None:
            check_layer_input("CausalConv1d", state, "(B, K - 1, C)", 3, self.weight.shape[1], name="state")
            if tuple(state.shape) != (x.shape[0], k - 1, x.shape[2]):
                want = (x.shape[0], k - 1, x.shape[2])
                raise ValueError(f"CausalConv1d: state must have shape (B, K - 1, C) = {want}, got {tuple(state.shape)}")
        if state is None:
            state = self.initial_state(x.shape[0], x.shape[-1], x.dtype)
        xp = mx.concatenate([state.astype(x.dtype), x], axis=1)  # (B, K-1+S, C)
        s = x.shape[1]
        y = sum(xp[:, j : j + s] * self.weight[j].astype(x.dtype) for j in range(k))
        if "bias" in self:
            y = y + self.bias.astype(x.dtype)
        new_state = xp[:, xp.shape[1] - (k - 1) :] if k > 1 else state
        return y, new_state
