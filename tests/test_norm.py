"""Norm family (metal_src/norm.metal, ops/norm.py): RMSNorm, LayerNorm, multi-head LayerNorm.

Forward outputs against float64 NumPy references for every dtype, row lengths on every
kernel layout (7, 16: rows shorter than a simdgroup; 32, 100: simdgroup per row; 1031:
threadgroup per row, cached; 4097: looped), weight/bias absent and present; against
mx.fast in float32; gradients (dx, dweight, dbias) against mx.vjp of the reference ops;
schedules and bounds through the emulator.
"""

from __future__ import annotations

import zlib

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels import runtime
from xlstm_kernels.ops import norm as norm_mod
from xlstm_kernels.ops.norm import layer_norm, multihead_layer_norm, rms_norm

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
ROW_LENGTHS = (7, 16, 32, 100, 1031, 4097)
WB = [(False, False), (True, False), (False, True), (True, True)]
EPS = 1e-5


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def rand(rng, shape, dtype=mx.float32, scale: float = 1.0, shift: float = 0.0) -> mx.array:
    """Fresh normal data (never exactly zero) in `dtype`."""
    x = rng.standard_normal(shape).astype(np.float32) * scale + shift
    x[x == 0] = 0.5
    return mx.array(x).astype(dtype)


def f64(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32)).astype(np.float64)


def rel_err(out: mx.array, ref) -> float:
    ref = f64(ref) if isinstance(ref, mx.array) else np.asarray(ref, dtype=np.float64)
    out = f64(out)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def tol(dtype) -> float:
    return 1e-5 if dtype == mx.float32 else 1e-2


# float64 references -------------------------------------------------------------------


def rms_ref64(x, w, eps=EPS):
    x = f64(x)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * f64(w)


def ln_ref64(x, w, b, eps=EPS, num_heads=1):
    x = f64(x)
    xh = x.reshape(*x.shape[:-1], num_heads, x.shape[-1] // num_heads)
    mean = xh.mean(axis=-1, keepdims=True)
    var = ((xh - mean) ** 2).mean(axis=-1, keepdims=True)
    y = ((xh - mean) / np.sqrt(var + eps)).reshape(x.shape)
    if w is not None:
        y = y * f64(w)
    if b is not None:
        y = y + f64(b)
    return y


def make(rng, shape, dtype, has_w, has_b):
    d = shape[-1]
    x = rand(rng, shape, dtype, scale=2.0, shift=0.5)  # a non-zero mean exercises the centring
    w = rand(rng, (d,), dtype) if has_w else None
    b = rand(rng, (d,), dtype) if has_b else None
    return x, w, b


# forward ------------------------------------------------------------------------------


@pytest.mark.parametrize("d", ROW_LENGTHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("has_w", [False, True])
def test_rms_norm_forward(kernel_backend, d, dtype, has_w):
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed_of("rms", d, dtype, has_w))
    shape = (2, 3, d) if d < 4096 else (3, d)
    x, w, _ = make(rng, shape, dt, has_w, False)
    y = rms_norm(x, w, EPS)
    assert y.dtype == dt and y.shape == x.shape
    assert rel_err(y, rms_ref64(x, w)) < tol(dt)


@pytest.mark.parametrize("d", ROW_LENGTHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("has_w,has_b", WB)
def test_layer_norm_forward(kernel_backend, d, dtype, has_w, has_b):
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed_of("ln", d, dtype, has_w, has_b))
    shape = (2, 3, d) if d < 4096 else (3, d)
    x, w, b = make(rng, shape, dt, has_w, has_b)
    y = layer_norm(x, w, b, EPS)
    assert y.dtype == dt and y.shape == x.shape
    assert rel_err(y, ln_ref64(x, w, b)) < tol(dt)


@pytest.mark.parametrize("d", (7, 100, 1031, 4097))
@pytest.mark.parametrize("has_w,has_b", WB)
def test_matches_mx_fast_float32(kernel_backend, d, has_w, has_b):
    rng = np.random.default_rng(seed_of("fast", d, has_w, has_b))
    x, w, b = make(rng, (5, d), mx.float32, has_w, has_b)
    assert rel_err(layer_norm(x, w, b, EPS), mx.fast.layer_norm(x, w, b, EPS)) < 1e-5
    if not has_b:
        assert rel_err(rms_norm(x, w, EPS), mx.fast.rms_norm(x, w, EPS)) < 1e-5


@pytest.mark.parametrize("nh,dh", [(1, 16), (1, 48), (4, 16), (4, 48)])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("has_w,has_b", [(False, False), (True, True)])
def test_multihead_layer_norm_forward(kernel_backend, nh, dh, dtype, has_w, has_b):
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed_of("mh", nh, dh, dtype, has_w, has_b))
    x, w, b = make(rng, (2, 5, nh * dh), dt, has_w, has_b)
    y = multihead_layer_norm(x, w, b, nh, EPS)
    assert y.dtype == dt and y.shape == x.shape
    assert rel_err(y, ln_ref64(x, w, b, num_heads=nh)) < tol(dt)
    if nh > 1:  # the per-head statistics matter: whole-row LayerNorm differs
        assert rel_err(y, ln_ref64(x, w, b)) > 10 * tol(dt)


def test_multihead_layer_norm_head_offsets(kernel_backend):
    """Heads with very different scales and means are normalised independently."""
    rng = np.random.default_rng(3)
    nh, dh = 4, 48
    x = rand(rng, (3, nh, dh)) * mx.array([0.01, 1.0, 30.0, 500.0])[:, None] + mx.array([0.05, -3.0, 0.0, 1e3])[:, None]
    x = x.reshape(3, nh * dh)
    w, b = rand(rng, (nh * dh,)), rand(rng, (nh * dh,))
    y = multihead_layer_norm(x, w, b, nh, EPS)
    assert rel_err(y, ln_ref64(x, w, b, num_heads=nh)) < 1e-5


def test_noncontiguous_and_long_head_slices(kernel_backend):
    """A transposed (non-row-contiguous) input, and head slices long enough to loop."""
    rng = np.random.default_rng(11)
    xt = rand(rng, (200, 6)).T  # (6, 200)
    w, b = rand(rng, (200,)), rand(rng, (200,))
    assert rel_err(layer_norm(xt, w, b, EPS), ln_ref64(xt, w, b)) < 1e-5
    assert rel_err(rms_norm(xt, None, EPS), rms_ref64(xt, None)) < 1e-5
    xl, wl, _ = make(rng, (2, 2 * 4100), mx.float32, True, False)
    assert rel_err(multihead_layer_norm(xl, wl, None, 2, EPS), ln_ref64(xl, wl, None, num_heads=2)) < 1e-5


# gradients ----------------------------------------------------------------------------


def _check_rms_grads_at_offsets(x, w, cot):
    """rms_norm's gradients (dx, and dw when `w` is given) on aligned views and on views one
    element into their buffers, against the float32 reference backend's; returns those."""
    args = [x] + ([w] if w is not None else [])
    fn = (lambda a, c: rms_norm(a, c, EPS)) if w is not None else (lambda a: rms_norm(a, None, EPS))
    with runtime.use_backend("reference"):
        want = _grads(fn, [a.astype(mx.float32) for a in args], cot.astype(mx.float32))
    limit = 2e-5 if x.dtype == mx.float32 else 1.5e-2
    for off in (0, 1):
        got = _grads(fn, [offset_view(a, off) for a in args], offset_view(cot, off))
        for g_, r_ in zip(got, want):
            assert rel_err(g_, r_) < limit, off
    return want


@pytest.fixture(autouse=True)
def _reference_bandwidth(monkeypatch):
    """Plan the staged backward's short-row units for the reference bandwidth (the H100's, on
    which the plans were measured) on every backend, so that the plan assertions hold on any
    GPU (on an H200 the cuda backend plans four units a SM where they assume three); the tests
    of that scaling patch ``_device_bandwidth_gbs`` themselves."""
    monkeypatch.setattr(norm_mod, "_device_bandwidth_gbs", lambda: norm_mod.RMS_VJP_UNITS_REF_GBPS)


@pytest.fixture
def fresh_norm_calls():
    """The norm call memo cleared before and after the test (tests that patch the plans:
    the memo key does not hold them)."""
    norm_mod._CALLS.clear()
    yield
    norm_mod._CALLS.clear()


def _grads(fn, args, cot):
    _, g = mx.vjp(fn, args, [cot])
    mx.eval(g)
    return g


def _check_grads(kind, shape, dtype, has_w, has_b, nh=1, seed=0):
    rng = np.random.default_rng(seed)
    x, w, b = make(rng, shape, dtype, has_w, has_b)
    cot = rand(rng, shape, dtype)
    args = [x] + ([w] if has_w else []) + ([b] if has_b else [])

    def call(*a):
        xa = a[0]
        wa = a[1] if has_w else None
        ba = a[1 + has_w] if has_b else None
        if kind == "rms":
            return rms_norm(xa, wa, EPS)
        if nh == 1:
            return layer_norm(xa, wa, ba, EPS)
        return multihead_layer_norm(xa, wa, ba, nh, EPS)

    got = _grads(call, args, cot)
    # Oracle: the reference ops on float32 copies of the same values.
    with runtime.use_backend("reference"):
        want = _grads(call, [a.astype(mx.float32) for a in args], cot.astype(mx.float32))
    limit = 2e-5 if dtype == mx.float32 else 1.5e-2
    names = ["dx"] + (["dweight"] if has_w else []) + (["dbias"] if has_b else [])
    assert len(got) == len(args)
    for name, a, g, r in zip(names, args, got, want):
        assert g.dtype == a.dtype and g.shape == a.shape, name
        err = rel_err(g, r)
        assert err < limit, f"{name}: rel err {err:.2e}"


@pytest.mark.parametrize("d", (7, 100, 1031, 4097))
@pytest.mark.parametrize("has_w", [False, True])
def test_rms_norm_grad_float32(kernel_backend, d, has_w):
    _check_grads("rms", (2, 3, d) if d < 4096 else (3, d), mx.float32, has_w, False, seed=seed_of("grms", d, has_w))


@pytest.mark.parametrize("d", (7, 100, 1031, 4097))
@pytest.mark.parametrize("has_w,has_b", WB)
def test_layer_norm_grad_float32(kernel_backend, d, has_w, has_b):
    _check_grads("ln", (2, 3, d) if d < 4096 else (3, d), mx.float32, has_w, has_b, seed=seed_of("gln", d, has_w, has_b))


@pytest.mark.parametrize("d", (32, 1031, 4097))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_grads_half_precision(kernel_backend, d, dtype):
    dt = DTYPES[dtype]
    shape = (4, d) if d < 4096 else (2, d)
    _check_grads("rms", shape, dt, True, False, seed=seed_of("grms16", d, dtype))
    _check_grads("ln", shape, dt, True, True, seed=seed_of("gln16", d, dtype))


@pytest.mark.parametrize("nh,dh", [(1, 16), (1, 48), (4, 16), (4, 48)])
@pytest.mark.parametrize("has_w,has_b", [(False, False), (True, True)])
def test_multihead_layer_norm_grad(kernel_backend, nh, dh, has_w, has_b):
    _check_grads("ln", (2, 5, nh * dh), mx.float32, has_w, has_b, nh=nh, seed=seed_of("gmh", nh, dh, has_w, has_b))


@pytest.mark.parametrize("cached_max", [norm_mod.CACHED_MAX, 64])
def test_grads_many_rows_per_group(kernel_backend, monkeypatch, cached_max):
    """Few backward units: each sums dweight/dbias over several rows (registers when
    cached, its own partial cells when looped; cached_max=64 forces the looped kernels)."""
    monkeypatch.setattr(norm_mod, "VJP_TARGET_THREADS", 1024)
    monkeypatch.setattr(norm_mod, "CACHED_MAX", cached_max)
    _check_grads("ln", (37, 200), mx.float32, True, True, seed=1)
    _check_grads("rms", (37, 200), mx.float32, True, False, seed=2)
    _check_grads("ln", (9, 4, 100), mx.float32, True, True, nh=4, seed=3)  # rows of 4 heads x 100
    _check_grads("ln", (33, 4 * 16), mx.float32, True, False, nh=4, seed=4)  # simdgroup units
    spec, _, groups = norm_mod._vjp_plan("ln", mx.zeros((37, 200)), mx.zeros((200,)), True, mx.zeros((37, 200)), EPS)
    assert groups < 37 and spec.kernel == ("layer_norm_vjp" if cached_max > 200 else "layer_norm_vjp_looped")


def test_rms_vjp_units_fill_one_wave_on_cuda(monkeypatch):
    """On CUDA the RMSNorm backward of the cached layout runs about
    RMS_VJP_TARGET_THREADS_CUDA threads of units (one wave on an H100), with
    RMS_VJP_THREADS_CUDA_16BIT threads per row for 16-bit rows and VJP_THREADS for float32
    rows; other layouts, LayerNorm and other backends keep VJP_THREADS and
    VJP_TARGET_THREADS."""

    def units(kind, n, dtype, backend, rows=16384):
        monkeypatch.setattr(norm_mod, "current_backend", lambda: backend)
        x = mx.zeros((rows, n), dtype=dtype)
        _, kw, groups = norm_mod._vjp_plan(kind, x, mx.zeros((n,), dtype=dtype), kind == "ln", x, EPS)
        return groups, kw["threadgroup"][0]

    for staged in (True, False):
        monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_CUDA", staged)
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            groups, tpr = units("rms", 4096, dtype, "cuda")
            # rows whose stages fit RMS_VJP_STAGE_BYTES stage through threadgroup memory: their own layout
            if staged and 4 * 4096 * dtype.size <= norm_mod.RMS_VJP_STAGE_BYTES:
                threads = norm_mod.RMS_VJP_STAGED_THREADS_CUDA
                # float32 rows of 4096 (32 KiB of x and g) take four stages, 128 KiB: one unit a SM
                per_sm = 1 if dtype.size == 4 else norm_mod.RMS_VJP_STAGED_UNITS_PER_SM
                want = norm_mod.RMS_VJP_SMS_CUDA * per_sm
                # STRIDED units take every groups-th row: exactly the target's units
                assert norm_mod.RMS_VJP_STAGED_STRIDED and groups == want, (dtype, tpr, groups)
            else:
                threads = norm_mod.RMS_VJP_THREADS_CUDA_16BIT if dtype.size == 2 else norm_mod.VJP_THREADS
                want = norm_mod.RMS_VJP_TARGET_THREADS_CUDA // tpr
                assert groups == -(-16384 // -(-16384 // want)), (dtype, tpr, groups)  # rows per group rounded up
            assert tpr == threads, (dtype, tpr)
    groups, tpr = units("rms", 4096, mx.bfloat16, "emulate")
    assert tpr == norm_mod.VJP_THREADS
    assert groups == 16384 // -(-16384 // (norm_mod.VJP_TARGET_THREADS // tpr))
    # LayerNorm stages on CUDA as RMSNorm does (LN_VJP_STAGED_CUDA), its 32-element threads at
    # LN_VJP_STAGED_REGISTERS (two units a SM); unstaged, the emulator's layout
    staged_units = norm_mod.RMS_VJP_SMS_CUDA * (65536 // (norm_mod.LN_VJP_STAGED_REGISTERS
                                                          * norm_mod.RMS_VJP_STAGED_THREADS_CUDA))
    assert units("ln", 4096, mx.bfloat16, "cuda") == (staged_units, norm_mod.RMS_VJP_STAGED_THREADS_CUDA)
    monkeypatch.setattr(norm_mod, "LN_VJP_STAGED_CUDA", False)
    assert units("ln", 4096, mx.bfloat16, "cuda") == units("ln", 4096, mx.bfloat16, "emulate")
    assert units("rms", 16384, mx.float32, "cuda") == units("rms", 16384, mx.float32, "emulate")  # looped


