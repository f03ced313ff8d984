"""The ``cuda`` backend: the unchanged Metal bodies of ``metal_src/`` on NVIDIA GPUs
through ``mx.fast.cuda_kernel`` (MLX's CUDA backend, the ``mlx[cuda13]`` wheels).

:func:`metal_kernel` has ``mx.fast.metal_kernel``'s signature; ``compat.h`` is the
Metal Shading Language subset the bodies use, written for CUDA. See docs/CUDA.md.
"""

from .kernel import CudaKernel, CudaKernelError, compat_header, metal_kernel, rewrite_threadgroup_decls

__all__ = ["CudaKernel", "CudaKernelError", "compat_header", "is_available", "metal_kernel",
           "rewrite_threadgroup_decls"]


def is_available() -> bool:
    """Whether MLX has a CUDA device here (``mx.cuda.is_available()``)."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available())
    except Exception:  # noqa: BLE001  an MLX without the CUDA backend
        return False
