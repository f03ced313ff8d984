"""Normalisation ops backed by ``metal_src/norm.metal``."""

from __future__ import annotations

import mlx.core as mx

from ..runtime import KernelSpec, current_backend, launch
from ._validate import check_array, check_same_dtype

__all__ = ["rms_norm", "rms_norm_reference"]

RMS_NORM = KernelSpec("norm", "rms_norm", ("x", "w", "eps", "axis_size"), ("y",))


def rms_norm_reference(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """RMSNorm with plain mx ops (float32 accumulation); the ``reference`` backend."""
    xf = x.astype(mx.float32)
    normed = (xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return normed if weight is None else weight.astype(x.dtype) * normed


def _threads_for(axis_size: int) -> int:
    """Threads per row: about 4 elements each, a multiple of 32, at most 1024."""
    needed = -(-axis_size // 4)
    return min(1024, max(32, -(-needed // 32) * 32))


def _rms_norm_kernel(x: mx.array, weight: mx.array | None, eps: float, backend: str) -> mx.array:
    d = x.shape[-1]
    rows = x.size // d
    x2 = x.reshape(rows, d)
    w = weight.astype(x.dtype) if weight is not None else mx.ones((1,), dtype=x.dtype)
    threads = _threads_for(d)
    (y,) = launch(
        RMS_NORM,
        inputs=[x2, w, mx.array(float(eps), dtype=mx.float32), mx.array(d, dtype=mx.int32)],
        output_shapes=[(rows, d)],
        output_dtypes=[x.dtype],
        grid=(threads, rows, 1),
        threadgroup=(threads, 1, 1),
        template=[("T", x.dtype), ("HAS_WEIGHT", weight is not None)],
        backend=backend,
    )
    return y.reshape(x.shape)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float = 1e-5) -> mx.array:
    """Root-mean-square normalisation over the last axis, like ``mx.fast.rms_norm``.

    Args:
        x: (..., D) float32, float16 or bfloat16.
        weight: (D,) scale, or None.
        eps: added to the mean square before the reciprocal square root.

    Returns:
        (..., D) in x's dtype: ``weight * (x / sqrt(mean(x^2) + eps))``, reduced in float32.

    Differentiable; the backward pass currently runs through the reference ops.
    """
    check_array(x, "x", min_ndim=1)
    if weight is not None:
        check_array(weight, "weight", ndim=1)
        check_same_dtype(x, "x", weight, "weight")
        if weight.shape[0] != x.shape[-1]:
            raise ValueError(f"weight must have shape ({x.shape[-1]},) to match x's last axis, got {tuple(weight.shape)}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    backend = current_backend()
    if backend == "reference" or x.size == 0:
        return rms_norm_reference(x, weight, eps)

    if weight is None:

        @mx.custom_function
        def f(x):
            return _rms_norm_kernel(x, None, eps, backend)

        @f.vjp
        def f_vjp(primals, cotangent, output):
            _, vjp = mx.vjp(lambda x: rms_norm_reference(x, None, eps), list(primals), [cotangent])
            return vjp[0]

        return f(x)

    @mx.custom_function
    def g(x, w):
        return _rms_norm_kernel(x, w, eps, backend)

    @g.vjp
    def g_vjp(primals, cotangent, output):
        _, vjp = mx.vjp(lambda x, w: rms_norm_reference(x, w, eps), list(primals), [cotangent])
        return tuple(vjp)

    return g(x, weight)
