"""Fused RMSNorm + projection ops backed by ``metal_src/fused.metal``.

    fused_norm_linear(x, norm_weight, weight, bias=None, eps=1e-5)
        x (..., K), norm_weight (K,), weight (N, K), bias (N,) or None -> (..., N)
        = linear(rms_norm(x, norm_weight, eps), weight, bias)

    fused_norm_qkv_rope(x, norm_weight, w_qkv, n_heads, n_kv_heads, *, eps=1e-5,
                        traditional=False, base=10000.0, scale=1.0, offset=0)
        x (B, L, E), norm_weight (E,), w_qkv ((n_heads + 2 * n_kv_heads) * D, E)
        -> q (B, n_heads, L, D), k (B, n_kv_heads, L, D), v (B, n_kv_heads, L, D)
        = split of linear(rms_norm(x), w_qkv) into heads (q heads, then k, then v; each
          head D consecutive output features), moved head-major, RoPE (all D features,
          ``mx.fast.rope`` semantics) on q and k.

One kernel launch per call (knob ``single_kernel`` on, below); the normalised activations
are never written to memory.
RMSNorm's row scale r = rsqrt(mean(x^2) + eps) factors out of the product, so the kernel
multiplies the raw x tile with T(W * norm_weight) (the norm weight applied while W is
loaded), accumulates sum(x^2) from the x values its loader already holds, and applies
r (and the bias, or RoPE and the head-major scatter) in the epilogue. See the comment
block of ``metal_src/fused.metal``.

Paths (tiles from :mod:`xlstm_kernels.tiles`, resolved as ``gemm_a_bt`` with M rows,
N outputs, reduction K; ``tiles=`` takes the same forms as the GEMM ops):
* M == 1 (the GEMM's gemv rule): one simdgroup per output column (``norm_linear_gemv``)
  or per RoPE pair of columns (``norm_qkv_rope_gemv``).
* otherwise the simdgroup-matrix path with the config's BM, BN, BK, WM, WN whatever its
  ``path`` (no scalar path, no split-K: a row's statistics need the whole of K in one
  threadgroup). BK is rounded to 8, 16 or 32 (the BK lanes of a row reduce within one
  simdgroup). For QKV the column tile is HPT = max(1, BN // D) whole heads (BN rounded
  up to a multiple of 8 * WN), shrunk until the threadgroup memory (tiles plus the
  BM x BN float staging tile of the RoPE epilogue) fits 32 KiB: D up to about 500
  (float32) or 670 (float16/bfloat16); larger D is a ValueError.

Dtypes: float32, float16, bfloat16 (mixed inputs promote like the other ops: float32
unless all agree); float32 accumulation and statistics; outputs in the promoted dtype.
Rounding differs from the unfused sequence (which rounds the normalised activations and
the pre-RoPE projection to the dtype); both agree with a float64 reference to the
dtype's precision. float16 note: x * rsqrt(...) is never formed in half, so a row whose
raw values are large stays finite as long as W * norm_weight fits float16.

Knob ``single_kernel`` (:mod:`xlstm_kernels.tiles.knobs`, op ``fused``; ``knobs=``,
``XLSTM_FUSED_SINGLE_KERNEL``, presets by rows M): on (the built-in default) runs the one
fused kernel above; off runs the unfused sequence of this package's kernels (``rms_norm``,
``linear``, ``rope``), as the NVIDIA presets do: there the sequence's staged tensor-core
GEMM beats the single-buffered fused tile by 1.4-28x (H200, session 45). ``tiles=`` (the
fused kernel's tile) selects the fused kernel.

Differentiable: the VJP is the VJP of the unfused composite (``rms_norm`` + ``linear``
(+ ``rope``) of this package, whose backward passes run their own kernels), recomputing
the normalised activations in the backward pass. ``offset`` gets no gradient.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from .. import tiles as tiles_mod
from ..runtime import KernelSpec, const_array, current_backend, launch
from ..tiles.gemm import MAX_THREADGROUP_BYTES
from ..tiles.knobs import resolve_knobs
from ._callcache import CallCache, placeholder
from ._validate import check_array
from .gemm import linear
from .norm import rms_norm, rms_norm_reference
from .rope import _base_freqs, _kernel_freqs, _offset_array
from .rope import _reference as _rope_reference
from .rope import rope

__all__ = [
    "fused_norm_linear",
    "fused_norm_linear_reference",
    "fused_norm_qkv_rope",
    "fused_norm_qkv_rope_reference",
    "unfused_norm_linear",
    "unfused_norm_qkv_rope",
]

NORM_LINEAR = KernelSpec("fused", "norm_linear", ("x", "nw", "w", "bias", "params", "eps"), ("y",))
NORM_LINEAR_GEMV = KernelSpec("fused", "norm_linear_gemv", ("x", "nw", "w", "bias", "params", "eps"), ("y",))
_QKV_INPUTS = ("x", "nw", "w", "offsets", "freqs", "params", "eps", "scale")
NORM_QKV_ROPE = KernelSpec("fused", "norm_qkv_rope", _QKV_INPUTS, ("qo", "ko", "vo"))
NORM_QKV_ROPE_GEMV = KernelSpec("fused", "norm_qkv_rope_gemv", _QKV_INPUTS, ("qo", "ko", "vo"))
SPECS = (NORM_LINEAR, NORM_LINEAR_GEMV, NORM_QKV_ROPE, NORM_QKV_ROPE_GEMV)

MAX_TG_BYTES = MAX_THREADGROUP_BYTES
#: Accumulators (output elements) a simdgroup holds in norm_linear's plan: 32 a thread.
MAX_SUBTILE = 1024


# ---------------------------------------------------------------------------------------
# Small constant inputs (made once: mx arrays are immutable)
# ---------------------------------------------------------------------------------------


def _params(*values: int) -> mx.array:
    """The kernels' int64 shape parameters (runtime.const_array: device memory on cuda)."""
    if current_backend() == "cuda":
        return const_array(list(values), mx.int64, "cuda")
    return _host_params(*values)


