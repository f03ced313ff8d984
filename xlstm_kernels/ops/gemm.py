"""GEMM ops backed by ``metal_src/gemm.metal``."""

from __future__ import annotations

import mlx.core as mx

from ..runtime import KernelSpec, current_backend, launch
from ._validate import check_array, check_same_dtype

__all__ = ["gemm_av", "GEMM_AV_TILE"]

GEMM_AV = KernelSpec("gemm", "gemm_av", ("A", "V"), ("C",))
GEMM_AV_TILE = 16


def _gemm_av_kernel(a: mx.array, v: mx.array, backend: str, tile: int = GEMM_AV_TILE) -> mx.array:
    m, n = a.shape
    k = v.shape[1]
    (c,) = launch(
        GEMM_AV,
        inputs=[a, v],
        output_shapes=[(m, k)],
        output_dtypes=[a.dtype],
        grid=(-(-k // tile) * tile, -(-m // tile) * tile, 1),
        threadgroup=(tile, tile, 1),
        template=[("T", a.dtype), ("TILE", tile), ("PAD", 0)],
        backend=backend,
    )
    return c


def gemm_av(a: mx.array, v: mx.array) -> mx.array:
    """C = A · V with a tiled Metal kernel (float32 accumulation).

    Args:
        a: (M, N) float32, float16 or bfloat16.
        v: (N, K), same dtype as `a`.

    Returns:
        (M, K) in the inputs' dtype. Differentiable (the backward pass currently
        uses mx.matmul).
    """
    check_array(a, "a", ndim=2)
    check_array(v, "v", ndim=2)
    check_same_dtype(a, "a", v, "v")
    if a.shape[1] != v.shape[0]:
        raise ValueError(f"a (M, N) and v (N, K) disagree on N: a has shape {tuple(a.shape)}, v has {tuple(v.shape)}")
    backend = current_backend()
    if backend == "reference" or a.size == 0 or v.size == 0:
        return mx.matmul(a, v)

    @mx.custom_function
    def f(a, v):
        return _gemm_av_kernel(a, v, backend)

    @f.vjp
    def f_vjp(primals, cotangent, output):
        a, v = primals
        return mx.matmul(cotangent, v.T), mx.matmul(a.T, cotangent)

    return f(a, v)
