"""GEMM ops backed by ``metal_src/gemm.metal``: gemm_av, gemm_at_b, gemm_a_bt, linear.

Layouts (leading batch dimensions broadcast like ``mx.matmul``):

    gemm_av(a, v)    a (..., m, n), v (..., n, k) -> (..., m, k)   C = A · V
    gemm_at_b(a, b)  a (..., m, n), b (..., m, k) -> (..., n, k)   Z = Aᵀ · B
    gemm_a_bt(a, b)  a (..., m, k), b (..., n, k) -> (..., m, n)   A · Bᵀ (nn.Linear)
    linear(x, w, bias, activation, residual)      x (..., in), w (out, in) -> (..., out)

float32, float16 and bfloat16 (mixed inputs promote like ``mx.matmul``), float32
accumulation, output in the (promoted) input dtype. Every op is differentiable: the
VJP of each layout runs the other layouts' kernels.

The tile configuration comes from :mod:`xlstm_kernels.tiles` (argument > env >
presets > default); ``tiles=`` takes a :class:`~xlstm_kernels.tiles.GemmConfig`, a
dict of its fields or a ``"TMxTN[xTK]"`` string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import mlx.core as mx

from .. import tiles as tiles_mod
from ..tiles.gemm import SIMD_AUTO_STAGES
from ..runtime import KernelSpec, const_array, current_backend, prepare_launch
from ._callcache import CallCache, placeholder, replayable
from ._validate import INT32_MAX, check_array, check_int32

__all__ = ["ACTIVATIONS", "gemm_a_bt", "gemm_at_b", "gemm_av", "linear", "gemm_reference", "simd_stages"]

ACTIVATIONS = {None: 0, "none": 0, "relu": 1, "gelu": 2, "gelu_approx": 3, "silu": 4}

_OPERANDS = ("A", "B", "bias", "residual", "params")
SCALAR = KernelSpec("gemm", "gemm_scalar", _OPERANDS, ("C",))
SIMD = KernelSpec("gemm", "gemm_simd", _OPERANDS, ("C", "P"))
SPLIT_REDUCE = KernelSpec("gemm", "gemm_split_k_reduce", ("P", "bias", "residual", "params"), ("C",))
GEMV = KernelSpec("gemm", "gemv", _OPERANDS, ("C",))


@dataclass(frozen=True)
class _Layout:
    op: str
    trans_a: bool
    trans_b: bool


_LAYOUTS = {
    "gemm_av": _Layout("gemm_av", False, False),
    "gemm_at_b": _Layout("gemm_at_b", True, False),
    "gemm_a_bt": _Layout("gemm_a_bt", False, True),
}


# gemm_simd's automatic pipeline budget per backend (stages = 0): (threadgroup bytes the
# stages may fill, most stages); see xlstm_kernels.tiles.gemm.SIMD_AUTO_STAGES.
SIMD_STAGE_BUDGET = SIMD_AUTO_STAGES


def simd_stages(cfg, dtype: mx.Dtype, trans_a: bool, trans_b: bool, backend: str = "metal") -> int:
    """K tiles in flight in ``gemm_simd`` for `cfg` on `backend` (its template STAGES): the
    config's ``stages``, or with 0 as many stages of threadgroup tiles as fit in 32 KiB, at
    most 3 (Apple GPUs and the emulator), or in 48 KiB, at most 4 (cuda); 1: load, barrier,
    multiply, barrier. (GemmConfig.simd_stages.)"""
    return cfg.simd_stages(dtype, trans_a, trans_b, backend)


def _promote(a: mx.dtype, b: mx.dtype) -> mx.dtype:
    if a == b:
        return a
    return mx.float32  # float32 with anything, and float16 with bfloat16, give float32 in MLX


def _dims(layout: _Layout, a_shape, b_shape) -> tuple[int, int, int]:
    """(M, N, K) of the output-centric product for the two operand shapes."""
    if layout.op == "gemm_av":
        m, k_a = a_shape[-2], a_shape[-1]
        k_b, n = b_shape[-2], b_shape[-1]
        names = ("a (..., m, n)", "v (..., n, k)", "n")
    elif layout.op == "gemm_at_b":
        k_a, m = a_shape[-2], a_shape[-1]
        k_b, n = b_shape[-2], b_shape[-1]
        names = ("a (..., m, n)", "b (..., m, k)", "m")
    else:
        m, k_a = a_shape[-2], a_shape[-1]
        n, k_b = b_shape[-2], b_shape[-1]
        names = ("a (..., m, k)", "b (..., n, k)", "k")
    if k_a != k_b:
        raise ValueError(
            f"{layout.op}: {names[0]} and {names[1]} disagree on {names[2]}: "
            f"got shapes {tuple(a_shape)} and {tuple(b_shape)}"
        )
    return m, n, k_a


def gemm_reference(
    op: str, a: mx.array, b: mx.array, bias=None, activation=None, residual=None
) -> mx.array:
    """The same op with plain mx ops (the ``reference`` backend and the tests' oracle)."""
    x = a.swapaxes(-1, -2) if op == "gemm_at_b" else a
    y = b.swapaxes(-1, -2) if op == "gemm_a_bt" else b
    if x.size == 0 or y.size == 0:
        # an empty operand: zeros of the product's shape without mx.matmul (MLX 0.32's CUDA
        # matmul crashed the process on zero-size operands on the H100)
        shape = (*mx.broadcast_shapes(tuple(x.shape[:-2]), tuple(y.shape[:-2])), x.shape[-2], y.shape[-1])
        out = mx.zeros(shape, dtype=_promote(x.dtype, y.dtype))
    else:
        out = mx.matmul(x, y)
    if bias is not None:
        out = out + bias
    out = _activate_reference(out, activation)
    if residual is not None:
        out = out + residual
    return out


def _activate_reference(x: mx.array, activation: str | None) -> mx.array:
    if activation in (None, "none"):
        return x
    xf = x.astype(mx.float32)
    if activation == "relu":
        y = mx.maximum(xf, 0.0)
    elif activation == "gelu":
        y = 0.5 * xf * (1.0 + mx.erf(xf * 0.7071067811865476))
    elif activation == "gelu_approx":
        y = 0.5 * xf * (1.0 + mx.tanh(0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)))
    else:
        y = xf * mx.sigmoid(xf)
    return y.astype(x.dtype)


