"""Fused norm + projection family (metal_src/fused.metal + xlstm_kernels.ops.fused).

fused_norm_linear and fused_norm_qkv_rope against float64 NumPy references (computed
from the inputs as rounded to the tested dtype; error max|out - ref| / max|ref| below
1e-5 for float32, 1e-2 for float16, 2e-2 for bfloat16) and against the unfused
sequence of this package's ops (rms_norm, linear, rope); gradients against the unfused
float32 reference composite; thread-order independence and bounds of every fused
kernel on the emulator; validation messages; the ``single_kernel`` knob (the NVIDIA
presets run the unfused sequence).

Every test runs with XLSTM_FUSED_SINGLE_KERNEL=1 (the autouse fixture below) so the fused
kernels are what is tested on every backend, the cuda one included; the knob tests set
or clear it themselves.
"""

from __future__ import annotations

import zlib

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels import runtime
from xlstm_kernels.ops import fused as fused_mod
from xlstm_kernels.ops.fused import (
    fused_norm_linear,
    fused_norm_linear_reference,
    fused_norm_qkv_rope,
    fused_norm_qkv_rope_reference,
    unfused_norm_linear,
    unfused_norm_qkv_rope,
)

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 2e-2}
EPS = 1e-5
# Explicit multi-simdgroup tiles (2 x 2 simdgroups, 128 threads): 32 x 32 x 16 blocks.
TILES_BASE = {"path": "simd", "bm": 32, "bn": 32, "bk": 16, "wm": 1, "wn": 1, "split_k": 1}
TILES_2X2 = {"path": "simd", "bm": 32, "bn": 32, "bk": 16, "wm": 2, "wn": 2, "split_k": 1}
TILES_WIDE = {"path": "simd", "bm": 16, "bn": 64, "bk": 32, "wm": 1, "wn": 2, "split_k": 1}
TILES_BIG = {"path": "simd", "bm": 64, "bn": 64, "bk": 16, "wm": 2, "wn": 2, "split_k": 1}  # m3_max-style
# the CUDA preset's 16-bit shape (128 rows in 8 simdgroups), bk 16 to fit Apple's 32 KiB
TILES_TALL = {"path": "simd", "bm": 128, "bn": 256, "bk": 16, "wm": 8, "wn": 1, "split_k": 1}
TILES_48 = {"path": "simd", "bm": 48, "bn": 64, "bk": 16, "wm": 2, "wn": 2, "split_k": 1}  # rows not a power of two


KNOB_VAR = "XLSTM_FUSED_SINGLE_KERNEL"


@pytest.fixture(autouse=True)
def _fused_kernel_on(monkeypatch):
    """The fused kernels, whatever the device's presets choose (NVIDIA: the sequence)."""
    monkeypatch.setenv(KNOB_VAR, "1")


# ---------------------------------------------------------------------------------------
# Inputs and float64 references
# ---------------------------------------------------------------------------------------


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def rand(rng, shape, dtype, scale: float = 1.0) -> mx.array:
    x = rng.standard_normal(shape).astype(np.float32) * scale
    x[x == 0] = 0.5
    out = mx.array(x).astype(dtype)
    assert np.all(f64(out) != 0), "an input rounded to zero"
    return out


def f64(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32)).astype(np.float64)


def rel_err(out: mx.array, ref: np.ndarray) -> float:
    o = f64(out)
    assert o.shape == ref.shape, (o.shape, ref.shape)
    assert np.all(np.isfinite(o))
    return float(np.max(np.abs(o - ref)) / np.max(np.abs(ref)))


def np_norm(x, nw, eps=EPS):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * nw


def np_norm_linear(x, nw, w, b=None, eps=EPS):
    y = np_norm(f64(x), f64(nw), eps) @ f64(w).T
    return y + f64(b) if b is not None else y


def np_rope(t, traditional, base=10000.0, scale=1.0, offset=0):
    """t (B, h, L, D) float64; all D features rotated; offset int or (B,) ints."""
    bsz, _, seq, d = t.shape
    half = d // 2
    inv = base ** (-np.arange(half) / half)
    pos = np.arange(seq)[None, :] + np.broadcast_to(np.asarray(offset).reshape(-1, 1), (bsz, 1))  # (B, L)
    theta = (scale * pos)[:, None, :, None] * inv  # (B, 1, L, half)
    c, s = np.cos(theta), np.sin(theta)
    if traditional:
        x0, x1 = t[..., 0::2], t[..., 1::2]
        out = np.empty_like(t)
        out[..., 0::2], out[..., 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
        return out
    x0, x1 = t[..., :half], t[..., half:]
    return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)