def test_nvidia_preset_norm_layouts(kernel_backend, monkeypatch):
    """The nvidia_hopper preset's rows longer than 4096 (class large): float32 RMSNorm rows
    held by 1024 threads x 8 (FULL at 8192; looped with runs of 8 beyond 8192 elements),
    LayerNorm rows by threads of 32 elements; the LayerNorm backward on CUDA widens
    VJP_THREADS to 512 threads for 16-bit rows of 8192 rather than looping. The plans, then
    the kernels on those layouts (whichever backend runs the tests) against float64, at 8192
    and at a ragged 8200."""
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "nvidia_hopper")
    norm_mod._CALLS.clear()

    def plan(kind, n, dtype):
        x = mx.zeros((4, n), dtype=dtype)
        spec, kw = norm_mod._plan(kind, x, x[0], x[0] if kind == "ln" else None, EPS)
        return spec.kernel, kw["threadgroup"][0], dict(kw["template"])["N_READS"]

    assert plan("rms", 8192, mx.float32) == ("rms_norm", 1024, 8)
    assert plan("rms", 16384, mx.float32) == ("rms_norm_looped", 1024, 8)
    assert plan("rms", 8192, mx.bfloat16) == ("rms_norm", 128, 64)  # the automatic layout
    assert plan("rms", 4096, mx.float32) == ("rms_norm", 128, 32)  # class medium: automatic
    for dt in (mx.float32, mx.bfloat16, mx.float16):
        assert plan("ln", 8192, dt) == ("layer_norm", 256, 32)
    assert plan("ln", 16384, mx.bfloat16) == ("layer_norm", 512, 32)
    monkeypatch.setattr(norm_mod, "LN_VJP_STAGED_CUDA", False)  # the unstaged backward's widened layout

    def vjp_tpr(n, dtype, backend):
        monkeypatch.setattr(norm_mod, "current_backend", lambda: backend)
        x = mx.zeros((8, n), dtype=dtype)
        spec, kw, _ = norm_mod._vjp_plan("ln", x, x[0], True, x, EPS)
        return spec.kernel, kw["threadgroup"][0]

    assert vjp_tpr(8192, mx.bfloat16, "cuda") == ("layer_norm_vjp", 512)
    assert vjp_tpr(8192, mx.bfloat16, "emulate") == ("layer_norm_vjp_looped", norm_mod.LOOPED_THREADS)
    assert vjp_tpr(4096, mx.bfloat16, "cuda") == ("layer_norm_vjp", norm_mod.VJP_THREADS)  # fits: unchanged
    assert vjp_tpr(8192, mx.float32, "cuda")[0] == "layer_norm_vjp_looped"  # float32 > CACHED_MAX: looped
    monkeypatch.setattr(norm_mod, "current_backend", runtime.current_backend)

    rng = np.random.default_rng(seed_of("nvidia-preset"))
    for d in (8192, 8200):
        x, w, b = make(rng, (2, d), mx.float32, True, True)
        assert rel_err(rms_norm(x, w, EPS), rms_ref64(x, w)) < 1e-5
        assert rel_err(layer_norm(x, w, b, EPS), ln_ref64(x, w, b)) < 1e-5
        xh, wh, bh = make(rng, (2, d), mx.bfloat16, True, True)
        assert rel_err(layer_norm(xh, wh, bh, EPS), ln_ref64(xh, wh, bh)) < 1e-2
    norm_mod._CALLS.clear()


def test_ln_vjp_widened_threads_gradients(kernel_backend, monkeypatch):
    """The LayerNorm backward on the widened CUDA layout (16-bit rows of 8192: 512 threads
    per row), planned as on CUDA and run on the active backend: dx, dw, db against float64."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "LN_VJP_STAGED_CUDA", False)  # (staged: test_ln_vjp_staged)
    norm_mod._CALLS.clear()
    rng = np.random.default_rng(seed_of("ln-vjp-wide"))
    d = 8192
    x, w, b = make(rng, (3, d), mx.bfloat16, True, True)
    g = rand(rng, (3, d), mx.bfloat16)
    spec, kw, _ = norm_mod._vjp_plan("ln", x, w, True, g, EPS)
    assert spec.kernel == "layer_norm_vjp" and kw["threadgroup"][0] == 512
    dx, dw, db = mx.vjp(lambda a, c, e: layer_norm(a, c, e, EPS), [x, w, b], [g])[1]
    x64, w64, g64 = f64(x), f64(w), f64(g)
    mu = x64.mean(-1, keepdims=True)
    r = 1.0 / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + EPS)
    xhat = (x64 - mu) * r
    gw = g64 * w64
    dx64 = r * (gw - gw.mean(-1, keepdims=True) - xhat * (gw * xhat).mean(-1, keepdims=True))
    assert rel_err(dx, dx64) < 1e-2
    assert rel_err(dw, (g64 * xhat).sum(0)) < 1e-2
    assert rel_err(db, g64.sum(0)) < 1e-2
    norm_mod._CALLS.clear()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("has_w", [True, False])
@pytest.mark.parametrize("rows_of", ["1024", "4096", "longest"])
@pytest.mark.parametrize("strided", [True, False])
def test_rms_vjp_staged_rows(kernel_backend, monkeypatch, fresh_norm_calls, dtype, has_w, rows_of, strided):
    """The RMSNorm backward whose units stage their next row in threadgroup memory (STAGED,
    planned as on CUDA), units of 4 and 3 rows (both stages, the last row copying nothing),
    each taking every other row (STRIDED) or consecutive rows, aligned and offset views (the
    latter stage with plain element copies and store element by element), against the
    float32 reference's gradients. Rows of 1024 (128 threads), 4096 (128 threads x 32
    elements: 16-bit rows need 32 KiB of stages, past Apple's limit) and the longest that
    stage (16-bit 16384: 512 threads x 32; float32 8192: 256 threads; 128 KiB of stages)."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", 2)  # two units: 4 + 3 rows
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_UNITS_PER_SM", 1)
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_THREADS_PER_SM", 0)
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_STRIDED", strided)
    dt = DTYPES[dtype]
    n = {"1024": 1024, "4096": 4096, "longest": norm_mod.RMS_VJP_STAGE_BYTES // (4 * dt.size)}[rows_of]
    rng = np.random.default_rng(seed_of("vjp-staged", dtype, has_w, n))
    x, w, _ = make(rng, (7, n), dt, has_w, False)
    cot = rand(rng, (7, n), dt)
    spec, kw, groups = norm_mod._vjp_plan("rms", x, w, False, cot, EPS)
    t = dict(kw["template"])
    assert t["STAGED"] and t["NF"] == n and t["FULL"] == 1 and t["STRIDED"] == strided, t
    assert kw["threadgroup"][0] == max(128, n // norm_mod.RMS_VJP_STAGED_MAX_READS)
    assert t["NS"] == norm_mod._vjp_stages(2 * n * dt.size)  # 16-bit 1024 and float32 4096 rows: four
    assert kw["shared_memory"] == 2 * t["NS"] * n * dt.size + norm_mod.RMS_VJP_RED_BYTES
    assert groups == (2 if has_w else 7)
    _check_rms_grads_at_offsets(x, w if has_w else None, cot)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rms_vjp_staged_through_l1(kernel_backend, monkeypatch, fresh_norm_calls, dtype):
    """The staged backward with its copies through L1 (STAGE_L1: cp.async.ca on CUDA, the
    probe's alternative to .cg), aligned and offset views, against the reference's gradients."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", 2)
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_UNITS_PER_SM", 1)
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_THREADS_PER_SM", 0)
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGE_L1", True)
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed_of("vjp-staged-l1", dtype))
    x, w, _ = make(rng, (7, 2048), dt, True, False)
    cot = rand(rng, (7, 2048), dt)
    t = dict(norm_mod._vjp_plan("rms", x, w, False, cot, EPS)[1]["template"])
    assert t["STAGED"] and t["STAGE_L1"], t
    _check_rms_grads_at_offsets(x, w, cot)


def test_rms_vjp_staged_units_per_sm(monkeypatch):
    """Staged units planned per SM: RMS_VJP_STAGED_UNITS_PER_SM, fewer where the registers
    (at the hint) or the shared memory of an SM run out, at least one; the launch's
    occupancy hint says the same."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    per = norm_mod._staged_units_per_sm
    assert per(128, 33280) == norm_mod.RMS_VJP_STAGED_UNITS_PER_SM == 3
    assert per(64, 17408) == norm_mod.RMS_VJP_STAGED_THREADS_PER_SM // 64 == 6  # narrow units: six
    assert per(256, 33280) == 65536 // (norm_mod.RMS_VJP_STAGED_REGISTERS * 256)  # registers: 1
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_REGISTERS", 0)
    assert per(256, 33280) == 3 and per(256, 66048) == 3 and per(256, 131584) == 1  # shared memory
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_REGISTERS", 160)
    x = mx.zeros((16384, 4096), dtype=mx.bfloat16)
    _, kw, groups = norm_mod._vjp_plan("rms", x, mx.zeros((4096,), dtype=mx.bfloat16), False, x, EPS)
    assert dict(kw["template"])["XK_MIN_BLOCKS"] == 3
    assert groups == norm_mod.RMS_VJP_SMS_CUDA * 3
    # 16-bit heads of 512: 64-thread units, six a SM (each head its own units)
    x = mx.zeros((4096, 8 * 512), dtype=mx.bfloat16)
    w = mx.zeros((8 * 512,), dtype=mx.bfloat16)
    _, kw, groups = norm_mod._vjp_plan("ln", x, w, True, x, EPS, 8)
    assert kw["threadgroup"] == (64, 1, 1) and dict(kw["template"])["XK_MIN_BLOCKS"] == 6
    assert groups == norm_mod.RMS_VJP_SMS_CUDA * 6 // 8


@pytest.mark.parametrize("gbps,units", [(3350.0, 3), (2039.0, 3), (4800.0, 4), (8000.0, 7)])
def test_vjp_short_pair_units_scale_with_bandwidth(monkeypatch, gbps, units):
    """Staged units whose rows' x and g take at most RMS_VJP_SHORT_PAIR_BYTES: three a SM on the
    H100's bandwidth and below, floor(3 x bandwidth / 3350) above it (H200: four), the register
    hint lowered to fit them; longer rows (16-bit 4096: 16 KiB) keep three, narrow 64-thread
    units six unless the scaled count is higher."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "_device_bandwidth_gbs", lambda: gbps)

    def plan(kind, shape, dt, nh=1):
        x = mx.zeros(shape, dtype=dt)
        _, kw, groups = norm_mod._vjp_plan(kind, x, mx.zeros((shape[-1],), dtype=dt), kind == "ln", x, EPS, nh)
        return dict(kw["template"])["XK_MIN_BLOCKS"], groups

    sms = norm_mod.RMS_VJP_SMS_CUDA
    for kind, shape, dt in [("ln", (8192, 2048), mx.bfloat16), ("rms", (16384, 1024), mx.float32),
                            ("ln", (8192, 512), mx.float32)]:
        assert plan(kind, shape, dt) == (units, sms * units), (kind, shape, dt)
    # 16-bit rows of 1024 on GPUs faster than the H100: 64-thread units (RMS_VJP_NARROW_*), six a SM
    # or the scaled count; at the H100's bandwidth and below, 128-thread units as above
    for kind in ("rms", "ln"):
        narrow_1024 = max(6, units) if gbps > norm_mod.RMS_VJP_UNITS_REF_GBPS else units
        assert plan(kind, (16384, 1024), mx.bfloat16) == (narrow_1024, sms * narrow_1024), (kind, gbps)
    assert plan("rms", (4096, 4096), mx.bfloat16) == (3, sms * 3)
    # heads of 512: on GPUs faster than the H100 one-simdgroup units, eight a SM
    # (RMS_VJP_ONE_SIMD_*); else 64-thread units, six a SM (RMS_VJP_STAGED_THREADS_PER_SM) or the scaled count
    narrow = 8 if gbps > norm_mod.RMS_VJP_UNITS_REF_GBPS else max(6, units)
    assert plan("ln", (4096, 4096), mx.bfloat16, 8) == (narrow, sms * narrow // 8)
    assert norm_mod._short_pair_units(8192, 128, 160) == (units, 160 if units == 3 else 65536 // (units * 128))
    # rows of 768 do not tile with 64 threads (12 elements): they keep their 96-thread units
    x768 = mx.zeros((4096, 768), dtype=mx.bfloat16)
    _, kw768, _ = norm_mod._vjp_plan("rms", x768, mx.zeros((768,), dtype=mx.bfloat16), False, x768, EPS)
    assert kw768["threadgroup"] == (96, 1, 1) and dict(kw768["template"])["STAGED"], kw768["threadgroup"]
    monkeypatch.setattr(norm_mod, "RMS_VJP_NARROW_MAX_N", 0)
    assert plan("rms", (16384, 1024), mx.bfloat16) == (units, sms * units)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SHORT_PAIR_BYTES", 0)
    assert plan("rms", (16384, 1024), mx.bfloat16) == (3, sms * 3)


@pytest.mark.parametrize("narrow", [True, False])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_vjp_short_pair_units_grads(kernel_backend, monkeypatch, fresh_norm_calls, kind, dtype, narrow):
    """The backward planned with the H200's short-row units (two SMs, so that each unit takes
    several strided rows) gives the reference's gradients on 16-bit rows of 1024: 64-thread
    units, six a SM (RMS_VJP_NARROW_*), or with those off 128-thread units, four a SM."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "_device_bandwidth_gbs", lambda: 4800.0)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", 2)
    if not narrow:
        monkeypatch.setattr(norm_mod, "RMS_VJP_NARROW_MAX_N", 0)
    x = mx.zeros((37, 1024), dtype=dtype)
    _, kw, groups = norm_mod._vjp_plan(kind, x, mx.zeros((1024,), dtype=dtype), kind == "ln", x, EPS)
    t = dict(kw["template"])
    tpr, per_sm = (64, 6) if narrow else (128, 4)
    assert kw["threadgroup"] == (tpr, 1, 1) and t["N_READS"] == 1024 // tpr, (kw["threadgroup"], t)
    assert t["STAGED"] and t["STRIDED"] and t["XK_MIN_BLOCKS"] == per_sm and groups == 2 * per_sm, (t, groups)
    _check_grads(kind, (37, 1024), dtype, True, kind == "ln", seed=seed_of("short-units", kind, str(dtype), narrow))


