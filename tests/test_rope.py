"""RoPE family (metal_src/rope.metal, xlstm_kernels/ops/rope.py) vs a float64 NumPy reference.

Runs on the backend chosen with ``pytest --backend`` (default: the emulator).
"""

from __future__ import annotations

import io
import re
import zlib

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels import runtime
from xlstm_kernels.ops.rope import ROPE, _launch_geometry, rope, rope_reference

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


def np_rope(x, dims, *, traditional=False, base=10000.0, scale=1.0, offset=0, freqs=None):
    """float64 reference: pairs (2j, 2j+1) or (j, j+dims/2), theta = scale*(pos+offset)*inv_freq."""
    x = np.asarray(x, dtype=np.float64)
    half = dims // 2
    seq_len = x.shape[-2]
    if freqs is not None:
        inv = 1.0 / np.asarray(freqs, dtype=np.float64)
    else:
        inv = float(base) ** (-np.arange(half, dtype=np.float64) / half)
    off = np.asarray(offset, dtype=np.float64)
    if off.ndim == 1 and off.size > 1:  # per batch element: (B, 1, ..., 1)
        off = off.reshape((-1,) + (1,) * (x.ndim - 3))
    pos = off[..., None] + np.arange(seq_len, dtype=np.float64)  # (..., L)
    theta = scale * pos[..., None] * inv  # (..., L, half)
    c, s = np.cos(theta), np.sin(theta)
    out = x.copy()
    if traditional:
        x0, x1 = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2] = x0 * c - x1 * s
        out[..., 1:dims:2] = x0 * s + x1 * c
    else:
        x0, x1 = x[..., :half], x[..., half:dims]
        out[..., :half] = x0 * c - x1 * s
        out[..., half:dims] = x0 * s + x1 * c
    return out


def to_np(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32), dtype=np.float64)


def rel_err(out: mx.array, ref: np.ndarray) -> float:
    return float(np.max(np.abs(to_np(out) - ref)) / np.max(np.abs(ref)))


def rand(shape, dtype, seed) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def as_kwargs(case: dict) -> dict:
    """Op keyword arguments of a case (offset lists become int32 arrays, freqs an array)."""
    kw = {k: v for k, v in case.items() if k not in ("shape", "dims")}
    if isinstance(kw.get("offset"), list):
        kw["offset"] = mx.array(kw["offset"], dtype=mx.int32)
    if kw.get("freqs") is not None:
        kw["freqs"] = mx.array(np.asarray(kw["freqs"], dtype=np.float32))
        kw["base"] = None
    return kw


def np_kwargs(case: dict) -> dict:
    kw = {k: v for k, v in case.items() if k not in ("shape", "dims")}
    if kw.get("freqs") is not None:
        kw["freqs"] = np.asarray(kw["freqs"], dtype=np.float32)
    return kw


