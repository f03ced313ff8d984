"""Input checks shared by the ops: clear errors naming the argument."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def check_array(value: Any, name: str, *, ndim: int | tuple[int, ...] | None = None, min_ndim: int | None = None) -> mx.array:
    """`value` as an mx.array of a supported float dtype and rank, or a clear error."""
    if not isinstance(value, mx.array):
        raise TypeError(f"{name} must be an mx.array, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {value.dtype}; supported: float32, float16, bfloat16"
        )
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if value.ndim not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(value.shape)}")
    if min_ndim is not None and value.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(value.shape)}")
    return value


def check_same_dtype(a: mx.array, a_name: str, b: mx.array, b_name: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{a_name} ({a.dtype}) and {b_name} ({b.dtype}) must have the same dtype")
