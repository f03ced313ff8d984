"""xlstm-kernels: MLX custom Metal kernels with a CPU Metal emulator.

Ops run on the active backend (``metal``, ``emulate`` or ``reference``); choose
it with ``XLSTM_KERNELS_BACKEND`` or :func:`use_backend`.
"""

from .ops.attention import scaled_dot_product_attention
from .ops.fused import fused_norm_linear, fused_norm_qkv_rope
from .ops.gemm import gemm_a_bt, gemm_at_b, gemm_av, linear
from .ops.mlstm import mlstm, mlstm_step
from .ops.norm import layer_norm, multihead_layer_norm, rms_norm
from .ops.rope import rope
from .ops.slstm import slstm, slstm_step
from .runtime import current_backend, use_backend
from .tiles import GemmConfig, explain, get_gemm_tiles, set_gemm_tiles

__version__ = "0.1.0"

__all__ = [
    "GemmConfig",
    "current_backend",
    "explain",
    "fused_norm_linear",
    "fused_norm_qkv_rope",
    "gemm_a_bt",
    "gemm_at_b",
    "gemm_av",
    "get_gemm_tiles",
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
    "set_gemm_tiles",
    "use_backend",
    "__version__",
]