def _one_simd_staged(monkeypatch):
    """Plan as on an H200 of two SMs with staged one-simdgroup units (RMS_VJP_STAGED_ONE_SIMD,
    RMS_VJP_NARROW_THREADS = 32: 16-bit rows of 256-1024 in 32-thread units)."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "_device_bandwidth_gbs", lambda: 4800.0)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", 2)
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_ONE_SIMD", True)
    monkeypatch.setattr(norm_mod, "RMS_VJP_NARROW_THREADS", 32)


@pytest.mark.parametrize("gbps", [3350.0, 4800.0])
def test_vjp_one_simd_rule_plans(monkeypatch, gbps):
    """The shipped rule (RMS_VJP_STAGED_ONE_SIMD, RMS_VJP_ONE_SIMD_MAX_N,
    RMS_VJP_ONE_SIMD_PAIR_BYTES_PER_SM): on GPUs faster than the H100 16-bit rows (and heads)
    of 256 and 512 stage in one-simdgroup units, twelve and eight a SM; rows of 1024 keep
    64-thread units, float32 rows and the H100 their plans; rows of 128 are not staged; off
    (the flag False, or RMS_VJP_ONE_SIMD_MAX_N 0), rows of 512 take 64-thread units again."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "_device_bandwidth_gbs", lambda: gbps)
    fast = gbps > norm_mod.RMS_VJP_UNITS_REF_GBPS

    def plan(kind, n, dt, nh=1):
        x = mx.zeros((4096, n * nh), dtype=dt)
        _, kw, _ = norm_mod._vjp_plan(kind, x, mx.zeros((n * nh,), dtype=dt), kind == "ln", x, EPS, nh)
        t = dict(kw["template"])
        return kw["threadgroup"][0], t["ONE_SIMD"], t["STAGED"], t.get("XK_MIN_BLOCKS")

    for kind in ("rms", "ln"):
        for dt in (mx.bfloat16, mx.float16):
            for nh in (1, 8):
                assert plan(kind, 512, dt, nh) == ((32, True, True, 8) if fast else (64, False, True, 6)), (kind, dt, nh)
                if fast:
                    assert plan(kind, 256, dt, nh) == (32, True, True, 12), (kind, dt, nh)
                else:
                    assert not plan(kind, 256, dt, nh)[2], (kind, dt, nh)
            assert plan(kind, 1024, dt)[:2] == ((64, False) if fast else (128, False)), (kind, dt)
            assert not plan(kind, 128, dt)[2], (kind, dt)
        assert plan(kind, 512, mx.float32)[:3] == (128, False, True), kind
    if fast:
        monkeypatch.setattr(norm_mod, "RMS_VJP_ONE_SIMD_PAIR_BYTES_PER_SM", 0)  # no cap: the threads' twelve
        assert plan("ln", 512, mx.bfloat16, 8) == (32, True, True, 12)
    for off in (("RMS_VJP_STAGED_ONE_SIMD", False), ("RMS_VJP_ONE_SIMD_MAX_N", 0)):
        with monkeypatch.context() as m:
            m.setattr(norm_mod, *off)
            assert plan("rms", 512, mx.bfloat16) == (64, False, True, 6), off


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("n, nh", [(512, 1), (512, 2), (256, 1)])
def test_vjp_one_simd_rule_grads(kernel_backend, monkeypatch, fresh_norm_calls, kind, n, nh):
    """The shipped one-simdgroup rule planned as on an H200 of two SMs (rows of 512 eight units
    a SM, rows and heads of 256 twelve; 37 rows strided over them): dx, dw, db of bf16 rows
    against the float32 reference ops."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "_device_bandwidth_gbs", lambda: 4800.0)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", 2)
    x = mx.zeros((37, n), dtype=mx.bfloat16)
    _, kw, groups = norm_mod._vjp_plan(kind, x, mx.zeros((n,), dtype=mx.bfloat16), kind == "ln", x, EPS, nh)
    t = dict(kw["template"])
    units = 8 if n // nh == 512 else 12
    assert kw["threadgroup"] == (32, 1, 1) and t["ONE_SIMD"] and t["STAGED"] and t["XK_MIN_BLOCKS"] == units, t
    assert groups == 2 * units // nh, groups
    _check_grads(kind, (37, n), mx.bfloat16, True, kind == "ln", nh=nh, seed=seed_of("one-simd-rule", kind, n, nh))


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("n, nh", [(1024, 1), (512, 1), (1024, 2), (256, 1)])
def test_vjp_staged_one_simd_grads(kernel_backend, monkeypatch, fresh_norm_calls, kind, dtype, n, nh):
    """Staged units of one simdgroup (one a threadgroup, row sums by shuffles alone): the plan,
    then the gradients (dx, dw, db) against float64 on rows that strided units share."""
    _one_simd_staged(monkeypatch)
    x = mx.zeros((37, n), dtype=dtype)
    _, kw, groups = norm_mod._vjp_plan(kind, x, mx.zeros((n,), dtype=dtype), kind == "ln", x, EPS, nh)
    t = dict(kw["template"])
    assert kw["threadgroup"] == (32, 1, 1) and t["ONE_SIMD"] and t["STAGED"] and t["TGSUM"] == 0, (kw["threadgroup"], t)
    assert t["N_READS"] == n // nh // 32 and t["STRIDED"], t
    _check_grads(kind, (37, n), dtype, True, kind == "ln", nh=nh, seed=seed_of("one-simd-staged", kind, str(dtype), n, nh))


@pytest.mark.emulator_only
@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_vjp_staged_one_simd_schedules(monkeypatch, kind):
    """Staged one-simdgroup units under every thread order: bit-identical, in bounds (each lane
    reads back only its own staged runs; no barrier a row)."""
    from xlstm_kernels.emulate import check_schedules

    _one_simd_staged(monkeypatch)
    rng = np.random.default_rng(seed_of("one-simd-schedules", kind))
    x, w, _ = make(rng, (9, 512), mx.bfloat16, True, kind == "ln")
    g = rand(rng, (9, 512), mx.bfloat16)
    spec, kw, groups = norm_mod._vjp_plan(kind, x, w, kind == "ln", g, EPS)
    assert dict(kw["template"])["ONE_SIMD"] and dict(kw["template"])["STAGED"] and groups == 9, (kw["template"], groups)
    check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1, 2), check_bounds=True, **kw)


def test_ln_vjp_wide_threads_register_hint(monkeypatch):
    """LayerNorm's staged units whose threads hold LN_VJP_WIDE_READS or more elements are
    planned at LN_VJP_STAGED_REGISTERS (16-bit rows of 4096: two units a SM, not three);
    narrower LayerNorm threads and every RMSNorm unit keep RMS_VJP_STAGED_REGISTERS; units
    that the shared memory holds to one a SM stay at one."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    assert norm_mod.LN_VJP_STAGED_REGISTERS == 255 and norm_mod.LN_VJP_WIDE_READS == 32

    def plan(kind, n, dt, rows=4096):
        x = mx.zeros((rows, n), dtype=dt)
        _, kw, groups = norm_mod._vjp_plan(kind, x, mx.zeros((n,), dtype=dt), kind == "ln", x, EPS)
        t = dict(kw["template"])
        return t["N_READS"], t["XK_MIN_BLOCKS"], groups

    assert plan("ln", 4096, mx.bfloat16) == (32, 2, norm_mod.RMS_VJP_SMS_CUDA * 2)
    assert plan("ln", 4096, mx.float16) == (32, 2, norm_mod.RMS_VJP_SMS_CUDA * 2)
    assert plan("rms", 4096, mx.bfloat16) == (32, 3, norm_mod.RMS_VJP_SMS_CUDA * 3)  # RMSNorm: no bias sums
    assert plan("ln", 2048, mx.bfloat16) == (16, 3, norm_mod.RMS_VJP_SMS_CUDA * 3)  # 16 elements a thread
    assert plan("ln", 4096, mx.float32)[1] == 1 and plan("ln", 8192, mx.bfloat16)[1] == 1  # shared memory: one
    monkeypatch.setattr(norm_mod, "LN_VJP_STAGED_REGISTERS", 160)  # the hint as before session 26
    assert plan("ln", 4096, mx.bfloat16)[1:] == (3, norm_mod.RMS_VJP_SMS_CUDA * 3)


def test_vjp_stages_plan(monkeypatch):
    """Stages of the staged backward by the bytes of a row's x and g: RMS_VJP_STAGES, two where
    RMS_VJP_TWO_STAGES holds the row, fewer where RMS_VJP_STAGE_BYTES runs out, at least two;
    the launch's NS, shared memory and units a SM follow."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    st = norm_mod._vjp_stages
    assert norm_mod.RMS_VJP_STAGES == 4 and norm_mod.RMS_VJP_TWO_STAGES == (8192, 16384)
    assert [st(b) for b in (512, 4096, 8192, 16384, 32768, 65536)] == [4, 4, 2, 2, 4, 2]
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGES", 6)
    assert [st(b) for b in (4096, 4097, 32768)] == [6, 6, 4]  # 32 KiB rows: four fill 128 KiB
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGES", 4)
    for kind, n, dt, ns, per_sm in (("rms", 4096, mx.float32, 4, 1), ("rms", 1024, mx.float32, 2, 3),
                                    ("ln", 1024, mx.bfloat16, 4, 3), ("ln", 4096, mx.bfloat16, 2, 2)):
        x = mx.zeros((4096, n), dtype=dt)
        _, kw, groups = norm_mod._vjp_plan(kind, x, mx.zeros((n,), dtype=dt), kind == "ln", x, EPS)
        t = dict(kw["template"])
        red = norm_mod.RMS_VJP_RED_BYTES if kind == "rms" else norm_mod.LN_VJP_RED_BYTES
        assert t["STAGED"] and t["NS"] == ns and kw["shared_memory"] == 2 * ns * n * dt.size + red, (kind, n, t)
        assert t["XK_MIN_BLOCKS"] == per_sm and groups == norm_mod.RMS_VJP_SMS_CUDA * per_sm, (kind, n, groups)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("stages", [3, 5])
@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("rows", [13, 3])  # two units: 7 + 6 rows (the ring wraps) or 2 + 1 (fewer rows than stages)
def test_vjp_staged_ring(kernel_backend, monkeypatch, fresh_norm_calls, dtype, stages, kind, rows):
    """The staged backward with `stages` stages (NS: each unit copies its rows NS - 1 ahead
    into a ring), units with more rows than stages and with fewer: dx, dw (and db) through the
    op on aligned and offset views against the reference's gradients, and under every thread
    order with bounds checked (emulator)."""
    from xlstm_kernels.emulate import check_schedules

    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", 2)
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_UNITS_PER_SM", 1)
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_THREADS_PER_SM", 0)
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGES", stages)
    monkeypatch.setattr(norm_mod, "RMS_VJP_TWO_STAGES", (0, 0))
    dt = DTYPES[dtype]
    n = 512 * 4 // dt.size  # 128 threads x 4 float32 (16-bit: x 8)
    rng = np.random.default_rng(seed_of("vjp-ring", kind, dtype, stages, rows))
    x, w, b = make(rng, (rows, n), dt, True, kind == "ln")
    g = rand(rng, (rows, n), dt)
    spec, kw, groups = norm_mod._vjp_plan(kind, x, w, kind == "ln", g, EPS)
    t = dict(kw["template"])
    assert t["STAGED"] and t["NS"] == stages and t["STRIDED"] and groups == 2, t
    if kind == "rms":
        _check_rms_grads_at_offsets(x, w, g)
    else:
        want = _ln_grads64(x, w, b, g, 1)
        limit = 2e-5 if dt == mx.float32 else 1.5e-2
        for off in (0, 1):
            got = mx.vjp(lambda a, c, e: layer_norm(a, c, e, EPS), [offset_view(x, off), w, b], [offset_view(g, off)])[1]
            for got_k, want_k in zip(got, want):
                assert rel_err(got_k, want_k) < limit, (off, stages)
    outs = check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1,), check_bounds=True, **kw)
    assert outs[0].shape == (rows, n)


@pytest.mark.emulator_only
def test_rms_vjp_staged_schedules(monkeypatch):
    """The staged backward under every thread order: bit-identical, in bounds, no races on
    the stages (each thread reads back only its own copies)."""
    from xlstm_kernels.emulate import check_schedules

    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", 2)
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_UNITS_PER_SM", 1)
    monkeypatch.setattr(norm_mod, "RMS_VJP_STAGED_THREADS_PER_SM", 0)
    rng = np.random.default_rng(9)
    x, w, _ = make(rng, (5, 512), mx.bfloat16, True, False)
    g = rand(rng, (5, 512), mx.bfloat16)
    spec, kw, _ = norm_mod._vjp_plan("rms", x, w, False, g, EPS)
    assert dict(kw["template"])["STAGED"] and kw["threadgroup"][0] == 64
    check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1, 2), check_bounds=True, **kw)


def _staged_forward_plan(monkeypatch, sms=2):
    """The RMSNorm forward planned as on CUDA with its staged rows on, `sms` SMs of one unit."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "RMS_FWD_STAGED_CUDA", True)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", sms)
    monkeypatch.setattr(norm_mod, "RMS_FWD_STAGED_UNITS_PER_SM", 1)
    monkeypatch.setattr(norm_mod, "RMS_FWD_STAGED_MIN_WAVES", 0.0)  # a few rows: well under a wave


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("has_w", [True, False])
@pytest.mark.parametrize("n", [512, 4096])  # float32 elements (16-bit: twice): 128 threads x 4 / x 32
def test_rms_norm_staged_rows(kernel_backend, monkeypatch, fresh_norm_calls, dtype, n, has_w):
    """The RMSNorm forward whose persistent units stage their next row in threadgroup memory
    (STAGED, planned as on CUDA): two units over 7 rows (4 + 3: both stages, the last row
    copying nothing), aligned and offset views (plain copies and element stores), against
    float64, and bit-identical to the unstaged FULL kernel launched directly."""
    from xlstm_kernels.runtime import launch

    _staged_forward_plan(monkeypatch)
    dt = DTYPES[dtype]
    n = n * 4 // dt.size
    rng = np.random.default_rng(seed_of("fwd-staged", dtype, n, has_w))
    x, w, _ = make(rng, (7, n), dt, has_w, False)
    spec, kw = norm_mod._plan("rms", x, w, None, EPS)
    t = dict(kw["template"])
    assert t["STAGED"] and t["FULL"] == 1 and t["NF"] == n and t["XK_MIN_BLOCKS"] == 1, t
    assert kw["grid"] == (kw["threadgroup"][0], 2, 1) and kw["threadgroup"][1] == 1
    assert kw["shared_memory"] == 2 * n * dt.size + norm_mod.RMS_FWD_RED_BYTES
    want = rms_ref64(x, w)
    for off in (0, 1):
        wv = None if w is None else offset_view(w, off)
        assert rel_err(rms_norm(offset_view(x, off), wv, EPS), want) < tol(dt), off
    (staged,) = launch(spec, **kw)
    plain = dict(kw, grid=(kw["grid"][0], 7, 1), template=[(k, False if k == "STAGED" else v) for k, v in t.items()
                                                          if k != "XK_MIN_BLOCKS"])
    del plain["shared_memory"]
    (unstaged,) = launch(spec, **plain)
    assert rel_err(staged, want) < tol(dt)
    assert np.array_equal(np.array(staged.astype(mx.float32)), np.array(unstaged.astype(mx.float32)))


