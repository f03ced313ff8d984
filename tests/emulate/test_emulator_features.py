"""Metal features give the right numbers: simd/quad collectives under divergence,
simdgroup_matrix, two-level reductions, atomics, half/bfloat16, strided inputs,
scalars, templates, vector types, math namespaces, launch attributes, 3-D grids.

These tests use the ``metal_kernel`` fixture and only MLX's call keywords, so
``pytest --backend metal`` runs them unchanged on a Mac. Tests of emulator-only
behaviour are marked ``emulator_only``. References are float64 NumPy.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest


def _load_kernels():
    name = "xlstm_emulate_test_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("kernels.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


K = _load_kernels()

TOL = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 1e-2}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out)), "non-finite values in the output"
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _np(x: mx.array) -> np.ndarray:
    """float64 NumPy copy of an MLX array (bfloat16 via float32)."""
    if x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    return np.array(x).astype(np.float64)


def _round_bf16(x) -> np.ndarray:
    """Round to the nearest bfloat16 (ties to even); float32 holding the value."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (u.astype(np.uint32) << 16).view(np.float32)


def _round_to(x, dtype: mx.Dtype) -> np.ndarray:
    if dtype == mx.float16:
        return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)
    if dtype == mx.bfloat16:
        return _round_bf16(x).astype(np.float64)
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


# ---------------------------------------------------------------------------
# SIMD-group collectives under divergence and in a partial simdgroup
# ---------------------------------------------------------------------------
SIMD_TG = 40  # two simdgroups per threadgroup: 32 lanes and a partial one of 8
SIMD_N = 80  # two threadgroups
SIMD_MASKS = {"all": 0xFFFFFFFF, "lt8": 0x000000FF, "scattered": 0xA5C3F00F}
SIMD_DELTA = {"shuffle_xor": 2, "shuffle_up": 3, "shuffle_down": 3}


def _simdgroups(n: int, tg: int) -> list[np.ndarray]:
    """Global thread ids of each simdgroup, in lane order."""
    out = []
    for g0 in range(0, n, tg):
        size = min(tg, n - g0)
        for s0 in range(0, size, 32):
            out.append(np.arange(g0 + s0, g0 + min(size, s0 + 32)))
    return out


def _closed_mask(op: str, mask: int, d: int) -> int:
    """`mask` plus the lanes that its shuffle sources need, so that no active lane reads
    an inactive one (undefined on Metal; the emulator poisons it)."""
    step = {"shuffle_xor": lambda l: l ^ d, "shuffle_up": lambda l: l - d, "shuffle_down": lambda l: l + d}.get(op)
    if step is None:
        return mask
    while True:
        grown = mask
        for lane in range(32):
            s = step(lane)
            if (mask >> lane) & 1 and 0 <= s < 32:
                grown |= 1 << s
        if grown == mask:
            return mask
        mask = grown