def np_qkv_rope(x, nw, w, h, hkv, traditional, base=10000.0, scale=1.0, offset=0, eps=EPS):
    qkv = np_norm(f64(x), f64(nw), eps) @ f64(w).T  # (B, L, N)
    bsz, seq, n = qkv.shape
    heads = h + 2 * hkv
    t = qkv.reshape(bsz, seq, heads, n // heads).transpose(0, 2, 1, 3)
    q, k, v = t[:, :h], t[:, h : h + hkv], t[:, h + hkv :]
    return np_rope(q, traditional, base, scale, offset), np_rope(k, traditional, base, scale, offset), v


def linear_inputs(lead, k, n, dtype, seed, bias=True, x_scale=1.0):
    rng = np.random.default_rng(seed)
    x = rand(rng, (*lead, k), dtype, x_scale)
    nw = rand(rng, (k,), dtype)
    w = rand(rng, (n, k), dtype, 1.0 / np.sqrt(k))
    b = rand(rng, (n,), dtype) if bias else None
    return x, nw, w, b


def qkv_inputs(bsz, seq, e, h, hkv, d, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rand(rng, (bsz, seq, e), dtype)
    nw = rand(rng, (e,), dtype)
    w = rand(rng, ((h + 2 * hkv) * d, e), dtype, 1.0 / np.sqrt(e))
    return x, nw, w


class Spy:
    """Records the fused module's kernel launches (and still runs them)."""

    def __init__(self, monkeypatch):
        self.kernels: list[str] = []
        real = fused_mod.launch

        def spy(spec, **kwargs):
            self.kernels.append(spec.kernel)
            return real(spec, **kwargs)

        monkeypatch.setattr(fused_mod, "launch", spy)


@pytest.fixture
def spy(monkeypatch):
    return Spy(monkeypatch)


def _expected_kernels(backend, name):
    return [] if backend == "reference" else [name]


# ---------------------------------------------------------------------------------------
# fused_norm_linear
# ---------------------------------------------------------------------------------------

# name -> (leading shape, K, N, tiles, expected kernel)
LINEAR_CASES = {
    "odd_33x29x31": ((33,), 29, 31, None, "norm_linear"),
    # the base chips' tile, pinned (a GPU family's default may be larger than the shape)
    "2tiles_70x37x67": ((70,), 37, 67, TILES_BASE, "norm_linear"),  # >= 3 tiles along M and N, 3 along K
    "batched_2x3x40_K300": ((2, 3), 300, 40, None, "norm_linear"),  # 19 K tiles
    "gemv_1x301x37": ((1,), 301, 37, None, "norm_linear_gemv"),  # lanes loop over K ten times
    "2x2sg_70x37x67": ((70,), 37, 67, TILES_2X2, "norm_linear"),
    "wide_19x45x70": ((19,), 45, 70, TILES_WIDE, "norm_linear"),
    "big_67x50x130": ((67,), 50, 130, TILES_BIG, "norm_linear"),
    # TILES_TALL plans 128 x 64 in 8 simdgroups (16 x 64 each): 2 row tiles, 3 column tiles, 3 K steps
    "tall_150x37x130": ((150,), 37, 130, TILES_TALL, "norm_linear"),
}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", LINEAR_CASES)
def test_norm_linear_vs_float64_and_unfused(kernel_backend, spy, case, dtype_name, bias):
    lead, k, n, tiles, kernel = LINEAR_CASES[case]
    dtype = DTYPES[dtype_name]
    x, nw, w, b = linear_inputs(lead, k, n, dtype, seed_of(case, dtype_name, bias), bias)
    y = fused_norm_linear(x, nw, w, b, EPS, tiles=tiles)
    mx.eval(y)
    assert spy.kernels == _expected_kernels(kernel_backend, kernel)  # one launch: no normalised x written
    assert y.shape == (*lead, n) and y.dtype == dtype
    assert rel_err(y, np_norm_linear(x, nw, w, b)) < TOL[dtype_name]
    unfused = unfused_norm_linear(x, nw, w, b, EPS)
    assert rel_err(y, f64(unfused)) < TOL[dtype_name]


def test_norm_linear_spans_tiles():
    """The default-config cases above really span several threadgroups along M, N and K."""
    for case in ("2tiles_70x37x67", "2x2sg_70x37x67"):
        lead, k, n, tiles, _ = LINEAR_CASES[case]
        plan = fused_mod.plan_tiles(lead[0], n, k, mx.float32, tiles)
        assert plan.path == "simd"
        assert -(-lead[0] // plan.bm) >= 2 and -(-n // plan.bn) >= 2 and -(-k // plan.bk) >= 2, plan
    assert fused_mod.plan_tiles(1, 37, 301, mx.float16).path == "gemv"


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_norm_linear_plan_caps_a_simdgroups_accumulators(dtype_name):
    """At most MAX_SUBTILE (1024) outputs a simdgroup: TILES_TALL's 128 x 256 in 8 x 1
    simdgroups (16 x 256 each) narrows to 128 x 64; tiles within the cap plan as given."""
    dtype = DTYPES[dtype_name]
    plan = fused_mod.plan_tiles(150, 130, 37, dtype, TILES_TALL)
    assert (plan.bm, plan.bn, plan.wm, plan.wn, plan.cpt) == (128, 64, 8, 1, 64), plan
    assert (plan.bm // plan.wm) * (plan.bn // plan.wn) <= fused_mod.MAX_SUBTILE == 1024
    for tiles in (TILES_BASE, TILES_2X2, TILES_WIDE, TILES_BIG):
        plan = fused_mod.plan_tiles(150, 130, 37, dtype, tiles)
        assert (plan.bm, plan.bn, plan.wm, plan.wn) == tuple(tiles[f] for f in ("bm", "bn", "wm", "wn")), plan


def test_norm_linear_float16_large_rows(kernel_backend):
    """Raw rows near the float16 limit: the statistics are float, x * rsqrt is never formed in half."""
    x, nw, w, b = linear_inputs((40,), 64, 48, mx.float16, 3, True, x_scale=4e3)
    y = fused_norm_linear(x, nw, w, b)
    assert rel_err(y, np_norm_linear(x, nw, w, b)) < TOL["float16"]


def test_norm_linear_mixed_dtypes_promote(kernel_backend):
    x, nw, w, b = linear_inputs((5, 7), 24, 20, mx.float16, 4)
    b = b.astype(mx.bfloat16)
    y = fused_norm_linear(x, nw.astype(mx.float32), w, b)
    assert y.dtype == mx.float32
    assert rel_err(y, np_norm_linear(x, nw, w, b)) < 1e-5


def test_non_contiguous_inputs(kernel_backend):
    """Strided views (a transposed weight, every other feature of x and of the norm weight)."""
    rng = np.random.default_rng(7)
    x = rand(rng, (34, 2 * 29), mx.float32)[:, ::2]
    nw = rand(rng, (2 * 29,), mx.float32)[1::2]
    w = rand(rng, (29, 37), mx.float32, 0.2).T
    assert rel_err(fused_norm_linear(x, nw, w), np_norm_linear(x, nw, w)) < 1e-5
    xq = rand(rng, (17, 2, 24), mx.float32).transpose(1, 0, 2)  # (B=2, L=17, E=24), not row-contiguous
    wq = rand(rng, (24, 6 * 16), mx.float32, 0.2).T
    outs = fused_norm_qkv_rope(xq, nw[:24], wq, 4, 1, offset=2)
    for out, ref in zip(outs, np_qkv_rope(xq, nw[:24], wq, 4, 1, False, offset=2)):
        assert rel_err(out, ref) < 1e-5


def test_norm_linear_reference_backend_matches_numpy():
    x, nw, w, b = linear_inputs((6,), 33, 17, mx.float32, 5)
    with runtime.use_backend("reference"):
        y = fused_norm_linear(x, nw, w, b)
    assert rel_err(y, np_norm_linear(x, nw, w, b)) < 1e-5
    assert rel_err(fused_norm_linear_reference(x, nw, w, b), np_norm_linear(x, nw, w, b)) < 1e-5


def test_norm_linear_empty(kernel_backend):
    x, nw, w, _ = linear_inputs((0,), 8, 5, mx.float32, 6, False)
    assert fused_norm_linear(x, nw, w).shape == (0, 5)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("lead", [(2, 35), (1,)], ids=["simd", "gemv"])
def test_norm_linear_grad(kernel_backend, lead, bias):
    x, nw, w, b = linear_inputs(lead, 29, 31, mx.float32, seed_of("grad", lead, bias), bias)
    cot = rand(np.random.default_rng(9), (*lead, 31), mx.float32)
    args = [x, nw, w] + ([b] if bias else [])

    def fused(*a):
        return fused_norm_linear(a[0], a[1], a[2], a[3] if bias else None, EPS)

    def ref(*a):
        return fused_norm_linear_reference(a[0], a[1], a[2], a[3] if bias else None, EPS)

    _, grads = mx.vjp(fused, args, [cot])
    with runtime.use_backend("reference"):
        _, want = mx.vjp(ref, args, [cot])
    assert len(grads) == len(args)
    for g, r, a in zip(grads, want, args):
        assert g.shape == a.shape and g.dtype == a.dtype
        assert rel_err(g, f64(r)) < 1e-5
    # through a scalar loss with mx.grad, low precision input
    xh = x.astype(mx.bfloat16)
    g = mx.grad(lambda t: (fused_norm_linear(t, nw, w, b).astype(mx.float32) * cot).sum())(xh)
    gref = mx.grad(lambda t: (ref(t, nw, w, b) * cot).sum() if bias else (ref(t, nw, w) * cot).sum())(
        xh.astype(mx.float32)
    )
    assert g.dtype == mx.bfloat16 and rel_err(g, f64(gref)) < 3e-2


# ---------------------------------------------------------------------------------------
# fused_norm_qkv_rope
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("traditional", [False, True], ids=["split_half", "traditional"])
@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("heads", [(4, 1), (4, 2)], ids=["gqa4_1", "gqa4_2"])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_qkv_rope_vs_float64_and_unfused(kernel_backend, spy, dtype_name, heads, d, traditional):
    h, hkv = heads
    dtype = DTYPES[dtype_name]
    bsz, seq, e = 2, 17, 29  # 34 rows: 2 row tiles of 32; 6 or 8 heads: 3 to 8 column tiles; odd E
    x, nw, w = qkv_inputs(bsz, seq, e, h, hkv, d, dtype, seed_of("qkv", dtype_name, heads, d, traditional))
    kw = dict(traditional=traditional, offset=5, base=10000.0, scale=1.0)
    q, k, v = fused_norm_qkv_rope(x, nw, w, h, hkv, eps=EPS, **kw)
    mx.eval(q, k, v)
    assert spy.kernels == _expected_kernels(kernel_backend, "norm_qkv_rope")
    assert q.shape == (bsz, h, seq, d) and k.shape == v.shape == (bsz, hkv, seq, d)
    assert q.dtype == k.dtype == v.dtype == dtype
    refs = np_qkv_rope(x, nw, w, h, hkv, traditional, offset=5)
    unfused = unfused_norm_qkv_rope(x, nw, w, h, hkv, eps=EPS, **kw)
    for name, out, ref, un in zip("qkv", (q, k, v), refs, unfused):
        assert rel_err(out, ref) < TOL[dtype_name], name
        assert rel_err(out, f64(un)) < TOL[dtype_name], name


# (B, L, E, H, HKV, D, traditional, offset, scale, base, tiles, kernel)
QKV_EXTRA = {
    "decode_gemv_split": (1, 1, 45, 4, 1, 16, False, 7, 1.0, 10000.0, None, "norm_qkv_rope_gemv"),
    "decode_gemv_trad": (1, 1, 70, 4, 2, 64, True, 123, 0.5, 500.0, None, "norm_qkv_rope_gemv"),
    "per_batch_offsets": (3, 5, 33, 4, 2, 16, False, [0, 4, 9], 1.0, 10000.0, None, "norm_qkv_rope"),
    "0d_offset_2x2sg": (2, 19, 40, 4, 2, 16, True, "0d", 2.0, 10000.0, TILES_2X2, "norm_qkv_rope"),
    "d24_padded_tile": (2, 9, 31, 4, 1, 24, False, 3, 1.0, 10000.0, TILES_2X2, "norm_qkv_rope"),
    "d64_wide_tiles": (1, 21, 37, 4, 1, 64, True, 2, 1.0, 10000.0, TILES_WIDE, "norm_qkv_rope"),
    "d16_4heads_per_tile": (2, 9, 30, 4, 1, 16, False, 1, 1.0, 10000.0, TILES_WIDE, "norm_qkv_rope"),  # 6 heads: 2nd tile partial
    "d32_big_tiles": (1, 70, 41, 4, 2, 32, True, 0, 1.0, 10000.0, TILES_BIG, "norm_qkv_rope"),
    # TILES_TALL at D = 128 plans 32 rows in 4 simdgroups: 74 rows = 3 row tiles, 5 K steps
    "d128_tall_tiles": (2, 37, 40, 2, 1, 128, False, 5, 1.0, 10000.0, TILES_TALL, "norm_qkv_rope"),
}


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", QKV_EXTRA)
def test_qkv_rope_options_and_paths(kernel_backend, spy, case, dtype_name):
    bsz, seq, e, h, hkv, d, trad, offset, scale, base, tiles, kernel = QKV_EXTRA[case]
    dtype = DTYPES[dtype_name]
    x, nw, w = qkv_inputs(bsz, seq, e, h, hkv, d, dtype, seed_of("qkv_extra", case, dtype_name))
    if offset == "0d":
        off_arg, off_np = mx.array(11, dtype=mx.int32), 11
    elif isinstance(offset, list):
        off_arg, off_np = mx.array(offset, dtype=mx.int32), np.array(offset)
    else:
        off_arg, off_np = offset, offset
    kw = dict(traditional=trad, offset=off_arg, scale=scale, base=base)
    outs = fused_norm_qkv_rope(x, nw, w, h, hkv, tiles=tiles, **kw)
    mx.eval(*outs)
    assert spy.kernels == _expected_kernels(kernel_backend, kernel)
    refs = np_qkv_rope(x, nw, w, h, hkv, trad, base, scale, off_np)
    unfused = unfused_norm_qkv_rope(x, nw, w, h, hkv, **kw)
    for name, out, ref, un in zip("qkv", outs, refs, unfused):
        assert rel_err(out, ref) < TOL[dtype_name], name
        assert rel_err(out, f64(un)) < TOL[dtype_name], name


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("tiles", [None, TILES_2X2, TILES_BIG, TILES_WIDE, TILES_TALL, TILES_48],
                         ids=["default", "2x2", "big", "wide", "tall", "48rows"])
def test_qkv_plan_fits_and_covers_whole_heads(tiles, dtype_name):
    dtype = DTYPES[dtype_name]
    for d in (8, 16, 24, 64, 128, 256, 496):  # up to ~500 (float32) fits
        plan = fused_mod.plan_tiles(512, 6 * d, 1024, dtype, tiles, head_dim=d)
        assert plan.path == "simd"
        assert plan.threadgroup_bytes(dtype, True) <= 32768, (d, plan)
        assert plan.cpt % d == 0 and plan.cpt <= plan.bn and plan.bn % (8 * plan.wn) == 0, (d, plan)
        assert plan.bk in (8, 16, 32) and plan.bm % (8 * plan.wm) == 0, (d, plan)
    with pytest.raises(ValueError, match="head dimension D=4096 is too large"):
        fused_mod.plan_tiles(512, 6 * 4096, 1024, dtype, tiles, head_dim=4096)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_qkv_plan_shrinks_rows_and_simdgroups_together(dtype_name):
    """A tile too large for the staged output shrinks its rows and simdgroups together (at
    least 8 rows a simdgroup), never straight to one simdgroup of 8 rows while more rows fit:
    TILES_TALL (128 rows, 8 simdgroups) at D = 128 plans 32 rows in 4 simdgroups."""
    dtype = DTYPES[dtype_name]
    plan = fused_mod.plan_tiles(512, 6 * 128, 1024, dtype, TILES_TALL, head_dim=128)
    assert (plan.bm, plan.wm, plan.cpt) == (32, 4, 128), plan
    assert plan.threadgroup_bytes(dtype, True) <= 32768
    bigger = fused_mod.FusedTiles("simd", 2 * plan.bm, plan.bn, plan.bk, plan.wm, plan.wn, plan.cpt)
    assert bigger.threadgroup_bytes(dtype, True) > 32768  # the largest row count that fits


def test_qkv_rope_reference_backend_matches_numpy():
    x, nw, w = qkv_inputs(2, 6, 20, 4, 2, 8, mx.float32, 21)
    refs = np_qkv_rope(x, nw, w, 4, 2, True, offset=np.array([1, 4]), scale=0.5)
    with runtime.use_backend("reference"):
        outs = fused_norm_qkv_rope(x, nw, w, 4, 2, traditional=True, offset=mx.array([1, 4]), scale=0.5)
    for out, ref in zip(outs, refs):
        assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize(
    "traditional, offset", [(False, 3), (True, "0d"), (False, [2, 6])], ids=["split_half", "trad_0d", "per_batch"]
)
def test_qkv_rope_grad(kernel_backend, traditional, offset):
    h, hkv, d = 4, 2, 16
    x, nw, w = qkv_inputs(2, 5, 24, h, hkv, d, mx.float32, seed_of("qkv_grad", traditional))
    rng = np.random.default_rng(31)
    cots = [rand(rng, (2, n, 5, d), mx.float32) for n in (h, hkv, hkv)]
    if offset == "0d":
        offset = mx.array(4)
    elif isinstance(offset, list):
        offset = mx.array(offset)
    kw = dict(traditional=traditional, offset=offset)

    _, grads = mx.vjp(lambda *a: list(fused_norm_qkv_rope(*a, h, hkv, **kw)), [x, nw, w], cots)
    with runtime.use_backend("reference"):
        _, want = mx.vjp(lambda *a: list(fused_norm_qkv_rope_reference(*a, h, hkv, **kw)), [x, nw, w], cots)
    for g, r, a in zip(grads, want, (x, nw, w)):
        assert g.shape == a.shape
        assert rel_err(g, f64(r)) < 1e-5
    # a loss on q alone (k and v get no cotangent)
    g = mx.grad(lambda t: (fused_norm_qkv_rope(t, nw, w, h, hkv, **kw)[0] * cots[0]).sum())(x)
    gref = mx.grad(lambda t: (fused_norm_qkv_rope_reference(t, nw, w, h, hkv, **kw)[0] * cots[0]).sum())(x)
    assert rel_err(g, f64(gref)) < 1e-5


# ---------------------------------------------------------------------------------------
# Emulator: thread-order independence and bounds of every fused kernel
# ---------------------------------------------------------------------------------------


def _schedule_cases():
    """(spec, launch kwargs, float64 reference, output reshape) per fused kernel, odd shapes."""
    cases = []
    x, nw, w, b = linear_inputs((35,), 29, 37, mx.float16, 41)
    spec, kw = fused_mod.norm_linear_launch(x, nw, w, b, EPS, TILES_2X2)
    cases.append((spec, kw, [np_norm_linear(x, nw, w, b)], "float16"))
    x, nw, w, _ = linear_inputs((1,), 45, 37, mx.bfloat16, 42, False)
    spec, kw = fused_mod.norm_linear_launch(x, nw, w, None, EPS)
    cases.append((spec, kw, [np_norm_linear(x, nw, w)], "bfloat16"))
    freqs = fused_mod._base_freqs(8, 10000.0)
    for bsz, seq, trad, tiles in ((2, 17, False, TILES_2X2), (1, 1, True, None)):  # simd; gemv (one row)
        x, nw, w = qkv_inputs(bsz, seq, 27, 4, 1, 16, mx.float32, 43 + seq)
        offsets = mx.array([3, 8][:bsz], dtype=mx.int32)
        spec, kw = fused_mod.norm_qkv_rope_launch(x, nw, w, 4, 1, EPS, trad, 1.0, offsets, freqs, tiles)
        cases.append((spec, kw, list(np_qkv_rope(x, nw, w, 4, 1, trad, offset=np.asarray(offsets))), "float32"))
    return cases


@pytest.mark.emulator_only
def test_check_schedules_and_bounds_every_kernel():
    from xlstm_kernels.emulate import check_schedules

    seen = set()
    for spec, kw, refs, dtype_name in _schedule_cases():
        seen.add(spec.kernel)
        kernel = runtime.get_kernel(spec, "emulate")
        outs = check_schedules(kernel, seeds=(1,), **kw)
        bounded = kernel(**kw, check_bounds=True)
        for out, again, ref in zip(outs, bounded, refs):
            assert np.array_equal(f64(out), f64(again))
            assert rel_err(out.reshape(ref.shape), ref) < TOL[dtype_name], spec.kernel
    assert seen == {s.kernel for s in fused_mod.SPECS}


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


def _lin_args(**over):
    rng = np.random.default_rng(51)
    args = dict(x=rand(rng, (3, 8), mx.float32), norm_weight=rand(rng, (8,), mx.float32),
                weight=rand(rng, (5, 8), mx.float32), bias=None, eps=EPS)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(norm_weight=mx.ones((7,))), ValueError, r"norm_weight must have shape \(8,\).*got \(7,\)"),
        (dict(norm_weight=mx.ones((8, 1))), ValueError, "norm_weight must have 1 dimensions"),
        (dict(weight=mx.ones((5, 9))), ValueError, r"weight .* in_features=8 .* shape \(5, 9\)"),
        (dict(weight=mx.ones((8,))), ValueError, "weight must have 2 dimensions"),
        (dict(bias=mx.ones((4,))), ValueError, r"bias must have shape \(5,\)"),
        (dict(x=mx.ones((3, 8), dtype=mx.int32)), TypeError, "x has dtype"),
        (dict(x=np.ones((3, 8))), TypeError, "x must be an mx.array"),
        (dict(eps=-1.0), ValueError, "eps must be a finite non-negative"),
        (dict(eps=float("nan")), ValueError, "eps must be a finite non-negative"),
    ],
)
def test_norm_linear_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        fused_norm_linear(**_lin_args(**over))


def test_norm_linear_bad_tiles():
    from xlstm_kernels.tiles import TileConfigError

    with pytest.raises(TileConfigError):
        fused_norm_linear(**_lin_args(), tiles={"bm": 30, "wm": 2})


def _qkv_args(**over):
    rng = np.random.default_rng(52)
    args = dict(x=rand(rng, (2, 3, 8), mx.float32), norm_weight=rand(rng, (8,), mx.float32),
                w_qkv=rand(rng, (6 * 4, 8), mx.float32), n_heads=4, n_kv_heads=1)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(x=mx.ones((6, 8))), ValueError, "x must have 3 dimensions"),
        (dict(norm_weight=mx.ones((9,))), ValueError, r"norm_weight must have shape \(8,\)"),
        (dict(w_qkv=mx.ones((24, 7))), ValueError, r"w_qkv .* E=8 .* shape \(24, 7\)"),
        (dict(w_qkv=mx.ones((25, 8))), ValueError, r"w_qkv must have \(n_heads \+ 2 \* n_kv_heads\) \* D = 6 \* D rows"),
        (dict(w_qkv=mx.ones((18, 8))), ValueError, "D = w_qkv.shape\\[0\\] / 6 = 3 must be even"),
        (dict(n_heads=0), ValueError, "n_heads must be a positive int"),
        (dict(n_kv_heads=1.0), ValueError, "n_kv_heads must be a positive int"),
        (dict(traditional=1), TypeError, "traditional must be a bool"),
        (dict(base=-1.0), ValueError, "base must be a positive"),
        (dict(scale=float("inf")), ValueError, "scale must be finite"),
        (dict(offset=mx.array([1, 2, 3])), ValueError, r"one offset per batch element, shape \(2,\)"),
        (dict(offset=1.5), TypeError, "offset must be an int"),
        (dict(eps=-1e-3), ValueError, "eps must be"),
    ],
)
def test_qkv_rope_errors(over, exc, match):
    args = _qkv_args(**over)
    pos = [args.pop(k) for k in ("x", "norm_weight", "w_qkv", "n_heads", "n_kv_heads")]
    with pytest.raises(exc, match=match):
        fused_norm_qkv_rope(*pos, **args)