def test_rms_norm_staged_plan(monkeypatch):
    """Which forward rows stage on the CUDA plan, and how many units: SMs x the units that
    fit one (shared memory, 2048 threads, RMS_FWD_STAGED_UNITS_PER_SM), at most one per row;
    off the CUDA plan, with the switch off, a simdgroup per row or past RMS_FWD_STAGE_BYTES:
    unstaged, one threadgroup per row."""
    def plan(shape, dtype=mx.float32):
        x = mx.zeros(shape, dtype=dtype)
        kw = norm_mod._plan("rms", x, x[0], None, EPS)[1]
        return dict(kw["template"]).get("STAGED"), kw["grid"][1]

    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: False)
    assert plan((2048, 4096)) == (False, 2048)  # not the CUDA plan
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "RMS_FWD_STAGED_CUDA", False)
    assert plan((2048, 4096)) == (False, 2048)
    monkeypatch.setattr(norm_mod, "RMS_FWD_STAGED_CUDA", True)
    sms = norm_mod.RMS_VJP_SMS_CUDA
    # float32 4096: 128 threads x 32 elements, 56 registers at the hint: 9 rows resident per SM;
    # 32 KiB of stages, 6 units fit an SM's shared memory
    resident = sms * 9
    assert plan((resident + 1, 4096)) == (True, sms * 6)  # 228 KiB // (32 KiB + 256 + 1024)
    most = int(norm_mod.RMS_FWD_STAGED_MAX_WAVES * resident)
    assert plan((most, 4096))[0] and not plan((most + 1, 4096))[0]  # past the window's waves
    assert plan((resident, 4096)) == (False, resident)  # one wave
    # float32 1024: 128 x 8, 32 registers: 16 rows per SM; 8 KiB of stages: 8 units per SM
    assert plan((sms * 16 * 3 // 2, 1024)) == (True, sms * norm_mod.RMS_FWD_STAGED_UNITS_PER_SM)
    monkeypatch.setattr(norm_mod, "RMS_FWD_STAGED_MIN_WAVES", 0.0)
    assert plan((100, 1024)) == (True, 100)  # at most one unit per row
    assert plan((64, 128)) == (False, 64 // norm_mod.SIMD_ROWS * norm_mod.SIMD_ROWS)  # a simdgroup per row
    monkeypatch.setattr(norm_mod, "RMS_FWD_STAGE_BYTES", 16384)
    assert plan((2048, 4096)) == (False, 2048)


@pytest.mark.emulator_only
def test_rms_norm_staged_schedules(monkeypatch, fresh_norm_calls):
    """The staged forward under every thread order: bit-identical, in bounds, no races on the
    stages (each thread reads back only its own copies)."""
    from xlstm_kernels.emulate import check_schedules

    _staged_forward_plan(monkeypatch)
    rng = np.random.default_rng(10)
    x, w, _ = make(rng, (5, 512), mx.bfloat16, True, False)
    spec, kw = norm_mod._plan("rms", x, w, None, EPS)
    assert dict(kw["template"])["STAGED"] and kw["threadgroup"][0] == 64
    (y,) = check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1, 2), check_bounds=True, **kw)
    assert rel_err(y, rms_ref64(x, w)) < tol(mx.bfloat16)


def test_forward_looped_short_rows(kernel_backend, monkeypatch):
    """The looped kernels with several chunks per thread and a ragged tail."""
    monkeypatch.setattr(norm_mod, "CACHED_MAX", 64)
    monkeypatch.setattr(norm_mod, "LOOPED_THREADS", 64)
    rng = np.random.default_rng(5)
    x, w, b = make(rng, (3, 4 * 2 * 4 * 64 + 3), mx.float32, True, True)
    assert rel_err(layer_norm(x, w, b, EPS), ln_ref64(x, w, b)) < 1e-5
    assert rel_err(rms_norm(x, w, EPS), rms_ref64(x, w)) < 1e-5
    assert norm_mod._plan("ln", x, w, b, EPS)[0].kernel == "layer_norm_looped"


# runs: vector body, scalar tail, misaligned buffers ---------------------------------------


def offset_view(a: mx.array, off: int) -> mx.array:
    """`a`'s values in a row-contiguous view that starts `off` elements into a larger
    buffer (no copy: the data pointer is not 16-byte aligned for off % 8 != 0)."""
    if not off:
        return a
    flat = a.reshape(-1)
    big = mx.concatenate([mx.zeros((off,), dtype=a.dtype), flat, mx.zeros((3,), dtype=a.dtype)])
    return big[off : off + flat.size].reshape(a.shape)


# Row lengths around the run widths (4 float32 / 8 16-bit elements) and the layouts: one
# simdgroup (33), threadgroup per row with a ragged last run (129, 300), looped with a
# second step of a few elements (4100), a full cached row (4096), tiny rows (5).
RUN_SHAPES = [(3, 33), (2, 129), (3, 300), (2, 4100), (1, 4096), (2, 3, 5)]


@pytest.mark.parametrize("shape", RUN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("off", [0, 1, 2, 4])
def test_runs_and_misaligned_inputs(kernel_backend, shape, dtype, off):
    """Forward and backward of both norms on x, weight, bias and cotangent views that start
    off elements into their buffers (off 1, 2: no 16-byte alignment, so the wide accesses
    fall back to narrower ones on CUDA; 4: 16-byte aligned for 16-bit types only)."""
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed_of("runs", shape, dtype))
    x, w, b = make(rng, shape, dt, True, True)
    cot = rand(rng, shape, dt)
    xv, wv, bv, cv = (offset_view(a, off) for a in (x, w, b, cot))
    assert rel_err(rms_norm(xv, wv, EPS), rms_ref64(x, w)) < tol(dt)
    assert rel_err(layer_norm(xv, wv, bv, EPS), ln_ref64(x, w, b)) < tol(dt)
    limit = 2e-5 if dt == mx.float32 else 1.5e-2
    for kind, args in (("rms", [xv, wv]), ("ln", [xv, wv, bv])):
        fn = (lambda a, c: rms_norm(a, c, EPS)) if kind == "rms" else (lambda a, c, d: layer_norm(a, c, d, EPS))
        got = _grads(fn, args, cv)
        with runtime.use_backend("reference"):
            want = _grads(fn, [a.astype(mx.float32) for a in args], cot.astype(mx.float32))
        for name, g, r in zip(("dx", "dweight", "dbias"), got, want):
            assert rel_err(g, r) < limit, (kind, name)


@pytest.mark.parametrize("n_reads", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_n_reads_16bit(kernel_backend, n_reads, dtype):
    """Every n_reads on 16-bit data (runs of up to 8 elements = 16 bytes), aligned and not,
    on the one-simdgroup, cached and looped layouts."""
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed_of("nr16", n_reads, dtype))
    for n in (33, 129, 300, 1031, 8200):
        x, w, b = make(rng, (2, n), dt, True, True)
        for off in (0, 3):
            xv, wv, bv = (offset_view(a, off) for a in (x, w, b))
            assert rel_err(rms_norm(xv, wv, EPS, knobs={"n_reads": n_reads}), rms_ref64(x, w)) < tol(dt), (n, off)
            y = layer_norm(xv, wv, bv, EPS, knobs={"n_reads": n_reads})
            assert rel_err(y, ln_ref64(x, w, b)) < tol(dt), (n, off)


@pytest.mark.parametrize("nh,dh", [(3, 33), (2, 4100)])
def test_multihead_odd_head_slices(kernel_backend, nh, dh):
    """Head slices of odd length: each head's rows and weight slices start at a different
    alignment (runs fall back where they are misaligned)."""
    rng = np.random.default_rng(seed_of("mhodd", nh, dh))
    x, w, b = make(rng, (3, nh * dh), mx.bfloat16, True, True)
    assert rel_err(multihead_layer_norm(x, w, b, nh, EPS), ln_ref64(x, w, b, num_heads=nh)) < 1e-2
    _check_grads("ln", (3, nh * dh), mx.float32, True, True, nh=nh, seed=seed_of("gmhodd", nh, dh))


# the shared vector-access helpers (metal_src/_memory.metal; CUDA: cuda/vector_io.h) ------

MEM_BODY = """
const uint t = thread_position_in_grid.x;
const uint i = t * 8;  // modes 0-2: elements [i, i + 8) of this thread
device T* yo = y + OFF;
if (MODE < 3 && i + 8 <= n) {
  if (MODE == 0) {
    xk_store<4>(yo + i, xk_load<4>(x + i));
    xk_store<4>(yo + i + 4, xk_load<4>(x + i + 4));
  } else if (MODE == 1) {
    vec<T, 4> lo, hi;
    xk_load8(x + i, lo, hi);
    xk_store8(yo + i, lo, hi);
  } else {
    for (int k = 0; k < 8; k += 2) {
      xk_store<2>(yo + i + k, xk_load<2>(x + i + k));
    }
  }
} else if (MODE < 3) {
  for (uint k = i; k < n; k++) {
    yo[k] = x[k];
  }
} else {  // runs of 4: two per thread, run j at element 4 t + 4 j * threads (tail element-wise)
  T v[8];
  xk_load_runs<4, 2>(x, t * 4, threads_per_grid.x * 4, n, v);
  xk_store_runs<4, 2>(yo, t * 4, threads_per_grid.x * 4, n, v);
}
"""


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", [0, 1, 2, 3], ids=["load4", "load8", "load2", "runs"])
@pytest.mark.parametrize("x_off,y_off", [(0, 0), (1, 3), (2, 1), (4, 2)])
def test_vector_access_helpers(metal_kernel, dtype, mode, x_off, y_off):
    """xk_load / xk_store (2, 4), xk_load8 / xk_store8 and xk_load_runs / xk_store_runs copy
    exactly, at any alignment of source and destination (on CUDA the wide accesses and
    their narrower fallbacks)."""
    from xlstm_kernels.runtime.sources import family_sections

    dt = DTYPES[dtype]
    n = 77
    x = offset_view(rand(np.random.default_rng(seed_of("mem", dtype)), (n,), dt), x_off)
    k = metal_kernel(name="xk_mem_copy", input_names=["x", "n"], output_names=["y"], source=MEM_BODY,
                     header=family_sections("_memory")["@header"])
    (y,) = k(inputs=[x, mx.array(n, dtype=mx.uint32)], output_shapes=[(n + 8,)], output_dtypes=[dt],
             grid=(-(-n // 8), 1, 1), threadgroup=(4, 1, 1),
             template=[("T", dt), ("MODE", mode), ("OFF", y_off)], init_value=0)
    assert mx.array_equal(y[y_off:y_off + n], x).item()


# kernel choice, validation, edge cases ------------------------------------------------


@pytest.mark.parametrize(
    "d,dtype,kernel,tg,n_reads",
    [(7, "float32", "rms_norm", (32, 8, 1), 4), (128, "float32", "rms_norm", (32, 8, 1), 4),
     (129, "float32", "rms_norm", (64, 1, 1), 4), (512, "float32", "rms_norm", (128, 1, 1), 4),
     (1031, "float32", "rms_norm", (96, 1, 1), 16), (4096, "float32", "rms_norm", (128, 1, 1), 32),
     (4097, "float32", "rms_norm_looped", (1024, 1, 1), 4), (256, "bfloat16", "rms_norm", (32, 8, 1), 8),
     (4096, "bfloat16", "rms_norm", (128, 1, 1), 32), (8192, "float16", "rms_norm", (128, 1, 1), 64),
     (8193, "bfloat16", "rms_norm_looped", (1024, 1, 1), 8)],
)
def test_plan_picks_layout(d, dtype, kernel, tg, n_reads, monkeypatch):
    """The automatic layout: runs of 16 bytes, one simdgroup per row up to 32 runs, then
    about CACHED_THREADS threads with ceil(runs / CACHED_THREADS) runs each, then looped.
    (Preset family cpu: no norm knobs; the H100's: test_nvidia_preset_norm_layouts. Planned as
    off CUDA: CUDA's rows of one simdgroup in narrower runs, test_forward_short_rows_full_lanes.)"""
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "cpu")
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: False)
    spec, kw = norm_mod._plan("rms", mx.zeros((16, d), dtype=DTYPES[dtype]), None, None, EPS)
    assert spec.kernel == kernel and kw["threadgroup"] == tg and dict(kw["template"])["N_READS"] == n_reads
    assert kw["grid"][1] % tg[1] == 0 and kw["grid"][1] >= 16
    assert norm_mod.knob_values("rms_norm", d, dtype)["n_reads"] == n_reads


@pytest.mark.parametrize(
    "d,dtype,kernel,tpr,n_reads",
    [(100, "float32", "rms_norm_vjp", 32, 4), (4096, "float32", "rms_norm_vjp", 256, 16),
     (4097, "float32", "rms_norm_vjp_looped", 1024, 4), (2048, "bfloat16", "rms_norm_vjp", 256, 8),
     (4096, "bfloat16", "rms_norm_vjp", 256, 16), (4104, "bfloat16", "rms_norm_vjp_looped", 1024, 8)],
)
def test_vjp_plan_picks_layout(d, dtype, kernel, tpr, n_reads, monkeypatch):
    """Backward: about VJP_THREADS threads per row, at most VJP_MAX_READS elements each
    (the Metal / emulator plan; CUDA's 16-bit rows: test_rms_vjp_units_fill_one_wave_on_cuda)."""
    monkeypatch.setattr(norm_mod, "current_backend", lambda: "emulate")
    x = mx.zeros((16, d), dtype=DTYPES[dtype])
    spec, kw, _ = norm_mod._vjp_plan("rms", x, None, False, x, EPS)
    assert spec.kernel == kernel and kw["threadgroup"][0] == tpr and dict(kw["template"])["N_READS"] == n_reads


def test_errors():
    x = mx.zeros((4, 12))
    with pytest.raises(ValueError, match=r"weight must have shape \(12,\)"):
        rms_norm(x, mx.ones((11,)))
    with pytest.raises(ValueError, match=r"bias must have shape \(12,\)"):
        layer_norm(x, None, mx.ones((13,)))
    with pytest.raises(ValueError, match="weight must have 1 dimensions"):
        layer_norm(x, mx.ones((1, 12)), None)
    with pytest.raises(ValueError, match="num_heads=5 does not divide"):
        multihead_layer_norm(x, None, None, 5)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        multihead_layer_norm(x, None, None, 0)
    with pytest.raises(TypeError, match="x has dtype .*int32"):
        rms_norm(mx.zeros((4, 12), dtype=mx.int32), None)
    with pytest.raises(TypeError, match="weight has dtype .*int32"):
        layer_norm(x, mx.ones((12,), dtype=mx.int32), None)
    with pytest.raises(ValueError, match="eps must be a finite non-negative float"):
        rms_norm(x, None, -1e-5)
    with pytest.raises(ValueError, match="eps must be a finite non-negative float"):
        layer_norm(x, None, None, float("nan"))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        layer_norm(mx.array(1.0), None, None)
    with pytest.raises(TypeError, match="must be an mx.array"):
        rms_norm(np.zeros((2, 3), dtype=np.float32), None)


@pytest.mark.parametrize("shape", [(0, 12), (3, 0), (2, 0, 12)])
def test_zero_size(kernel_backend, shape):
    x = mx.zeros(shape)
    d = shape[-1]
    w = mx.ones((d,))
    for y in (rms_norm(x, w), layer_norm(x, w, w), multihead_layer_norm(x, w, None, 1 if d == 0 else 4)):
        mx.eval(y)
        assert y.shape == shape and y.size == 0


def test_dtype_promotion(kernel_backend):
    """As mx.fast: a float32 weight with bfloat16 x gives float32 (computed on x's values)."""
    rng = np.random.default_rng(9)
    x = rand(rng, (3, 40), mx.bfloat16)
    w = rand(rng, (40,))
    y = rms_norm(x, w)
    assert y.dtype == mx.float32
    assert rel_err(y, rms_ref64(x, w)) < 1e-5
    assert layer_norm(x.astype(mx.float16), None, w.astype(mx.bfloat16)).dtype == mx.float32


def test_reference_backend_matches():
    rng = np.random.default_rng(2)
    x, w, b = make(rng, (3, 4 * 48), mx.float32, True, True)
    with runtime.use_backend("reference"):
        assert rel_err(rms_norm(x, w), rms_ref64(x, w)) < 1e-5
        assert rel_err(layer_norm(x, w, b), ln_ref64(x, w, b)) < 1e-5
        assert rel_err(multihead_layer_norm(x, w, b, 4), ln_ref64(x, w, b, num_heads=4)) < 1e-5


# the emulator's own checks ------------------------------------------------------------


def _kernel_cases():
    """(spec, launch kwargs) for every kernel and layout, on small odd shapes."""
    rng = np.random.default_rng(7)
    cases = []
    for d in (7, 300, 4097):  # simdgroup per row, threadgroup per row (3 simdgroups), looped
        rows = 2 if d > 4096 else 5
        x, w, b = make(rng, (rows, d), mx.float32, True, True)
        g = rand(rng, (rows, d))
        for kind, bias in (("rms", None), ("ln", b)):
            cases.append(norm_mod._plan(kind, x, w, bias, EPS))
            cases.append(norm_mod._vjp_plan(kind, x, w, bias is not None, g, EPS)[:2])
    xb, wb, bb = make(rng, (3, 1031), mx.bfloat16, True, True)  # runs of 8 with a 7-element tail
    cases.append(norm_mod._plan("ln", xb, wb, bb, EPS, 1, {"n_reads": 8}))
    xl, wl, _ = make(rng, (2, 8200), mx.bfloat16, True, False)  # looped, 17 steps of 64 runs of 8 + 8
    cases.append(norm_mod._plan("rms", xl, wl, None, EPS, 1, {"n_reads": 8, "looped_threads": 64}))
    cases.append(norm_mod._plan("rms", offset_view(xb, 1), wb, None, EPS, 1, {"n_reads": 2}))
    x, w, _ = make(rng, (7, 3 * 20), mx.float16, True, False)  # 3 heads of 20
    cases.append(norm_mod._plan("ln", x, w, None, EPS, 3))
    cases.append(norm_mod._vjp_plan("ln", x, w, False, rand(rng, x.shape, mx.float16), EPS, 3)[:2])
    return cases


@pytest.mark.emulator_only
def test_check_schedules_every_kernel(monkeypatch):
    from xlstm_kernels.emulate import check_schedules

    # Few backward units, so that each sums its partials over several rows.
    monkeypatch.setattr(norm_mod, "VJP_TARGET_THREADS", 288)
    seen = set()
    for spec, kw in _kernel_cases():
        seen.add(spec.kernel)
        check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1,), **kw)
    assert seen == {s.kernel for s in norm_mod._SPECS.values()}


