"""xlstm-kernels: MLX custom Metal kernels with a CPU Metal emulator.

Ops run on the active backend (``metal``, ``emulate`` or ``reference``); choose
it with ``XLSTM_KERNELS_BACKEND`` or :func:`use_backend`.
"""

from .ops import gemm_av, rms_norm
from .runtime import current_backend, use_backend

__version__ = "0.1.0"

__all__ = ["current_backend", "gemm_av", "rms_norm", "use_backend", "__version__"]
