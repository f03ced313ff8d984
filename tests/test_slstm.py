"""sLSTM ops (metal_src/slstm.metal) against a float64 NumPy loop and MLX autodiff.

Default backend: the CPU Metal emulator (``pytest --backend metal`` on a Mac).
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels import runtime
from xlstm_kernels.emulate import check_schedules
from xlstm_kernels.ops import slstm as sl
from xlstm_kernels.ops.slstm import slstm, slstm_reference, slstm_step, slstm_step_reference

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
TOL = {mx.float32: 2e-5, mx.float16: 1e-2, mx.bfloat16: 2e-2}


# ---------------------------------------------------------------------------
# Ground truth: float64 NumPy
# ---------------------------------------------------------------------------
def np_logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def np_cell(raw, y, c, n, m):
    ir, fr, zr, orr = raw[:, 0], raw[:, 1], raw[:, 2], raw[:, 3]
    empty = n == 0
    lfm = m + np_logsigmoid(fr)
    mt = np.where(empty, ir, np.maximum(ir, lfm))
    ig = np.exp(ir - mt)
    fg = np.where(empty, 0.0, np.exp(np.where(empty, 0.0, lfm - mt)))
    og = 0.5 * (1.0 + np.tanh(0.5 * orr))  # sigmoid without overflow
    c = fg * c + ig * np.tanh(zr)
    n = fg * n + ig
    return og * c / n, c, n, mt


def np_slstm(wx, r, b, state=None):
    """float64 loop: wx (B,S,4,NH,DH), r (NH,DH,4,DH), b (4,NH,DH) -> y (B,S,NH,DH), final state."""
    wx, r, b = (np.asarray(a, dtype=np.float64) for a in (wx, r, b))
    bsz, s, _, nh, dh = wx.shape
    if state is None:
        st = [np.zeros((bsz, nh, dh)) for _ in range(4)]
    else:
        st = [np.asarray(a, dtype=np.float64) for a in state]
    ys = []
    for t in range(s):
        raw = wx[:, t] + np.einsum("bhi,higj->bghj", st[0], r) + b
        st = list(np_cell(raw, *st))
        ys.append(st[0])
    return np.stack(ys, axis=1) if ys else np.zeros((bsz, 0, nh, dh)), st


def host(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32), dtype=np.float64)


def rel_err(out, ref) -> float:
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.max(np.abs(host(out) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def make_inputs(seed, bsz, s, nh, dh, dtype=mx.float32, with_state=False, scale=1.0):
    rng = np.random.default_rng(seed)
    wx = mx.array((scale * rng.standard_normal((bsz, s, 4, nh, dh))).astype(np.float32)).astype(dtype)
    r = mx.array((rng.standard_normal((nh, dh, 4, dh)) / np.sqrt(dh)).astype(np.float32)).astype(dtype)
    b = mx.array((0.5 * rng.standard_normal((4, nh, dh))).astype(np.float32)).astype(dtype)
    state = None
    if with_state:
        shp = (bsz, nh, dh)
        state = (
            mx.array((0.5 * rng.standard_normal(shp)).astype(np.float32)),
            mx.array(rng.standard_normal(shp).astype(np.float32)),
            mx.array(rng.uniform(0.5, 2.0, shp).astype(np.float32)),
            mx.array(rng.standard_normal(shp).astype(np.float32)),
        )
    return wx, r, b, state


def np_state(state):
    return None if state is None else [host(x) for x in state]


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------
FWD_CASES = [
    (dt, s, nh, dh, st)
    for dt, s, nh, dh, st in itertools.product(DTYPES, (1, 7, 33), (1, 3), (8, 32, 64), (False, True))
    # float32 runs the full grid; the half types every S, DH and state on both NH at S = 7
    # and on NH = 3 otherwise
    if dt == mx.float32 or s == 7 or nh == 3
]


@pytest.mark.parametrize("dtype,s,nh,dh,with_state", FWD_CASES,
                         ids=[f"{str(c[0]).split('.')[-1]}-S{c[1]}-NH{c[2]}-DH{c[3]}-{'state' if c[4] else 'zero'}"
                              for c in FWD_CASES])
def test_forward_matches_numpy(kernel_backend, dtype, s, nh, dh, with_state):
    wx, r, b, state = make_inputs(s * 100 + nh * 10 + dh, 2, s, nh, dh, dtype, with_state)
    y, st = slstm(wx, r, b, state=state, return_state=True)
    assert y.dtype == dtype and y.shape == (2, s, nh, dh)
    assert all(x.dtype == mx.float32 and x.shape == (2, nh, dh) for x in st)
    y_ref, st_ref = np_slstm(host(wx), host(r), host(b), np_state(state))
    assert rel_err(y, y_ref) < TOL[dtype]
    # states are float32 in every dtype; only y's rounding to the output dtype differs
    for name, a, ref in zip("ycnm", st, st_ref):
        assert rel_err(a, ref) < (2e-5 if dtype == mx.float32 else 1e-4), name


def test_reference_matches_numpy():
    wx, r, b, state = make_inputs(3, 2, 9, 3, 16, with_state=True)
    y, st = slstm_reference(wx, r, b, state=state, return_state=True)
    y_ref, st_ref = np_slstm(host(wx), host(r), host(b), np_state(state))
    assert rel_err(y, y_ref) < 2e-5
    for a, ref in zip(st, st_ref):
        assert rel_err(a, ref) < 2e-5


@pytest.mark.parametrize(
    "dh,cfg",
    [
        (12, {"threads_per_unit": 8, "r_in_registers": True}),  # DH not a multiple of K
        (12, {"threads_per_unit": 8, "r_in_registers": False}),
        (5, {"threads_per_unit": 32}),  # 160 threads: partial simdgroup, 1 term per lane
        (32, {"threads_per_unit": 1, "r_in_registers": False}),
        (64, {"threads_per_unit": 16, "r_in_registers": False}),  # 1024 threads
        (40, sl.SLSTMConfig(threads_per_unit=2, r_in_registers=True)),
    ],
)
def test_configs_match_numpy(kernel_backend, dh, cfg):
    wx, r, b, state = make_inputs(dh, 2, 6, 3, dh, with_state=True)
    y, st = slstm(wx, r, b, state=state, return_state=True, config=cfg)
    y_ref, st_ref = np_slstm(host(wx), host(r), host(b), np_state(state))
    assert rel_err(y, y_ref) < 2e-5
    assert rel_err(st[1], st_ref[1]) < 2e-5
    ys, _ = slstm_step(wx[:, 0], r, b, state, config=cfg)
    assert rel_err(ys, y_ref[:, 0]) < 2e-5
    # the backward kernel under the same configuration
    w = mx.array(np.random.default_rng(1).standard_normal(y.shape).astype(np.float32))
    argnums = (0, 1, 2, 3)
    g = mx.grad(lambda x, r_, b_, y0: (slstm(x, r_, b_, state=(y0,) + state[1:], config=cfg) * w).sum(),
                argnums=argnums)(wx, r, b, state[0])
    g_ref = mx.grad(lambda x, r_, b_, y0: (slstm_reference(x, r_, b_, state=(y0,) + state[1:]) * w).sum(),
                    argnums=argnums)(wx, r, b, state[0])
    for a, ref in zip(g, g_ref):
        assert rel_err(a, host(ref)) < 1e-4


def test_default_plan(monkeypatch):
    """The built-in plan (a family without sLSTM presets), and the H100 family's presets."""
    from xlstm_kernels import tiles

    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "cpu")
    tiles.reload_presets()
    assert sl.plan(8) == sl.SLSTMConfig(1, True)
    assert sl.plan(32) == sl.SLSTMConfig(4, True)
    assert sl.plan(64) == sl.SLSTMConfig(8, True)
    assert sl.plan(128) == sl.SLSTMConfig(4, False)
    assert sl.plan(256, mx.bfloat16) == sl.SLSTMConfig(2, False)
    for dh in (1, 7, 64, 100, 256, 512):
        cfg = sl.plan(dh)
        assert dh * cfg.threads_per_unit <= 1024
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "nvidia_hopper")  # R in registers, more lanes per unit
    assert sl.plan(128) == sl.SLSTMConfig(8, True) and sl.plan(256) == sl.SLSTMConfig(4, True)