@pytest.mark.emulator_only
def test_check_bounds_odd_shape():
    rng = np.random.default_rng(8)
    x, w, b = make(rng, (3, 5, 2 * 13), mx.bfloat16, True, True)  # rows of 2 heads x 13
    g = rand(rng, x.shape, mx.bfloat16)
    xl, wl, _ = make(rng, (2, 4099), mx.float16, True, False)
    gl = rand(rng, xl.shape, mx.float16)
    xm, wm, bm = make(rng, (3, 301), mx.float32, True, True)
    plans = [
        norm_mod._plan("ln", x, w, b, EPS, 2),
        norm_mod._vjp_plan("ln", x, w, True, g, EPS, 2)[:2],
        norm_mod._plan("rms", xl, wl, None, EPS),
        norm_mod._vjp_plan("rms", xl, wl, False, gl, EPS)[:2],
        norm_mod._plan("ln", xm, wm, bm, EPS),
    ]
    outs = [runtime.get_kernel(spec, "emulate")(**kw, check_bounds=True) for spec, kw in plans]
    mx.eval(outs)
    assert rel_err(outs[0][0].reshape(x.shape), ln_ref64(x, w, b, num_heads=2)) < 1e-2
    assert rel_err(outs[2][0], rms_ref64(xl, wl)) < 1e-2
    assert rel_err(outs[4][0], ln_ref64(xm, wm, bm)) < 1e-5


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", [128, 512, 2048])
@pytest.mark.parametrize("has_w", [True, False])
def test_rms_norm_full_rows(kernel_backend, dtype, n, has_w):
    """RMSNorm rows of exactly tpr * n_reads elements (FULL = 1: no bounds code), on
    aligned and offset views (off 1: the element path on CUDA), and the kernel with
    FULL = 0 (general path) and FULL = 2 (always element accesses) against the reference."""
    from xlstm_kernels.runtime import launch

    dt = DTYPES[dtype]
    n = n * 4 // dt.size  # 16-bit: twice as long (runs of 8 elements)
    rng = np.random.default_rng(seed_of("full", dtype, n, has_w))
    x, w, _ = make(rng, (3, n), dt, has_w, False)
    spec, kw = norm_mod._plan("rms", x, w, None, EPS)
    assert dict(kw["template"])["FULL"] == int(dt in norm_mod.FULL_FORWARD_DTYPES)
    assert kw["threadgroup"][0] * dict(kw["template"])["N_READS"] == n
    want = rms_ref64(x, w)
    for off in (0, 1):
        xv = offset_view(x, off)
        wv = None if w is None else offset_view(w, off)
        assert rel_err(rms_norm(xv, wv, EPS), want) < tol(dt), off
    assert dict(kw["template"])["NF"] == (n if dict(kw["template"])["FULL"] else 0)
    # FULL rows take eps from its float bits: another eps is another kernel, same answer
    assert dict(kw["template"])["EPSB"] == (norm_mod._float_bits(EPS) if dict(kw["template"])["FULL"] else 0)
    assert rel_err(rms_norm(x, w, 0.25), rms_ref64(x, w, 0.25)) < tol(dt)
    for full in (0, 1, 2):
        forced = {"FULL": full, "NF": n if full else 0, "EPSB": norm_mod._float_bits(EPS) if full else 0}
        kw2 = dict(kw, template=[(k, forced.get(k, v)) for k, v in kw["template"]])
        assert rel_err(launch(spec, **kw2)[0], want) < tol(dt), full
    # a row one run short is not FULL
    _, kw3 = norm_mod._plan("rms", x[:, : n - 8], None, None, EPS)
    assert dict(kw3["template"])["FULL"] == 0 and dict(kw3["template"])["NF"] == 0


def _forced_full(kw: dict, full: int, n: int) -> dict:
    """A LayerNorm forward plan's launch keywords with FULL forced to `full` (0: the general
    path, which takes a row a simdgroup: RW 1 and its grid; 2: always element accesses)."""
    forced = {"FULL": full, "NF": n if full else 0, "EPSB": norm_mod._float_bits(EPS) if full else 0}
    if full == 0:
        forced["RW"] = 1
        forced["EWB"] = False  # EWB needs RW > 1
        forced["AFT"] = False  # AFT needs FULL rows
    out = dict(kw, template=[(k, forced.get(k, v)) for k, v in kw["template"]])
    if full == 0 and dict(kw["template"]).get("RW", 1) > 1:
        rows, r = kw["output_shapes"][0][0], norm_mod.SIMD_ROWS if kw["threadgroup"][1] > 1 else 1
        r = min(r, rows)
        out["threadgroup"] = (kw["threadgroup"][0], r, 1)
        out["grid"] = (kw["grid"][0], r * -(-rows // r), 1)
    return out


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", [128, 512, 2048])
@pytest.mark.parametrize("has_w,has_b", [(True, True), (False, True), (True, False), (False, False)])
def test_layer_norm_full_rows(kernel_backend, dtype, n, has_w, has_b):
    """LayerNorm rows of exactly tpr * n_reads elements (FULL = 1, as RMSNorm's): on aligned
    and offset views (the element path on CUDA), FULL = 0 / 1 / 2 launched directly, every
    thread order with bounds checked, against float64; multi-head rows (FULL too) likewise."""
    from xlstm_kernels.emulate import check_schedules
    from xlstm_kernels.runtime import launch

    dt = DTYPES[dtype]
    n = n * 4 // dt.size
    rng = np.random.default_rng(seed_of("lnfull", dtype, n, has_w, has_b))
    # 11 rows: the simdgroup-per-row layout (n = 128 float32) has threadgroups of 8 rows, so
    # the second one runs past the last row (the kernel's row guard)
    x, w, b = make(rng, (11, n), dt, has_w, has_b)
    spec, kw = norm_mod._plan("ln", x, w, b, EPS)
    t = dict(kw["template"])
    assert t["FULL"] == 1 and t["NF"] == n and t["EPSB"] == norm_mod._float_bits(EPS), t
    assert kw["threadgroup"][0] * t["N_READS"] == n
    want = ln_ref64(x, w, b)
    # all offset, and (x aligned) the weight alone or the bias alone: each must take the
    # element path where it is misaligned (a wide access there faults on CUDA)
    for offs in ((0, 0, 0), (1, 1, 1), (0, 1, 0), (0, 0, 1)):
        views = [None if a is None else offset_view(a, o) for a, o in zip((x, w, b), offs)]
        assert rel_err(layer_norm(*views, EPS), want) < tol(dt), offs
    assert rel_err(layer_norm(x, w, b, 0.25), ln_ref64(x, w, b, 0.25)) < tol(dt)
    for full in (0, 1, 2):
        assert rel_err(launch(spec, **_forced_full(kw, full, n))[0], want) < tol(dt), full
    if n <= 1024:  # every schedule (the emulator), the FULL path
        (y,) = check_schedules(runtime.get_kernel(spec, "emulate"), **kw, check_bounds=True)
        assert rel_err(y, want) < tol(dt)
    _, kw3 = norm_mod._plan("ln", x[:, : n - 8], None, None, EPS)  # a row one run short
    assert dict(kw3["template"])["FULL"] == 0
    # two heads (multi-head LayerNorm): FULL rows too, each head's own weight and bias slices
    xm = mx.concatenate([x, rand(rng, x.shape, dt)], axis=-1)
    wm, bm = [None if a is None else mx.concatenate([a, rand(rng, a.shape, dt)]) for a in (w, b)]
    spec4, kw4 = norm_mod._plan("ln", xm, wm, bm, EPS, 2)
    assert dict(kw4["template"])["FULL"] == 1
    want4 = ln_ref64(xm, wm, bm, num_heads=2)
    for full in (0, 1, 2):
        assert rel_err(launch(spec4, **_forced_full(kw4, full, n))[0].reshape(xm.shape), want4) < tol(dt), ("heads", full)
    views = [None if a is None else offset_view(a, 1) for a in (xm, wm, bm)]
    assert rel_err(multihead_layer_norm(views[0], views[1], views[2], 2, EPS), want4) < tol(dt)


def _ln_grads64(x, w, b, g, nh=1):
    """float64 dx, dw, db of LayerNorm (heads of the last axis) for cotangent g."""
    x64, g64 = f64(x), f64(g)
    shape = x64.shape
    xh = x64.reshape(-1, nh, shape[-1] // nh)
    gh = g64.reshape(-1, nh, shape[-1] // nh)
    w64 = np.ones(shape[-1]) if w is None else f64(w)
    wh = w64.reshape(nh, -1)
    mu = xh.mean(-1, keepdims=True)
    r = 1.0 / np.sqrt(((xh - mu) ** 2).mean(-1, keepdims=True) + EPS)
    xhat = (xh - mu) * r
    gw = gh * wh
    dx = r * (gw - gw.mean(-1, keepdims=True) - xhat * (gw * xhat).mean(-1, keepdims=True))
    return dx.reshape(shape), (gh * xhat).sum(0).reshape(-1), gh.sum(0).reshape(-1)


@pytest.mark.parametrize("dtype", list(DTYPES))
# float32 elements (16-bit: twice): 64-thread units (six a SM: RMS_VJP_STAGED_THREADS_PER_SM), 128 threads of whole runs
@pytest.mark.parametrize("n", [256, 512, 2048])
@pytest.mark.parametrize("has_w,has_b,nh", [(True, True, 1), (False, True, 1), (True, False, 2), (False, False, 1)])
def test_ln_vjp_staged(kernel_backend, monkeypatch, fresh_norm_calls, dtype, n, has_w, has_b, nh):
    """The LayerNorm backward with CUDA's staged plan (LN_VJP_STAGED_CUDA: the next row of x
    and g copied into threadgroup memory while this one is reduced, units taking every
    groups-th row) on every backend: through the op on aligned and offset views (element
    copies), launched directly with STAGED off, and (emulator) under every thread order
    with bounds checked; dx, dw, db against float64."""
    from xlstm_kernels.emulate import check_schedules
    from xlstm_kernels.runtime import launch

    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", 1)  # 3 (or 6) units: each takes several of the 7 rows
    dt = DTYPES[dtype]
    n = n * 4 // dt.size
    rng = np.random.default_rng(seed_of("lnstaged", dtype, n, has_w, has_b, nh))
    x, w, b = make(rng, (7, nh * n), dt, has_w, has_b)
    g = rand(rng, (7, nh * n), dt)
    want = _ln_grads64(x, w, b, g, nh)
    limit = 2e-5 if dt == mx.float32 else 1.5e-2
    spec, kw, groups = norm_mod._vjp_plan("ln", x, w, has_b, g, EPS, nh)
    t = dict(kw["template"])
    assert spec.kernel == "layer_norm_vjp" and t["STAGED"] and t["NF"] == n and t["STRIDED"], t
    # 64-thread units for 1 KiB rows; 32 elements a thread (16-bit rows of 4096): two units a SM
    per_sm = 6 if n * dt.size == 1024 else (2 if n // 128 >= norm_mod.LN_VJP_WIDE_READS else 3)
    assert kw["threadgroup"][0] == (64 if per_sm == 6 else 128)
    assert kw["shared_memory"] >= 4 * n * dt.size and groups == (max(1, per_sm // nh) if (has_w or has_b) else 7)

    def check(outs, tag):
        assert rel_err(outs[0].reshape(x.shape), want[0]) < limit, tag
        if has_w:
            assert rel_err(outs[1].sum(axis=0), want[1]) < limit, tag
        if has_b:
            assert rel_err(outs[2].sum(axis=0), want[2]) < limit, tag

    for xo, go in ((0, 0), (1, 1), (0, 1), (1, 0)):  # x or g alone misaligned: element copies
        xs, gs = offset_view(x, xo), offset_view(g, go)
        off = (xo, go)
        args = [xs] + ([w] if has_w else []) + ([b] if has_b else [])

        def call(*a):
            wa = a[1] if has_w else None
            ba = a[1 + has_w] if has_b else None
            return layer_norm(a[0], wa, ba, EPS) if nh == 1 else multihead_layer_norm(a[0], wa, ba, nh, EPS)

        got = mx.vjp(call, args, [gs])[1]
        assert rel_err(got[0], want[0]) < limit, off
        if has_w:
            assert rel_err(got[1], want[1]) < limit, off
        if has_b:
            assert rel_err(got[1 + has_w], want[2]) < limit, off
    check(launch(spec, **kw), "staged")
    unstaged = {"STAGED": False, "NF": 0, "STRIDED": False}
    kw2 = {k: v for k, v in kw.items() if k != "shared_memory"}
    kw2["template"] = [(k, unstaged.get(k, v)) for k, v in kw["template"]]
    check(launch(spec, **kw2), "unstaged")
    if n * dt.size <= 2048:
        check(check_schedules(runtime.get_kernel(spec, "emulate"), **kw, check_bounds=True), "schedules")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n,nh", [(64, 4), (33, 3), (128, 1), (5, 2)])
@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_forward_short_rows_full_lanes(kernel_backend, monkeypatch, fresh_norm_calls, dtype, n, nh, kind):
    """The forward's rows of one simdgroup planned as on CUDA (FWD_SHORT_LANES_CUDA): runs of
    _short_row_reads(n) elements (heads of 64 in 2-element runs over all 32 lanes), and the
    16-byte runs where the n_reads knob is given; through the op on aligned and offset views
    and (emulator) under every thread order with bounds checked, against float64."""
    from xlstm_kernels.emulate import check_schedules

    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    dt = DTYPES[dtype]
    if kind == "rms":
        nh = 1
    rng = np.random.default_rng(seed_of("fwd-short", dtype, n, nh, kind))
    x, w, b = make(rng, (19, nh * n), dt, True, kind == "ln")
    want = rms_ref64(x, w) if kind == "rms" else ln_ref64(x, w, b, num_heads=nh)
    spec, kw = norm_mod._plan(kind, x, w, b, EPS, nh)
    t = dict(kw["template"])
    assert t["ONE_SIMD"] and t["N_READS"] == norm_mod._short_row_reads(n), t
    wide = 16 // dt.size
    assert dict(norm_mod._plan(kind, x, w, b, EPS, nh, {"n_reads": wide})[1]["template"])["N_READS"] == wide

    def call(a):
        if kind == "rms":
            return rms_norm(a, w, EPS)
        return layer_norm(a, w, b, EPS) if nh == 1 else multihead_layer_norm(a, w, b, nh, EPS)

    for off in (0, 1):
        assert rel_err(call(offset_view(x, off)), want) < tol(dt), off
    outs = check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1,), check_bounds=True, **kw)
    assert rel_err(outs[0].reshape(x.shape), want) < tol(dt)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n,nh,reads,one_simd", [(1024, 1, 32, True), (512, 2, 16, True), (2048, 1, 32, False),
                                                 (768, 1, 8, False), (1031, 1, None, False)])
@pytest.mark.parametrize("wide", [True, False])
def test_ln_forward_16bit_wide_threads(kernel_backend, monkeypatch, fresh_norm_calls, dtype, n, nh, reads, one_simd,
                                       wide):
    """16-bit LayerNorm forward rows planned as on CUDA (LN_FWD_RUNS_CUDA_16BIT): a row of 1024
    is one simdgroup of 32-element threads, heads of 512 one of 16-element threads, 2048 64
    threads of 32; rows that such threads do not tile (768, 1031) keep the automatic layout;
    off (0) every row keeps it. Through the op on aligned and offset views and (emulator) under
    every thread order with bounds checked, against float64."""
    from xlstm_kernels.emulate import check_schedules

    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    if not wide:
        monkeypatch.setattr(norm_mod, "LN_FWD_RUNS_CUDA_16BIT", 0)
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed_of("ln-fwd-wide", dtype, n, nh, wide))
    x, w, b = make(rng, (11, nh * n), dt, True, True)
    want = ln_ref64(x, w, b, num_heads=nh)
    spec, kw = norm_mod._plan("ln", x, w, b, EPS, nh)
    t = dict(kw["template"])
    auto = norm_mod._layout(n, 11 * nh, itemsize=2)
    if wide and reads is not None:
        assert (t["N_READS"], t["ONE_SIMD"], t["FULL"]) == (reads, one_simd, 1), t
    else:
        assert (t["N_READS"], t["ONE_SIMD"]) == (auto.n_reads, auto.one_simd), t

    def call(a):
        return layer_norm(a, w, b, EPS) if nh == 1 else multihead_layer_norm(a, w, b, nh, EPS)

    for off in (0, 1):
        assert rel_err(call(offset_view(x, off)), want) < tol(dt), off
    outs = check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1,), check_bounds=True, **kw)
    assert rel_err(outs[0].reshape(x.shape), want) < tol(dt)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n,nh", [(64, 4), (33, 3), (128, 1), (5, 2)])
