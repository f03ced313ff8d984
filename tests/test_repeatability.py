"""Run-to-run bit identity: every kernel path, run twice on the same inputs, gives the same bits.

On a GPU (``--backend cuda`` / ``metal``) this is the check that no kernel depends on
scheduling: a race, an uninitialised threadgroup read or an order-dependent atomic
reduction shows up as differing bits between runs. The emulator's own version of the
check (``check_schedules``: sequential, reverse and random simdgroup orders) runs in
tests/emulate; here the same ops go through whatever backend pytest selected.

Each case is evaluated REPEATS times, each time in a fresh graph (mx.eval per run), and
every run must equal the first bit for bit (NaN-aware). Shapes span several tiles and
are odd where the kernel has edge handling.
"""

from __future__ import annotations

import zlib

import mlx.core as mx
import numpy as np
import pytest

import xlstm_kernels as xk

REPEATS = 3


def _rand(rng: np.random.Generator, shape, dtype=mx.float32, scale: float = 1.0) -> mx.array:
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _bits(a: mx.array) -> np.ndarray:
    a = a.astype(mx.float32) if a.dtype == mx.bfloat16 else a
    return np.array(a).view(np.uint8)


def _flatten(out) -> list[mx.array]:
    if isinstance(out, mx.array):
        return [out]
    res = []
    for o in out:
        res += _flatten(o)
    return res


def _gemm_cases(rng):
    a = _rand(rng, (67, 45), mx.float16)
    b = _rand(rng, (45, 70), mx.float16)
    at = _rand(rng, (45, 67), mx.bfloat16)
    bt = _rand(rng, (45, 70), mx.bfloat16)
    x32 = _rand(rng, (33, 96))
    w32 = _rand(rng, (40, 96))
    v1 = _rand(rng, (1, 300))
    w1 = _rand(rng, (300, 75))
    sk_a = _rand(rng, (16, 1024))
    sk_b = _rand(rng, (1024, 24))
    return {
        "gemm_av simd f16": lambda: xk.gemm_av(a, b, tiles={"path": "simd", "bm": 32, "bn": 32, "bk": 16, "wm": 2, "wn": 2}),
        "gemm_av scalar f16": lambda: xk.gemm_av(a, b, tiles="32x32"),
        "gemm_at_b simd bf16": lambda: xk.gemm_at_b(at, bt, tiles={"path": "simd"}),
        "gemm_a_bt f32": lambda: xk.gemm_a_bt(x32, w32),
        "gemv": lambda: xk.gemm_av(v1, w1),
        "split-k": lambda: xk.gemm_av(sk_a, sk_b, tiles={"path": "simd", "split_k": 4}),
    }


def _norm_cases(rng):
    x = _rand(rng, (37, 129), mx.float16)
    w = _rand(rng, (129,), mx.float16)
    b = _rand(rng, (129,), mx.float16)
    xl = _rand(rng, (3, 4100))
    wl = _rand(rng, (4100,))
    xs = _rand(rng, (41, 96))
    ws = _rand(rng, (96,))
    g = _rand(rng, (37, 129), mx.float16)

    def rms_vjp():
        return mx.vjp(lambda x_, w_: xk.rms_norm(x_, w_, 1e-5), [x, w], [g])[1]

    def ln_vjp():
        return mx.vjp(lambda x_, w_, b_: xk.layer_norm(x_, w_, b_, 1e-5), [x, w, b], [g])[1]

    return {
        "rms_norm": lambda: xk.rms_norm(x, w, 1e-5),
        "rms_norm one-simd": lambda: xk.rms_norm(xs, ws, 1e-5),
        "rms_norm looped": lambda: xk.rms_norm(xl, wl, 1e-5),
        "layer_norm": lambda: xk.layer_norm(x, w, b, 1e-5),
        "layer_norm looped": lambda: xk.layer_norm(xl, wl, None, 1e-5),
        "multihead_layer_norm": lambda: xk.multihead_layer_norm(xs, ws, None, 4, 1e-5),
        "rms_norm vjp": rms_vjp,
        "layer_norm vjp": ln_vjp,
    }