CASES = [
    pytest.param(dict(shape=(2, 3, 7, 64), dims=64), id="b2h3L7d64"),
    pytest.param(dict(shape=(2, 3, 7, 64), dims=32, offset=5, scale=0.5), id="dims32of64-off5-scale"),
    pytest.param(dict(shape=(1, 1, 1, 128), dims=128, offset=37), id="decode-d128"),
    pytest.param(dict(shape=(3, 33, 80), dims=64, offset=[0, 7, 19]), id="b3L33d80-perbatch"),
    pytest.param(dict(shape=(3, 5, 17, 24), dims=24, offset=[4, 0, 9], base=500.0), id="rows5-perbatch-base500"),
    pytest.param(dict(shape=(2, 2, 9, 11), dims=8, scale=2.0, freqs=[1.0, 3.0, 17.0, 250.0]), id="oddD11-freqs"),
    pytest.param(dict(shape=(1, 2, 301, 16), dims=16, offset=3), id="L301-d16"),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("traditional", [False, True], ids=["split", "trad"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward(kernel_backend, case, traditional, dtype):
    x = rand(case["shape"], DTYPES[dtype], seed=zlib.crc32(f"{case}{traditional}".encode()))
    out = rope(x, case["dims"], traditional=traditional, **as_kwargs(case))
    mx.eval(out)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = np_rope(to_np(x), case["dims"], traditional=traditional, **np_kwargs(case))
    assert rel_err(out, ref) < TOL[dtype]
    d = case["dims"]
    if d < x.shape[-1]:  # the pass-through features are bit-exact copies
        assert mx.array_equal(out[..., d:], x[..., d:]).item()


@pytest.mark.parametrize(
    "case",
    [
        dict(shape=(2, 3, 7, 64), dims=64),
        dict(shape=(2, 3, 7, 64), dims=48, offset=9, scale=0.25, base=1000.0),
        dict(shape=(3, 33, 80), dims=64, offset=[0, 7, 19]),
        dict(shape=(2, 4, 5, 32), dims=32, offset=[2, 6]),
        dict(shape=(1, 1, 1, 128), dims=128, offset=41),
        dict(shape=(2, 3, 6, 40), dims=40, freqs=list(np.linspace(1.0, 300.0, 20))),
    ],
    ids=["full", "partial-base1000", "perbatch-3d", "perbatch-4d", "decode", "freqs"],
)
@pytest.mark.parametrize("traditional", [False, True], ids=["split", "trad"])
def test_matches_mx_fast_rope(kernel_backend, case, traditional):
    x = rand(case["shape"], mx.float32, seed=3)
    kw = as_kwargs(case)
    ours = rope(x, case["dims"], traditional=traditional, **kw)
    theirs = mx.fast.rope(
        x, case["dims"], traditional=traditional, base=kw.get("base", 10000.0), scale=kw.get("scale", 1.0),
        offset=kw.get("offset", 0), freqs=kw.get("freqs"),
    )
    assert rel_err(ours, to_np(theirs)) < 2e-5


def test_offset_forms_agree(kernel_backend):
    """int, 0-d array and a constant per-batch vector give the same result."""
    x = rand((3, 2, 5, 16), mx.float32, seed=5)
    a = rope(x, 16, offset=6)
    b = rope(x, 16, offset=mx.array(6))
    c = rope(x, 16, offset=mx.array([6, 6, 6]))
    assert mx.array_equal(a, b).item() and mx.array_equal(a, c).item()


def test_decode_loop_offsets(kernel_backend):
    """A decode loop: the int offset changes every step, the same offset serves two calls
    (q and k); on cuda each new offset is a lazily copied device value (ops.rope's
    _offset_array), here also made first inside a compiled step."""
    q = rand((2, 4, 1, 32), mx.bfloat16, seed=21)
    k = rand((2, 2, 1, 32), mx.bfloat16, seed=22)
    for off in (7, 8, 9, 4095, 8):
        if off == 9 and kernel_backend != "emulate":  # the emulator evaluates its inputs: no compile
            got_q, got_k = mx.compile(lambda a, b: (rope(a, 32, offset=9), rope(b, 32, offset=9)))(q, k)
        else:
            got_q, got_k = rope(q, 32, offset=off), rope(k, 32, offset=off)
        assert rel_err(got_q, np_rope(to_np(q), 32, offset=off)) < TOL["bfloat16"]
        assert rel_err(got_k, np_rope(to_np(k), 32, offset=off)) < TOL["bfloat16"]


def test_offset_array_per_backend():
    from xlstm_kernels.cuda import constants
    from xlstm_kernels.ops.rope import _offset_array

    constants.clear()
    try:
        dev = _offset_array(4095, "cuda")
        assert _offset_array(4095, "cuda") is dev and _offset_array(4096, "cuda") is not dev
        host = _offset_array(4095, "emulate")
        assert _offset_array(4095, "emulate") is host and host is not dev
        for a in (dev, host):
            assert a.dtype == mx.int32 and tuple(a.shape) == (1,) and np.array(a).tolist() == [4095]
    finally:
        constants.clear()


def test_non_contiguous_input(kernel_backend):
    """(B, L, H, D) data seen as (B, H, L, D) through swapaxes, the usual attention layout."""
    blhd = rand((2, 9, 3, 32), mx.float32, seed=6)
    x = blhd.swapaxes(1, 2)
    out = rope(x, 32, traditional=True, offset=mx.array([1, 4]))
    ref = np_rope(to_np(x), 32, traditional=True, offset=np.array([1, 4]))
    assert rel_err(out, ref) < TOL["float32"]


def x_layout(a: mx.array, layout: str) -> mx.array:
    """`a`'s values in a view the kernel must read in place through its strides."""
    if layout == "transposed":  # (B, L, H, D) projections seen as (B, H, L, D)
        return mx.contiguous(a.swapaxes(1, 2)).swapaxes(1, 2)
    if layout == "swapped":  # feature stride L: the last two axes swapped
        return mx.contiguous(a.swapaxes(-1, -2)).swapaxes(-1, -2)
    if layout == "every_other":  # feature stride 2
        big = mx.stack([a, mx.full(a.shape, 1e4, dtype=a.dtype)], axis=-1)
        return big.reshape(*a.shape[:-1], 2 * a.shape[-1])[..., ::2]
    if layout == "broadcast":  # one row's values broadcast over H (row stride 0)
        return mx.broadcast_to(a[:, :1], a.shape)
    if layout == "misaligned":  # rows of D + 1 features, the view starting at feature 1
        big = mx.concatenate([mx.full((*a.shape[:-1], 1), 1e4, dtype=a.dtype), a], axis=-1)
        return big[..., 1:]
    if layout == "cache":  # a slice of a longer position axis
        big = mx.concatenate([a, mx.full((*a.shape[:-2], 5, a.shape[-1]), 1e4, dtype=a.dtype)], axis=-2)
        return big[..., : a.shape[-2], :]
    raise ValueError(layout)


# x reaches the kernel uncopied in any layout (ensure_row_contiguous is off for rope):
# every layout with each pairing, partial rotation (dims < D: the pass-through features too),
# one offset and per-batch offsets, 2-byte dtypes, and the VJP of a transposed input.
@pytest.mark.parametrize("layout", ["transposed", "swapped", "every_other", "broadcast", "misaligned", "cache"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_x_read_in_place(kernel_backend, layout, dtype):
    assert not ROPE.ensure_row_contiguous
    dt = DTYPES[dtype]
    for shape, dims, traditional, offset in [((2, 5, 9, 32), 32, False, 3), ((2, 5, 9, 32), 16, True, [4, 11]),
                                             ((3, 4, 7, 24), 24, True, 0), ((3, 4, 7, 24), 20, False, [1, 0, 9])]:
        a = rand(shape, dt, seed=len(layout) * 7 + dims)
        if layout == "broadcast":
            a = mx.broadcast_to(a[:, :1], a.shape)
        x = x_layout(a, layout)
        off = mx.array(offset, dtype=mx.int32) if isinstance(offset, list) else offset
        out = rope(x, dims, traditional=traditional, offset=off)
        ref = np_rope(to_np(a), dims, traditional=traditional, offset=np.array(offset) if isinstance(offset, list)
                      else offset)
        assert out.shape == a.shape and out.dtype == dt
        assert rel_err(out, ref) < TOL[dtype], (layout, shape, dims, traditional, offset)
    if layout == "transposed":  # the VJP of a transposed input, against the reference path's
        cot = rand((2, 5, 9, 32), dt, seed=3)
        x = x_layout(rand((2, 5, 9, 32), dt, seed=4), layout)
        _, (dx,) = mx.vjp(lambda v: rope(v, 32, offset=2), [x], [cot])
        _, (dref,) = mx.vjp(lambda v: rope_reference(v, 32, offset=2), [x.astype(mx.float32)],
                            [cot.astype(mx.float32)])
        assert rel_err(dx, to_np(dref)) < TOL[dtype]


def test_offsets_and_freqs_read_as_given(kernel_backend):
    """Per-batch offsets and freqs given as strided views (the kernel reads them through
    their strides), and as broadcast views (stride 0)."""
    x = rand((3, 2, 5, 16), mx.float32, seed=12)
    offs = mx.array([7, 0, 2, 0, 9, 0], dtype=mx.int32)[::2]  # [7, 2, 9], stride 2
    freqs = mx.array(np.stack([np.linspace(1.0, 50.0, 8), np.zeros(8)], axis=1).reshape(-1).astype(np.float32))[::2]
    out = rope(x, 16, offset=offs, base=None, freqs=freqs)
    ref = np_rope(to_np(x), 16, offset=np.array([7, 2, 9]), freqs=np.linspace(1.0, 50.0, 8))
    assert rel_err(out, ref) < TOL["float32"]
    out = rope(x, 16, offset=mx.broadcast_to(mx.array(4, dtype=mx.int32), (3,)), base=None,
               freqs=mx.broadcast_to(mx.array(3.0), (8,)))
    ref = np_rope(to_np(x), 16, offset=np.array([4, 4, 4]), freqs=np.full(8, 3.0))
    assert rel_err(out, ref) < TOL["float32"]


@pytest.mark.parametrize(
    "dtype,traditional,shape,dims,offset",
    [
        ("float32", False, (2, 3, 7, 64), 64, 0),
        ("float32", True, (2, 3, 7, 64), 48, 5),
        ("float32", False, (3, 33, 80), 64, [0, 7, 19]),
        ("float32", True, (1, 1, 1, 128), 128, 37),
        ("float16", False, (2, 2, 5, 24), 16, [3, 1]),
        ("bfloat16", True, (2, 2, 5, 24), 24, 2),
    ],
)
def test_grad(kernel_backend, dtype, traditional, shape, dims, offset):
    x = rand(shape, DTYPES[dtype], seed=7)
    cot = rand(shape, DTYPES[dtype], seed=8)
    kw = dict(traditional=traditional, offset=mx.array(offset, dtype=mx.int32) if isinstance(offset, list) else offset)
    _, (dx,) = mx.vjp(lambda x: rope(x, dims, **kw), [x], [cot])
    _, (dref,) = mx.vjp(lambda x: rope_reference(x.astype(mx.float32), dims, **kw), [x.astype(mx.float32)], [cot.astype(mx.float32)])
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert rel_err(dx, to_np(dref)) < TOL[dtype]
    # mx.grad through a scalar loss as well
    w = rand(shape, mx.float32, seed=9)
    g = mx.grad(lambda x: (rope(x, dims, **kw).astype(mx.float32) * w).sum())(x)
    gref = mx.grad(lambda x: (rope_reference(x, dims, **kw) * w).sum())(x.astype(mx.float32))
    assert rel_err(g, to_np(gref)) < TOL[dtype]


def test_reference_matches_numpy():
    x = rand((2, 3, 6, 40), mx.float32, seed=10)
    out = rope_reference(x, 32, traditional=True, offset=mx.array([2, 5]), scale=0.5)
    ref = np_rope(to_np(x), 32, traditional=True, offset=np.array([2, 5]), scale=0.5)
    assert rel_err(out, ref) < TOL["float32"]


def offset_view(a: mx.array, off: int) -> mx.array:
    """`a`'s values in a row-contiguous view that starts `off` elements into a larger
    buffer (no copy: the data pointer is not 16-byte aligned for off % 8 != 0)."""
    flat = a.reshape(-1)
    big = mx.concatenate([mx.zeros((off,), dtype=a.dtype), flat, mx.zeros((3,), dtype=a.dtype)])
    return big[off : off + flat.size].reshape(a.shape)


# Run boundaries: half not a multiple of P (the pairs per thread: 4 / 8 split-half, 2 / 4
# traditional for float32 / 16-bit), pass-through counts not a multiple of the run, odd D,
# rows not a multiple of N = 4; each through aligned and offset (misaligned) buffers.
RUN_CASES = [
    pytest.param((2, 3, 5, 128), 128, id="d128"),
    pytest.param((5, 4, 48), 44, id="half22-copy4"),
    pytest.param((3, 7, 33), 30, id="half15-copy3-oddD"),
    pytest.param((2, 2, 3, 129), 120, id="half60-copy9"),
    pytest.param((1, 9, 6), 2, id="one-pair-copy4"),
    pytest.param((2, 3, 5, 300), 256, id="d300"),
]


@pytest.mark.parametrize("shape,dims", RUN_CASES)
@pytest.mark.parametrize("traditional", [False, True], ids=["split", "trad"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("off", [0, 1, 3])
def test_runs_and_misaligned_inputs(kernel_backend, shape, dims, traditional, dtype, off):
    """Vector runs, their scalar tails and the misaligned fallback, forward and VJP."""
    x = rand(shape, DTYPES[dtype], seed=zlib.crc32(f"runs{shape}{dims}{traditional}{dtype}".encode()))
    cot = rand(shape, DTYPES[dtype], seed=21)
    xv, cv = (offset_view(a, off) for a in (x, cot)) if off else (x, cot)
    out, vjp = mx.vjp(lambda a: rope(a, dims, traditional=traditional, offset=3), [xv], [cv])
    ref = np_rope(to_np(x), dims, traditional=traditional, offset=3)
    assert rel_err(out[0], ref) < TOL[dtype]
    if dims < shape[-1]:
        assert mx.array_equal(out[0][..., dims:], x[..., dims:]).item()
    # the VJP rotates the cotangent by -theta = (-1) * (l + 3) * inv_freq
    assert rel_err(vjp[0], np_rope(to_np(cot), dims, traditional=traditional, offset=3, scale=-1.0)) < TOL[dtype]


@pytest.mark.emulator_only
@pytest.mark.parametrize(
    "dtype,traditional,shape,dims",
    [
        ("bfloat16", True, (3, 5, 13, 22), 16),  # 5 rows per batch (not a multiple of N=4), copy 16..21
        ("float32", False, (3, 5, 13, 30), 12),  # half 6: a full and a partial run of P=4; copy 18 = 4*4 + 2
        ("float16", False, (3, 2, 3, 19), 18),  # half 9 with P=8: one full run and one pair; D odd
    ],
)
def test_check_schedules(dtype, traditional, shape, dims):
    """Every thread order gives bit-identical outputs; bounds checked (partial threadgroups in x, y, z)."""
    from xlstm_kernels.emulate import check_schedules
    from xlstm_kernels.ops.rope import _launch_kwargs

    x = rand(shape, DTYPES[dtype], seed=11)
    offsets = mx.array([2, 0, 7], dtype=mx.int32)
    half = dims // 2
    freqs = mx.array((10000.0 ** (np.arange(half) / half)).astype(np.float32))
    kw = _launch_kwargs(x, dims, traditional, 1.0, offsets, freqs, False)
    kw["threadgroup"] = (2, 4, 2)  # partial threadgroups in x, y and z
    (y,) = check_schedules(runtime.get_kernel(ROPE, "emulate"), **kw, check_bounds=True)
    ref = np_rope(to_np(x), dims, traditional=traditional, offset=np.array([2, 0, 7]))
    assert rel_err(y.reshape(shape), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype,traditional,p", [("bfloat16", False, 4), ("bfloat16", True, 2), ("float32", False, 2),
                                                  ("float32", True, 1)])
def test_cuda_plan_runs_in_the_emulator(dtype, traditional, p):
    """cuda's launch plan (8-byte runs, RUN_BYTES) has the expected P and gives bit-identical,
    correct outputs under every thread order in the emulator."""
    from xlstm_kernels.emulate import check_schedules
    from xlstm_kernels.ops.rope import _launch_kwargs

    shape, dims = (3, 5, 7, 40), 36  # half 18: full and partial runs; copy 4
    x = rand(shape, DTYPES[dtype], seed=zlib.crc32(f"cuda plan {dtype}{traditional}".encode()))
    offsets = mx.array([5, 0, 9], dtype=mx.int32)
    half = dims // 2
    freqs = mx.array((10000.0 ** (np.arange(half) / half)).astype(np.float32))
    kw = _launch_kwargs(x, dims, traditional, 1.0, offsets, freqs, False, "cuda")
    assert dict(kw["template"])["P"] == p
    assert dict(kw["template"])["FAST_TRIG"] and np.prod(kw["threadgroup"]) <= 128
    assert dict(_launch_kwargs(x, dims, traditional, 1.0, offsets, freqs, False, "emulate")["template"])["P"] == 2 * p
    (y,) = check_schedules(runtime.get_kernel(ROPE, "emulate"), **kw, check_bounds=True)
    ref = np_rope(to_np(x), dims, traditional=traditional, offset=np.array([5, 0, 9]))
    assert rel_err(y.reshape(shape), ref) < TOL[dtype]


def test_rope_launches_with_the_backends_run_bytes(kernel_backend, monkeypatch):
    """rope() itself plans with the active backend's RUN_BYTES (forward and VJP): 8-byte
    runs given to this backend halve P, and the results still match float64."""
    from launch_spies import spy_prepared_launches

    from xlstm_kernels.ops import rope as rope_mod

    seen = []
    spy_prepared_launches(monkeypatch, rope_mod, lambda spec, kw: seen.append(dict(kw["template"])["P"]))
    x = rand((2, 3, 5, 64), DTYPES["bfloat16"], seed=21)
    cot = rand((2, 3, 5, 64), DTYPES["bfloat16"], seed=22)
    for run_bytes, p in ((16, 8), (8, 4)):
        monkeypatch.setattr(rope_mod, "RUN_BYTES", {kernel_backend: run_bytes})
        rope_mod._CALLS.clear()
        seen.clear()
        out, vjp = mx.vjp(lambda a: rope(a, 64, offset=3), [x], [cot])
        mx.eval(out, vjp)
        assert seen == [p, p], (run_bytes, seen)
        assert rel_err(out[0], np_rope(to_np(x), 64, offset=3)) < TOL["bfloat16"]
        assert rel_err(vjp[0], np_rope(to_np(cot), 64, offset=3, scale=-1.0)) < TOL["bfloat16"]
    rope_mod._CALLS.clear()


def test_launch_geometry():
    assert _launch_geometry(64, 7, 2) == (64, 4, 1)
    assert _launch_geometry(64, 1, 8) == (64, 1, 4)
    tx, ty, tz = _launch_geometry(300, 1000, 1000)
    assert tx * ty * tz <= 256
    assert _launch_geometry(16, 4096, 16, 128) == (16, 8, 1)
    assert np.prod(_launch_geometry(300, 1000, 1000, 128)) <= 128


def np_rope_float_theta(x, dims, offset, traditional=False, sign=1.0):
    """The rotation by sign * theta with theta made as the kernel makes it, in float32
    (pos = float(l + offset), inv_freq = 1 / freqs, theta = (1 * pos) * inv_freq), then rotated
    in float64: the reference for positions where theta's own rounding (ulp(theta) / 2,
    0.06 at 2^20) is far above float32's tolerance."""
    half = dims // 2
    freqs = np.power(np.float64(10000.0), np.arange(half, dtype=np.float64) / half).astype(np.float32)
    inv = np.float32(1.0) / freqs
    pos = (np.arange(x.shape[-2], dtype=np.int64) + offset).astype(np.float32)
    theta = (np.float32(1.0) * pos)[:, None] * inv[None, :]  # float32 products, as the kernel's
    c, s = np.cos(theta.astype(np.float64)), sign * np.sin(theta.astype(np.float64))
    x = np.asarray(x, dtype=np.float64)
    out = x.copy()
    i0, i1 = (slice(0, dims, 2), slice(1, dims, 2)) if traditional else (slice(0, half), slice(half, dims))
    out[..., i0] = x[..., i0] * c - x[..., i1] * s
    out[..., i1] = x[..., i0] * s + x[..., i1] * c
    return out


@pytest.mark.parametrize("fast_trig", [False, True])
@pytest.mark.parametrize("offset,traditional", [(3, False), (4000, False), (100_000, True), (2**20, False),
                                                (2**24 - 64, False), (-(2**20), True)])
def test_large_positions(kernel_backend, monkeypatch, fast_trig, offset, traditional):
    """cos / sin of large angles, both ways the kernel computes them (FAST_TRIG: theta
    reduced to [-pi, pi], then the fast functions; else the precise ones), forward and VJP
    (rotation by -theta), against the exact cos / sin of the kernel's own float32 theta
    (float32 tolerance)."""
    from xlstm_kernels.ops import rope as rope_mod

    if fast_trig and kernel_backend not in ("emulate", "cuda"):
        pytest.skip("FAST_TRIG ships on cuda only (Metal documents its fast cos / sin to 2^-13)")
    monkeypatch.setattr(rope_mod, "FAST_TRIG", {kernel_backend: fast_trig})
    rope_mod._CALLS.clear()
    seed = zlib.crc32(f"large positions {offset} {traditional}".encode())
    x, cot = rand((1, 3, 9, 64), mx.float32, seed=seed), rand((1, 3, 9, 64), mx.float32, seed=seed + 1)
    out, (grad,) = mx.vjp(lambda a: rope(a, 64, traditional=traditional, offset=offset), [x], [cot])
    assert rel_err(out[0], np_rope_float_theta(to_np(x), 64, offset, traditional)) < TOL["float32"]
    assert rel_err(grad, np_rope_float_theta(to_np(cot), 64, offset, traditional, sign=-1.0)) < TOL["float32"]
    rope_mod._CALLS.clear()


def test_kernel_freqs_are_the_base_freqs(kernel_backend):
    """The frequencies the kernel reads (a device-memory copy on cuda) are _base_freqs'."""
    from xlstm_kernels.ops.rope import _base_freqs, _kernel_freqs

    got = _kernel_freqs(24, 500.0, kernel_backend)
    assert got.dtype == mx.float32 and got.shape == (24,)
    assert np.array_equal(np.asarray(got), np.asarray(_base_freqs(24, 500.0)))


def test_empty(kernel_backend):
    x = mx.zeros((2, 0, 8), dtype=mx.float32)
    assert rope(x, 8).shape == (2, 0, 8)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(dims=7), ValueError, "even"),
        (dict(dims=0), ValueError, "even"),
        (dict(dims=34), ValueError, "must be <= x's last axis D=32"),
        (dict(dims=8.0), TypeError, "dims must be an int"),
        (dict(dims=8, freqs=mx.ones((3,))), ValueError, r"freqs must have shape \(dims // 2,\) = \(4,\)"),
        (dict(dims=8, freqs=mx.ones((4,), dtype=mx.int32), base=None), TypeError, "freqs has dtype"),
        (dict(dims=8, freqs=mx.ones((4,)), base=500.0), ValueError, "either base or freqs"),
        (dict(dims=8, base=None), ValueError, "one of base and freqs"),
        (dict(dims=8, base=-2.0), ValueError, "base must be a positive"),
        (dict(dims=8, offset=mx.array([1, 2, 3])), ValueError, r"shape \(2,\).*got shape \(3,\)"),
        (dict(dims=8, offset=mx.array([1.0, 2.0])), TypeError, "offset must be an integer array"),
        (dict(dims=8, offset=1.5), TypeError, "offset must be an int"),
        (dict(dims=8, scale=float("nan")), ValueError, "scale must be finite"),
    ],
)
def test_errors(kwargs, exc, match):
    x = rand((2, 3, 4, 32), mx.float32, seed=12)
    dims = kwargs.pop("dims")
    with pytest.raises(exc, match=match):
        rope(x, dims, **kwargs)


def test_errors_on_x():
    with pytest.raises(TypeError, match="x has dtype .*int32"):
        rope(mx.ones((2, 4, 8), dtype=mx.int32), 8)
    with pytest.raises(ValueError, match="at least 2 dimension"):
        rope(mx.ones((8,)), 8)
    with pytest.raises(TypeError, match="x must be an mx.array"):
        rope(np.ones((2, 4, 8), dtype=np.float32), 8)


def test_freqs_with_default_base_is_accepted(kernel_backend):
    """freqs without base=None: the default base is ignored (only an explicit base conflicts)."""
    x = rand((1, 2, 3, 8), mx.float32, seed=13)
    f = mx.array([1.0, 2.0, 4.0, 8.0])
    assert mx.array_equal(rope(x, 8, freqs=f), rope(x, 8, base=None, freqs=f)).item()


SPLITS = [(1, 1), (1, 2), (2, 4), (4, 1), (4, 8), (3, 2)]


@pytest.mark.parametrize("n,p", SPLITS, ids=[f"N{n}P{p}" for n, p in SPLITS])
@pytest.mark.parametrize("traditional", [False, True], ids=["split", "trad"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_work_split(kernel_backend, monkeypatch, n, p, traditional, dtype):
    """Rows (N) and pairs (P, at most a 16-byte run) per thread other than the shipped ones
    (scripts/probe_rope.py times them), forward and VJP, per-batch offsets with rows per
    batch not a multiple of N, a pass-through tail, against float64."""
    from xlstm_kernels.ops import rope as rope_mod

    shape, dims = (3, 5, 6, 40), 36  # half 18: full and partial runs of every P; copy 4
    p_max = rope_mod.pairs_per_thread
    monkeypatch.setattr(rope_mod, "ROWS_PER_THREAD", n)
    # P up to a 16-byte run on every backend (cuda ships 8-byte runs: RUN_BYTES)
    monkeypatch.setattr(rope_mod, "pairs_per_thread",
                        lambda dtype, trad, half, run_bytes=16: min(p, p_max(dtype, trad, half)))
    rope_mod._CALLS.clear()
    try:
        x = rand(shape, DTYPES[dtype], seed=zlib.crc32(f"split{n}{p}{traditional}{dtype}".encode()))
        cot = rand(shape, DTYPES[dtype], seed=5)
        offs = [4, 0, 11]
        out, vjp = mx.vjp(lambda a: rope(a, dims, traditional=traditional, offset=mx.array(offs, dtype=mx.int32)),
                          [x], [cot])
        off = np.array(offs)
        assert rel_err(out[0], np_rope(to_np(x), dims, traditional=traditional, offset=off)) < TOL[dtype]
        assert mx.array_equal(out[0][..., dims:], x[..., dims:]).item()
        ref_vjp = np_rope(to_np(cot), dims, traditional=traditional, offset=off, scale=-1.0)
        assert rel_err(vjp[0], ref_vjp) < TOL[dtype]
    finally:
        rope_mod._CALLS.clear()


@pytest.mark.parametrize("rows", [3, 1100])
@pytest.mark.parametrize("values", [[5], [-3, 4096]])
def test_device_offsets_keep_the_values(monkeypatch, values, rows):
    """Per-sequence offsets of at most SMALL_OFFSETS_BYTES (which MLX's CUDA allocator keeps in
    managed memory) go to the kernel as row 0 of a (3, B) array: the same values, a view of
    shape (B,) whose buffer holds 12 B bytes (device memory on cuda). A view: its graph
    slices the copy; an int index (``wide[0]``) would gather the row into a new array of
    B int32, back in the managed scalar pool (session 44: 75% of copy instead of 92%)."""
    from xlstm_kernels.ops import rope as rope_ops

    offs = mx.array(values, dtype=mx.int32)
    assert offs.nbytes <= rope_ops.SMALL_OFFSETS_BYTES == 8 and rope_ops.SMALL_OFFSETS_MIN_X_BYTES == 32 << 20
    assert rope_ops.SMALL_OFFSETS_COPY_ROWS == 3
    monkeypatch.setattr(rope_ops, "SMALL_OFFSETS_COPY_ROWS", rows)  # larger copies: a probe's knob
    wide = rope_ops._device_offsets(offs)
    assert wide.shape == offs.shape and wide.dtype == mx.int32
    dot = io.StringIO()
    mx.export_to_dot(dot, wide)  # before evaluation: the graph that makes it
    ops = set(re.findall(r'label ="(\w+)"', dot.getvalue()))
    assert "Slice" in ops and not ops & {"Gather", "Take", "Copy"}, ops
    assert np.array_equal(np.asarray(wide), np.asarray(values, dtype=np.int32))


def test_device_offsets_reuses_the_last_arrays_copy():
    """With a `last` entry, the copy made for the same given array on the same stream is
    reused; another array (equal values or not) gets a copy of its own."""
    from xlstm_kernels.ops import rope as rope_ops

    a = mx.array([7, 9], dtype=mx.int32)
    b = mx.array([7, 9], dtype=mx.int32)
    last = [None]
    wa = rope_ops._device_offsets(a, last, a)
    assert rope_ops._device_offsets(a, last, a) is wa
    wb = rope_ops._device_offsets(b, last, b)
    assert wb is not wa and last[0][0] is b
    assert np.array_equal(np.asarray(wb), np.asarray(b)) and np.array_equal(np.asarray(wa), np.asarray(a))
    assert rope_ops._device_offsets(a, None) is not wa  # no entry: a new copy