@pytest.mark.parametrize("tg_partials,short_lanes", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_vjp_short_rows(kernel_backend, monkeypatch, fresh_norm_calls, dtype, n, nh, tg_partials, short_lanes, kind):
    """The backward's rows of one simdgroup (LayerNorm heads of 64, odd heads of 33 and 5, rows
    of 128; RMSNorm rows of those lengths) planned as on CUDA: runs narrow enough to fill the
    32 lanes (VJP_SHORT_LANES_CUDA) or 16-byte runs, and units of a threadgroup of 8 simdgroups
    that add their dw (and db) sums in threadgroup memory (TGSUM, VJP_TG_PARTIALS_CUDA: 37 rows
    in groups of 16, 16 and 5, the last with three simdgroups of no row) or of one simdgroup;
    through the op on aligned and offset views and (emulator) under every thread order with
    bounds checked; dx, dw, db against float64."""
    from xlstm_kernels.emulate import check_schedules

    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setitem(norm_mod.VJP_TG_PARTIALS_CUDA, kind, tg_partials)
    monkeypatch.setitem(norm_mod.VJP_SHORT_LANES_CUDA, kind, short_lanes)
    if kind == "rms":
        nh = 1
    monkeypatch.setattr(norm_mod, "VJP_TARGET_THREADS", 32 * 19 * nh)  # units of 2 rows a simdgroup
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed_of("vjp-short", dtype, n, nh, kind))
    x, w, b = make(rng, (37, nh * n), dt, True, kind == "ln")
    g = rand(rng, (37, nh * n), dt)
    spec, kw, groups = norm_mod._vjp_plan(kind, x, w, kind == "ln", g, EPS, nh)
    t = dict(kw["template"])
    assert spec.kernel == f"{kind.replace('ln', 'layer_norm').replace('rms', 'rms_norm')}_vjp", spec.kernel
    assert t["ONE_SIMD"] and not t["STAGED"], t
    wide = norm_mod._layout(n, 37 * nh, itemsize=dt.size, vjp=True).n_reads  # 16-byte runs
    assert t["N_READS"] == (norm_mod._short_row_reads(n) if short_lanes else wide), t
    if tg_partials:
        assert t["TGSUM"] == 8 and kw["threadgroup"] == (32, 8, 1) and groups == 3, (t, kw["threadgroup"], groups)
        assert kw["grid"] == (32, 8 * 3 * nh, 1)
    else:
        assert t["TGSUM"] == 0 and groups == 19, (t, groups)
    if kind == "ln":
        want = _ln_grads64(x, w, b, g, nh)
    else:
        x64, w64, g64 = f64(x), f64(w), f64(g)
        r = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS)
        xhat, gw = x64 * r, g64 * w64
        want = (r * (gw - xhat * (gw * xhat).mean(-1, keepdims=True)), (g64 * xhat).sum(0))
    limit = 2e-5 if dt == mx.float32 else 1.5e-2

    def call(a, wa, *ba):
        if kind == "rms":
            return rms_norm(a, wa, EPS)
        return layer_norm(a, wa, ba[0], EPS) if nh == 1 else multihead_layer_norm(a, wa, ba[0], nh, EPS)

    for off in (0, 1):
        got = mx.vjp(call, [offset_view(x, off), w] + ([b] if kind == "ln" else []), [offset_view(g, off)])[1]
        for got_k, want_k in zip(got, want):
            assert rel_err(got_k, want_k) < limit, off
    outs = check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1,), check_bounds=True, **kw)
    assert outs[1].shape == (groups, nh * n)
    for k, want_k in enumerate(want):
        got_k = outs[0].reshape(x.shape) if k == 0 else outs[k].sum(axis=0)
        assert rel_err(got_k, want_k) < limit, k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [32, 64])
@pytest.mark.parametrize("kind,has_w,has_b", [("ln", False, True), ("ln", True, False), ("rms", False, False)])
def test_vjp_short_rows_affine_parts(kernel_backend, monkeypatch, fresh_norm_calls, dtype, n, kind, has_w, has_b):
    """test_vjp_short_rows' CUDA plan (2 x 37 rows, lanes filled, threadgroup partials) with
    a bias alone, a weight alone and (RMSNorm) neither (no partials: TGSUM off), on rows of 32
    (16-bit: one element a lane) and 64; dx, dw, db against float64 through the op and
    (emulator) under every thread order with bounds checked."""
    from xlstm_kernels.emulate import check_schedules

    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "VJP_TARGET_THREADS", 32 * 19 * 2)
    dt = DTYPES[dtype]
    nh = 2 if kind == "ln" else 1
    rng = np.random.default_rng(seed_of("vjp-short-wb", dtype, n, kind, has_w, has_b))
    x, w, b = make(rng, (37, nh * n), dt, has_w, has_b)
    g = rand(rng, (37, nh * n), dt)
    spec, kw, groups = norm_mod._vjp_plan(kind, x, w, has_b, g, EPS, nh)
    t = dict(kw["template"])
    assert t["ONE_SIMD"] and t["N_READS"] == norm_mod._short_row_reads(n), t
    assert t["TGSUM"] == (8 if (has_w or has_b) else 0), t
    limit = 2e-5 if dt == mx.float32 else 1.5e-2
    x64, g64 = f64(x), f64(g)
    if kind == "ln":
        dx64, dw64, db64 = _ln_grads64(x, w, b, g, nh)
    else:
        r = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS)
        dx64 = r * (g64 - x64 * r * (g64 * x64 * r).mean(-1, keepdims=True))
    args = [x] + ([w] if has_w else []) + ([b] if has_b else [])

    def call(a, *rest):
        wa = rest[0] if has_w else None
        ba = rest[has_w] if has_b else None
        return rms_norm(a, wa, EPS) if kind == "rms" else multihead_layer_norm(a, wa, ba, nh, EPS)

    got = mx.vjp(call, args, [g])[1]
    assert rel_err(got[0], dx64) < limit
    if has_w:
        assert rel_err(got[1], dw64) < limit
    if has_b:
        assert rel_err(got[1 + has_w], db64) < limit
    outs = check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1,), check_bounds=True, **kw)
    assert rel_err(outs[0].reshape(x.shape), dx64) < limit


def test_knob_values_short_rows_on_cuda(monkeypatch):
    """knob_values reports the forward's CUDA run width for rows of one simdgroup (as the
    launch uses), the 16-byte runs off CUDA and wherever n_reads is given."""
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "cpu")
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    assert norm_mod.knob_values("layer_norm", 64, "bfloat16")["n_reads"] == 2
    assert norm_mod.knob_values("rms_norm", 128, "bfloat16")["n_reads"] == 4
    assert norm_mod.knob_values("rms_norm", 128, "float32")["n_reads"] == 4
    assert norm_mod.knob_values("rms_norm", 64, "bfloat16", {"n_reads": 8})["n_reads"] == 8
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: False)
    assert norm_mod.knob_values("layer_norm", 64, "bfloat16")["n_reads"] == 8


@pytest.mark.parametrize("mom", [True, False])
# float32 elements: 96 threads x 4 (three simdgroups: the moments' sums of parts), 128 x 4 and
# 128 x 16 (four: their butterfly)
@pytest.mark.parametrize("n", [384, 512, 2048])
def test_ln_moments_hard_rows(kernel_backend, monkeypatch, fresh_norm_calls, mom, n):
    """LayerNorm's statistics on rows that defeat a float32 sum of squares minus squared
    sum (mean 300 against a spread of 1) and a row with one feature 1000x the rest: the
    FULL forward and the staged backward, with the threads' moments merged in one reduction
    (MOM, LN_MOMENTS) and two-pass, against float64; every thread order (emulator). The
    two-pass form's first sum (of x, ~300 n) rounds the mean by ~1e-5 of the spread: on the
    H100 it read 2.05e-5 at n = 512, so its bound is 4e-5; the merged moments keep 1e-5 (2e-5
    backward)."""
    from xlstm_kernels.emulate import check_schedules

    monkeypatch.setattr(norm_mod, "LN_MOMENTS", mom)
    fwd_tol, bwd_tol = (1e-5, 2e-5) if mom else (4e-5, 4e-5)
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", 1)
    rng = np.random.default_rng(seed_of("ln-moments", mom, n))
    xs = rng.standard_normal((6, n))
    xs[:3] += 300.0
    xs[3, 7] = 1000.0
    xs[4] *= 1e-3
    x32 = xs.astype(np.float32)
    # the rows are hard: the one-pass float32 variance is off by far more than the tolerance
    naive = (x32 * x32).mean(-1) - x32.mean(-1) ** 2
    exact = x32.astype(np.float64).var(-1)
    assert np.max(np.abs(naive[:3] - exact[:3]) / exact[:3]) > 1e-3
    x = mx.array(x32)
    w, b = rand(rng, (n,)), rand(rng, (n,))
    spec, kw = norm_mod._plan("ln", x, w, b, EPS)
    t = dict(kw["template"])
    assert t["FULL"] == 1 and t["MOM"] == mom and kw["threadgroup"][0] == (96 if n == 384 else 128), t
    assert rel_err(layer_norm(x, w, b, EPS), ln_ref64(x, w, b)) < fwd_tol
    if n <= 512:
        (y,) = check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1,), check_bounds=True, **kw)
        assert rel_err(y, ln_ref64(x, w, b)) < fwd_tol
    g = rand(rng, x.shape)
    want = _ln_grads64(x, w, b, g)
    spec, kw, _ = norm_mod._vjp_plan("ln", x, w, True, g, EPS)
    t = dict(kw["template"])
    assert t["STAGED"] and t["MOM"] == mom and kw["threadgroup"][0] == (96 if n == 384 else 128), t
    got = mx.vjp(lambda a, c, e: layer_norm(a, c, e, EPS), [x, w, b], [g])[1]
    for got_k, want_k in zip(got, want):
        assert rel_err(got_k, want_k) < bwd_tol
    if n <= 512:
        outs = check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1,), check_bounds=True, **kw)
        assert rel_err(outs[0], want[0]) < bwd_tol


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", [128, 512, 2048])
@pytest.mark.parametrize("has_w", [True, False])
@pytest.mark.parametrize("cuda_plans", [False, True])
def test_rms_norm_vjp_full_rows(kernel_backend, monkeypatch, fresh_norm_calls, dtype, n, has_w, cuda_plans):
    """The RMSNorm backward on rows of exactly tpr * n_reads elements: FULL = 1 through the
    op (aligned and offset views; with a weight a unit sums several of the 5 rows, alternating its
    reduction scratch), FULL = 0 and 2 launched directly (unstaged), against float32 reference
    grads; with the generic plans and with CUDA's (staged rows, other threads per row) on
    every backend."""
    from xlstm_kernels.runtime import launch

    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: cuda_plans)
    monkeypatch.setattr(norm_mod, "VJP_TARGET_THREADS", 64)
    monkeypatch.setattr(norm_mod, "RMS_VJP_TARGET_THREADS_CUDA", 64)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", 1)

    dt = DTYPES[dtype]
    n = n * 4 // dt.size
    rng = np.random.default_rng(seed_of("vjpfull", dtype, n, has_w))
    x, w, _ = make(rng, (5, n), dt, has_w, False)
    cot = rand(rng, (5, n), dt)
    want = _check_rms_grads_at_offsets(x, w if has_w else None, cot)
    limit = 2e-5 if dt == mx.float32 else 1.5e-2
    spec, kw, groups = norm_mod._vjp_plan("rms", x, w, False, cot, EPS)
    assert dict(kw["template"])["FULL"] == 1 and (groups < 5 if has_w else groups == 5)
    unstaged = {"STAGED": False, "NF": 0}
    for full in (0, 2):
        kw2 = {k: v for k, v in kw.items() if k != "shared_memory"}
        kw2["template"] = [(k, full if k == "FULL" else unstaged.get(k, v)) for k, v in kw["template"]]
        outs = launch(spec, **kw2)
        assert rel_err(outs[0], want[0]) < limit, full
        if has_w:
            assert rel_err(outs[1].sum(axis=0), want[1]) < limit, full


# the backward's partial sums (norm_partials_sum) -----------------------------------------


# norm_partials_sum (32 columns a threadgroup) and norm_partials_sum_cols (a threadgroup a column)
PARTIALS_KERNELS = {"strips": ("PARTIALS_SUM", "_partials_sum_plan"),
                    "by_column": ("PARTIALS_SUM_COLS", "_partials_sum_cols_plan")}