# ---------------------------------------------------------------------------
# States: zero state, carried state, step-by-step
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_sequence_carries_state(kernel_backend, dtype):
    wx, r, b, state = make_inputs(11, 2, 33, 3, 32, dtype, with_state=True)
    for st0 in (None, state):
        y_all, st_all = slstm(wx, r, b, state=st0, return_state=True)
        y1, st1 = slstm(wx[:, :20], r, b, state=st0, return_state=True)
        y2, st2 = slstm(wx[:, 20:], r, b, state=st1, return_state=True)
        y_cat = mx.concatenate([y1, y2], axis=1)
        # the carried float32 state continues the recurrence exactly
        assert rel_err(y_cat, host(y_all)) <= 1e-6
        for a, ref in zip(st2, st_all):
            assert rel_err(a, host(ref)) <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_state_equals_no_state(kernel_backend, dtype):
    wx, r, b, _ = make_inputs(12, 2, 7, 3, 32, dtype)
    z = mx.zeros((2, 3, 32), dtype=mx.float32)
    y0, st0 = slstm(wx, r, b, return_state=True)
    y1, st1 = slstm(wx, r, b, state=(z, z, z, z), return_state=True)
    assert rel_err(y1, host(y0)) == 0.0
    for a, ref in zip(st1, st0):
        assert rel_err(a, host(ref)) == 0.0
    # the first step from the zero state uses m_0 = i_raw (NX-AI's rule)
    _, st_first = slstm(wx[:, :1], r, b, return_state=True)
    i_raw0 = host(wx[:, 0, 0]) + host(b[0])
    np.testing.assert_allclose(host(st_first[3]), i_raw0, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(host(st_first[2]), 1.0, rtol=0, atol=0)  # n_0 = i = exp(0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_step_by_step_equals_sequence(kernel_backend, dtype, with_state):
    bsz, s, nh, dh = 2, 7, 3, 32
    wx, r, b, state = make_inputs(13, bsz, s, nh, dh, dtype, with_state)
    y_seq, st_seq = slstm(wx, r, b, state=state, return_state=True)
    st = state if state is not None else tuple(mx.zeros((bsz, nh, dh), dtype=mx.float32) for _ in range(4))
    ys = []
    sl._STEP_CALLS.clear()
    for t in range(s):
        y_t, st = slstm_step(wx[:, t], r, b, st)
        assert y_t.dtype == dtype and y_t.shape == (bsz, nh, dh)
        ys.append(y_t)
    assert len(sl._STEP_CALLS) <= 2  # one prepared call per signature (the first state may differ)
    assert rel_err(mx.stack(ys, axis=1), host(y_seq)) <= 1e-6
    for a, ref in zip(st, st_seq):
        assert rel_err(a, host(ref)) <= 1e-6
    y_ref, _ = np_slstm(host(wx), host(r), host(b), np_state(state))
    assert rel_err(mx.stack(ys, axis=1), y_ref) < TOL[dtype]


def test_step_reference_matches_numpy():
    wx, r, b, state = make_inputs(14, 2, 1, 3, 16, with_state=True)
    y, st = slstm_step_reference(wx[:, 0], r, b, state)
    y_ref, st_ref = np_slstm(host(wx), host(r), host(b), np_state(state))
    assert rel_err(y, y_ref[:, 0]) < 2e-5
    assert rel_err(st[2], st_ref[2]) < 2e-5


def test_empty_sequence(kernel_backend):
    wx, r, b, state = make_inputs(15, 2, 0, 3, 8, with_state=True)
    y, st = slstm(wx, r, b, state=state, return_state=True)
    assert y.shape == (2, 0, 3, 8)
    for a, ref in zip(st, state):
        assert rel_err(a, host(ref)) == 0.0


# ---------------------------------------------------------------------------
# Gradients vs MLX autodiff of the reference loop
# ---------------------------------------------------------------------------
def _loss(fn, w, ws, return_state):
    def loss(wx, r, b, y0, c0, n0, m0):
        st = None if y0 is None else (y0, c0, n0, m0)
        if return_state:
            y, sT = fn(wx, r, b, state=st, return_state=True)
            extra = sum((a * q).sum() for a, q in zip(sT, ws))
        else:
            y = fn(wx, r, b, state=st)
            extra = 0.0
        return (y.astype(mx.float32) * w).sum() + extra

    return loss


GRAD_CASES = [
    (mx.float32, 1, 1, 8, True, True),
    (mx.float32, 7, 3, 8, False, False),
    (mx.float32, 7, 3, 32, True, True),
    (mx.float32, 33, 1, 32, False, True),
    (mx.float32, 7, 1, 64, True, False),
    (mx.float16, 7, 3, 32, True, True),
    (mx.bfloat16, 7, 3, 32, False, False),
]


@pytest.mark.parametrize("dtype,s,nh,dh,with_state,return_state", GRAD_CASES)
def test_gradients_match_reference(kernel_backend, dtype, s, nh, dh, with_state, return_state):
    bsz = 2
    wx, r, b, state = make_inputs(20 + s + dh, bsz, s, nh, dh, dtype, with_state)
    rng = np.random.default_rng(99)
    w = mx.array(rng.standard_normal((bsz, s, nh, dh)).astype(np.float32))
    ws = [mx.array(rng.standard_normal((bsz, nh, dh)).astype(np.float32)) for _ in range(4)]
    args = (wx, r, b) + (state if state is not None else (None,) * 4)
    argnums = (0, 1, 2, 3, 4, 5, 6) if with_state else (0, 1, 2)
    if with_state:
        g = mx.grad(_loss(slstm, w, ws, return_state), argnums=argnums)(*args)
        g_ref = mx.grad(_loss(slstm_reference, w, ws, return_state), argnums=argnums)(*args)
    else:
        g = mx.grad(lambda *a: _loss(slstm, w, ws, return_state)(*a, None, None, None, None), argnums=argnums)(wx, r, b)
        g_ref = mx.grad(lambda *a: _loss(slstm_reference, w, ws, return_state)(*a, None, None, None, None),
                        argnums=argnums)(wx, r, b)
    tol = 1e-4 if dtype == mx.float32 else 3e-2
    names = ["wx", "r", "b", "y0", "c0", "n0", "m0"]
    for name, a, ref, prim in zip(names, g, g_ref, args):
        assert a.shape == prim.shape and a.dtype == prim.dtype, name
        assert np.all(np.isfinite(host(a))), name
        assert rel_err(a, host(ref)) < tol, name


def test_step_gradients_match_reference(kernel_backend):
    wx, r, b, state = make_inputs(31, 2, 1, 3, 32, with_state=True)
    rng = np.random.default_rng(5)
    w = mx.array(rng.standard_normal((2, 3, 32)).astype(np.float32))
    ws = [mx.array(rng.standard_normal((2, 3, 32)).astype(np.float32)) for _ in range(4)]

    def loss(fn):
        def f(x, r, b, y0, c0, n0, m0):
            y, st = fn(x, r, b, (y0, c0, n0, m0))
            return (y * w).sum() + sum((a * q).sum() for a, q in zip(st, ws))

        return f

    args = (wx[:, 0], r, b) + state
    g = mx.grad(loss(slstm_step), argnums=tuple(range(7)))(*args)
    g_ref = mx.grad(loss(slstm_step_reference), argnums=tuple(range(7)))(*args)
    for a, ref in zip(g, g_ref):
        assert rel_err(a, host(ref)) < 1e-4


# ---------------------------------------------------------------------------
# Extreme gate pre-activations
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [30.0, 1e4])
def test_extreme_preactivations_stay_finite(kernel_backend, scale):
    bsz, s, nh, dh = 2, 9, 3, 8
    wx, r, b, state = make_inputs(40, bsz, s, nh, dh, scale=scale, with_state=True)
    # push the gates to both ends: i and f very negative / very positive in turns
    signs = np.where(np.arange(s) % 2 == 0, 1.0, -1.0).astype(np.float32)[None, :, None, None, None]
    wx = wx * mx.array(signs)
    for st0 in (None, state):
        y, st = slstm(wx, r, b, state=st0, return_state=True)
        y_ref, st_ref = np_slstm(host(wx), host(r), host(b), np_state(st0))
        assert np.all(np.isfinite(host(y))) and all(np.all(np.isfinite(host(x))) for x in st)
        assert rel_err(y, y_ref) < 1e-4
        g = mx.grad(lambda x, r_, b_: (slstm(x, r_, b_, state=st0) ** 2).sum(), argnums=(0, 1, 2))(wx, r, b)
        for a in g:
            assert np.all(np.isfinite(host(a)))


