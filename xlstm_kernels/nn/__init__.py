"""Drop-in ``mlx.nn`` layers on the package's kernels: linear, norms, attention, xLSTM."""

from .attention import AttentionBlock, MultiHeadAttention
from .config import (
    AttentionBlockConfig,
    FeedForwardConfig,
    mLSTMBlockConfig,
    mLSTMLayerConfig,
    sLSTMBlockConfig,
    sLSTMLayerConfig,
    xLSTMBlockStackConfig,
    xLSTMLMModelConfig,
)
from .conv import CausalConv1d
from .feedforward import FeedForward
from .linear import HeadwiseLinear, Linear
from .lm import generate, xLSTMLM
from .mlstm import mLSTMBlock, mLSTMLayer
from .norm import LayerNorm, MultiHeadLayerNorm, RMSNorm
from .slstm import sLSTMBlock, sLSTMLayer
from .stack import xLSTMBlockStack

__all__ = [
    "AttentionBlock",
    "AttentionBlockConfig",
    "CausalConv1d",
    "FeedForward",
    "FeedForwardConfig",
    "HeadwiseLinear",
    "LayerNorm",
    "Linear",
    "MultiHeadAttention",
    "MultiHeadLayerNorm",
    "RMSNorm",
    "generate",
    "mLSTMBlock",
    "mLSTMBlockConfig",
    "mLSTMLayer",
    "mLSTMLayerConfig",
    "sLSTMBlock",
    "sLSTMBlockConfig",
    "sLSTMLayer",
    "sLSTMLayerConfig",
    "xLSTMBlockStack",
    "xLSTMBlockStackConfig",
    "xLSTMLM",
    "xLSTMLMModelConfig",
]