# ---------------------------------------------------------------------------------------
# The single_kernel knob
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,expected", [("m1", True), ("m5", True), ("generic_apple", True),
                                             ("nvidia_hopper", False), ("nvidia_generic", False)])
def test_single_kernel_default_per_family(monkeypatch, family, expected):
    """Apple presets keep the fused kernel; the NVIDIA presets run the unfused sequence
    (measured on an H200: 1.6-22x faster there). Every shape class resolves alike."""
    monkeypatch.delenv(KNOB_VAR)
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", family)
    for m in (1, 8, 9, 512, 513, 4096):
        assert fused_mod.knob_values(m, mx.bfloat16) == {"single_kernel": expected}
    path = fused_mod.fused_path(512, 64, 64, mx.float16)
    assert path == ("simd" if expected else "sequence")
    assert fused_mod.fused_path(1, 64, 64, mx.float16, knobs={"single_kernel": True}) == "gemv"


@pytest.mark.parametrize("source", ["argument", "environment"])
def test_single_kernel_off_runs_the_unfused_sequence(kernel_backend, spy, monkeypatch, source):
    """Off (by argument or variable): no fused launch, bitwise the unfused sequence of this
    package's kernels, within the dtype's bound of float64, and differentiable."""
    knobs = {"single_kernel": False} if source == "argument" else None
    if source == "environment":
        monkeypatch.setenv(KNOB_VAR, "off")
    x, nw, w, b = linear_inputs((2, 35), 29, 31, mx.float32, seed_of("seq", source), True)
    y = fused_norm_linear(x, nw, w, b, EPS, knobs=knobs)
    mx.eval(y)
    assert spy.kernels == []
    assert np.array_equal(np.asarray(y), np.asarray(unfused_norm_linear(x, nw, w, b, EPS)))
    assert rel_err(y, np_norm_linear(x, nw, w, b)) < TOL["float32"]
    g = mx.grad(lambda xa: fused_norm_linear(xa, nw, w, b, EPS, knobs=knobs).sum())(x)
    g_ref = mx.grad(lambda xa: unfused_norm_linear(xa, nw, w, b, EPS).sum())(x)
    assert np.array_equal(np.asarray(g), np.asarray(g_ref))

    x, nw, w = qkv_inputs(2, 9, 48, 4, 2, 16, mx.float32, seed_of("seq-qkv", source))
    offset = mx.array([3, 11])
    outs = fused_norm_qkv_rope(x, nw, w, 4, 2, eps=EPS, offset=offset, knobs=knobs)
    mx.eval(outs)
    assert spy.kernels == []
    refs = unfused_norm_qkv_rope(x, nw, w, 4, 2, eps=EPS, offset=offset)
    for out, ref in zip(outs, refs):
        assert np.array_equal(np.asarray(out), np.asarray(ref))
    qkv64 = np_qkv_rope(x, nw, w, 4, 2, False, offset=np.array([3, 11]))
    for out, ref in zip(outs, qkv64):
        assert rel_err(out, ref) < TOL["float32"]