def test_empty_unit_with_very_negative_input_gate(kernel_backend):
    # first step from the zero state with i_raw << logsigmoid(f_raw): m_0 = i_raw keeps
    # i = 1 (with m_0 = max(...) n would underflow to 0 and y would be 0/0)
    bsz, s, nh, dh = 1, 3, 1, 8
    wx = mx.zeros((bsz, s, 4, nh, dh))
    wx[:, :, 0] = -200.0
    wx[:, :, 2] = 0.5
    r = mx.zeros((nh, dh, 4, dh))
    b = mx.zeros((4, nh, dh))
    y, st = slstm(wx, r, b, return_state=True)
    y_ref, _ = np_slstm(host(wx), host(r), host(b))
    assert np.all(np.isfinite(host(y)))
    assert rel_err(y, y_ref) < 1e-5
    g = mx.grad(lambda x: slstm(x, r, b).sum())(wx)
    assert np.all(np.isfinite(host(g)))


# ---------------------------------------------------------------------------
# Races and bounds (emulator only)
# ---------------------------------------------------------------------------
def _kernel_args(kind):
    bsz, s, nh, dh, k = 2, 5, 2, 32, 4
    wx, r, b, state = make_inputs(50, bsz, s, nh, dh, with_state=True)
    s0 = mx.stack(state)
    params = mx.array([bsz, s, nh], dtype=mx.int32)
    common = dict(grid=(dh * k, nh, bsz), threadgroup=(dh * k, 1, 1))
    if kind == "fwd":
        return sl.FWD, dict(
            inputs=[wx, r, b, s0, params],
            output_shapes=[(bsz, s, nh, dh), (4, bsz, nh, dh), (bsz, s, 4, nh, dh), (bsz, s, 4, nh, dh)],
            output_dtypes=[mx.float32] * 4,
            template=[("T", mx.float32), ("DH", dh), ("K", k), ("RREG", True), ("SAVE", True)], **common)
    if kind == "bwd":
        _, _, g_raw, h_st = sl._forward(wx, r, b, s0, sl.SLSTMConfig(k, False), True, "emulate")
        rng = np.random.default_rng(51)
        dy = mx.array(rng.standard_normal((bsz, s, nh, dh)).astype(np.float32))
        ds = mx.array(rng.standard_normal((4, bsz, nh, dh)).astype(np.float32))
        return sl.BWD, dict(
            inputs=[dy, ds, g_raw, h_st, s0, r, params],
            output_shapes=[(bsz, s, 4, nh, dh), (4, bsz, nh, dh)], output_dtypes=[mx.float32] * 2,
            template=[("T", mx.float32), ("DH", dh), ("K", k), ("RREG", False)], **common)
    return sl.STEP, dict(
        inputs=[wx[:, 0], r, b, s0, mx.array([bsz, nh], dtype=mx.int32)],
        output_shapes=[(bsz, nh, dh), (4, bsz, nh, dh)], output_dtypes=[mx.float32] * 2,
        template=[("T", mx.float32), ("DH", dh), ("K", k)], **common)