def _simd_case(op: str, mask: int, seed: int):
    """Inputs shaped so votes see all-true, all-false and mixed simdgroups; shuffle
    sources are active lanes (broadcast: one per simdgroup)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SIMD_N).astype(np.float32)
    src = np.zeros(SIMD_N, np.uint32)
    for k, ids in enumerate(_simdgroups(SIMD_N, SIMD_TG)):
        lanes = np.arange(len(ids))
        act = ((mask >> lanes) & 1).astype(bool)
        if k == 0:
            x[ids] = np.abs(x[ids]) + 0.1
        elif k == 1:
            x[ids] = -np.abs(x[ids]) - 0.1
        elif k == 2:  # true exactly on the active lanes
            x[ids] = np.where(act, np.abs(x[ids]) + 0.1, -np.abs(x[ids]) - 0.1)
        active = lanes[act]
        if active.size == 0:
            continue
        if op == "broadcast":
            src[ids] = rng.choice(active)
        else:
            src[ids] = rng.choice(active, size=len(ids))
    return x, src


def _simd_reference(op: str, x: np.ndarray, mask: int, d: int, src: np.ndarray):
    """Expected y (float64), u (uint32) and which lanes are defined on Metal."""
    x64 = x.astype(np.float64)
    y = x64.copy()
    u = np.zeros(len(x), np.uint64)
    defined = np.ones(len(x), bool)
    for ids in _simdgroups(len(x), SIMD_TG):
        width = len(ids)
        lanes = np.arange(width)
        act = ((mask >> lanes) & 1).astype(bool)
        al = lanes[act]
        v = x64[ids]
        if op == "sum":
            y[ids[al]] = v[al].sum()
        elif op == "max":
            y[ids[al]] = v[al].max()
        elif op == "min":
            y[ids[al]] = v[al].min()
        elif op == "prefix_inclusive_sum":
            y[ids[al]] = np.cumsum(v[al])
        elif op == "prefix_exclusive_sum":
            y[ids[al]] = np.cumsum(v[al]) - v[al]
        elif op == "prefix_inclusive_product":
            y[ids[al]] = np.cumprod(v[al])
        elif op == "prefix_exclusive_product":
            y[ids[al]] = np.concatenate([[1.0], np.cumprod(v[al])[:-1]])
        elif op == "quad_sum":
            for lane in al:
                quad = al[al // 4 == lane // 4]
                y[ids[lane]] = v[quad].sum()
        elif op in ("shuffle", "broadcast", "shuffle_xor", "shuffle_up", "shuffle_down"):
            for lane in al:
                if op in ("shuffle", "broadcast"):
                    s = int(src[ids[lane]])
                elif op == "shuffle_xor":
                    s = lane ^ d
                elif op == "shuffle_up":
                    s = lane - d if lane >= d else lane
                else:
                    if lane + d >= 32:
                        s = lane
                    elif lane + d >= width:  # a lane that does not exist: undefined
                        s = -1
                    else:
                        s = lane + d
                if 0 <= s < width and act[s]:
                    y[ids[lane]] = v[s]
                else:
                    defined[ids[lane]] = False
        elif op == "ballot":
            bits = sum(1 << int(lane) for lane in al if v[lane] > 0)
            u[ids[al]] = bits
        elif op == "all":
            u[ids[al]] = int(bool(np.all(v[al] > 0)))
        elif op == "any":
            u[ids[al]] = int(bool(np.any(v[al] > 0)))
        else:
            raise ValueError(op)
    return y, u.astype(np.uint32), defined


@pytest.fixture
def simd_kernel(metal_kernel):
    return metal_kernel(name="feat_simd_ops", input_names=["x", "src", "op", "mask", "d"],
                        output_names=["y", "u"], source=K.SIMD_OPS)


def _run_simd(kernel, op: str, mask: int, x: np.ndarray, src: np.ndarray, d: int, **extra):
    return kernel(
        inputs=[mx.array(x), mx.array(src), K.SIMD_OP_CODES[op], mx.array(mask, dtype=mx.uint32),
                mx.array(d, dtype=mx.uint32)],
        output_shapes=[(SIMD_N,), (SIMD_N,)],
        output_dtypes=[mx.float32, mx.uint32],
        grid=(SIMD_N, 1, 1),
        threadgroup=(SIMD_TG, 1, 1),
        **extra,
    )


@pytest.mark.parametrize("mask_name", list(SIMD_MASKS))
@pytest.mark.parametrize("op", list(K.SIMD_OP_CODES))
def test_simd_collectives_under_divergence(simd_kernel, op, mask_name):
    d = SIMD_DELTA.get(op, 0)
    mask = SIMD_MASKS[mask_name]
    if op == "shuffle_down":  # mirror the lanes: shuffle_down reads upwards
        mask = int(f"{mask:032b}"[::-1], 2)
    mask = _closed_mask(op, mask, d)
    assert mask != 0xFFFFFFFF or mask_name == "all"  # still divergent
    x, src = _simd_case(op, mask, seed=K.SIMD_OP_CODES[op] * 10 + list(SIMD_MASKS).index(mask_name))
    y, u = _run_simd(simd_kernel, op, mask, x, src, d)
    ref_y, ref_u, defined = _simd_reference(op, x, mask, d, src)
    assert defined.sum() >= 8  # the check below covers enough lanes
    y = np.array(y).astype(np.float64)
    err = np.max(np.abs(y[defined] - ref_y[defined])) / np.max(np.abs(ref_y[defined]))
    assert err < 1e-5, (op, mask_name, err)
    np.testing.assert_array_equal(np.array(u), ref_u)
    if op in ("all", "any"):  # the inputs make both answers appear on active lanes
        lane = np.arange(SIMD_N) % SIMD_TG % 32
        active = ((mask >> lane) & 1).astype(bool)
        assert set(ref_u[active].tolist()) == {0, 1}


@pytest.mark.emulator_only
def test_shuffle_from_inactive_lane_is_reported():
    """On Metal reading a diverged lane is undefined; the emulator poisons the result."""
    from xlstm_kernels.emulate import EmulatorError, metal_kernel

    k = metal_kernel(name="feat_simd_ops", input_names=["x", "src", "op", "mask", "d"],
                     output_names=["y", "u"], source=K.SIMD_OPS)
    x, src = _simd_case("shuffle_xor", 0xFF, seed=5)
    # lanes 0..7 are active and read lanes 8..15 (inactive)
    with pytest.raises(EmulatorError, match="poison"):
        _run_simd(k, "shuffle_xor", 0xFF, x, src, 8)
    # the same shuffle with check_unwritten=False shows the poison as NaN on exactly those lanes
    y, _ = _run_simd(k, "shuffle_xor", 0xFF, x, src, 8, check_unwritten=False)
    y = np.array(y)
    lanes = np.arange(SIMD_N) % SIMD_TG % 32
    assert np.all(np.isnan(y[lanes < 8]))
    assert np.all(np.isfinite(y[lanes >= 8]))


# ---------------------------------------------------------------------------
# simdgroup_matrix
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(33, 29, 31), (2, 3, 5)], ids=["33x29x31", "2x3x5"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["float", "half"])
def test_simdgroup_matrix_gemm(metal_kernel, dtype, shape):
    m, n, k = shape
    rng = np.random.default_rng(11)
    a = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
    b = mx.array(rng.standard_normal((k, n)).astype(np.float32)).astype(dtype)
    kernel = metal_kernel(name="feat_mma_gemm", input_names=["A", "B"], output_names=["C"],
                          source=K.MMA_GEMM, header=K.SIMDGROUP_MATRIX_HEADER)
    (c,) = kernel(
        inputs=[a, b],
        output_shapes=[(m, n)],
        output_dtypes=[mx.float32],
        grid=(64 * _ceil(n, 16), 2 * _ceil(m, 16), 1),
        threadgroup=(64, 2, 1),
        template=[("T", dtype)],
    )
    ref = _np(a) @ _np(b)
    # float accumulation: half inputs multiply exactly, so the bound stays far below half's eps
    assert _rel_err(c, ref) < (1e-5 if dtype == mx.float32 else 1e-4)


def _frag_coord(lane: int, backend: str) -> tuple[int, int]:
    """Metal leaves the element layout to the implementation: Apple's (and the emulator's)
    differs from xlstm_kernels.cuda's (the tensor cores' accumulator layout)."""
    if backend == "cuda":
        return lane // 4, 2 * (lane % 4)
    q = lane // 4
    return (q & 4) + (lane // 2) % 4, (q & 2) * 2 + (lane % 2) * 2


def test_simdgroup_matrix_thread_elements_layout(metal_kernel, backend):
    rng = np.random.default_rng(12)
    src = rng.standard_normal((8, 8)).astype(np.float32)
    kernel = metal_kernel(name="feat_sg_layout", input_names=["src"], output_names=["out"],
                          source=K.SIMDGROUP_LAYOUT, header=K.SIMDGROUP_MATRIX_HEADER)
    (out,) = kernel(inputs=[mx.array(src)], output_shapes=[(32, 2)], output_dtypes=[mx.float32],
                    grid=(32, 1, 1), threadgroup=(32, 1, 1))
    expected = np.empty((32, 2), np.float32)
    for lane in range(32):
        row, col = _frag_coord(lane, backend)
        expected[lane] = src[row, col], src[row, col + 1]
    np.testing.assert_array_equal(np.array(out), expected)


def test_shared_header_frag_helpers_match_the_layout(metal_kernel):
    """xk_frag_coord / xk_frag_row_max / xk_frag_row_sum (metal_src/_simdgroup.metal, in every
    family's header) agree with the backend's own simdgroup_matrix layout."""
    from xlstm_kernels.runtime import family_header

    rng = np.random.default_rng(13)
    src = rng.standard_normal((8, 8)).astype(np.float32)
    body = """
const uint lane = thread_index_in_simdgroup;
simdgroup_matrix<float, 8, 8> m;
simdgroup_load(m, src, 8);
int r, c;
xk_frag_coord(lane, r, c);
const vec<float, 2> e = m.thread_elements();
out[lane * 5 + 0] = e[0] - src[r * 8 + c];
out[lane * 5 + 1] = e[1] - src[r * 8 + c + 1];
out[lane * 5 + 2] = float(r);
out[lane * 5 + 3] = xk_frag_row_max(metal::max(e[0], e[1]));
out[lane * 5 + 4] = xk_frag_row_sum(e[0] + e[1]);
"""
    kernel = metal_kernel(name="feat_frag_helpers", input_names=["src"], output_names=["out"], source=body,
                          header="#include <metal_stdlib>\n#include <metal_simdgroup_matrix>\nusing namespace metal;\n"
                          + family_header("gemm"))
    (out,) = kernel(inputs=[mx.array(src)], output_shapes=[(32, 5)], output_dtypes=[mx.float32],
                    grid=(32, 1, 1), threadgroup=(32, 1, 1))
    got = np.array(out)
    np.testing.assert_array_equal(got[:, :2], 0.0)  # thread_elements are where xk_frag_coord says
    rows = got[:, 2].astype(int)
    assert sorted(np.bincount(rows, minlength=8)) == [4] * 8  # 4 lanes per row
    np.testing.assert_array_equal(got[:, 3], src.max(axis=1)[rows])
    np.testing.assert_allclose(got[:, 4], src.sum(axis=1)[rows], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Two-level reduction
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n, threads, dtype",
    [(7, 32, mx.float32), (100, 96, mx.float32), (1031, 256, mx.float32), (100, 96, mx.float16)],
    ids=["7-f32", "100-f32", "1031-f32", "100-f16"],
)
def test_rms_norm_two_level_reduction(metal_kernel, n, threads, dtype):
    rows, eps = 3, 1e-5
    rng = np.random.default_rng(n)
    x = mx.array((rng.standard_normal((rows, n)) * 2.0).astype(np.float32)).astype(dtype)
    w = mx.array(rng.standard_normal(n).astype(np.float32)).astype(dtype)
    kernel = metal_kernel(name="feat_rms_norm", input_names=["x", "w", "eps"], output_names=["y"],
                          source=K.RMS_NORM)
    (y,) = kernel(inputs=[x, w, eps], output_shapes=[(rows, n)], output_dtypes=[dtype],
                  grid=(threads, rows, 1), threadgroup=(threads, 1, 1), template=[("T", dtype)])
    x64, w64 = _np(x), _np(w)
    ref = x64 / np.sqrt(np.mean(x64**2, axis=1, keepdims=True) + eps) * w64
    assert _rel_err(_np(y), ref) < TOL[dtype]


# ---------------------------------------------------------------------------
# Atomics
# ---------------------------------------------------------------------------
def test_atomic_histogram(metal_kernel):
    n, nbins, lo, scale = 1237, 13, -2.5, 13 / 5.0
    rng = np.random.default_rng(13)
    x = rng.standard_normal(n).astype(np.float32)
    kernel = metal_kernel(name="feat_atomic_hist", input_names=["x", "lo", "scale", "nbins"],
                          output_names=["counts", "sums"], source=K.ATOMIC_HISTOGRAM, atomic_outputs=True)
    counts, sums = kernel(inputs=[mx.array(x), lo, scale, nbins], output_shapes=[(nbins,), (nbins,)],
                          output_dtypes=[mx.int32, mx.float32], grid=(_ceil(n, 128) * 128, 1, 1),
                          threadgroup=(128, 1, 1), init_value=0)
    bins = np.clip(np.floor((x - np.float32(lo)) * np.float32(scale)).astype(np.int64), 0, nbins - 1)
    np.testing.assert_array_equal(np.array(counts), np.bincount(bins, minlength=nbins))
    assert int(np.array(counts).sum()) == n
    ref_sums = np.bincount(bins, weights=x.astype(np.float64), minlength=nbins)
    assert _rel_err(np.array(sums), ref_sums) < 1e-5


# ---------------------------------------------------------------------------
# half / bfloat16
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["half", "bfloat"])
def test_half_and_bfloat16_io_and_arithmetic(metal_kernel, dtype):
    n = 301
    rng = np.random.default_rng(14)
    a = mx.array((rng.standard_normal(n) * 3).astype(np.float32)).astype(dtype)
    b = mx.array((rng.standard_normal(n) * 3).astype(np.float32)).astype(dtype)
    kernel = metal_kernel(name="feat_low_precision", input_names=["a", "b"],
                          output_names=["copy", "prod", "mixed"], source=K.LOW_PRECISION)
    copy, prod, mixed = kernel(inputs=[a, b], output_shapes=[(n,)] * 3, output_dtypes=[dtype] * 3,
                               grid=(_ceil(n, 64) * 64, 1, 1), threadgroup=(64, 1, 1), template=[("T", dtype)])
    assert copy.dtype == dtype and prod.dtype == dtype and mixed.dtype == dtype
    bits = mx.uint16
    np.testing.assert_array_equal(np.array(copy.view(bits)), np.array(a.view(bits)))  # bit-exact round trip
    a64, b64 = _np(a), _np(b)
    ref_prod = _round_to(a64 * b64, dtype)
    ref_mixed = _round_to(a64.astype(np.float32) * b64.astype(np.float32) + a64.astype(np.float32), dtype)
    assert _rel_err(_np(prod), ref_prod) < TOL[dtype]
    assert _rel_err(_np(mixed), ref_mixed) < TOL[dtype]
    # results are representable in the dtype: rounding really happened in T
    assert np.array_equal(_round_to(_np(mixed), dtype), _np(mixed))


# ---------------------------------------------------------------------------
# Strided inputs
# ---------------------------------------------------------------------------
def _strided_cases():
    base2 = mx.array(np.random.default_rng(15).standard_normal((9, 11)).astype(np.float32))
    base3 = mx.array(np.random.default_rng(16).standard_normal((2, 3, 5)).astype(np.float32))
    return {
        "transposed": (mx.transpose(base2), (1, 11)),
        "sliced": (base2[1::2, ::3], (22, 3)),
        "transposed-3d": (mx.transpose(base3, (2, 0, 1)), (1, 15, 5)),
    }


@pytest.mark.parametrize("case", ["transposed", "sliced", "transposed-3d"])
@pytest.mark.parametrize("contiguous", [False, True], ids=["strided", "row-contiguous"])
def test_strided_input_elem_to_loc(metal_kernel, case, contiguous):
    view, strides = _strided_cases()[case]
    kernel = metal_kernel(name="feat_strided", input_names=["inp"], output_names=["out", "seen"],
                          source=K.STRIDED_GATHER, ensure_row_contiguous=contiguous)
    out, seen = kernel(inputs=[view], output_shapes=[view.shape, (view.ndim,)],
                       output_dtypes=[mx.float32, mx.int32], grid=(_ceil(view.size, 32) * 32, 1, 1),
                       threadgroup=(32, 1, 1))
    ref = 2.0 * _np(view) + 1.0
    assert _rel_err(out, ref) < 1e-6
    if contiguous:
        strides = tuple(int(np.prod(view.shape[i + 1 :])) for i in range(view.ndim))
    assert tuple(np.array(seen).tolist()) == strides


# ---------------------------------------------------------------------------
# 0-d scalars and template arguments
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, scale, neg", [(mx.float32, 3, True), (mx.float16, -2, False)], ids=["f32-3-neg", "f16-m2-pos"]
)
def test_scalars_and_template_arguments(metal_kernel, dtype, scale, neg):
    n, alpha, beta = 77, 0.375, -3
    rng = np.random.default_rng(17)
    x = mx.array(rng.standard_normal(n).astype(np.float32)).astype(dtype)
    kernel = metal_kernel(name="feat_scalar_template", input_names=["x", "alpha", "beta"], output_names=["out"],
                          source=K.SCALAR_TEMPLATE)
    (out,) = kernel(inputs=[x, alpha, beta], output_shapes=[(n,)], output_dtypes=[dtype],
                    grid=(_ceil(n, 32) * 32, 1, 1), threadgroup=(32, 1, 1),
                    template=[("T", dtype), ("SCALE", scale), ("NEG", neg)])
    assert out.dtype == dtype
    ref = _np(x) * alpha * scale + beta
    ref = -ref if neg else ref
    assert _rel_err(_np(out), ref) < TOL[dtype]


# ---------------------------------------------------------------------------
# Vector types
# ---------------------------------------------------------------------------
def test_float4_and_half4_vectors(metal_kernel):
    n = 4 * 37
    rng = np.random.default_rng(18)
    xf = rng.standard_normal(n).astype(np.float32)
    xh = rng.standard_normal(n).astype(np.float16)
    kernel = metal_kernel(name="feat_vec4", input_names=["xf", "xh"], output_names=["yf", "yh", "dots"],
                          source=K.VEC4)
    yf, yh, dots = kernel(inputs=[mx.array(xf), mx.array(xh)], output_shapes=[(n,), (n,), (n // 4,)],
                          output_dtypes=[mx.float32, mx.float16, mx.float32], grid=(64, 1, 1),
                          threadgroup=(32, 1, 1))
    a = xf.astype(np.float64).reshape(-1, 4)
    h = xh.astype(np.float64).reshape(-1, 4)
    assert _rel_err(np.array(yf).reshape(-1, 4), 2.0 * a[:, ::-1] + h) < 1e-6
    assert _rel_err(np.array(yh).reshape(-1, 4), _round_to(_round_to(a * h, mx.float16) + h, mx.float16)) < 1e-2
    assert _rel_err(np.array(dots), (a * h).sum(axis=1)) < 1e-5


# ---------------------------------------------------------------------------
# metal::precise:: and metal::fast::
# ---------------------------------------------------------------------------
def test_precise_and_fast_math(metal_kernel):
    n = 203
    x = np.random.default_rng(19).uniform(0.1, 3.0, n).astype(np.float32)
    kernel = metal_kernel(name="feat_math", input_names=["x"], output_names=["out"], source=K.MATH_NAMESPACES)
    (out,) = kernel(inputs=[mx.array(x)], output_shapes=[(n, 8)], output_dtypes=[mx.float32],
                    grid=(_ceil(n, 64) * 64, 1, 1), threadgroup=(64, 1, 1))
    out = np.array(out).astype(np.float64)
    x64 = x.astype(np.float64)
    refs = {
        "exp": np.exp(x64),
        "log": np.log(x64),
        "rsqrt": 1.0 / np.sqrt(x64),
        "tanh": np.tanh(x64 - 1.5),
        "sin": np.sin(x64),
    }
    for col, (name, ns) in enumerate(K.MATH_NAMESPACES_COLUMNS):
        ref = refs[name.split("::")[1]]
        tol = 1e-5 if ns == "precise" else 1e-4
        assert _rel_err(out[:, col], ref) < tol, name
        if ns == "precise":  # elementwise too: a few float32 ulps
            np.testing.assert_allclose(out[:, col], ref, rtol=2e-6, atol=1e-7, err_msg=name)


# ---------------------------------------------------------------------------
# Launch attributes and 3-D grids
# ---------------------------------------------------------------------------
def test_threads_per_threadgroup_on_edge_groups(metal_kernel):
    grid, group = (10, 5, 3), (4, 2, 2)
    kernel = metal_kernel(name="feat_launch_attrs", input_names=["dummy"], output_names=["info"],
                          source=K.LAUNCH_ATTRIBUTES)
    dummy = mx.array(np.random.default_rng(20).standard_normal(4).astype(np.float32))
    (info,) = kernel(inputs=[dummy], output_shapes=[(grid[2], grid[1], grid[0], 12)], output_dtypes=[mx.int32],
                     grid=grid, threadgroup=group)
    info = np.array(info)
    expected = np.empty_like(info)
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                pos = (x, y, z)
                gid = [p // g for p, g in zip(pos, group)]
                actual = [min(g, n - i * g) for g, n, i in zip(group, grid, gid)]
                local = [p % g for p, g in zip(pos, group)]
                expected[z, y, x] = [*actual, *group, *local, *gid]
    np.testing.assert_array_equal(info, expected)
    # the edge groups really are smaller: x has 4, 4, 2 threads; y 2, 2, 1; z 2, 1
    assert sorted(set(info[..., 0].ravel().tolist())) == [2, 4]
    assert sorted(set(info[..., 1].ravel().tolist())) == [1, 2]
    assert sorted(set(info[..., 2].ravel().tolist())) == [1, 2]


@pytest.mark.parametrize("shape", [(2, 3, 5), (7, 9, 11)], ids=["2x3x5", "7x9x11"])
def test_3d_grid(metal_kernel, shape):
    d, h, w = shape
    group = (4, 4, 2)
    x = np.random.default_rng(21).standard_normal(shape).astype(np.float32)
    kernel = metal_kernel(name="feat_grid3d", input_names=["x"], output_names=["out"], source=K.GRID_3D)
    (out,) = kernel(inputs=[mx.array(x)], output_shapes=[shape], output_dtypes=[mx.float32],
                    grid=(_ceil(w, 4) * 4, _ceil(h, 4) * 4, _ceil(d, 2) * 2), threadgroup=group)
    zz, yy, xx = np.meshgrid(np.arange(d), np.arange(h), np.arange(w), indexing="ij")
    ref = 2.0 * x.astype(np.float64) + (100 * xx + 10 * yy + zz)
    assert _rel_err(out, ref) < 1e-6