def _attention_cases(rng):
    q = _rand(rng, (2, 4, 37, 32), mx.float16)
    k = _rand(rng, (2, 2, 45, 32), mx.float16)
    v = _rand(rng, (2, 2, 45, 32), mx.float16)
    qd = _rand(rng, (1, 4, 1, 64))
    kd = _rand(rng, (1, 2, 1100, 64))
    vd = _rand(rng, (1, 2, 1100, 64))
    qs = _rand(rng, (2, 8, 1, 128), mx.bfloat16)  # one-launch decode: 4 rows a kv head, bulk copies
    ks = _rand(rng, (2, 2, 1500, 128), mx.bfloat16)
    vs = _rand(rng, (2, 2, 1500, 128), mx.bfloat16)
    x = _rand(rng, (2, 5, 64))
    nw = _rand(rng, (64,))
    wqkv = _rand(rng, (4 * 16 + 2 * 2 * 16, 64), scale=0.2)
    wl = _rand(rng, (48, 64), scale=0.2)
    xr = _rand(rng, (2, 3, 19, 32), mx.bfloat16)
    return {
        "attention prefill causal": lambda: xk.scaled_dot_product_attention(q, k, v, scale=0.17, mask="causal"),
        "attention split-kv": lambda: xk.scaled_dot_product_attention(qd, kd, vd, scale=0.125,
                                                                      knobs={"split_kv_stream": False}),
        "attention one-launch decode": lambda: xk.scaled_dot_product_attention(qs, ks, vs, scale=0.125,
                                                                               knobs={"split_kv_stream": True}),
        "rope": lambda: xk.rope(xr, 32, traditional=False, base=10000.0, scale=1.0, offset=3),
        "rope traditional": lambda: xk.rope(xr, 16, traditional=True, base=10000.0, scale=1.0, offset=0),
        "fused_norm_linear": lambda: xk.fused_norm_linear(x, nw, wl),
        "fused_norm_qkv_rope": lambda: xk.fused_norm_qkv_rope(x, nw, wqkv, 4, 2),
    }


def _xlstm_cases(rng):
    b, nh, s, dk, dv = 1, 2, 70, 16, 24
    q, k = _rand(rng, (b, nh, s, dk)), _rand(rng, (b, nh, s, dk))
    v = _rand(rng, (b, nh, s, dv))
    ig, fg = _rand(rng, (b, nh, s)), _rand(rng, (b, nh, s)) + 2.0
    st = (_rand(rng, (b, nh, dk, dv), scale=0.1), _rand(rng, (b, nh, dk), scale=0.1), _rand(rng, (b, nh)))
    q1, k1, v1 = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    wx = _rand(rng, (2, 9, 4, 2, 16), scale=0.5)
    r = _rand(rng, (2, 16, 4, 16), scale=0.2)
    bias = _rand(rng, (4, 2, 16), scale=0.1)
    dy = _rand(rng, (2, 9, 2, 16))
    sst = tuple(_rand(rng, (2, 2, 16), scale=0.3) for _ in range(4))

    def slstm_vjp():
        return mx.vjp(lambda wx_, r_: xk.slstm(wx_, r_, bias), [wx, r], [dy])[1]

    return {
        "mlstm chunkwise": lambda: xk.mlstm(q, k, v, ig, fg, chunk_size=32, return_state=True),
        "mlstm step": lambda: xk.mlstm_step(q1, k1, v1, ig[:, :, 0], fg[:, :, 0], st),
        "slstm": lambda: xk.slstm(wx, r, bias, return_state=True),
        "slstm step": lambda: xk.slstm_step(wx[:, 0], r, bias, sst),
        "slstm vjp": slstm_vjp,
    }


_FAMILIES = {"gemm": _gemm_cases, "norm": _norm_cases, "attention": _attention_cases, "xlstm": _xlstm_cases}


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_repeat_runs_are_bit_identical(kernel_backend, family):
    cases = _FAMILIES[family](np.random.default_rng(zlib.crc32(family.encode())))
    for name, fn in cases.items():
        runs = []
        for _ in range(REPEATS):
            outs = _flatten(fn())
            mx.eval(outs)
            runs.append([_bits(o) for o in outs])
        first = runs[0]
        assert first and all(o.size for o in first), f"{name}: no output"
        assert any(np.any(o != 0) for o in first), f"{name}: all-zero output"
        for i, other in enumerate(runs[1:], start=2):
            for j, (a, b) in enumerate(zip(first, other)):
                diff = int(np.count_nonzero(a != b))
                assert diff == 0, f"{name}: output {j} of run {i} differs from run 1 in {diff} bytes"