def test_single_kernel_argument_beats_the_environment(kernel_backend, spy, monkeypatch):
    monkeypatch.setenv(KNOB_VAR, "0")
    x, nw, w, b = linear_inputs((33,), 29, 31, mx.float32, seed_of("arg-wins"), False)
    mx.eval(fused_norm_linear(x, nw, w, b, EPS, knobs={"single_kernel": True}))
    assert spy.kernels == _expected_kernels(kernel_backend, "norm_linear")


@pytest.mark.parametrize(
    "knobs,exc,match",
    [
        ({"single_kernel": "yes"}, "TileConfigError", r"single_kernel='yes' \(fused\): expected a boolean"),
        ({"single_kernels": False}, "TileConfigError", "fused has the knobs single_kernel"),
        ([("single_kernel", False)], TypeError, "fused_norm_[a-z_]+: knobs must be a dict"),
    ],
)
def test_single_kernel_bad_argument(knobs, exc, match):
    from xlstm_kernels.tiles import TileConfigError

    exc = TileConfigError if exc == "TileConfigError" else exc
    with pytest.raises(exc, match=match):
        fused_norm_linear(**_lin_args(), knobs=knobs)
    args = _qkv_args()
    pos = [args.pop(k) for k in ("x", "norm_weight", "w_qkv", "n_heads", "n_kv_heads")]
    with pytest.raises(exc, match=match):
        fused_norm_qkv_rope(*pos, **args, knobs=knobs)