def _f32(value: float) -> mx.array:
    """A float32 scalar input (eps, scale), as _params."""
    if current_backend() == "cuda":
        return const_array(value, mx.float32, "cuda")
    return _host_f32(value)


@functools.lru_cache(maxsize=256)
def _host_params(*values: int) -> mx.array:
    return mx.array(list(values), dtype=mx.int64)


@functools.lru_cache(maxsize=64)
def _host_f32(value: float) -> mx.array:
    return mx.array(value, dtype=mx.float32)


@functools.lru_cache(maxsize=8)
def _dummy(dtype: mx.Dtype) -> mx.array:
    return placeholder(dtype)


# ---------------------------------------------------------------------------------------
# Tile plans
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusedTiles:
    """What one fused launch runs: ``path`` "gemv" (rows = simdgroups per threadgroup)
    or "simd" (bm, bn, bk, wm, wn; cpt = output columns per threadgroup)."""

    path: str
    bm: int = 0
    bn: int = 0
    bk: int = 0
    wm: int = 0
    wn: int = 0
    cpt: int = 0
    rows: int = 0

    def threadgroup_bytes(self, dtype: mx.Dtype, staged: bool) -> int:
        if self.path != "simd":
            return 0
        size = 4 if dtype == mx.float32 else 2
        pads = 16 // size
        total = size * (self.bm * (self.bk + pads) + self.bk * (self.bn + pads)) + 4 * self.bm
        return total + (4 * self.bm * self.bn if staged else 0)


