"""Differentiable ops; each runs a Metal kernel on the active backend.

The op functions whose names equal their module's (``mlstm``, ``slstm``, ``rope``) are
exported by the top-level package (``xlstm_kernels.mlstm``) and by their modules
(``xlstm_kernels.ops.mlstm.mlstm``), so ``xlstm_kernels.ops.mlstm`` stays the module.
"""

from . import mlstm, rope, slstm
from .attention import scaled_dot_product_attention
from .fused import fused_norm_linear, fused_norm_qkv_rope
from .gemm import ACTIVATIONS, gemm_a_bt, gemm_at_b, gemm_av, linear
from .mlstm import mlstm_step
from .norm import layer_norm, multihead_layer_norm, rms_norm
from .slstm import slstm_step

__all__ = [
    "ACTIVATIONS",
    "fused_norm_linear",
    "fused_norm_qkv_rope",
    "gemm_a_bt",
    "gemm_at_b",
    "gemm_av",
    "layer_norm",
    "linear",
    "mlstm",
    "mlstm_step",
    "multihead_layer_norm",
    "rms_norm",
    "rope",
    "scaled_dot_product_attention",
    "slstm",
    "slstm_step",
]