def test_single_kernel_malformed_variable(monkeypatch):
    from xlstm_kernels.tiles import TileConfigError

    monkeypatch.setenv(KNOB_VAR, "sometimes")
    with pytest.raises(TileConfigError, match=f"{KNOB_VAR}='sometimes'"):
        fused_norm_linear(**_lin_args())


@pytest.mark.parametrize("single", ["1", "0"], ids=["kernel", "sequence"])
def test_repeated_calls_take_each_calls_offset_and_inputs(kernel_backend, monkeypatch, single):
    """The memo of a call signature (ops/_callcache) keeps shapes, dtypes and flags only:
    a repeated call with new inputs and another int offset (a decode step's position)
    gets its own result, on both paths."""
    monkeypatch.setenv(KNOB_VAR, single)
    for step, offset in enumerate((3, 17, mx.array([5, 0]), mx.array([1, 9]))):
        x, nw, w = qkv_inputs(2, 5, 48, 4, 2, 16, mx.float32, seed_of("memo", single, step))
        outs = fused_norm_qkv_rope(x, nw, w, 4, 2, eps=EPS, offset=offset)
        off = np.asarray(offset) if isinstance(offset, mx.array) else offset
        for out, ref in zip(outs, np_qkv_rope(x, nw, w, 4, 2, False, offset=off)):
            assert rel_err(out, ref) < TOL["float32"], (step, offset)
        x, nw, w, b = linear_inputs((3, 7), 29, 31, mx.float32, seed_of("memo-lin", single, step), step % 2 == 0)
        assert rel_err(fused_norm_linear(x, nw, w, b, EPS), np_norm_linear(x, nw, w, b)) < TOL["float32"]