def _batch_operand(x: mx.array, batch_shape: tuple[int, ...], rows: int, cols: int) -> tuple[mx.array, int]:
    """`x` as (batch..., rows, cols) data plus its batch stride (0 = broadcast 2-D operand)."""
    if x.ndim == 2 and batch_shape:
        return x, 0
    if tuple(x.shape[:-2]) != batch_shape:
        x = mx.broadcast_to(x, (*batch_shape, rows, cols))
    return x, rows * cols


def _kernel_gemm(
    layout: _Layout,
    a: mx.array,
    b: mx.array,
    bias: mx.array | None,
    act: int,
    residual: mx.array | None,
    tiles: Any,
    backend: str,
) -> mx.array:
    """Forward on a kernel backend. a, b already promoted; residual broadcast to the output."""
    run = _launcher(layout, tuple(a.shape), tuple(b.shape), a.dtype, bias is not None, act, residual is not None,
                    tiles, backend)
    return run(a, b, bias, residual)


_LAUNCHERS = CallCache("gemm launchers")



def _launcher(layout, a_shape, b_shape, dtype, has_bias, act, has_res, tiles, backend):
    """run(a, b, bias, residual) -> C for operands of these shapes: the tile config resolved
    and the launches planned once per signature (and configuration)."""
    try:
        key = (layout.op, a_shape, b_shape, dtype, has_bias, act, has_res, _tiles_key(tiles), backend)
    except TypeError:  # unhashable tiles: planned for this call only
        return _build_launcher(layout, a_shape, b_shape, dtype, has_bias, act, has_res, tiles, backend)
    run = _LAUNCHERS.get(key)
    if run is None:
        run = _LAUNCHERS.put(key, _build_launcher(layout, a_shape, b_shape, dtype, has_bias, act, has_res, tiles,
                                                  backend))
    return run


