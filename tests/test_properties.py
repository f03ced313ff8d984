"""Property-based tests (Hypothesis): every op family on the selected backend (default: the
emulator) against float64 NumPy references, over random shapes, dtypes, tile configs and
options.

Profiles (tests/conftest_hypothesis.py): ``ci`` is the default (a few derandomized
examples per family); ``--hypothesis-profile=thorough`` runs >= 500 examples per family.
Template parameters (tile sizes, head dims, DH) are drawn from small sets so that the
number of distinct kernels the emulator compiles stays bounded; free dimensions (rows,
M/N/K, sequence lengths, batch) are drawn from ranges that cross the tile and chunk
boundaries.
"""

from __future__ import annotations

import math

import conftest_hypothesis  # noqa: F401  (registers and loads the profiles)
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import assume, given, note
from hypothesis import strategies as st

import xlstm_kernels as xk
from xlstm_kernels.ops import attention as att_mod
from xlstm_kernels.ops import mlstm as mlstm_mod
from xlstm_kernels.tiles import TileConfigError

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DT = st.sampled_from(sorted(DTYPES))
TOL = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 2e-2}
TOL_RECURRENT = {mx.float32: 1e-4, mx.float16: 2e-2, mx.bfloat16: 3e-2}

_erf = np.vectorize(math.erf, otypes=[np.float64])


def data(seed: int, shape, dtype, scale=1.0, shift=0.0) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * scale + shift).astype(np.float32)).astype(dtype)


def f64(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32)).astype(np.float64)