def test_a_changed_knob_variable_applies_to_the_next_call(kernel_backend, spy, monkeypatch):
    x, nw, w, b = linear_inputs((33,), 29, 31, mx.float32, seed_of("memo-env"), True)
    mx.eval(fused_norm_linear(x, nw, w, b, EPS))
    monkeypatch.setenv(KNOB_VAR, "0")
    mx.eval(fused_norm_linear(x, nw, w, b, EPS))
    monkeypatch.setenv(KNOB_VAR, "1")
    mx.eval(fused_norm_linear(x, nw, w, b, EPS))
    assert spy.kernels == _expected_kernels(kernel_backend, "norm_linear") * 2


def test_tiles_select_the_fused_kernel(kernel_backend, spy, monkeypatch):
    """tiles= describes the fused kernel's tile: given, the call runs the kernel even where
    the variable (or a preset) runs the sequence; with single_kernel=False it is an error."""
    monkeypatch.setenv(KNOB_VAR, "0")
    x, nw, w, b = linear_inputs((70,), 37, 67, mx.float32, seed_of("tiles-kernel"), True)
    y = fused_norm_linear(x, nw, w, b, EPS, tiles=TILES_2X2)
    mx.eval(y)
    assert spy.kernels == _expected_kernels(kernel_backend, "norm_linear")
    assert rel_err(y, np_norm_linear(x, nw, w, b)) < TOL["float32"]
    assert fused_mod.fused_path(70, 67, 37, mx.float32, TILES_2X2) == "simd"
    with pytest.raises(ValueError, match="fused_norm_linear: tiles= sets the fused kernel's tile"):
        fused_norm_linear(x, nw, w, b, EPS, tiles=TILES_2X2, knobs={"single_kernel": False})
    args = _qkv_args()
    pos = [args.pop(k) for k in ("x", "norm_weight", "w_qkv", "n_heads", "n_kv_heads")]
    with pytest.raises(ValueError, match="fused_norm_qkv_rope: tiles= sets"):
        fused_norm_qkv_rope(*pos, **args, tiles=TILES_2X2, knobs={"single_kernel": False})