@pytest.mark.emulator_only
@pytest.mark.parametrize("kind", ["fwd", "bwd", "step"])
def test_kernels_are_race_free_and_in_bounds(kind):
    spec, kwargs = _kernel_args(kind)
    kernel = runtime.get_kernel(spec, "emulate")
    first = check_schedules(kernel, **kwargs)
    bounded = kernel(**kwargs, check_bounds=True)
    for a, c in zip(first, bounded):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------
def test_validation_errors():
    wx, r, b, state = make_inputs(60, 2, 3, 2, 8, with_state=True)
    with pytest.raises(ValueError, match=r"wx must have 5 dimensions"):
        slstm(wx[0], r, b)
    with pytest.raises(ValueError, match=r"wx must have shape \(B, S, 4, NH, DH\)"):
        slstm(wx[:, :, :3], r, b)
    with pytest.raises(ValueError, match=r"r must have shape \(NH, DH, 4, DH\) = \(2, 8, 4, 8\)"):
        slstm(wx, r[:, :4], b)
    with pytest.raises(ValueError, match=r"b must have shape \(4, NH, DH\) = \(4, 2, 8\)"):
        slstm(wx, r, b[:, :1])
    with pytest.raises(TypeError, match=r"state must be a tuple \(y, c, n, m\)"):
        slstm(wx, r, b, state=state[:3])
    with pytest.raises(ValueError, match=r"state.n must have shape \(B, NH, DH\) = \(2, 2, 8\)"):
        slstm(wx, r, b, state=(state[0], state[1], state[2][:1], state[3]))
    with pytest.raises(TypeError, match=r"wx has dtype .*int32"):
        slstm(wx.astype(mx.int32), r, b)
    with pytest.raises(TypeError, match=r"r must be an mx.array"):
        slstm(wx, np.zeros((2, 8, 4, 8)), b)
    with pytest.raises(ValueError, match=r"threads_per_unit must be a power of two"):
        slstm(wx, r, b, config={"threads_per_unit": 3})
    with pytest.raises(ValueError, match=r"unknown keys"):
        slstm(wx, r, b, config={"tile": 3})
    with pytest.raises(ValueError, match=r"DH\*K = 2048"):
        sl.plan(256, mx.float32, {"threads_per_unit": 8})
    with pytest.raises(ValueError, match=r"wx_t must have shape \(B, 4, NH, DH\)"):
        slstm_step(wx[:, 0, :3], r, b, state)
    with pytest.raises(TypeError, match=r"state \(y, c, n, m\) is required"):
        slstm_step(wx[:, 0], r, b, None)
    with pytest.raises(ValueError, match=r"DH = 520 units per head is above the supported 512"):
        slstm(mx.zeros((1, 1, 4, 1, 520)), mx.zeros((1, 520, 4, 520)), mx.zeros((4, 1, 520)))
    with pytest.raises(ValueError, match=r"wx_t must have 4 dimensions"):
        slstm_step(wx, r, b, state)
