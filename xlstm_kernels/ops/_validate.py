"""Input checks shared by the ops: clear errors naming the argument."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)

#: MLX shape dimensions, the kernels' int32 size parameters and Metal grid positions are
#: 32-bit. Element offsets inside the kernels are computed in 64 bits, so an operand may
#: hold more than 2**31 elements; a count that the op must pass as one 32-bit value (a
#: flattened row count, a grid dimension) may not exceed this.
INT32_MAX = 2**31 - 1


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


def check_int32(op: str, what: str, value: int, detail: str) -> None:
    """Raise a clear ValueError (before any launch) when `value` does not fit in int32.

    `what` names the count (``"rows (the product of x's leading dimensions)"``) and
    `detail` the shapes it came from.
    """
    if value > INT32_MAX:
        raise ValueError(
            f"{op}: {what} = {value} exceeds 2**31 - 1 = {INT32_MAX} ({detail}); MLX shape dimensions and "
            "this kernel's size parameters and grid are 32-bit. Split the input along a leading axis "
            "(every op here is independent across the rows it flattens)."
        )


def check_layer_input(
    layer: str, x: Any, layout: str, ndim: int | None, last: int | None = None, name: str = "x"
) -> None:
    """The input of an nn layer: a float mx.array of rank `ndim` (any rank >= 1 if None;
    `layout` e.g. ``"(B, S, E)"``) whose last axis is `last` (when given); else a
    TypeError / ValueError naming the shape received and the one expected."""
    if not isinstance(x, mx.array):
        raise TypeError(f"{layer}: {name} must be an mx.array, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{layer}: {name} has dtype {x.dtype}; supported: float32, float16, bfloat16")
    wrong_rank = x.ndim == 0 if ndim is None else x.ndim != ndim
    if wrong_rank or (last is not None and x.shape[-1] != last):
        want = layout if last is None else f"{layout} with {layout.strip('()').split(',')[-1].strip()} = {last}"
        raise ValueError(f"{layer}: {name} must have shape {want}, got {tuple(x.shape)}")