def _round_bk(bk: int) -> int:
    return 8 if bk < 16 else (16 if bk < 32 else 32)


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def plan_tiles(m: int, n: int, k: int, dtype: mx.Dtype, tiles: Any = None, head_dim: int | None = None) -> FusedTiles:
    """The fused launch plan for an (m, k) x (n, k)ᵀ product; `head_dim` for the QKV kernel."""
    cfg = tiles_mod.resolve_gemm_config("gemm_a_bt", m, n, k, dtype, tiles).config
    if cfg.path == "gemv" and m == 1:
        return FusedTiles("gemv", rows=max(1, cfg.gemv_threads // 32))
    bm, bk, wm, wn = cfg.bm, _round_bk(cfg.bk), cfg.wm, cfg.wn
    if head_dim is None:
        bn = cfg.bn
        # at most MAX_SUBTILE accumulators a simdgroup: the CUDA preset's 128x256 tile in 8x1
        # simdgroups gave each 16x256 (128 floats a thread: 255 registers and spills in the K
        # loop, scripts/cuda_sass.py, session 44); Apple presets' sub-tiles are within it
        while (bm // wm) * (bn // wn) > MAX_SUBTILE and bn // 2 >= 8 * wn and (bn // 2) % (8 * wn) == 0:
            bn //= 2
        plan = FusedTiles("simd", bm, bn, bk, wm, wn, bn)
        if plan.threadgroup_bytes(dtype, False) > MAX_TG_BYTES:  # a GemmConfig that fits, plus Rs
            plan = FusedTiles("simd", bm, bn, 8, wm, wn, bn)
        return plan
    d = head_dim
    hpt = max(1, cfg.bn // d)
    while True:
        cpt = hpt * d
        plan = FusedTiles("simd", bm, _round_up(cpt, 8 * wn), bk, wm, wn, cpt)
        if plan.threadgroup_bytes(dtype, True) <= MAX_TG_BYTES:
            return plan
        if hpt > 1:
            hpt //= 2
        elif bk > 8:
            bk = 8
        elif wn > 1:
            wn = 1
        elif bm > 8:
            # rows and simdgroups halve together (>= 8 rows a simdgroup): with the CUDA
            # preset's 128-row, 8-simdgroup tiles, jumping to one simdgroup of 8 rows left
            # 1-warp threadgroups each reading all of K for 8 rows (bf16 2x2048x4096: 47.5 ms
            # a call on an H200, session 44); halving reaches 32 rows in 4 simdgroups
            bm = max(8, bm // 2 // 8 * 8)
            wm = next(w for w in range(min(wm, bm // 8), 0, -1) if bm % (8 * w) == 0)
        else:
            raise ValueError(
                f"fused_norm_qkv_rope: head dimension D={d} is too large for one threadgroup's tile "
                f"({plan.threadgroup_bytes(dtype, True)} bytes of threadgroup memory > {MAX_TG_BYTES})"
            )


def _simd_template(dtype, plan: FusedTiles) -> list[tuple[str, Any]]:
    return [("T", dtype), ("BM", plan.bm), ("BN", plan.bn), ("BK", plan.bk), ("WM", plan.wm), ("WN", plan.wn)]


def norm_linear_launch(x2, nw, w, bias, eps: float, tiles: Any = None) -> tuple[KernelSpec, dict[str, Any]]:
    """(spec, launch keywords) of the fused norm+linear kernel; x2 (M, K), all one dtype."""
    m, k = x2.shape
    n = w.shape[0]
    dtype = x2.dtype
    plan = plan_tiles(m, n, k, dtype, tiles)
    inputs = [x2, nw, w, bias if bias is not None else _dummy(dtype), _params(m, n, k, int(bias is not None)),
              _f32(float(eps))]
    common = dict(inputs=inputs, output_shapes=[(m, n)], output_dtypes=[dtype])
    if plan.path == "gemv":
        r = plan.rows
        return NORM_LINEAR_GEMV, dict(common, grid=(32, r * -(-n // r), m), threadgroup=(32, r, 1),
                                      template=[("T", dtype), ("ROWS", r)])
    grid = (32 * plan.wn * -(-n // plan.bn), plan.wm * -(-m // plan.bm), 1)
    return NORM_LINEAR, dict(common, grid=grid, threadgroup=(32 * plan.wn, plan.wm, 1),
                             template=_simd_template(dtype, plan))


def norm_qkv_rope_launch(
    x, nw, w, n_heads: int, n_kv_heads: int, eps: float, traditional: bool, scale: float, offsets: mx.array,
    freqs32: mx.array, tiles: Any = None,
) -> tuple[KernelSpec, dict[str, Any]]:
    """(spec, launch keywords) of the fused QKV+RoPE kernel; x (B, L, E), all one dtype."""
    bsz, seq, e = x.shape
    n = w.shape[0]
    heads = n_heads + 2 * n_kv_heads
    d = n // heads
    m = bsz * seq
    dtype = x.dtype
    plan = plan_tiles(m, n, e, dtype, tiles, head_dim=d)
    cpt = plan.cpt if plan.path == "simd" else d
    params = _params(m, n, e, seq, d, n_heads, n_kv_heads, cpt, offsets.size, int(traditional))
    common = dict(
        inputs=[x.reshape(m, e), nw, w, offsets, freqs32, params, _f32(float(eps)), _f32(float(scale))],
        output_shapes=[(bsz, n_heads, seq, d), (bsz, n_kv_heads, seq, d), (bsz, n_kv_heads, seq, d)],
        output_dtypes=[dtype] * 3,
    )
    if plan.path == "gemv":
        r = plan.rows
        pairs = n // 2
        return NORM_QKV_ROPE_GEMV, dict(common, grid=(32, r * -(-pairs // r), m), threadgroup=(32, r, 1),
                                        template=[("T", dtype), ("ROWS", r)])
    hpt = plan.cpt // d
    grid = (32 * plan.wn * -(-heads // hpt), plan.wm * -(-m // plan.bm), 1)
    return NORM_QKV_ROPE, dict(common, grid=grid, threadgroup=(32 * plan.wn, plan.wm, 1),
                               template=_simd_template(dtype, plan))


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


def _promote(*dtypes: mx.Dtype) -> mx.Dtype:
    out = dtypes[0]
    for d in dtypes[1:]:
        if d != out:
            out = mx.float32
    return out


def _check_eps(op: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)) or not math.isfinite(
        float(eps)
    ) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite non-negative float, got {eps!r}")
    return float(eps)


def _check_norm_weight(op: str, norm_weight, k: int, x) -> None:
    check_array(norm_weight, "norm_weight", ndim=1)
    if norm_weight.shape[0] != k:
        raise ValueError(
            f"{op}: norm_weight must have shape ({k},) to match the last axis of x {tuple(x.shape)}, "
            f"got {tuple(norm_weight.shape)}"
        )


_INT32_MAX = 2**31 - 1


def _check_rows(op: str, rows: int, x) -> None:
    """The flattened row count is a grid dimension (32-bit); element offsets are 64-bit."""
    if rows > _INT32_MAX:
        raise ValueError(
            f"{op}: rows (the product of x's leading dimensions) = {rows} exceeds 2**31 - 1 "
            f"(x has shape {tuple(x.shape)}); split x along a leading axis"
        )


def _check_positive_int(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
    return int(value)


def _check_offset(op: str, offset, bsz: int) -> mx.array | int:
    if isinstance(offset, mx.array):
        if not mx.issubdtype(offset.dtype, mx.integer):
            raise TypeError(f"{op}: offset must be an int or an integer mx.array, got dtype {offset.dtype}")
        if offset.ndim == 0:
            return offset.astype(mx.int32)
        if tuple(offset.shape) != (bsz,):
            raise ValueError(
                f"{op}: offset must be an int, a 0-d integer array or one offset per batch element, "
                f"shape ({bsz},); got shape {tuple(offset.shape)}"
            )
        return offset.astype(mx.int32)
    if isinstance(offset, (int, np.integer)) and not isinstance(offset, bool):
        offset = int(offset)
        if not -(2**31) <= offset < 2**31:
            raise ValueError(f"{op}: offset must fit in int32, got {offset}")
        return offset
    raise TypeError(f"{op}: offset must be an int or an integer mx.array, got {type(offset).__name__}")


def _validate_linear(x, norm_weight, weight, bias, eps):
    op = "fused_norm_linear"
    check_array(x, "x", min_ndim=1)
    k = x.shape[-1]
    _check_norm_weight(op, norm_weight, k, x)
    check_array(weight, "weight", ndim=2)
    if weight.shape[1] != k:
        raise ValueError(
            f"{op}: weight (out_features, in_features) must have in_features={k} to match x {tuple(x.shape)}, "
            f"got weight of shape {tuple(weight.shape)}"
        )
    n = weight.shape[0]
    if bias is not None:
        check_array(bias, "bias", ndim=1)
        if bias.shape[0] != n:
            raise ValueError(f"{op}: bias must have shape ({n},) (one per output feature), got {tuple(bias.shape)}")
    eps = _check_eps(op, eps)
    dtype = _promote(x.dtype, norm_weight.dtype, weight.dtype, *([bias.dtype] if bias is not None else []))
    cast = lambda a: None if a is None else (a if a.dtype == dtype else a.astype(dtype))  # noqa: E731
    return cast(x), cast(norm_weight), cast(weight), cast(bias), eps


def _validate_qkv(x, norm_weight, w_qkv, n_heads, n_kv_heads, eps, traditional, base, scale, offset):
    op = "fused_norm_qkv_rope"
    check_array(x, "x", ndim=3)
    bsz, _, e = x.shape
    _check_norm_weight(op, norm_weight, e, x)
    n_heads = _check_positive_int(op, "n_heads", n_heads)
    n_kv_heads = _check_positive_int(op, "n_kv_heads", n_kv_heads)
    check_array(w_qkv, "w_qkv", ndim=2)
    heads = n_heads + 2 * n_kv_heads
    if w_qkv.shape[1] != e:
        raise ValueError(
            f"{op}: w_qkv ((n_heads + 2 * n_kv_heads) * D, E) must have E={e} columns to match x {tuple(x.shape)}, "
            f"got w_qkv of shape {tuple(w_qkv.shape)}"
        )
    if w_qkv.shape[0] % heads or w_qkv.shape[0] == 0:
        raise ValueError(
            f"{op}: w_qkv must have (n_heads + 2 * n_kv_heads) * D = {heads} * D rows for n_heads={n_heads}, "
            f"n_kv_heads={n_kv_heads}; got w_qkv of shape {tuple(w_qkv.shape)}"
        )
    d = w_qkv.shape[0] // heads
    if d % 2:
        raise ValueError(
            f"{op}: the head dimension D = w_qkv.shape[0] / {heads} = {d} must be even (RoPE rotates pairs); "
            f"got w_qkv of shape {tuple(w_qkv.shape)}"
        )
    eps = _check_eps(op, eps)
    if not isinstance(traditional, (bool, np.bool_)):
        raise TypeError(f"{op}: traditional must be a bool, got {type(traditional).__name__}")
    for name, val in (("base", base), ("scale", scale)):
        if isinstance(val, bool) or not isinstance(val, (int, float, np.floating, np.integer)):
            raise TypeError(f"{op}: {name} must be a float, got {type(val).__name__}")
        if not math.isfinite(float(val)):
            raise ValueError(f"{op}: {name} must be finite, got {val!r}")
    if float(base) <= 0:
        raise ValueError(f"{op}: base must be a positive finite float, got {base!r}")
    offset = _check_offset(op, offset, bsz)
    dtype = _promote(x.dtype, norm_weight.dtype, w_qkv.dtype)
    cast = lambda a: a if a.dtype == dtype else a.astype(dtype)  # noqa: E731
    return cast(x), cast(norm_weight), cast(w_qkv), n_heads, n_kv_heads, d, eps, bool(traditional), offset


# ---------------------------------------------------------------------------------------
# References and the unfused sequences
# ---------------------------------------------------------------------------------------


def _split_heads(qkv: mx.array, n_heads: int, n_kv_heads: int) -> tuple[mx.array, mx.array, mx.array]:
    """(B, L, heads * D) -> q (B, H, L, D), k, v (B, HKV, L, D)."""
    bsz, seq, n = qkv.shape
    heads = n_heads + 2 * n_kv_heads
    t = qkv.reshape(bsz, seq, heads, n // heads).transpose(0, 2, 1, 3)
    return t[:, :n_heads], t[:, n_heads : n_heads + n_kv_heads], t[:, n_heads + n_kv_heads :]


def fused_norm_linear_reference(x, norm_weight, weight, bias=None, eps: float = 1e-5) -> mx.array:
    """:func:`fused_norm_linear` with plain mx ops (the ``reference`` backend)."""
    y = mx.matmul(rms_norm_reference(x, norm_weight, eps), weight.T)
    return y + bias if bias is not None else y


def fused_norm_qkv_rope_reference(
    x, norm_weight, w_qkv, n_heads, n_kv_heads, *, eps=1e-5, traditional=False, base=10000.0, scale=1.0, offset=0
):
    """:func:`fused_norm_qkv_rope` with plain mx ops (the ``reference`` backend)."""
    qkv = mx.matmul(rms_norm_reference(x, norm_weight, eps), w_qkv.T)
    q, k, v = _split_heads(qkv, n_heads, n_kv_heads)
    d = q.shape[-1]
    freqs32 = _base_freqs(d // 2, float(base))
    if isinstance(offset, mx.array):
        offset = offset.astype(mx.int32)
    q = _rope_reference(q, d, bool(traditional), float(scale), offset, freqs32)
    k = _rope_reference(k, d, bool(traditional), float(scale), offset, freqs32)
    return q, k, v


def unfused_norm_linear(x, norm_weight, weight, bias=None, eps: float = 1e-5) -> mx.array:
    """The unfused sequence of this package's ops: ``linear(rms_norm(x), weight, bias)``."""
    return linear(rms_norm(x, norm_weight, eps), weight, bias)


def unfused_norm_qkv_rope(
    x, norm_weight, w_qkv, n_heads, n_kv_heads, *, eps=1e-5, traditional=False, base=10000.0, scale=1.0, offset=0
):
    """The unfused sequence of this package's ops: rms_norm, linear, split/transpose, rope(q), rope(k)."""
    qkv = linear(rms_norm(x, norm_weight, eps), w_qkv)
    q, k, v = _split_heads(qkv, n_heads, n_kv_heads)
    d = q.shape[-1]
    kw = dict(traditional=traditional, base=base, scale=scale, offset=offset)
    return rope(q, d, **kw), rope(k, d, **kw), v


def knob_values(m: int, dtype: Any, knobs: dict | None = None, tiles: Any = None,
                op: str = "fused_norm_linear") -> dict[str, bool]:
    """{"single_kernel": ...} a call with `m` rows uses (``knobs=`` > XLSTM_FUSED_SINGLE_KERNEL
    > presets > the built-in default, on). A ``tiles=`` argument describes the fused
    kernel's tile, so it selects the kernel too (an argument, above the variable and presets);
    with ``knobs={"single_kernel": False}`` it is a ValueError."""
    if knobs is not None and not isinstance(knobs, dict):
        raise TypeError(f"{op}: knobs must be a dict such as {{'single_kernel': False}} or None, got "
                        f"{type(knobs).__name__}")
    if tiles is not None:
        if knobs is not None and knobs.get("single_kernel") is False:
            raise ValueError(f"{op}: tiles= sets the fused kernel's tile, but knobs single_kernel=False runs the "
                             "unfused sequence; pass one or the other")
        knobs = {**(knobs or {}), "single_kernel": True}
    v = resolve_knobs("fused", dtype, m, args=knobs).values["single_kernel"]
    return {"single_kernel": True if v is None else v}


def fused_path(m: int, n: int, k: int, dtype: mx.Dtype, tiles: Any = None, head_dim: int | None = None,
               knobs: dict | None = None) -> str:
    """What a call runs: "gemv" or "simd" (the fused kernel's paths) or "sequence" (the
    unfused sequence of this package's kernels, knob ``single_kernel`` off)."""
    if not knob_values(m, dtype, knobs, tiles)["single_kernel"]:
        return "sequence"
    return plan_tiles(m, n, k, dtype, tiles, head_dim=head_dim).path


# ---------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------


def fused_norm_linear(
    x: mx.array,
    norm_weight: mx.array,
    weight: mx.array,
    bias: mx.array | None = None,
    eps: float = 1e-5,
    *,
    tiles: Any = None,
    knobs: dict | None = None,
) -> mx.array:
    """``linear(rms_norm(x, norm_weight, eps), weight, bias)`` in one kernel.

    Args:
        x: (..., K) float32, float16 or bfloat16.
        norm_weight: (K,) RMSNorm scale.
        weight: (N, K) (the nn.Linear layout).
        bias: (N,) or None.
        eps: finite, >= 0; added to the mean square.
        tiles: optional tile config of the fused kernel (as for the GEMM ops; resolved as
            ``gemm_a_bt``); given, the call runs the fused kernel.
        knobs: optional ``{"single_kernel": bool}``: False runs the unfused sequence of
            this package's kernels (see the module docstring; default from the presets).

    Returns:
        (..., N) in the promoted dtype. Statistics and accumulation in float32.

    Differentiable in x, norm_weight, weight and bias (VJP of the unfused composite).
    """
    key = None
    if tiles is None and knobs is None and x.__class__ is _ARRAY and eps.__class__ in _NUMBER:
        try:
            key = ("linear", x.shape, x.dtype, norm_weight.shape, norm_weight.dtype, weight.shape, weight.dtype,
                   None if bias is None else (bias.shape, bias.dtype), eps)
        except AttributeError:  # not arrays: validation says so
            key = None
        else:
            fn = _CALLS.get(key)
            if fn is not None:
                return fn(x, norm_weight, weight, bias)
    fn = _build_linear(x, norm_weight, weight, bias, eps, tiles, knobs)
    if key is not None:
        _CALLS.put(key, fn)
    return fn(x, norm_weight, weight, bias)


def _build_linear(x, norm_weight, weight, bias, eps, tiles, knobs):
    """Validate one fused_norm_linear call and build fn(x, norm_weight, weight, bias) -> y
    for its signature (the path: reference, the unfused sequence or the fused kernel)."""
    xv, nwv, wv, bv, eps = _validate_linear(x, norm_weight, weight, bias, eps)
    dtype = xv.dtype
    if tiles is not None:  # a bad tiles= fails before anything runs, whichever path runs
        tiles_mod.resolve_gemm_config("gemm_a_bt", 1, 1, 1, dtype, tiles)
    lead = tuple(xv.shape[:-1])
    k, n = xv.shape[-1], wv.shape[0]
    m = math.prod(lead)
    _check_rows("fused_norm_linear", m, xv)
    single = knob_values(m, dtype, knobs, tiles)["single_kernel"]
    backend = current_backend()
    cast = _caster(dtype)
    if backend == "reference" or m == 0 or n == 0 or k == 0:
        return lambda x, nw, w, b: fused_norm_linear_reference(cast(x), cast(nw), cast(w), cast(b), eps)
    if not single:
        return lambda x, nw, w, b: unfused_norm_linear(cast(x), cast(nw), cast(w), cast(b), eps)
    has_bias = bias is not None

    def forward(xa, nwa, wa, ba):
        spec, kw = norm_linear_launch(xa.reshape(m, k), nwa, wa, ba, eps, tiles)
        (y,) = launch(spec, **kw, backend=backend)
        return y.reshape(*lead, n)

    @mx.custom_function
    def f(*args):
        return forward(args[0], args[1], args[2], args[3] if has_bias else None)

    @f.vjp
    def f_vjp(primals, cotangent, output):
        if isinstance(cotangent, (list, tuple)):
            cotangent = cotangent[0]

        def composite(*a):
            return unfused_norm_linear(a[0], a[1], a[2], a[3] if has_bias else None, eps)

        _, grads = mx.vjp(composite, list(primals), [cotangent])
        return tuple(grads)

    if has_bias:
        return lambda x, nw, w, b: f(cast(x), cast(nw), cast(w), cast(b))
    return lambda x, nw, w, b: f(cast(x), cast(nw), cast(w))


def fused_norm_qkv_rope(
    x: mx.array,
    norm_weight: mx.array,
    w_qkv: mx.array,
    n_heads: int,
    n_kv_heads: int,
    *,
    eps: float = 1e-5,
    traditional: bool = False,
    base: float = 10000.0,
    scale: float = 1.0,
    offset: int | mx.array = 0,
    tiles: Any = None,
    knobs: dict | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """RMSNorm, the fused QKV projection and RoPE on q and k, in one kernel.

    Args:
        x: (B, L, E) float32, float16 or bfloat16.
        norm_weight: (E,) RMSNorm scale.
        w_qkv: ((n_heads + 2 * n_kv_heads) * D, E): the q heads' rows, then k's, then v's
            (each head D consecutive rows). D must be even.
        n_heads, n_kv_heads: query and key/value heads (GQA when n_kv_heads < n_heads).
        eps: RMSNorm epsilon.
        traditional: RoPE pairs (2j, 2j+1) instead of (j, j + D/2).
        base: inv_freq[j] = base^(-j / (D/2)).
        scale: multiplies the positions.
        offset: position of x[:, 0]: an int, a 0-d integer array or a (B,) integer array.
        tiles: optional tile config of the fused kernel (as for the GEMM ops; resolved as
            ``gemm_a_bt``); given, the call runs the fused kernel.
        knobs: optional ``{"single_kernel": bool}``: False runs the unfused sequence of
            this package's kernels (see the module docstring; default from the presets).

    Returns:
        q (B, n_heads, L, D), k (B, n_kv_heads, L, D) with RoPE applied (all D features),
        v (B, n_kv_heads, L, D); promoted dtype, float32 math.

    Differentiable in x, norm_weight and w_qkv (VJP of the unfused composite).
    """
    key = None
    if (tiles is None and knobs is None and x.__class__ is _ARRAY and n_heads.__class__ is int
            and n_kv_heads.__class__ is int and traditional.__class__ is bool
            and eps.__class__ in _NUMBER and base.__class__ in _NUMBER and scale.__class__ in _NUMBER):
        kind = _offset_kind(offset)
        try:
            key = ("qkv", x.shape, x.dtype, norm_weight.shape, norm_weight.dtype, w_qkv.shape, w_qkv.dtype,
                   n_heads, n_kv_heads, eps, traditional, base, scale, kind)
        except AttributeError:  # not arrays: validation says so
            key = None
        else:
            fn = _CALLS.get(key) if kind is not None else None
            if fn is not None:
                return fn(x, norm_weight, w_qkv, offset)
    fn = _build_qkv(x, norm_weight, w_qkv, n_heads, n_kv_heads, eps, traditional, base, scale, offset, tiles, knobs)
    if key is not None and key[-1] is not None:
        _CALLS.put(key, fn)
    return fn(x, norm_weight, w_qkv, offset)


def _offset_kind(offset) -> Any:
    """The part of a memo key `offset` sets: "int" (its value is an argument) or the
    array's (shape, dtype); None for anything else (validation says what is wrong)."""
    if offset.__class__ is int:
        return "int"
    if offset.__class__ is _ARRAY:
        return (offset.shape, offset.dtype)
    return None


def _build_qkv(x, norm_weight, w_qkv, n_heads, n_kv_heads, eps, traditional, base, scale, offset, tiles, knobs):
    """Validate one fused_norm_qkv_rope call and build fn(x, norm_weight, w_qkv, offset)
    -> (q, k, v) for its signature; fn checks each call's offset."""
    op = "fused_norm_qkv_rope"
    xv, nwv, wv, n_heads, n_kv_heads, d, eps, traditional, _ = _validate_qkv(
        x, norm_weight, w_qkv, n_heads, n_kv_heads, eps, traditional, base, scale, offset
    )
    dtype = xv.dtype
    if tiles is not None:
        tiles_mod.resolve_gemm_config("gemm_a_bt", 1, 1, 1, dtype, tiles)
    scale, base = float(scale), float(base)
    bsz, seq, e = xv.shape
    _check_rows(op, bsz * seq, xv)
    single = knob_values(bsz * seq, dtype, knobs, tiles, op)["single_kernel"]
    backend = current_backend()
    cast = _caster(dtype)
    rope_kw = dict(eps=eps, traditional=traditional, base=base, scale=scale)
    if backend == "reference" or bsz * seq == 0 or e == 0:
        run = fused_norm_qkv_rope_reference
    elif not single:
        run = unfused_norm_qkv_rope
    else:
        freqs32 = _kernel_freqs(d // 2, float(base), backend)

        def run(xa, nwa, wa, n_heads, n_kv_heads, *, offset, **rope_kw):
            offsets = offset.reshape(-1) if isinstance(offset, mx.array) else _offset_array(offset, backend)

            @mx.custom_function
            def f(xa, nwa, wa):
                spec, kw = norm_qkv_rope_launch(xa, nwa, wa, n_heads, n_kv_heads, eps, traditional, scale, offsets,
                                                freqs32, tiles)
                return tuple(launch(spec, **kw, backend=backend))

            @f.vjp
            def f_vjp(primals, cotangents, outputs):
                def composite(xa, nwa, wa):
                    return list(unfused_norm_qkv_rope(xa, nwa, wa, n_heads, n_kv_heads, offset=offset, **rope_kw))

                _, grads = mx.vjp(composite, list(primals), list(cotangents))
                return tuple(grads)

            return tuple(f(xa, nwa, wa))

    def fn(x, nw, w, offset):
        offset = _check_offset(op, offset, bsz)
        return tuple(run(cast(x), cast(nw), cast(w), n_heads, n_kv_heads, offset=offset, **rope_kw))

    return fn


_CALLS = CallCache("fused")
_ARRAY = mx.array
_NUMBER = (float, int)


def _caster(dtype: mx.Dtype):
    """a -> a in `dtype` (None stays None; no graph node where the dtype already matches)."""
    return lambda a: None if a is None else (a if a.dtype == dtype else a.astype(dtype))