@pytest.mark.parametrize("which,groups,cols,rows", [
    (which, g, c, u) for which in PARTIALS_KERNELS
    for g, c in [(1, 1), (3, 31), (9, 33), (33, 100), (264, 64), (5, 4096), (1000, 5)]
    for u in ((1, 4, 8, 32) if which == "strips" else (4,))
    if which == "strips" or c <= 1024  # by column: planned for few columns only
])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("has_w,has_b", [(True, False), (False, True), (True, True)])
def test_partials_sum_kernel(kernel_backend, monkeypatch, groups, cols, dtype, has_w, has_b, which, rows):
    """dw / db = the float partials summed over groups, rounded once to the dtype: columns
    spanning several 32-column strips and ragged ones, fewer groups than simdgroups (or than a
    simdgroup), more groups than a column's threads; an absent one set to 0. Strips: 1, 4, 8
    or 32 rows loaded before their adds (PARTIALS_ROWS), more or fewer than a simdgroup's."""
    monkeypatch.setattr(norm_mod, "PARTIALS_ROWS", rows)
    monkeypatch.setattr(norm_mod, "PARTIALS_ROWS_CUDA", rows)
    spec, plan = (getattr(norm_mod, name) for name in PARTIALS_KERNELS[which])
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed_of("partials", groups, cols, dtype, has_w, has_b))
    dwp, dbp = rand(rng, (groups, cols)), rand(rng, (groups, cols), shift=0.3)
    kw = plan(groups, cols, dt, has_w, has_b)
    kw["inputs"] = [dwp if has_w else kw["inputs"][0], dbp if has_b else kw["inputs"][1], kw["inputs"][2]]
    dw, db = runtime.launch(spec, **kw)
    for has, got, parts in ((has_w, dw, dwp), (has_b, db, dbp)):
        if has:
            assert got.dtype == dt and got.shape == (cols,)
            assert rel_err(got, f64(parts).sum(axis=0)) < tol(dt)
        else:
            assert got.shape == (1,) and float(got[0].item()) == 0.0


@pytest.mark.parametrize("which", list(PARTIALS_KERNELS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_partials_sum_adds_bf16_partials_in_float(kernel_backend, monkeypatch, which, dtype):
    """bfloat16 partials (PARTIALS_BF16, PARTIALS_FP16) are added in float: a float32 dw / db
    of 300 groups of them is within float32's error of the float64 sum of the same values (a
    bfloat16 accumulator would be ~1e-2 off); a bfloat16 or float16 one (float16 rows'
    partials are bfloat16 too) within its rounding. 300 x 37 (strips: two of 32 columns,
    ragged) and 300 x 7 (by column)."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    spec, plan = (getattr(norm_mod, name) for name in PARTIALS_KERNELS[which])
    dt = DTYPES[dtype]
    cols = 37 if which == "strips" else 7
    rng = np.random.default_rng(seed_of("partials-bf16-sum", which, dtype))
    dwp = rand(rng, (300, cols), mx.bfloat16)
    dbp = rand(rng, (300, cols), mx.bfloat16, shift=0.3)
    kw = plan(300, cols, dt, True, True)
    kw["inputs"] = [dwp, dbp, kw["inputs"][2]]
    dw, db = runtime.launch(spec, **kw)
    for got, parts in ((dw, dwp), (db, dbp)):
        assert got.dtype == dt and got.shape == (cols,)
        assert parts.dtype == mx.bfloat16
        assert rel_err(got, f64(parts).sum(axis=0)) < (2e-6 if dt == mx.float32 else
                                                       1.05 * (2 ** -8 if dt == mx.bfloat16 else 2 ** -11))


def test_partials_sum_rows_give_the_same_bits(kernel_backend, monkeypatch):
    """U (rows loaded before their adds) changes no sum's order: U = 1, 3, 4 and 32 give the
    same bits, 45 groups over 16 simdgroups (rounds cut short at the last rows)."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    rng = np.random.default_rng(seed_of("partials-rows"))
    dwp, dbp = rand(rng, (45, 70)), rand(rng, (45, 70), shift=0.3)
    outs = []
    for rows in (1, 3, 4, 32):
        monkeypatch.setattr(norm_mod, "PARTIALS_ROWS_CUDA", rows)
        kw = norm_mod._partials_sum_plan(45, 70, mx.float32, True, True)
        kw["inputs"] = [dwp, dbp, kw["inputs"][2]]
        outs.append([np.array(o) for o in runtime.launch(norm_mod.PARTIALS_SUM, **kw)])
    for dw, db in outs[1:]:
        assert np.array_equal(dw, outs[0][0]) and np.array_equal(db, outs[0][1])
    assert rel_err(mx.array(outs[0][0]), f64(dwp).sum(axis=0)) < tol(mx.float32)


@pytest.mark.emulator_only
@pytest.mark.parametrize("which,groups,cuda,rows", [("strips", 45, False, 4), ("strips", 45, True, 4),
                                                    ("strips", 45, True, 2), ("by_column", 300, True, 4)])
def test_partials_sum_schedules(monkeypatch, which, groups, cuda, rows):
    """Every thread order: the same bits (a fixed order of additions), in bounds. 45 groups:
    steps of `rows` rows, the last one short, per simdgroup (8 simdgroups; 16 as planned for
    cuda); 300 over a column's 256 threads."""
    from xlstm_kernels.emulate import check_schedules

    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: cuda)
    monkeypatch.setattr(norm_mod, "PARTIALS_ROWS_CUDA", rows)
    spec, plan = (getattr(norm_mod, name) for name in PARTIALS_KERNELS[which])
    rng = np.random.default_rng(11)
    cols = 45 if which == "strips" else 7
    dwp, dbp = rand(rng, (groups, cols)), rand(rng, (groups, cols))
    kw = plan(groups, cols, mx.bfloat16, True, True)
    kw["inputs"] = [dwp, dbp, kw["inputs"][2]]
    dw, db = check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1, 2),
                             check_bounds=True, **kw)
    assert rel_err(dw, f64(dwp).sum(axis=0)) < tol(mx.bfloat16)
    assert rel_err(db, f64(dbp).sum(axis=0)) < tol(mx.bfloat16)


def test_partials_sum_launch_picks_by_shape(monkeypatch):
    """The partials sum by column only on CUDA with PARTIALS_BY_COLUMN_CUDA, few columns and
    many groups (at least 64, and at least twice the columns); norm_partials_sum otherwise."""
    pick = lambda g, c: norm_mod._partials_sum_launch(g, c, mx.float32, True, True)[0]  # noqa: E731
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "PARTIALS_BY_COLUMN_CUDA", True)
    for g, c in ((512, 128), (528, 256), (1056, 512), (64, 32)):
        assert pick(g, c) is norm_mod.PARTIALS_SUM_COLS, (g, c)
    for g, c in ((128, 256), (528, 1024), (264, 256), (528, 513), (2100, 1050), (128, 4096), (8, 2), (63, 8)):
        assert pick(g, c) is norm_mod.PARTIALS_SUM, (g, c)
    monkeypatch.setattr(norm_mod, "PARTIALS_BY_COLUMN_CUDA", False)
    assert pick(512, 128) is norm_mod.PARTIALS_SUM
    monkeypatch.setattr(norm_mod, "PARTIALS_BY_COLUMN_CUDA", True)
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: False)
    assert pick(512, 128) is norm_mod.PARTIALS_SUM


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_vjp_with_partials_by_column(kernel_backend, monkeypatch, fresh_norm_calls, kind):
    """The backward through the op with its partials summed by column (CUDA's plan, patched
    on): heads of 64 in units of a threadgroup, 50 (LayerNorm) or 100 groups of partials; against
    float64."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "PARTIALS_BY_COLUMN_CUDA", True)
    monkeypatch.setattr(norm_mod, "PARTIALS_BY_COLUMN_MIN_GROUPS", 2)
    monkeypatch.setattr(norm_mod, "PARTIALS_BY_COLUMN_MIN_RATIO", 0)
    monkeypatch.setattr(norm_mod, "VJP_TARGET_THREADS", 32 * 800)  # 800 rows of 8 simdgroups: 100 groups
    nh = 2 if kind == "ln" else 1
    dt = mx.float32
    rng = np.random.default_rng(seed_of("vjp-cols", kind))
    x, w, b = make(rng, (800, nh * 64), dt, True, kind == "ln")
    g = rand(rng, (800, nh * 64), dt)
    groups = norm_mod._vjp_plan(kind, x, w, kind == "ln", g, EPS, nh)[2]
    assert norm_mod._partials_sum_launch(groups, nh * 64, dt, True, kind == "ln")[0] is norm_mod.PARTIALS_SUM_COLS
    if kind == "ln":
        want = _ln_grads64(x, w, b, g, nh)
        got = mx.vjp(lambda a, c, e: multihead_layer_norm(a, c, e, nh, EPS), [x, w, b], [g])[1]
    else:
        x64, w64, g64 = f64(x), f64(w), f64(g)
        r = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS)
        xhat, gw = x64 * r, g64 * w64
        want = (r * (gw - xhat * (gw * xhat).mean(-1, keepdims=True)), (g64 * xhat).sum(0))
        got = mx.vjp(lambda a, c: rms_norm(a, c, EPS), [x, w], [g])[1]
    for got_k, want_k in zip(got, want):
        assert rel_err(got_k, want_k) < 2e-5


@pytest.mark.parametrize("cuda", [False, True])
def test_partials_sum_plan_covers_every_column(monkeypatch, cuda):
    """Grid in threads: 32 lanes per strip of columns, at most PARTIALS_SIMDGROUPS
    (PARTIALS_SIMDGROUPS_CUDA on cuda; and at most `groups`) simdgroups a threadgroup; rows
    loaded at once: PARTIALS_ROWS (_CUDA), at most a simdgroup's; a bad value is refused."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: cuda)
    most = norm_mod.PARTIALS_SIMDGROUPS_CUDA if cuda else norm_mod.PARTIALS_SIMDGROUPS
    for groups, cols in ((1, 5), (3, 64), (400, 4097)):
        kw = norm_mod._partials_sum_plan(groups, cols, mx.float32, True, False)
        assert kw["grid"][0] >= cols and kw["grid"][0] % 32 == 0
        assert kw["threadgroup"] == (32, min(groups, most), 1)
        assert kw["grid"][1] == kw["threadgroup"][1]
        per_simdgroup = -(-groups // kw["threadgroup"][1])
        assert dict(kw["template"])["U"] == min(per_simdgroup, norm_mod.PARTIALS_ROWS_CUDA if cuda else
                                                  norm_mod.PARTIALS_ROWS)
    for bad in (0, 33, 2.0, True):
        monkeypatch.setattr(norm_mod, "PARTIALS_ROWS_CUDA" if cuda else "PARTIALS_ROWS", bad)
        with pytest.raises(ValueError, match="PARTIALS_ROWS"):
            norm_mod._partials_sum_plan(40, 64, mx.float32, True, False)


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("t_partials", [True, False])
def test_vjp_partials_are_unit_sums_rounded_once(kernel_backend, monkeypatch, fresh_norm_calls, kind, staged, dtype,
                                                 t_partials):
    """A 16-bit backward's partials (PARTIALS_BF16, PARTIALS_FP16): each unit's float sums of
    g * xhat (and of g) rounded once to bfloat16, so within one bfloat16 rounding (unit
    roundoff 2^-8, of the largest) of the float64 sums over the unit's rows; float32 partials
    with the switch off, within float32's error. CUDA's staged plan (units taking every
    groups-th row: 3 or 6 units of the 96 rows) and the cached plan (units of consecutive
    rows)."""
    dt = DTYPES[dtype]
    monkeypatch.setattr(norm_mod, "PARTIALS_BF16" if dt == mx.bfloat16 else "PARTIALS_FP16", t_partials)
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: staged)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", 1)
    monkeypatch.setattr(norm_mod, "VJP_TARGET_THREADS", 4 * norm_mod.VJP_THREADS)
    m, n = 96, 512
    rng = np.random.default_rng(seed_of("vjp-partials", kind, staged, dtype, t_partials))
    x, w, b = make(rng, (m, n), dt, True, kind == "ln")
    g = rand(rng, (m, n), dt)
    spec, kw, groups = norm_mod._vjp_plan(kind, x, w, kind == "ln", g, EPS)
    t = dict(kw["template"])
    assert bool(t["STAGED"]) == staged and 1 < groups < m, (t, groups)
    pdt = mx.bfloat16 if t_partials else mx.float32
    assert t["PT"] == pdt and all(d == pdt for d in kw["output_dtypes"][1:])
    outs = runtime.launch(spec, **kw)
    x64, g64 = f64(x), f64(g)
    mu = x64.mean(-1, keepdims=True) if kind == "ln" else 0.0
    xhat = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + EPS)
    rpg = -(-m // groups)
    sums = [(g64 * xhat, outs[1])] + ([(g64, outs[2])] if kind == "ln" else [])
    for terms, got in sums:
        assert got.dtype == pdt and got.shape == (groups, n)
        rows = [range(u, m, groups) if t["STRIDED"] else range(u * rpg, min(m, (u + 1) * rpg))
                for u in range(groups)]
        want = np.stack([terms[list(r)].sum(axis=0) for r in rows])
        assert rel_err(got, want) < (2 ** -8 * 1.05 if t_partials else 2e-6)


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("t_partials", [True, False])
def test_vjp_float16_partials_past_float16_range(kernel_backend, monkeypatch, fresh_norm_calls, kind, staged,
                                                 t_partials):
    """Why float16 rows' partials are bfloat16 (PARTIALS_FP16), not float16: two units whose
    sums of g * xhat pass 65504 with opposite signs (column 0's g is +G on the first unit's
    rows and -G on the second's, G a power of two with every product below 65504; the second
    unit's rows of x the first's, column 0 at about +3 standard deviations), so dw[0] ~ 0.
    bfloat16 partials (float's range) and float32 ones give a finite dw within float16's
    tolerance, as MLX's op does; so are the other columns and db. Staged plan (strided units)
    and cached plan (consecutive rows)."""
    monkeypatch.setattr(norm_mod, "PARTIALS_FP16", t_partials)
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: staged)
    monkeypatch.setattr(norm_mod, "RMS_VJP_SMS_CUDA", 1)
    monkeypatch.setattr(norm_mod, "VJP_TARGET_THREADS", 4 * norm_mod.VJP_THREADS)
    m, n = 96, 512
    rng = np.random.default_rng(seed_of("vjp-partials-range", kind, staged, t_partials))
    x = rng.standard_normal((m, n))
    x[:, 0] = 3.0 + 0.01 * rng.standard_normal(m)
    xs = mx.array(x.astype(np.float16))  # for the plan; the second unit's rows become the first's below
    spec, kw, groups = norm_mod._vjp_plan(kind, xs, xs[0], kind == "ln", xs, EPS)
    t = dict(kw["template"])
    assert bool(t["STAGED"]) == staged and groups >= 2
    assert t["PT"] == (mx.bfloat16 if t_partials else mx.float32)
    rpg = -(-m // groups)
    units = [list(range(u, m, groups)) if t["STRIDED"] else list(range(u * rpg, min(m, (u + 1) * rpg)))
             for u in range(2)]
    x[units[1]] = x[units[0][:len(units[1])]]
    xs = mx.array(x.astype(np.float16))
    big = 2.0 ** np.ceil(np.log2(1.5 * 65504 / (3 * len(units[1]))))
    assert big * 3.5 < 65504, (rpg, big)
    g = 0.5 * rng.standard_normal((m, n))
    g[:, 0] = 0.0
    g[units[0][:len(units[1])], 0], g[units[1], 0] = big, -big
    w = 1.0 + 0.1 * rng.standard_normal(n)
    gs, ws = (mx.array(a.astype(np.float16)) for a in (g, w))
    b = mx.array((0.1 * rng.standard_normal(n)).astype(np.float16)) if kind == "ln" else None
    if kind == "rms":
        _, vjps = mx.vjp(lambda a, ww: rms_norm(a, ww, EPS), [xs, ws], [gs])
    else:
        _, vjps = mx.vjp(lambda a, ww, bb: layer_norm(a, ww, bb, EPS), [xs, ws, b], [gs])
    x64, g64 = f64(xs), f64(gs)
    mu = x64.mean(-1, keepdims=True) if kind == "ln" else 0.0
    xhat = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + EPS)
    want = (g64 * xhat).sum(axis=0)
    assert abs(want[0]) < 0.05 * big * len(units[1]) and (g64 * xhat)[units[1], 0].sum() < -65504
    assert vjps[1].dtype == mx.float16 and bool(mx.all(mx.isfinite(vjps[1])).item())
    assert rel_err(vjps[1], want) < tol(mx.float16)
    if kind == "ln":
        assert vjps[2].dtype == mx.float16 and rel_err(vjps[2], g64.sum(axis=0)) < tol(mx.float16)


