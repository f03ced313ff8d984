"""sLSTM layer and block (scalar memory, exponential gating, block-diagonal recurrence).

Layer data flow for x (B, S, E), NH heads of DH = E / NH:

    x_c = SiLU(causal conv(x))                                (optional: conv1d_kernel_size > 0)
    wx = [igate(x_c), fgate(x_c), zgate(x), ogate(x)]         (B, S, 4, NH, DH), headwise projections
    y = slstm(wx, R, b)                                        the fused sequence kernel
    y = group norm (multi-head LayerNorm)(y)                   (B, S, E)

sLSTMBlock = x + layer(LN(x)), then x + FFN(LN(x)) (gated, GELU, factor 1.3).
A state for decoding is (conv state, (y, c, n, m)).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..ops._validate import check_layer_input
from ..ops.slstm import slstm, slstm_step
from .config import sLSTMBlockConfig, sLSTMLayerConfig
from .conv import CausalConv1d
from .feedforward import FeedForward
from .linear import HeadwiseLinear
from .norm import LayerNorm, MultiHeadLayerNorm


class sLSTMLayer(nn.Module):  # noqa: N801
    def __init__(self, config: sLSTMLayerConfig):
        super().__init__()
        e, nh = config.embedding_dim, config.num_heads
        if e <= 0:
            raise ValueError("sLSTMLayerConfig.embedding_dim must be set (positive)")
        if e % nh:
            raise ValueError(f"embedding_dim {e} is not divisible by num_heads {nh}")
        self.config = config
        self.num_heads, self.head_dim = nh, e // nh
        self.conv = CausalConv1d(e, config.conv1d_kernel_size) if config.conv1d_kernel_size > 0 else None
        self.igate = HeadwiseLinear(e, nh)
        self.fgate = HeadwiseLinear(e, nh)
        self.zgate = HeadwiseLinear(e, nh)
        self.ogate = HeadwiseLinear(e, nh)
        dh = self.head_dim
        # Recurrent weights start at zero (NX-AI); forget-gate bias spread over [3, 6].
        self.recurrent = mx.zeros((nh, dh, 4, dh))
        bias = mx.zeros((4, nh, dh))
        self.bias = mx.concatenate([bias[:1], mx.broadcast_to(mx.linspace(3.0, 6.0, dh), (1, nh, dh)), bias[2:]])
        self.group_norm = MultiHeadLayerNorm(e, nh, bias=False)

    def _gates(self, x: mx.array, conv_state):
        b, s, _ = x.shape
        if self.conv is not None:
            x_c, conv_state = self.conv(x, conv_state)
            x_c = nn.silu(x_c)
        else:
            x_c = x
        wx = mx.stack([self.igate(x_c), self.fgate(x_c), self.zgate(x), self.ogate(x)], axis=2)
        return wx.reshape(b, s, 4, self.num_heads, self.head_dim), conv_state

    def __call__(self, x: mx.array, state=None, return_state: bool = False):
        """x (B, S, E) -> y (B, S, E) (and the final state): the fused sequence kernel."""
        check_layer_input("sLSTMLayer", x, "(B, S, E)", 3, self.config.embedding_dim)
        conv_state, cell_state = state if state is not None else (None, None)
        wx, conv_state = self._gates(x, conv_state)
        y, cell_state = slstm(wx, self.recurrent.astype(x.dtype), self.bias.astype(x.dtype),
                                  state=cell_state, return_state=True)
        y = self.group_norm(y.reshape(x.shape))
        return (y, (conv_state, cell_state)) if return_state else y

    def step(self, x: mx.array, state):
        """One token: x (B, E) -> (y (B, E), state) with the step kernel."""
        check_layer_input("sLSTMLayer.step", x, "(B, E)", 2, self.config.embedding_dim)
        conv_state, cell_state = state if state is not None else (None, None)
        wx, conv_state = self._gates(x[:, None], conv_state)
        if cell_state is None:  # the zero state: the first step sets m from the input gate
            zero = mx.zeros((x.shape[0], self.num_heads, self.head_dim))
            cell_state = (zero, zero, zero, zero)
        y, cell_state = slstm_step(wx[:, 0], self.recurrent.astype(x.dtype), self.bias.astype(x.dtype), cell_state)
        return self.group_norm(y.reshape(x.shape)), (conv_state, cell_state)


class sLSTMBlock(nn.Module):  # noqa: N801
    """Pre-LayerNorm residual sLSTM layer, followed by a pre-LayerNorm gated FFN."""

    def __init__(self, config: sLSTMBlockConfig):
        super().__init__()
        e = config.slstm.embedding_dim
        self.norm = LayerNorm(e, bias=False)
        self.layer = sLSTMLayer(config.slstm)
        self.ffn_norm = LayerNorm(e, bias=False) if config.feedforward is not None else None
        self.ffn = FeedForward(config.feedforward) if config.feedforward is not None else None

    def _ffn(self, x: mx.array) -> mx.array:
        return x if self.ffn is None else x + self.ffn(self.ffn_norm(x))

    def __call__(self, x: mx.array, state=None, return_state: bool = False):
        y, state = self.layer(self.norm(x), state, return_state=True)
        out = self._ffn(x + y)
        return (out, state) if return_state else out

    def step(self, x: mx.array, state):
        y, state = self.layer.step(self.norm(x), state)
        return self._ffn(x + y), state
