"""A stack of xLSTM (mLSTM / sLSTM) and attention blocks with a final LayerNorm."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .attention import AttentionBlock
from .config import xLSTMBlockStackConfig
from .mlstm import mLSTMBlock
from .norm import LayerNorm
from .slstm import sLSTMBlock


class xLSTMBlockStack(nn.Module):  # noqa: N801
    """x (B, S, E) -> (B, S, E). Blocks per `config.block_kind(i)`."""

    def __init__(self, config: xLSTMBlockStackConfig):
        super().__init__()
        self.config = config
        self.blocks = []
        for i in range(config.num_blocks):
            kind = config.block_kind(i)
            if kind == "slstm":
                self.blocks.append(sLSTMBlock(config.slstm_block))
            elif kind == "attention":
                self.blocks.append(AttentionBlock(config.embedding_dim, config.attention_block))
            else:
                if config.mlstm_block is None:
                    raise ValueError(f"block {i} is an mLSTM block but mlstm_block is None")
                self.blocks.append(mLSTMBlock(config.mlstm_block))
        self.post_norm = LayerNorm(config.embedding_dim, bias=False)

    def __call__(self, x: mx.array, state: list | None = None, return_state: bool = False):
        """Parallel / chunkwise mode (training, prefill). `state` is one entry per block."""
        states = state if state is not None else [None] * len(self.blocks)
        new_states = []
        for block, s in zip(self.blocks, states):
            x, s = block(x, s, return_state=True)
            new_states.append(s)
        x = self.post_norm(x)
        return (x, new_states) if return_state else x

    def step(self, x: mx.array, state: list | None):
        """One token x (B, E) with carried per-block state."""
        states = state if state is not None else [None] * len(self.blocks)
        new_states = []
        for block, s in zip(self.blocks, states):
            x, s = block.step(x, s)
            new_states.append(s)
        return self.post_norm(x), new_states
