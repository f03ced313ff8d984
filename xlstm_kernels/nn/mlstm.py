"""mLSTM layer and block (matrix memory, covariance update), NX-AI's architecture.

Layer data flow for x (B, S, E), inner width D = proj_factor * E, NH heads of DH = D / NH:

    x -> up-projection -> (x_m, z)                         (B, S, D) each
    x_m -> causal conv + SiLU -> x_c
    q, k = headwise(x_c); v = headwise(x_m)                (B, NH, S, DH)
    i_pre, f_pre = gates([q, k, v])                         (B, NH, S)
    h = mlstm(q, k, v, i_pre, f_pre)                        the cell (chunkwise kernel)
    h = multi-head LayerNorm(h) + skip * x_c
    y = down-projection(h * SiLU(z))                        (B, S, E)

A state for step-by-step decoding is (conv state (B, K-1, D), (C, n, m)).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..ops._validate import check_layer_input
from ..ops.mlstm import mlstm, mlstm_step
from .config import mLSTMBlockConfig, mLSTMLayerConfig
from .conv import CausalConv1d
from .linear import HeadwiseLinear, Linear
from .norm import LayerNorm, MultiHeadLayerNorm

MLSTMState = tuple  # (conv_state, (C, n, m))


class mLSTMLayer(nn.Module):  # noqa: N801
    def __init__(self, config: mLSTMLayerConfig):
        super().__init__()
        e, d, nh = config.embedding_dim, config.inner_dim, config.num_heads
        if e <= 0:
            raise ValueError("mLSTMLayerConfig.embedding_dim must be set (positive)")
        if d % nh:
            raise ValueError(f"inner dim {d} is not divisible by num_heads {nh}")
        self.config = config
        self.num_heads = nh
        self.proj_up = Linear(e, 2 * d, bias=config.bias)
        self.conv = CausalConv1d(d, config.conv1d_kernel_size)
        heads = max(1, d // config.qkv_proj_blocksize)
        self.q_proj = HeadwiseLinear(d, heads)
        self.k_proj = HeadwiseLinear(d, heads)
        self.v_proj = HeadwiseLinear(d, heads)
        self.igate = Linear(3 * d, nh, bias=True)
        self.fgate = Linear(3 * d, nh, bias=True)
        # NX-AI's gate initialisation: zero weights, forget bias spread over [3, 6].
        self.igate.weight = mx.zeros_like(self.igate.weight)
        self.igate.bias = mx.random.normal((nh,)) * 0.1
        self.fgate.weight = mx.zeros_like(self.fgate.weight)
        self.fgate.bias = mx.linspace(3.0, 6.0, nh)
        self.outnorm = MultiHeadLayerNorm(d, nh, bias=False)
        self.learnable_skip = mx.ones((d,))
        self.proj_down = Linear(d, e, bias=config.bias)

    def _heads(self, t: mx.array) -> mx.array:
        b, s, d = t.shape
        return t.reshape(b, s, self.num_heads, d // self.num_heads).transpose(0, 2, 1, 3)

    def _cell_inputs(self, x: mx.array, conv_state):
        x_m, z = mx.split(self.proj_up(x), 2, axis=-1)
        x_c, conv_state = self.conv(x_m, conv_state)
        x_c = nn.silu(x_c)
        q, k, v = self.q_proj(x_c), self.k_proj(x_c), self.v_proj(x_m)
        qkv = mx.concatenate([q, k, v], axis=-1)
        i_pre = self.igate(qkv).transpose(0, 2, 1)  # (B, NH, S)
        f_pre = self.fgate(qkv).transpose(0, 2, 1)
        return q, k, v, i_pre, f_pre, x_c, z, conv_state

    def _output(self, h: mx.array, x_c: mx.array, z: mx.array) -> mx.array:
        b, nh, s, dh = h.shape
        h = h.transpose(0, 2, 1, 3).reshape(b, s, nh * dh)
        h = self.outnorm(h) + self.learnable_skip.astype(h.dtype) * x_c
        return self.proj_down(h * nn.silu(z))

    def __call__(self, x: mx.array, state: MLSTMState | None = None, return_state: bool = False):
        """x (B, S, E) -> y (B, S, E) (and the final state if asked): the chunkwise path."""
        check_layer_input("mLSTMLayer", x, "(B, S, E)", 3, self.config.embedding_dim)
        conv_state, cell_state = state if state is not None else (None, None)
        q, k, v, i_pre, f_pre, x_c, z, conv_state = self._cell_inputs(x, conv_state)
        h, cell_state = mlstm(
            self._heads(q), self._heads(k), self._heads(v), i_pre, f_pre,
            state=cell_state, chunk_size=self.config.chunk_size, return_state=True,
        )
        y = self._output(h, x_c, z)
        return (y, (conv_state, cell_state)) if return_state else y

    def step(self, x: mx.array, state: MLSTMState | None) -> tuple[mx.array, MLSTMState]:
        """One token: x (B, E) -> (y (B, E), state) with the fused recurrent step kernel."""
        check_layer_input("mLSTMLayer.step", x, "(B, E)", 2, self.config.embedding_dim)
        conv_state, cell_state = state if state is not None else (None, None)
        q, k, v, i_pre, f_pre, x_c, z, conv_state = self._cell_inputs(x[:, None], conv_state)
        if cell_state is None:
            b, d = x.shape[0], q.shape[-1]
            dh = d // self.num_heads
            cell_state = (mx.zeros((b, self.num_heads, dh, dh)), mx.zeros((b, self.num_heads, dh)),
                          mx.zeros((b, self.num_heads)))
        h, cell_state = mlstm_step(
            self._heads(q)[:, :, 0], self._heads(k)[:, :, 0], self._heads(v)[:, :, 0],
            i_pre[:, :, 0], f_pre[:, :, 0], cell_state,
        )
        y = self._output(h[:, :, None], x_c, z)
        return y[:, 0], (conv_state, cell_state)


class mLSTMBlock(nn.Module):  # noqa: N801
    """Pre-LayerNorm residual block around an :class:`mLSTMLayer`. x (B, S, E)."""

    def __init__(self, config: mLSTMBlockConfig):
        super().__init__()
        self.norm = LayerNorm(config.mlstm.embedding_dim, bias=False)
        self.layer = mLSTMLayer(config.mlstm)

    def __call__(self, x: mx.array, state=None, return_state: bool = False):
        y, state = self.layer(self.norm(x), state, return_state=True)
        return (x + y, state) if return_state else x + y

    def step(self, x: mx.array, state):
        y, state = self.layer.step(self.norm(x), state)
        return x + y, state