def test_vjp_partials_dtype_by_plan(monkeypatch):
    """bfloat16 partials only for 16-bit rows of the unlooped kernels, with PARTIALS_BF16 /
    PARTIALS_FP16 on; float32 rows, the looped kernels (which add into their cells) and the
    switches off keep float32; the template's PT says the same."""

    def partials(kind, dtype, n=512):
        x = mx.zeros((64, n), dtype=dtype)
        spec, kw, _ = norm_mod._vjp_plan(kind, x, x[0], kind == "ln", x, EPS)
        dts = set(kw["output_dtypes"][1:])
        assert len(dts) == 1
        return spec.kernel, dts.pop(), dict(kw["template"]).get("PT")

    for kind in ("rms", "ln"):
        for cuda in (False, True):
            monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: cuda)
            assert partials(kind, mx.bfloat16)[1:] == (mx.bfloat16, mx.bfloat16)
            assert partials(kind, mx.float16)[1:] == (mx.bfloat16, mx.bfloat16)
            assert partials(kind, mx.float32)[1:] == (mx.float32, mx.float32)
        # rows past VJP_THREADS x VJP_MAX_READS elements, unstaged: the looped kernels
        monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: False)
        looped = ("rms_norm" if kind == "rms" else "layer_norm") + "_vjp_looped"
        assert partials(kind, mx.bfloat16, n=8192) == (looped, mx.float32, None)
        assert partials(kind, mx.float16, n=8192) == (looped, mx.float32, None)
        monkeypatch.setattr(norm_mod, "PARTIALS_BF16", False)
        assert partials(kind, mx.bfloat16)[1:] == (mx.float32, mx.float32)
        assert partials(kind, mx.float16)[1:] == (mx.bfloat16, mx.bfloat16)
        monkeypatch.setattr(norm_mod, "PARTIALS_FP16", False)
        assert partials(kind, mx.float16)[1:] == (mx.float32, mx.float32)
        monkeypatch.undo()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows_a_simd", [2, 3])
@pytest.mark.parametrize("outer,nh,dh,has_w,has_b", [(19, 1, 128, True, True), (5, 4, 64, True, False),
                                                     (1, 1, 128, False, True), (7, 3, 32, False, False),
                                                     (3, 2, 256, True, True), (5, 1, 256, True, False),
                                                     (4, 1, 128, False, False)])
def test_layer_norm_rows_a_simdgroup(kernel_backend, monkeypatch, fresh_norm_calls, dtype, rows_a_simd,
                                     outer, nh, dh, has_w, has_b):
    """LN_FWD_ROWS_A_SIMD (template RW): FULL rows of one simdgroup, several consecutive rows a
    simdgroup, every row's loads first (the CUDA plan's layouts). Row counts not a multiple of
    RW or of the threadgroup (the last simdgroup's rows past the end touch nothing), one row,
    multi-head rows; aligned
    and offset views (the element path), every thread order with bounds checked; against
    float64. One-head rows also with EWB (w and b loaded once for the RW rows; forced on for
    every row length here, 16-bit rows of 1 KiB included: two runs a thread) against EWB off,
    bit for bit."""
    from xlstm_kernels.emulate import check_schedules

    monkeypatch.setattr(norm_mod, "LN_FWD_ROWS_A_SIMD", rows_a_simd)
    monkeypatch.setattr(norm_mod, "LN_FWD_SHORT_ROW_BYTES", 0)  # the short-row rule off (an H200 would take 2)
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)  # short heads in runs over all lanes
    monkeypatch.setattr(norm_mod, "LN_FWD_EARLY_WB_ROW_BYTES", 1 << 20)  # EWB on every one-head row
    dt = DTYPES[dtype]
    if dt == mx.float32 and dh * 4 > 512:
        pytest.skip("float32 heads of 1 KiB take two simdgroups a row (no RW); 16-bit ones are the 1 KiB case")
    dh = dh * 4 // dt.size  # 16-bit heads twice as long: whole 16-byte runs (256: heads of 1 KiB)
    rng = np.random.default_rng(seed_of("ln-rw", dtype, rows_a_simd, outer, nh, dh, has_w, has_b))
    x, w, b = make(rng, (outer, nh * dh), dt, has_w, has_b)
    spec, kw = norm_mod._plan("ln", x, w, b, EPS, nh)
    t = dict(kw["template"])
    rows = outer * nh
    assert t["ONE_SIMD"] and t["FULL"] == 1 and t["RW"] == rows_a_simd, t
    assert t["EWB"] == (nh == 1), t  # one head: w and b once, with the x loads
    r = kw["threadgroup"][1]
    simdgroups = -(-rows // rows_a_simd)
    assert r == min(norm_mod.SIMD_ROWS, simdgroups) and kw["grid"][1] == r * -(-simdgroups // r), (kw["grid"], r)
    want = ln_ref64(x, w, b, num_heads=nh)

    def call(*a):
        return layer_norm(*a, EPS) if nh == 1 else multihead_layer_norm(*a, nh, EPS)

    for off in (0, 1):
        views = [None if a is None else offset_view(a, off) for a in (x, w, b)]
        assert rel_err(call(*views), want) < tol(dt), off
    (y,) = check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1, 2), check_bounds=True, **kw)
    assert rel_err(y.reshape(x.shape), want) < tol(dt)
    # the element path (FULL 2; on the emulator the offset views above take the word path, as
    # its alignment check always passes) and the general path (FULL 0: one row a simdgroup)
    from xlstm_kernels.runtime import launch

    for full in (2, 0):
        assert rel_err(launch(spec, **_forced_full(kw, full, dh))[0].reshape(x.shape), want) < tol(dt), full
    # one row a simdgroup as shipped: the same kernel but for RW, the same bits
    monkeypatch.setattr(norm_mod, "LN_FWD_ROWS_A_SIMD", 1)
    spec1, kw1 = norm_mod._plan("ln", x, w, b, EPS, nh)
    assert dict(kw1["template"])["RW"] == 1 and not dict(kw1["template"])["EWB"]
    (y1,) = runtime.get_kernel(spec1, "emulate")(**kw1)
    assert np.array_equal(np.array(y1.astype(mx.float32)), np.array(y.astype(mx.float32)))
    # RW rows with w and b loaded for each row (EWB off): the same bits
    monkeypatch.setattr(norm_mod, "LN_FWD_ROWS_A_SIMD", rows_a_simd)
    monkeypatch.setattr(norm_mod, "LN_FWD_EARLY_WB_ROW_BYTES", 0)
    spec2, kw2 = norm_mod._plan("ln", x, w, b, EPS, nh)
    assert dict(kw2["template"])["RW"] == rows_a_simd and not dict(kw2["template"])["EWB"]
    (y2,) = check_schedules(runtime.get_kernel(spec2, "emulate"), seeds=(3,), check_bounds=True, **kw2)
    assert np.array_equal(np.array(y2.astype(mx.float32)), np.array(y.astype(mx.float32)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("outer,nh,n,rows_a_simd", [(37, 1, 256, 2), (37, 1, 512, 2), (9, 3, 128, 2), (5, 1, 512, 1),
                                                    (6, 2, 1024, 1), (3, 1, 4096, 1)])
@pytest.mark.parametrize("has_w,has_b", [(True, True), (True, False), (False, True)])
def test_layer_norm_affine_in_t(kernel_backend, monkeypatch, fresh_norm_calls, dtype, outer, nh, n, rows_a_simd,
                                has_w, has_b):
    """LN_FWD_AFFINE_IN_T (template AFT): 16-bit FULL rows take the affine step T(T(w * T(c)) + b)
    in T's own arithmetic (CUDA: __hmul_rn / __hadd_rn); against the float route (AFT off),
    bit for bit, on the active backend: a compiler that fused w * T(c) + b into one rounding
    (ptxas does, given plain bf16 operators) changes many of these elements. Rows of one and of
    several simdgroups, one and two rows a simdgroup (with EWB: w and b once), heads; and
    against float64."""
    from xlstm_kernels.runtime import launch

    monkeypatch.setattr(norm_mod, "LN_FWD_ROWS_A_SIMD", rows_a_simd)
    monkeypatch.setattr(norm_mod, "LN_FWD_SHORT_ROW_BYTES", 0)
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)  # 16-bit rows of 1 KiB: one simdgroup a row
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed_of("ln-aft", dtype, outer, nh, n, rows_a_simd, has_w, has_b))
    x, w, b = make(rng, (outer, nh * n), dt, has_w, has_b)
    spec, kw = norm_mod._plan("ln", x, w, b, EPS, nh)
    t = dict(kw["template"])
    assert t["FULL"] == 1 and t["AFT"] and t["RW"] == rows_a_simd, t
    want = ln_ref64(x, w, b, num_heads=nh)
    (y,) = launch(spec, **kw)
    assert rel_err(y.reshape(x.shape), want) < tol(dt)
    off = dict(kw, template=[(k, False if k == "AFT" else v) for k, v in kw["template"]])
    (y0,) = launch(spec, **off)
    a, a0 = np.array(y.astype(mx.float32)), np.array(y0.astype(mx.float32))
    assert np.array_equal(a, a0), f"{int((a != a0).sum())} of {a.size} elements differ"
    if kernel_backend != "emulate":
        return
    from xlstm_kernels.emulate import check_schedules

    (ys,) = check_schedules(runtime.get_kernel(spec, "emulate"), seeds=(1,), check_bounds=True, **kw)
    assert np.array_equal(np.array(ys.astype(mx.float32)), a)


def test_layer_norm_affine_in_t_plan(monkeypatch):
    """AFT exactly on 16-bit FULL forward rows (LN_FWD_AFFINE_IN_T); float32 rows, rows off
    the FULL path and the switch off take the float route."""
    rng = np.random.default_rng(seed_of("ln-aft-plan"))
    for dt in (mx.float16, mx.bfloat16, mx.float32):
        x, w, b = make(rng, (5, 512), dt, True, True)
        t = dict(norm_mod._plan("ln", x, w, b, EPS)[1]["template"])
        assert t["FULL"] == 1 and t["AFT"] == (dt != mx.float32), (dt, t)
        xs, ws, bs = make(rng, (5, 100), dt, True, True)  # not FULL: the general path
        t = dict(norm_mod._plan("ln", xs, ws, bs, EPS)[1]["template"])
        assert t["FULL"] == 0 and not t["AFT"], (dt, t)
    monkeypatch.setattr(norm_mod, "LN_FWD_AFFINE_IN_T", False)
    x, w, b = make(rng, (5, 512), mx.bfloat16, True, True)
    assert not dict(norm_mod._plan("ln", x, w, b, EPS)[1]["template"])["AFT"]


def test_layer_norm_rows_a_simdgroup_plan(monkeypatch):
    """RW > 1 only for LayerNorm's FULL rows of one simdgroup; rows of several simdgroups, the
    general path and RMSNorm keep one row (RMSNorm: no RW entry). EWB only with RW > 1 on rows
    of one head of at most LN_FWD_EARLY_WB_ROW_BYTES."""
    monkeypatch.setattr(norm_mod, "LN_FWD_ROWS_A_SIMD", 2)
    monkeypatch.setattr(norm_mod, "LN_FWD_SHORT_ROW_BYTES", 0)
    rng = np.random.default_rng(seed_of("ln-rw-plan"))
    x, w, b = make(rng, (9, 128), mx.float32, True, True)
    t = dict(norm_mod._plan("ln", x, w, b, EPS)[1]["template"])
    assert t["RW"] == 2 and t["EWB"], t
    xh, wh, bh = make(rng, (9, 2 * 128), mx.float32, True, True)  # two heads: each row its own w, b
    t = dict(norm_mod._plan("ln", xh, wh, bh, EPS, 2)[1]["template"])
    assert t["RW"] == 2 and not t["EWB"], t
    with monkeypatch.context() as m:  # 16-bit rows of 1 KiB, one simdgroup a row (the CUDA plan): over EWB's cap
        m.setattr(norm_mod, "_plans_for_cuda", lambda: True)
        xk_, wk_, bk_ = make(rng, (9, 512), mx.bfloat16, True, True)
        t = dict(norm_mod._plan("ln", xk_, wk_, bk_, EPS)[1]["template"])
        assert t["ONE_SIMD"] and t["RW"] == 2 and not t["EWB"], t
    xl, wl, bl = make(rng, (9, 2048), mx.float32, True, True)  # rows of several simdgroups
    t = dict(norm_mod._plan("ln", xl, wl, bl, EPS)[1]["template"])
    assert not t["ONE_SIMD"] and t["RW"] == 1 and not t["EWB"], t
    xs, ws, bs = make(rng, (9, 100), mx.float32, True, True)  # not FULL: the general path
    t = dict(norm_mod._plan("ln", xs, ws, bs, EPS)[1]["template"])
    assert t["FULL"] == 0 and t["RW"] == 1, t
    assert "RW" not in dict(norm_mod._plan("rms", x, w, None, EPS)[1]["template"])


@pytest.mark.parametrize("gbps", [3350.0, 4800.0])
def test_layer_norm_short_rows_a_simdgroup_rule(monkeypatch, gbps):
    """The shipped rule (LN_FWD_SHORT_ROW_BYTES, LN_FWD_SHORT_ROWS_A_SIMD): on the CUDA plan of a
    GPU faster than the H100, LayerNorm's FULL rows (and heads) of one simdgroup of at most 1 KiB
    take two rows a simdgroup, rows of 2 KiB one; the H100, the emulator's plan and the
    rule's off switch one row everywhere."""
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    monkeypatch.setattr(norm_mod, "_device_bandwidth_gbs", lambda: gbps)
    fast = gbps > norm_mod.RMS_VJP_UNITS_REF_GBPS

    def plan(n, dt, nh=1, rows=4096):
        x = mx.zeros((rows, n * nh), dtype=dt)
        w = mx.zeros((n * nh,), dtype=dt)
        _, kw = norm_mod._plan("ln", x, w, w, EPS, nh)
        t = dict(kw["template"])
        # EWB (w and b once for the RW rows) exactly where RW > 1 on rows of one head of at most
        # LN_FWD_EARLY_WB_ROW_BYTES (512)
        assert t["EWB"] == (t["RW"] > 1 and nh == 1 and n * dt.size <= 512), (n, dt, nh, t)
        return t["ONE_SIMD"], t["FULL"], t["RW"], kw["grid"][1]

    for dt in (mx.bfloat16, mx.float16):
        for nh in (1, 4):
            assert plan(256, dt, nh) == (True, 1, 2 if fast else 1, 4096 * nh // (2 if fast else 1)), (dt, nh)
            assert plan(64, dt, nh)[2] == (2 if fast else 1), (dt, nh)
            assert plan(512, dt, nh)[:3] == (True, 1, 2 if fast else 1), (dt, nh)  # 1 KiB
            assert plan(1024, dt, nh)[:3] == (True, 1, 1), (dt, nh)  # 2 KiB
    assert plan(128, mx.float32)[:3] == (True, 1, 2 if fast else 1)  # 512 bytes
    assert plan(256, mx.float32)[0] is False  # two simdgroups a row: no RW
    assert plan(256, mx.bfloat16, rows=9)[3] == (5 if fast else 16)  # ceil(9 / 2) simdgroups in one threadgroup; else two of 8
    monkeypatch.setattr(norm_mod, "LN_FWD_SHORT_ROW_BYTES", 0)
    assert plan(256, mx.bfloat16)[2] == 1
    monkeypatch.setattr(norm_mod, "LN_FWD_SHORT_ROW_BYTES", 1024)
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: False)
    assert plan(128, mx.float32)[2] == 1