def _build_launcher(layout, a_shape, b_shape, dtype, has_bias, act, has_res, tiles, backend, c_shape=None):
    """The launcher of _launcher's signature. `c_shape`: the shape C is made in (by default
    the output's, (*batch, m, n)); a folded batch's inner launcher makes the caller's shape,
    and takes A in the caller's shape too (any shape of its m x k elements). The kernels index
    their operands and C as flat buffers, so neither needs a reshape (a graph node, which a
    call's evaluation pays for on the host)."""
    m, n, k = _dims(layout, a_shape, b_shape)
    batch_shape = tuple(mx.broadcast_shapes(a_shape[:-2], b_shape[:-2])) if len(a_shape) > 2 or len(b_shape) > 2 else ()
    out_shape = (*batch_shape, m, n)
    flat_a = c_shape is not None  # (the folded inner launcher: A is one (m, k) block in any shape)
    c_shape = out_shape if c_shape is None else c_shape

    # A batched A times a shared 2-D B is one tall GEMM: fold the batch into M.
    # (Not when the folded M would exceed a 32-bit shape dimension: then B is broadcast per batch.)
    nbatch = 1
    for d in batch_shape:
        nbatch *= d
    foldable = batch_shape and len(b_shape) == 2 and not layout.trans_a and a_shape[:-2] == batch_shape
    if foldable and nbatch * m <= INT32_MAX:
        # (A, the residual and C keep the caller's shapes: flat buffers to the kernels)
        return _build_launcher(layout, (nbatch * m, a_shape[-1]), b_shape, dtype, has_bias, act, has_res, tiles,
                               backend, c_shape=out_shape)

    a_rows, a_cols = (k, m) if layout.trans_a else (m, k)
    b_rows, b_cols = (n, k) if layout.trans_b else (k, n)
    if out_shape and 0 in out_shape:
        return lambda a, b, bias, residual: mx.zeros(c_shape, dtype=dtype)
    sa = 0 if len(a_shape) == 2 and batch_shape else a_rows * a_cols
    sb = 0 if len(b_shape) == 2 and batch_shape else b_rows * b_cols

    cfg = tiles_mod.resolve_gemm_config(layout.op, m, n, k, dtype, tiles, batch=nbatch, backend=backend).config
    absent = placeholder(dtype)
    epilogue = [("HAS_BIAS", has_bias), ("ACT", act), ("HAS_RES", has_res)]
    split = cfg.split_k if cfg.path == "simd" else 1
    shapes = f"operands of shapes {a_shape} and {b_shape}"
    check_int32(layout.op, "batch count x split_k (grid z)", nbatch * split, shapes)
    if split > 1:
        check_int32(layout.op, "outputs of the split-K reduction (batch * M * N, its grid x)", nbatch * m * n,
                    shapes + "; use split_k=1")
    k_per_split = -(-k // split) if split > 1 else k
    params = const_array([m, n, k, sa, sb, k_per_split, split, nbatch], mx.int64)
    example = [absent, absent, absent, absent, params]  # ranks only: none is 0-d

    if cfg.path == "gemv" and m == 1:  # op(A) is one row: A is a contiguous K-vector in every layout
        rows = max(1, cfg.gemv_threads // 32)
        cols = cfg.gemv_cols(n, dtype, layout.trans_b)  # (N, K) rows: columns a simdgroup; else column blocks
        main = prepare_launch(
            GEMV, inputs=example, output_shapes=[c_shape], output_dtypes=[dtype],
            grid=cfg.grid(1, n, nbatch, dtype=dtype, trans_b=layout.trans_b), threadgroup=(32, rows, 1),
            template=[("T", dtype), ("ROWS", rows), ("TRANS_B", layout.trans_b), *epilogue, ("COLS", cols)],
            backend=backend,
        )
        reduce = None
    elif cfg.path == "simd":
        grid = (32 * cfg.wn * -(-n // cfg.bn), cfg.wm * -(-m // cfg.bm), nbatch * split)
        stages = cfg.simd_stages(dtype, layout.trans_a, layout.trans_b, backend)
        template = [
            ("T", dtype), ("BM", cfg.bm), ("BN", cfg.bn), ("BK", cfg.bk), ("WM", cfg.wm), ("WN", cfg.wn),
            ("STAGES", stages), ("TRANS_A", layout.trans_a), ("TRANS_B", layout.trans_b), *epilogue,
            ("SPLIT", split), ("WG", cfg.uses_warpgroup(dtype)),
        ]
        partial_shape = (split, nbatch, m, n) if split > 1 else (1,)
        main = prepare_launch(
            SIMD, inputs=example, output_shapes=[c_shape if split == 1 else (1,), partial_shape],
            output_dtypes=[dtype, mx.float32], grid=grid, threadgroup=(32 * cfg.wn, cfg.wm, 1),
            template=template, backend=backend,
            # (no init_value: the body sets the unused one of C / P itself)
            # cuda: the body's tile buffer is dynamic shared memory (XK_THREADGROUP_DYNAMIC)
            shared_memory=cfg.simd_threadgroup_bytes(dtype, layout.trans_a, layout.trans_b, backend),
        )
        reduce = None
        if split > 1:
            total = nbatch * m * n
            reduce = prepare_launch(
                SPLIT_REDUCE, inputs=[absent, absent, absent, params], output_shapes=[c_shape],
                output_dtypes=[dtype], grid=(total, 1, 1), threadgroup=(min(256, total), 1, 1),
                template=[("T", dtype), *epilogue], backend=backend,
            )
    else:
        rt, ct = cfg.tm // cfg.rm, cfg.tn // cfg.rn
        template = [
            ("T", dtype), ("TM", cfg.tm), ("TN", cfg.tn), ("TK", cfg.tk), ("RM", cfg.rm), ("RN", cfg.rn),
            ("PAD", cfg.pad), ("DB", cfg.double_buffer), ("VEC4", cfg.vec4),
            ("TRANS_A", layout.trans_a), ("TRANS_B", layout.trans_b), *epilogue,
        ]
        main = prepare_launch(
            SCALAR, inputs=example, output_shapes=[c_shape], output_dtypes=[dtype],
            grid=(ct * -(-n // cfg.tn), rt * -(-m // cfg.tm), nbatch), threadgroup=(ct, rt, 1),
            template=template, backend=backend,
        )
        reduce = None

    def run(a, b, bias, residual):
        a_data = a if flat_a else _batch_operand(a, batch_shape, a_rows, a_cols)[0]
        b_data, _ = _batch_operand(b, batch_shape, b_rows, b_cols)
        bias_in = bias.astype(dtype) if bias is not None else absent
        res_in = residual.astype(dtype) if residual is not None else absent
        outs = main([a_data, b_data, bias_in, res_in, params])
        if reduce is not None:
            outs = reduce([outs[1], bias_in, res_in, params])
        return outs[0]  # made in c_shape

    return run


def _sum_to_shape(g: mx.array, shape: tuple[int, ...]) -> mx.array:
    """Reduce a broadcast gradient back to `shape`."""
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, (s, gs) in enumerate(zip(shape, g.shape)) if s == 1 and gs != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g


def _act_grad(pre: mx.array, activation: str | None) -> mx.array:
    """d activation / d pre, in float32."""
    x = pre.astype(mx.float32)
    if activation == "relu":
        return (x > 0).astype(mx.float32)
    if activation == "gelu":
        cdf = 0.5 * (1.0 + mx.erf(x * 0.7071067811865476))
        pdf = mx.exp(-0.5 * x * x) * 0.3989422804014327
        return cdf + x * pdf
    if activation == "gelu_approx":
        c = 0.7978845608028654
        u = c * (x + 0.044715 * x * x * x)
        t = mx.tanh(u)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x * x)
    x_sig = mx.sigmoid(x)
    return x_sig * (1.0 + x * (1.0 - x_sig))


def _run(
    op: str,
    a: mx.array,
    b: mx.array,
    bias: mx.array | None = None,
    activation: str | None = None,
    residual: mx.array | None = None,
    tiles: Any = None,
) -> mx.array:
    """The differentiable op: validated and built once per signature (shapes, dtypes,
    activation, tiles) and configuration, then reused (see ops/_callcache.py)."""
    return _memoised(op, a, b, bias, activation, residual, tiles)(a, b, bias, residual)


def _memoised(op, a, b, bias, activation, residual, tiles):
    """fn(a, b, bias, residual) of this call's signature: from the memo, else validated and
    built (and stored where the signature is hashable)."""
    if bias is None and residual is None and activation is None and tiles is None \
            and a.__class__ is _ARRAY and b.__class__ is _ARRAY:
        key = (op, a.shape, a.dtype, b.shape, b.dtype)  # the plain product: a flat key
    else:
        key = _call_key(op, a, b, bias, activation, residual, tiles)
    fn = _CALLS.get(key) if key is not None else None
    if fn is None:
        fn = _build_call(op, a, b, bias, activation, residual, tiles, replay=key is not None)
        if key is not None:
            _CALLS.put(key, fn)
    return fn


_CALLS = CallCache("gemm")
_ARRAY = mx.array


def _tiles_key(tiles: Any) -> Hashable:
    """`tiles` as a hashable memo key part (a dict by its items), or raise TypeError."""
    if isinstance(tiles, dict):
        tiles = ("dict", tuple(sorted(tiles.items(), key=lambda kv: str(kv[0]))))
    hash(tiles)
    return tiles


def _call_key(op, a, b, bias, activation, residual, tiles) -> tuple | None:
    """Everything validation and the launches depend on, or None (not memoisable: then the
    call is built on its own, without graph replay)."""
    sig = []
    for x in (a, b, bias, residual):
        if x is None:
            sig.append(None)
        elif isinstance(x, mx.array):
            sig.append((x.shape, x.dtype))
        else:
            return None
    try:
        return (op, *sig, activation, _tiles_key(tiles))
    except TypeError:
        return None


def _build_call(op, a, b, bias, activation, residual, tiles, replay: bool = False):
    """Validate one call and build fn(a, b, bias, residual) -> output for its signature
    (`replay`: a memoised signature, whose launches cuda / metal record once and replay)."""
    layout = _LAYOUTS[op]
    check_array(a, "a", min_ndim=2)
    check_array(b, "b" if op != "gemm_av" else "v", min_ndim=2)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {[k for k in ACTIVATIONS if k]}, got {activation!r}")
    m, n, k = _dims(layout, a.shape, b.shape)
    dtype = _promote(a.dtype, b.dtype)
    try:
        batch_shape = tuple(mx.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2])))
    except ValueError:
        raise ValueError(
            f"{op}: batch dimensions of a {tuple(a.shape)} and b {tuple(b.shape)} do not broadcast"
        ) from None
    out_shape = (*batch_shape, m, n)
    if bias is not None:
        check_array(bias, "bias", ndim=1)
        if bias.shape[0] != n:
            raise ValueError(f"bias must have shape ({n},) (one per output column), got {tuple(bias.shape)}")
    if residual is not None:
        check_array(residual, "residual")
        try:
            mx.broadcast_shapes(tuple(residual.shape), out_shape)
            if len(residual.shape) > len(out_shape) or mx.broadcast_shapes(tuple(residual.shape), out_shape) != out_shape:
                raise ValueError
        except ValueError:
            raise ValueError(f"residual of shape {tuple(residual.shape)} does not broadcast to the output {out_shape}") from None
    backend = current_backend()
    # a bad tiles= fails before anything runs (with the limits of the backend that will run it)
    tiles_mod.resolve_gemm_config(op, m, n, k, dtype, tiles, backend=None if backend == "reference" else backend)

    has_bias, has_res = bias is not None, residual is not None

    def prepare(a, b, residual):
        a, b = a.astype(dtype), b.astype(dtype)
        if residual is not None:
            residual = mx.broadcast_to(residual, out_shape)
        return a, b, residual

    if backend == "reference" or 0 in out_shape or k == 0:
        def reference(a, b, bias, residual):
            a, b, residual = prepare(a, b, residual)
            return gemm_reference(op, a, b, bias, activation, residual).astype(dtype)

        return reference
    act = ACTIVATIONS[activation]

    @mx.custom_function
    def f(a, b, bias, residual):
        return _kernel_gemm(layout, a, b, bias if has_bias else None, act, residual if has_res else None, tiles,
                            backend)

    @f.vjp
    def f_vjp(primals, cotangent, output):
        a, b, bias_p, residual_p = primals
        dz = cotangent
        if act:
            pre = _kernel_gemm(layout, a, b, bias_p if has_bias else None, 0, None, tiles, backend)
            dz = (dz.astype(mx.float32) * _act_grad(pre, activation)).astype(dtype)
        # A batched A times a 2-D B (a layer's weight): B's gradient sums over the batch, so
        # it is one GEMM over all the batch's rows (not a product per batch, then a sum)
        fold = b.ndim == 2 and a.ndim > 2
        if op == "gemm_av":  # C = A V: dA = dC V^T, dV = A^T dC
            da = _run("gemm_a_bt", dz, b)
            db = (_run("gemm_at_b", a.reshape(-1, a.shape[-1]), dz.reshape(-1, dz.shape[-1])) if fold
                  else _run("gemm_at_b", a, dz))
        elif op == "gemm_at_b":  # Z = A^T B: dA = B dZ^T, dB = A dZ
            da, db = _run("gemm_a_bt", b, dz), _run("gemm_av", a, dz)
        else:  # C = A B^T: dA = dC B, dB = dC^T A
            da = _run("gemm_av", dz, b)
            db = (_run("gemm_at_b", dz.reshape(-1, dz.shape[-1]), a.reshape(-1, a.shape[-1])) if fold
                  else _run("gemm_at_b", dz, a))
        dbias = dz.reshape(-1, n).astype(mx.float32).sum(axis=0).astype(dtype) if has_bias else mx.zeros_like(bias_p)
        dres = cotangent if has_res else mx.zeros_like(residual_p)
        return _sum_to_shape(da, tuple(a.shape)), _sum_to_shape(db, tuple(b.shape)), dbias, dres

    if replay:
        f = replayable(f, backend, bare=lambda a, b, bias, residual: _kernel_gemm(
            layout, a, b, bias if has_bias else None, act, residual if has_res else None, tiles, backend))

    absent = placeholder(dtype)
    if not has_res and a.dtype == dtype and b.dtype == dtype and \
            (not has_bias or (bias.__class__ is _ARRAY and bias.dtype == dtype)):
        # the memo key holds the operands' dtypes: nothing to cast or broadcast per call
        if has_bias:
            return lambda a, b, bias, residual: f(a, b, bias, absent)
        return lambda a, b, bias, residual: f(a, b, absent, absent)

    def call(a, b, bias, residual):
        a, b, residual = prepare(a, b, residual)
        return f(a, b, bias.astype(dtype) if has_bias else absent, residual if has_res else absent)

    return call


def gemm_av(a: mx.array, v: mx.array, *, tiles: Any = None) -> mx.array:
    """C = A · V.  a (..., m, n), v (..., n, k) -> (..., m, k)."""
    if tiles is None and a.__class__ is _ARRAY and v.__class__ is _ARRAY:  # a memoised plain product
        fn = _CALLS.get(("gemm_av", a.shape, a.dtype, v.shape, v.dtype))
        if fn is not None:
            return fn(a, v, None, None)
    return _run("gemm_av", a, v, tiles=tiles)


def gemm_at_b(a: mx.array, b: mx.array, *, tiles: Any = None) -> mx.array:
    """Z = Aᵀ · B.  a (..., m, n), b (..., m, k) -> (..., n, k)."""
    if tiles is None and a.__class__ is _ARRAY and b.__class__ is _ARRAY:  # a memoised plain product
        fn = _CALLS.get(("gemm_at_b", a.shape, a.dtype, b.shape, b.dtype))
        if fn is not None:
            return fn(a, b, None, None)
    return _run("gemm_at_b", a, b, tiles=tiles)


def gemm_a_bt(a: mx.array, b: mx.array, *, tiles: Any = None) -> mx.array:
    """A · Bᵀ.  a (..., m, k), b (..., n, k) -> (..., m, n) (the nn.Linear layout)."""
    if tiles is None and a.__class__ is _ARRAY and b.__class__ is _ARRAY:  # a memoised plain product
        fn = _CALLS.get(("gemm_a_bt", a.shape, a.dtype, b.shape, b.dtype))
        if fn is not None:
            return fn(a, b, None, None)
    return _run("gemm_a_bt", a, b, tiles=tiles)


def linear(
    x: mx.array,
    weight: mx.array,
    bias: mx.array | None = None,
    activation: str | None = None,
    residual: mx.array | None = None,
    *,
    tiles: Any = None,
) -> mx.array:
    """``activation(x · weightᵀ + bias) + residual`` in one kernel (fused epilogue).

    Args:
        x: (..., in_features).
        weight: (out_features, in_features).
        bias: (out_features,) or None.
        activation: None, "relu", "gelu", "gelu_approx" or "silu".
        residual: broadcastable to (..., out_features), or None.
    """
    key = None
    if residual is None and tiles is None and x.__class__ is _ARRAY and weight.__class__ is _ARRAY \
            and (bias is None or bias.__class__ is _ARRAY) and x.ndim >= 2:
        # a memoised layer call: its key holds every shape and dtype the checks below read
        key = ("linear", x.shape, x.dtype, weight.shape, weight.dtype,
               None if bias is None else (bias.shape, bias.dtype), activation)
        fn = _CALLS.get(key)
        if fn is not None:
            return fn(x, weight, bias, None)
    check_array(x, "x", min_ndim=1)
    check_array(weight, "weight", ndim=2)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: x (..., in_features) of shape {tuple(x.shape)} has in_features={x.shape[-1]} "
            f"but weight (out_features, in_features) has shape {tuple(weight.shape)}"
        )
    out_shape = (*x.shape[:-1], weight.shape[0])
    if residual is not None:
        check_array(residual, "residual")
        try:
            residual = mx.broadcast_to(residual, out_shape)
        except ValueError:
            raise ValueError(
                f"linear: residual of shape {tuple(residual.shape)} does not broadcast to the output {out_shape}"
            ) from None
    if x.ndim >= 2:
        # x as it is: its leading axes fold into M inside the op (one GEMM over all rows, no
        # reshape nodes), or run batched where they cannot (more than 2^31 - 1 rows)
        fn = _memoised("gemm_a_bt", x, weight, bias, activation, residual, tiles)
        if key is not None:
            _CALLS.put(key, fn)
        return fn(x, weight, bias, residual)
    y = _run("gemm_a_bt", x.reshape(1, x.shape[-1]), weight, bias, activation,
             None if residual is None else residual.reshape(1, weight.shape[0]), tiles)
    return y.reshape(out_shape)