def check(out: mx.array, ref: np.ndarray, tol: float, dtype=None, what: str = "") -> None:
    """Shape, dtype, finiteness and max|out - ref| / max(max|ref|, 1e-2) <= tol."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if dtype is not None:
        assert out.dtype == dtype, f"{what}: dtype {out.dtype} != {dtype}"
    if ref.size == 0:
        return
    got = f64(out)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output"
    err = float(np.max(np.abs(got - ref))) / max(float(np.max(np.abs(ref))), 1e-2)
    note(f"{what}: relative error {err:.3e} (tol {tol:.0e})")
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


# ---------------------------------------------------------------------------------------
# GEMM family
# ---------------------------------------------------------------------------------------


def _divisors(n: int, options=(1, 2, 4)) -> list[int]:
    return [d for d in options if n % d == 0]


@st.composite
def gemm_tiles(draw):
    kind = draw(st.sampled_from(["auto", "scalar", "simd", "gemv", "string"]))
    if kind == "auto":
        return None
    if kind == "string":
        return draw(st.sampled_from(["16x16", "32x16x8", "8x32x16", "16x8"]))
    if kind == "gemv":
        return {"path": "gemv", "gemv_threads": draw(st.sampled_from([32, 64, 128]))}
    if kind == "scalar":
        tm, tn = draw(st.sampled_from([8, 16, 32])), draw(st.sampled_from([8, 16, 32]))
        return {
            "path": "scalar", "tm": tm, "tn": tn, "tk": draw(st.sampled_from([4, 8, 16])),
            "rm": draw(st.sampled_from(_divisors(tm))), "rn": draw(st.sampled_from(_divisors(tn))),
            "pad": draw(st.sampled_from([0, 1, 4])), "double_buffer": draw(st.booleans()),
            "vec4": draw(st.booleans()),
        }
    bm, bn = draw(st.sampled_from([16, 32, 64])), draw(st.sampled_from([16, 32, 64]))
    return {
        "path": "simd", "bm": bm, "bn": bn, "bk": draw(st.sampled_from([8, 16, 32])),
        "wm": draw(st.sampled_from([w for w in (1, 2) if bm % (8 * w) == 0])),
        "wn": draw(st.sampled_from([w for w in (1, 2) if bn % (8 * w) == 0])),
        "split_k": draw(st.sampled_from([1, 1, 2, 3])),
    }


def _np_act(x, act):
    if act in (None, "none"):
        return x
    if act == "relu":
        return np.maximum(x, 0.0)
    if act == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if act == "gelu_approx":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return x / (1.0 + np.exp(-x))


@given(
    op=st.sampled_from(["gemm_av", "gemm_at_b", "gemm_a_bt"]),
    dtypes=st.tuples(DT, DT),
    m=st.integers(1, 40), n=st.integers(1, 40), k=st.integers(1, 48),
    leads=st.sampled_from([((), ()), ((3,), ()), ((), (2,)), ((2, 1), (1, 3)), ((2,), (2,))]),
    tiles=gemm_tiles(),
    seed=st.integers(0, 2**16),
)
def test_gemm_property(kernel_backend, op, dtypes, m, n, k, leads, tiles, seed):
    da, db = DTYPES[dtypes[0]], DTYPES[dtypes[1]]
    lead_a, lead_b = leads
    sa = (*lead_a, k, m) if op == "gemm_at_b" else (*lead_a, m, k)
    sb = (*lead_b, n, k) if op == "gemm_a_bt" else (*lead_b, k, n)
    a, b = data(seed, sa, da), data(seed + 1, sb, db)
    fn = getattr(xk, op)
    try:
        out = fn(a, b, tiles=tiles)
        mx.eval(out)
    except TileConfigError:
        assume(False)  # e.g. vec4 with a tile not a multiple of 4: rejected by design
    x, y = f64(a), f64(b)
    if op == "gemm_at_b":
        x = np.swapaxes(x, -1, -2)
    if op == "gemm_a_bt":
        y = np.swapaxes(y, -1, -2)
    out_dtype = da if da == db else mx.float32
    check(out, np.matmul(x, y), TOL[out_dtype] * (2 if out_dtype == mx.bfloat16 and k > 32 else 1), out_dtype, op)


@given(
    dtype=DT,
    lead=st.sampled_from([(), (1,), (5,), (2, 3)]),
    in_f=st.integers(1, 40), out_f=st.integers(1, 40),
    has_bias=st.booleans(),
    act=st.sampled_from([None, "relu", "gelu", "gelu_approx", "silu"]),
    residual=st.sampled_from([None, "row", "full"]),
    tiles=gemm_tiles(),
    seed=st.integers(0, 2**16),
)
def test_linear_property(kernel_backend, dtype, lead, in_f, out_f, has_bias, act, residual, tiles, seed):
    dt = DTYPES[dtype]
    x, w = data(seed, (*lead, in_f), dt), data(seed + 1, (out_f, in_f), dt, scale=in_f**-0.5)
    bias = data(seed + 2, (out_f,), dt) if has_bias else None
    res = None if residual is None else data(seed + 3, (out_f,) if residual == "row" else (*lead, out_f), dt)
    try:
        out = xk.linear(x, w, bias, act, res, tiles=tiles)
        mx.eval(out)
    except TileConfigError:
        assume(False)
    ref = f64(x) @ f64(w).T
    if bias is not None:
        ref = ref + f64(bias)
    ref = _np_act(ref, act)
    if res is not None:
        ref = ref + f64(res)
    check(out, ref, TOL[dt] * (1 if dt == mx.float32 else 2), dt, "linear")


# ---------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------


@given(
    kind=st.sampled_from(["rms", "ln", "mhln"]),
    x_dtype=DT, w_dtype=DT,
    lead=st.sampled_from([(1,), (3,), (2, 5), (17,), (0,)]),
    head_dim=st.sampled_from([1, 3, 8, 32, 33, 100, 128, 129, 1000, 4096, 4100]),
    num_heads=st.sampled_from([1, 2, 3]),
    has_w=st.booleans(), has_b=st.booleans(),
    eps=st.sampled_from([1e-5, 1e-6, 0.1, 0.0]),
    shift=st.sampled_from([0.0, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_norm_property(kernel_backend, kind, x_dtype, w_dtype, lead, head_dim, num_heads, has_w, has_b, eps, shift, seed):
    nh = num_heads if kind == "mhln" else 1
    d = head_dim * nh
    assume(d <= 5000)
    xd, wd = DTYPES[x_dtype], DTYPES[w_dtype]
    x = data(seed, (*lead, d), xd, shift=shift)
    w = data(seed + 1, (d,), wd) if has_w else None
    b = data(seed + 2, (d,), wd) if has_b and kind != "rms" else None
    if eps == 0.0 and head_dim == 1:
        eps = 1e-6  # a one-element LayerNorm row has zero variance
    if kind == "rms":
        out = xk.rms_norm(x, w, eps)
    elif kind == "ln":
        out = xk.layer_norm(x, w, b, eps)
    else:
        out = xk.multihead_layer_norm(x, w, b, nh, eps)
    xf = f64(x).reshape(*lead, nh, head_dim)
    if kind == "rms":
        normed = xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + eps)
    else:
        xc = xf - xf.mean(-1, keepdims=True)
        normed = xc / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps)
    ref = normed.reshape(*lead, d)
    if w is not None:
        ref = ref * f64(w)
    if b is not None:
        ref = ref + f64(b)
    out_dtype = xd if not (has_w or b is not None) or xd == wd else mx.float32
    tol = TOL[out_dtype] * (2 if out_dtype != xd else 1)  # x rounded to out_dtype before the weight
    check(out, ref, max(tol, 1e-2 if xd != mx.float32 and out_dtype == mx.float32 else 0.0), out_dtype, kind)


# ---------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------


@given(
    dtype=DT,
    lead=st.sampled_from([(1,), (2, 3), (3,), (2, 1, 2)]),
    seq=st.integers(1, 20),
    d=st.sampled_from([2, 4, 6, 8, 16, 24, 64, 96]),
    dims_frac=st.sampled_from([1.0, 0.5, 0.25]),
    traditional=st.booleans(),
    base=st.sampled_from([10000.0, 500.0, 1e6, None]),
    scale=st.sampled_from([1.0, 0.5, 2.0]),
    offset=st.one_of(st.integers(0, 2000), st.just("per_batch")),
    seed=st.integers(0, 2**16),
)
def test_rope_property(kernel_backend, dtype, lead, seq, d, dims_frac, traditional, base, scale, offset, seed):
    dt = DTYPES[dtype]
    dims = max(2, int(d * dims_frac) // 2 * 2)
    x = data(seed, (*lead, seq, d), dt)
    half = dims // 2
    freqs = None
    if base is None:
        freqs = mx.array((np.random.default_rng(seed).uniform(1.0, 1000.0, half)).astype(np.float32))
    if offset == "per_batch":
        assume(x.ndim >= 3)
        offset = mx.array(np.random.default_rng(seed).integers(0, 500, x.shape[0]).astype(np.int32))
    out = xk.rope(x, dims, traditional=traditional, base=base if base is not None else None,
                  scale=scale, offset=offset, freqs=freqs)
    # the documented float32 angle: inv_freq = 1 / float32(freqs), theta = float32(float32(scale * pos) * inv_freq)
    fr = np.asarray(freqs) if freqs is not None else np.power(np.float64(base), np.arange(half) / half).astype(np.float32)
    inv = (np.float32(1.0) / fr.astype(np.float32)).astype(np.float32)
    pos = np.arange(seq, dtype=np.int64)
    if isinstance(offset, mx.array):
        pos = np.asarray(offset).astype(np.int64).reshape((-1,) + (1,) * (x.ndim - 2)) + pos
    else:
        pos = pos + offset
    theta = (np.float32(scale) * pos.astype(np.float32))[..., None].astype(np.float32) * inv
    theta = theta.astype(np.float32).astype(np.float64)
    c, s = np.cos(theta), np.sin(theta)
    xf = f64(x)
    xr = xf[..., :dims]
    if traditional:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rot = np.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).reshape(*xr.shape)
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
        rot = np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], -1)
    ref = np.concatenate([rot, xf[..., dims:]], -1)
    check(out, ref, TOL[dt] * (1 if dt == mx.float32 else 1), dt, "rope")


# ---------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------


def _np_attention(q, k, v, scale, mask_kind, marr):
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    k = np.repeat(k, hq // hkv, axis=1)
    v = np.repeat(v, hq // hkv, axis=1)
    s = (q @ k.swapaxes(-1, -2)) * scale
    lowest = float(np.finfo(np.float32).min)
    if mask_kind == "causal":
        vis = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq)
        s = np.where(vis, s, lowest)
    elif mask_kind == "bool":
        s = np.where(marr, s, lowest)
    elif mask_kind == "additive":
        s = s + marr
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(-1, keepdims=True)) @ v


@given(
    dtype=DT,
    b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]),
    lq=st.integers(1, 20), lk=st.integers(1, 40),
    dims=st.sampled_from([(8, 8), (16, 16), (20, 20), (64, 64), (16, 8), (32, 48)]),
    mask=st.sampled_from(["none", "causal", "bool", "additive"]),
    mask_shape=st.sampled_from(["full", "row", "key"]),
    path=st.sampled_from(["auto", "prefill", "split"]),
    blocks=st.sampled_from([(None, None), (8, 8), (16, 32), (32, 16)]),
    block_size=st.sampled_from([None, 8, 16]),
    seed=st.integers(0, 2**16),
)
def test_attention_property(kernel_backend, dtype, b, hkv, group, lq, lk, dims, mask, mask_shape, path, blocks,
                            block_size, seed):
    dt = DTYPES[dtype]
    d, dv = dims
    hq = hkv * group
    q, k, v = data(seed, (b, hq, lq, d), dt), data(seed + 1, (b, hkv, lk, d), dt), data(seed + 2, (b, hkv, lk, dv), dt)
    scale = d**-0.5
    rng = np.random.default_rng(seed)
    mshape = {"full": (b, hq, lq, lk), "row": (lq, lk), "key": (1, 1, 1, lk)}[mask_shape]
    marr = None
    if mask == "causal":
        m_arg = "causal"
    elif mask == "bool":
        marr = rng.random(mshape) < 0.8
        m_arg = mx.array(marr)
    elif mask == "additive":
        marr = rng.standard_normal(mshape).astype(np.float32)
        m_arg = mx.array(marr).astype(dt)
        marr = f64(m_arg)
    else:
        m_arg = None
    if path == "auto":
        out = xk.scaled_dot_product_attention(q, k, v, scale=scale, mask=m_arg)
    elif path == "prefill":
        out = att_mod.attention_prefill(q, k, v, scale=scale, mask=m_arg, block_q=blocks[0], block_k=blocks[1])
    else:
        out = att_mod.attention_decode_split_kv(q, k, v, scale=scale, mask=m_arg, block_size=block_size)
    ref = _np_attention(f64(q), f64(k), f64(v), scale, mask, None if marr is None else np.broadcast_to(marr, (b, hq, lq, lk)))
    check(out, ref, TOL[dt] * (2 if dt == mx.float32 else 1), dt, f"attention {path}")


# ---------------------------------------------------------------------------------------
# mLSTM
# ---------------------------------------------------------------------------------------


def _mlstm_inputs(seed, b, nh, s, dk, dv, dt, with_state, gate_scale):
    q, k, v = data(seed, (b, nh, s, dk), dt), data(seed + 1, (b, nh, s, dk), dt), data(seed + 2, (b, nh, s, dv), dt)
    ig = data(seed + 3, (b, nh, s), mx.float32, scale=gate_scale)
    fg = data(seed + 4, (b, nh, s), mx.float32, scale=gate_scale, shift=2.0)
    state = None
    if with_state:
        state = (data(seed + 5, (b, nh, dk, dv), mx.float32, 0.3), data(seed + 6, (b, nh, dk), mx.float32, 0.3),
                 data(seed + 7, (b, nh), mx.float32, 0.5))
    return q, k, v, ig, fg, state


def _f64_mx(x):
    return None if x is None else mx.array(f64(x))  # float64 mx array (CPU)


@given(
    dtype=DT, b=st.integers(1, 2), nh=st.integers(1, 2), s=st.integers(1, 40),
    heads=st.sampled_from([(4, 4), (8, 8), (16, 8), (24, 16), (8, 32)]),
    chunk=st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
    with_state=st.booleans(), gate_scale=st.sampled_from([1.0, 4.0]),
    eps=st.sampled_from([1e-6, 1e-3]),
    seed=st.integers(0, 2**16),
)
def test_mlstm_property(kernel_backend, dtype, b, nh, s, heads, chunk, with_state, gate_scale, eps, seed):
    dt = DTYPES[dtype]
    dk, dv = heads
    q, k, v, ig, fg, state = _mlstm_inputs(seed, b, nh, s, dk, dv, dt, with_state, gate_scale)
    h, (c, n, m) = xk.mlstm(q, k, v, ig, fg, state=state, chunk_size=chunk, eps=eps, return_state=True)
    mx.eval(h, c, n, m)
    with mx.stream(mx.cpu):
        st64 = None if state is None else tuple(_f64_mx(t) for t in state)
        h_ref, (c_ref, n_ref, m_ref) = mlstm_mod.mlstm_reference(
            *(_f64_mx(t) for t in (q, k, v, ig, fg)), state=st64, eps=eps, return_state=True)
        refs = [np.asarray(t) for t in (h_ref, c_ref, n_ref, m_ref)]
    tol = TOL_RECURRENT[dt]
    check(h, refs[0], tol, dt, "mlstm h")
    for got, ref, name in ((c, refs[1], "C"), (n, refs[2], "n"), (m, refs[3], "m")):
        check(got, ref, TOL_RECURRENT[mx.float32], mx.float32, f"mlstm state {name}")


@given(
    dtype=DT, b=st.integers(1, 3), nh=st.integers(1, 3),
    heads=st.sampled_from([(4, 4), (8, 8), (16, 8), (24, 40), (64, 64)]),
    with_state=st.booleans(), gate_scale=st.sampled_from([1.0, 4.0]),
    seed=st.integers(0, 2**16),
)
def test_mlstm_step_property(kernel_backend, dtype, b, nh, heads, with_state, gate_scale, seed):
    dt = DTYPES[dtype]
    dk, dv = heads
    q, k, v, ig, fg, state = _mlstm_inputs(seed, b, nh, 1, dk, dv, dt, with_state, gate_scale)
    q, k, v, ig, fg = q[:, :, 0], k[:, :, 0], v[:, :, 0], ig[:, :, 0], fg[:, :, 0]
    h, (c, n, m) = xk.mlstm_step(q, k, v, ig, fg, state)
    mx.eval(h, c, n, m)
    with mx.stream(mx.cpu):
        st64 = None if state is None else tuple(_f64_mx(t) for t in state)
        h_ref, (c_ref, n_ref, m_ref) = mlstm_mod.mlstm_step_reference(*(_f64_mx(t) for t in (q, k, v, ig, fg)), st64)
        refs = [np.asarray(t) for t in (h_ref, c_ref, n_ref, m_ref)]
    check(h, refs[0], TOL_RECURRENT[dt], dt, "mlstm_step h")
    for got, ref, name in ((c, refs[1], "C"), (n, refs[2], "n"), (m, refs[3], "m")):
        check(got, ref, TOL_RECURRENT[mx.float32], mx.float32, f"mlstm_step state {name}")


# ---------------------------------------------------------------------------------------
# sLSTM
# ---------------------------------------------------------------------------------------


def _np_logsigmoid(x):
    return np.minimum(x, 0.0) - np.log1p(np.exp(-np.abs(x)))


def _np_slstm(wx, r, b, state):
    """float64 sLSTM (module docstring equations); wx (B,S,4,NH,DH), r (NH,DH,4,DH), b (4,NH,DH)."""
    bsz, s, _, nh, dh = wx.shape
    y, c, n, m = (np.array(t, dtype=np.float64) for t in state)
    ys = []
    for t in range(s):
        raw = wx[:, t] + np.einsum("bhi,higj->bghj", y, r) + b
        ir, fr, zr, orr = raw[:, 0], raw[:, 1], raw[:, 2], raw[:, 3]
        empty = n == 0
        lfm = m + _np_logsigmoid(fr)
        mt = np.where(empty, ir, np.maximum(ir, lfm))
        i = np.exp(ir - mt)
        f = np.where(empty, 0.0, np.exp(np.where(empty, 0.0, lfm - mt)))
        o = 1.0 / (1.0 + np.exp(-orr))
        c = f * c + i * np.tanh(zr)
        n = f * n + i
        m = mt
        y = o * c / n
        ys.append(y)
    return np.stack(ys, 1) if ys else np.zeros((bsz, 0, nh, dh)), (y, c, n, m)


def _slstm_inputs(seed, bsz, s, nh, dh, dt, with_state):
    wx = data(seed, (bsz, s, 4, nh, dh), dt)
    r = data(seed + 1, (nh, dh, 4, dh), dt, scale=dh**-0.5)
    b = data(seed + 2, (4, nh, dh), mx.float32, scale=0.5)
    if with_state:
        st_ = (data(seed + 3, (bsz, nh, dh), mx.float32, 0.5), data(seed + 4, (bsz, nh, dh), mx.float32, 0.5),
               mx.abs(data(seed + 5, (bsz, nh, dh), mx.float32)) + 0.5, data(seed + 6, (bsz, nh, dh), mx.float32, 0.5))
    else:
        st_ = None
    return wx, r, b, st_


@st.composite
def slstm_config(draw, dh):
    kind = draw(st.sampled_from(["auto", "config"]))
    if kind == "auto":
        return None
    ks = [k for k in (1, 2, 4, 8, 16, 32) if dh * k <= 1024]
    cfg = {"threads_per_unit": draw(st.sampled_from(ks))}
    if draw(st.booleans()):
        cfg["r_in_registers"] = draw(st.booleans())
    return cfg


@given(data_=st.data(), dtype=DT, bsz=st.integers(1, 3), s=st.integers(1, 20), nh=st.integers(1, 2),
       dh=st.sampled_from([1, 2, 4, 8, 16, 32, 64]), with_state=st.booleans(), seed=st.integers(0, 2**16))
def test_slstm_property(kernel_backend, data_, dtype, bsz, s, nh, dh, with_state, seed):
    dt = DTYPES[dtype]
    config = data_.draw(slstm_config(dh))
    wx, r, b, state = _slstm_inputs(seed, bsz, s, nh, dh, dt, with_state)
    y, st_out = xk.slstm(wx, r, b, state=state, return_state=True, config=config)
    mx.eval(y, *st_out)
    st0 = [np.zeros((bsz, nh, dh))] * 4 if state is None else [f64(t) for t in state]
    y_ref, st_ref = _np_slstm(f64(wx), f64(r.astype(dt)), f64(b), st0)
    check(y, y_ref, TOL_RECURRENT[dt], dt, "slstm y")
    for got, ref, name in zip(st_out, st_ref, "ycnm"):
        check(got, ref, TOL_RECURRENT[mx.float32] if dt == mx.float32 else TOL_RECURRENT[dt], mx.float32,
              f"slstm state {name}")


@given(data_=st.data(), dtype=DT, bsz=st.integers(1, 3), nh=st.integers(1, 3),
       dh=st.sampled_from([1, 4, 8, 16, 32, 128]), with_state=st.booleans(), seed=st.integers(0, 2**16))
def test_slstm_step_property(kernel_backend, data_, dtype, bsz, nh, dh, with_state, seed):
    dt = DTYPES[dtype]
    config = data_.draw(slstm_config(dh))
    wx, r, b, state = _slstm_inputs(seed, bsz, 1, nh, dh, dt, with_state)
    if state is None:
        z = mx.zeros((bsz, nh, dh))
        state = (z, z, z, z)
    y, st_out = xk.slstm_step(wx[:, 0], r, b, state, config=config)
    mx.eval(y, *st_out)
    y_ref, st_ref = _np_slstm(f64(wx), f64(r.astype(dt)), f64(b), [f64(t) for t in state])
    check(y, y_ref[:, 0], TOL_RECURRENT[dt], dt, "slstm_step y")
    for got, ref, name in zip(st_out, st_ref, "ycnm"):
        check(got, ref, TOL_RECURRENT[mx.float32] if dt == mx.float32 else TOL_RECURRENT[dt], mx.float32,
              f"slstm_step state {name}")


def test_profiles_are_registered():
    from hypothesis import settings

    assert settings.get_profile("ci").max_examples >= 1 and settings.get_profile("ci").deadline is None
    assert settings.get_profile("thorough").max_examples >= 500
    assert settings.get_current_profile_name() in ("ci", "thorough") or settings.get_current_profile_name().startswith(
        ("ci-", "thorough-")
    ) or pytest.skip(f"profile {settings.get_current_profile_name()!r} chosen on the command line")
