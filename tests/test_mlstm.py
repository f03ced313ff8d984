"""mLSTM family: chunkwise kernels, fused step kernel, plain-mx references, VJP.

Ground truth: the recurrent equations in float64 NumPy (``np_mlstm``). Gradients are
checked against MLX's autodiff of the recurrent reference in float64 on the CPU (whose
exp/log1p are float32-accurate, ~1e-7 relative: far below the tolerances).

Tolerances (relative, ``max|out - ref| / max|ref|``): float32 1e-4. The mLSTM output is
a ratio of exp-weighted sums whose weights come from a float32 cumulative sum of
logsigmoid gates: an absolute rounding error of the cumsum (~S ulp of |b|) becomes a
relative error of the weights, and the normaliser |q·n| can be small (it is only bounded
below by exp(-m)), which amplifies relative errors of h. Measured errors are ~1e-6 here;
1e-4 leaves room for Metal's fused multiply-adds and fast exp. float16/bfloat16: 2e-2
(the inputs are rounded first, so this measures the kernel's float32 compute plus the
output rounding).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels import runtime
from xlstm_kernels.ops.mlstm import (
    OUTPUTS,
    STATES,
    STEP,
    _chunk_configs,
    mlstm,
    mlstm_chunkwise_mx,
    mlstm_parallel_reference,
    mlstm_reference,
    mlstm_step,
    mlstm_step_reference,
)

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
TOL = {mx.float32: 1e-4, mx.float16: 2e-2, mx.bfloat16: 2e-2}
GRAD_TOL = {mx.float32: 1e-4, mx.float16: 3e-2, mx.bfloat16: 6e-2}


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def to_np(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x, dtype=np.float64)


def rel_err(out, ref) -> float:
    out = to_np(out) if isinstance(out, mx.array) else np.asarray(out, dtype=np.float64)
    ref = to_np(ref) if isinstance(ref, mx.array) else np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out)), "non-finite output"
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def make_inputs(b, nh, s, dk, dv, dtype=mx.float32, seed=0, f_shift=2.0, i_shift=0.0, with_state=False):
    """q, k, v in `dtype`; gates float32 (forget gates biased open, like xLSTM's init)."""
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((b, nh, s, dk)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((b, nh, s, dk)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((b, nh, s, dv)).astype(np.float32)).astype(dtype)
    i_pre = mx.array((rng.standard_normal((b, nh, s)) + i_shift).astype(np.float32))
    f_pre = mx.array((rng.standard_normal((b, nh, s)) + f_shift).astype(np.float32))
    state = None
    if with_state:
        state = (
            mx.array(rng.standard_normal((b, nh, dk, dv)).astype(np.float32)),
            mx.array(rng.standard_normal((b, nh, dk)).astype(np.float32)),
            mx.array(rng.standard_normal((b, nh)).astype(np.float32)),
        )
    return q, k, v, i_pre, f_pre, state


def np_logsigmoid(x):
    return np.minimum(x, 0.0) - np.log1p(np.exp(-np.abs(x)))


def np_mlstm(q, k, v, i_pre, f_pre, state=None, eps=1e-6):
    """Recurrent mLSTM in float64 NumPy: (h (B, NH, S, DV), (C, n, m))."""
    q, k, v, i_pre, f_pre = (to_np(x) for x in (q, k, v, i_pre, f_pre))
    b, nh, s, dk = q.shape
    dv = v.shape[-1]
    if state is None:
        c, n, m = np.zeros((b, nh, dk, dv)), np.zeros((b, nh, dk)), np.zeros((b, nh))
    else:
        c, n, m = (to_np(x).copy() for x in state)
    h = np.zeros((b, nh, s, dv))
    qs = q * dk ** -0.5
    for t in range(s):
        lf = np_logsigmoid(f_pre[:, :, t])
        m1 = np.maximum(lf + m, i_pre[:, :, t])
        fa = np.exp(lf + m - m1)
        ia = np.exp(i_pre[:, :, t] - m1)
        c = fa[..., None, None] * c + ia[..., None, None] * k[:, :, t, :, None] * v[:, :, t, None, :]
        n = fa[..., None] * n + ia[..., None] * k[:, :, t]
        m = m1
        num = np.einsum("bhd,bhde->bhe", qs[:, :, t], c)
        qn = np.einsum("bhd,bhd->bh", qs[:, :, t], n)
        h[:, :, t] = num / (np.maximum(np.abs(qn), np.exp(-m)) + eps)[..., None]
    return h, (c, n, m)


# ---------------------------------------------------------------------------
# the plain-mx implementations against NumPy
# ---------------------------------------------------------------------------
def test_references_match_numpy():
    q, k, v, i_pre, f_pre, state = make_inputs(2, 2, 37, 16, 24, seed=1, with_state=True)
    h_ref, st_ref = np_mlstm(q, k, v, i_pre, f_pre, state)
    h, st = mlstm_reference(q, k, v, i_pre, f_pre, state=state, return_state=True)
    assert h.dtype == mx.float32 and st[0].dtype == mx.float32
    assert rel_err(h, h_ref) < 1e-5
    for a, r in zip(st, st_ref):
        assert rel_err(a, r) < 1e-5
    for chunk in (1, 8, 16, 37, 64):
        h, st = mlstm_chunkwise_mx(q, k, v, i_pre, f_pre, state=state, chunk_size=chunk, return_state=True)
        assert rel_err(h, h_ref) < 1e-5, chunk
        for a, r in zip(st, st_ref):
            assert rel_err(a, r) < 1e-5, chunk
    # The parallel form starts from zeros; its stabiliser ignores the zero state's m = 0,
    # which only changes eps-sized terms.
    h0_ref, _ = np_mlstm(q, k, v, i_pre, f_pre)
    assert rel_err(mlstm_parallel_reference(q, k, v, i_pre, f_pre), h0_ref) < 1e-5


def test_float64_reference_matches_numpy():
    """The float64 mx reference (the gradient oracle below) equals NumPy to ~1e-7.

    Not to 1e-15: MLX's CPU exp/log1p are float32-accurate approximations even in float64.
    """
    q, k, v, i_pre, f_pre, state = make_inputs(1, 2, 20, 16, 16, seed=2, with_state=True)
    with mx.stream(mx.cpu):
        args = [x.astype(mx.float64) for x in (q, k, v, i_pre, f_pre)]
        st64 = tuple(x.astype(mx.float64) for x in state)
        h, st = mlstm_reference(*args, state=st64, return_state=True)
        hc = mlstm_chunkwise_mx(*args, state=st64, chunk_size=8)
        mx.eval(h, st, hc)
    h_ref, st_ref = np_mlstm(q, k, v, i_pre, f_pre, state)
    assert h.dtype == mx.float64
    assert rel_err(np.asarray(h), h_ref) < 1e-6
    assert rel_err(np.asarray(hc), h_ref) < 1e-6
    assert rel_err(np.asarray(st[0]), st_ref[0]) < 1e-6


# ---------------------------------------------------------------------------
# forward on the selected backend
# ---------------------------------------------------------------------------
FORWARD_CASES = [
    # (B, NH, S, DHQK, DHV, chunk, with_state)
    (1, 2, 5, 16, 16, 64, False),    # S shorter than one chunk
    (2, 2, 37, 16, 16, 16, False),   # 3 chunks, tail of 5
    (1, 2, 64, 32, 32, 64, True),    # one full chunk of 64, two row blocks, initial state
    (1, 2, 64, 32, 32, 16, True),    # four chunks
    (2, 2, 45, 32, 16, 32, False),   # DHV != DHQK, tail of 13
    (1, 2, 50, 16, 40, 24, True),    # chunk not a power of two, DHV not a multiple of 16
    (1, 1, 100, 16, 16, 100, False), # one chunk of 100 (chunk capacity 128)
]


@pytest.mark.parametrize("b,nh,s,dk,dv,chunk,with_state", FORWARD_CASES)
def test_forward_matches_recurrent(kernel_backend, b, nh, s, dk, dv, chunk, with_state):
    q, k, v, i_pre, f_pre, state = make_inputs(b, nh, s, dk, dv, seed=s + dk + chunk, with_state=with_state)
    h, (c, n, m) = mlstm(q, k, v, i_pre, f_pre, state=state, chunk_size=chunk, return_state=True)
    h_ref, (c_ref, n_ref, m_ref) = np_mlstm(q, k, v, i_pre, f_pre, state)
    assert h.shape == (b, nh, s, dv) and h.dtype == mx.float32
    assert c.shape == (b, nh, dk, dv) and n.shape == (b, nh, dk) and m.shape == (b, nh)
    assert c.dtype == n.dtype == m.dtype == mx.float32
    assert rel_err(h, h_ref) < TOL[mx.float32]
    assert rel_err(c, c_ref) < TOL[mx.float32]
    assert rel_err(n, n_ref) < TOL[mx.float32]
    assert rel_err(m, m_ref) < 1e-5
    # Without return_state: the same h.
    h2 = mlstm(q, k, v, i_pre, f_pre, state=state, chunk_size=chunk)
    assert rel_err(h2, h_ref) < TOL[mx.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes(kernel_backend, dtype):
    q, k, v, i_pre, f_pre, state = make_inputs(1, 2, 37, 32, 32, dtype=dtype, seed=5, with_state=True)
    h, (c, n, m) = mlstm(q, k, v, i_pre, f_pre, state=state, chunk_size=16, return_state=True)
    h_ref, (c_ref, n_ref, _) = np_mlstm(q, k, v, i_pre, f_pre, state)
    assert h.dtype == dtype and c.dtype == mx.float32
    assert rel_err(h, h_ref) < TOL[dtype]
    assert rel_err(c, c_ref) < TOL[dtype] and rel_err(n, n_ref) < TOL[dtype]
    hs, (cs, _, _) = mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i_pre[:, :, 0], f_pre[:, :, 0], state)
    h1_ref, (c1_ref, _, _) = np_mlstm(q[:, :, :1], k[:, :, :1], v[:, :, :1], i_pre[:, :, :1], f_pre[:, :, :1], state)
    assert hs.dtype == dtype
    assert rel_err(hs, h1_ref[:, :, 0]) < TOL[dtype]
    assert rel_err(cs, c1_ref) < TOL[dtype]


def test_chunk_size_does_not_change_the_result(kernel_backend):
    q, k, v, i_pre, f_pre, _ = make_inputs(1, 2, 64, 16, 16, seed=6)
    h_ref, _ = np_mlstm(q, k, v, i_pre, f_pre)
    for chunk in (1, 7, 32, 64, 128, 1000):  # 1000 > S: one chunk of S
        assert rel_err(mlstm(q, k, v, i_pre, f_pre, chunk_size=chunk), h_ref) < TOL[mx.float32], chunk


def test_split_sequence_with_state(kernel_backend):
    """Running [0, 23) then [23, 50) from the carried state equals running [0, 50)."""
    q, k, v, i_pre, f_pre, state = make_inputs(2, 2, 50, 16, 16, seed=7, with_state=True)
    h_all, st_all = mlstm(q, k, v, i_pre, f_pre, state=state, chunk_size=16, return_state=True)
    cut = 23
    first = [x[:, :, :cut] for x in (q, k, v, i_pre, f_pre)]
    second = [x[:, :, cut:] for x in (q, k, v, i_pre, f_pre)]
    h1, st1 = mlstm(*first, state=state, chunk_size=16, return_state=True)
    h2, st2 = mlstm(*second, state=st1, chunk_size=16, return_state=True)
    assert rel_err(mx.concatenate([h1, h2], axis=2), h_all) < TOL[mx.float32]
    for a, r in zip(st2, st_all):
        assert rel_err(a, r) < TOL[mx.float32]


def test_step_decoding_matches_prefill(kernel_backend):
    """mlstm_step one token at a time equals the chunkwise prefill, states included."""
    q, k, v, i_pre, f_pre, _ = make_inputs(2, 2, 20, 16, 24, seed=8)
    h_pre, st_pre = mlstm(q, k, v, i_pre, f_pre, chunk_size=8, return_state=True)
    st, hs = None, []
    for t in range(q.shape[2]):
        h, st = mlstm_step(q[:, :, t], k[:, :, t], v[:, :, t], i_pre[:, :, t], f_pre[:, :, t], st)
        hs.append(h)
    assert rel_err(mx.stack(hs, axis=2), h_pre) < TOL[mx.float32]
    for a, r in zip(st, st_pre):
        assert rel_err(a, r) < TOL[mx.float32]
    # prefill 15 steps, then decode the rest
    _, st = mlstm(*[x[:, :, :15] for x in (q, k, v, i_pre, f_pre)], chunk_size=8, return_state=True)
    for t in range(15, 20):
        h, st = mlstm_step(q[:, :, t], k[:, :, t], v[:, :, t], i_pre[:, :, t], f_pre[:, :, t], st)
        assert rel_err(h, h_pre[:, :, t]) < TOL[mx.float32]


def test_step_from_state_and_s1(kernel_backend):
    """The step kernel from a random state (DHV spans two column tiles) and mlstm with S = 1."""
    q, k, v, i_pre, f_pre, state = make_inputs(2, 2, 1, 24, 40, seed=9, with_state=True)
    h_ref, st_ref = np_mlstm(q, k, v, i_pre, f_pre, state)
    h, st = mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i_pre[:, :, 0], f_pre[:, :, 0], state)
    assert h.shape == (2, 2, 40)
    assert rel_err(h, h_ref[:, :, 0]) < TOL[mx.float32]
    for a, r in zip(st, st_ref):
        assert rel_err(a, r) < TOL[mx.float32]
    h1, st1 = mlstm(q, k, v, i_pre, f_pre, state=state, return_state=True)
    assert rel_err(h1, h_ref) < TOL[mx.float32]
    for a, r in zip(st1, st_ref):
        assert rel_err(a, r) < TOL[mx.float32]
    # None = the zero state (C = 0, n = 0, m = 0)
    h0, _ = mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i_pre[:, :, 0], f_pre[:, :, 0], None)
    h0_ref, _ = np_mlstm(q, k, v, i_pre, f_pre, None)
    assert rel_err(h0, h0_ref[:, :, 0]) < TOL[mx.float32]


def test_step_calls_reuse_one_prepared_function_with_fresh_inputs(kernel_backend):
    """Repeated steps of one signature hit the call memo; each still computes its own inputs."""
    from xlstm_kernels.ops import mlstm as ml

    ml._STEP_CALLS.clear()
    for seed in (11, 12, 13):
        q, k, v, i_pre, f_pre, state = make_inputs(1, 3, 1, 16, 24, seed=seed, with_state=True)
        h_ref, st_ref = np_mlstm(q, k, v, i_pre, f_pre, state)
        h, st = mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i_pre[:, :, 0], f_pre[:, :, 0], state)
        assert rel_err(h, h_ref[:, :, 0]) < TOL[mx.float32]
        for a, r in zip(st, st_ref):
            assert rel_err(a, r) < TOL[mx.float32]
    assert len(ml._STEP_CALLS) == 1
    mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i_pre[:, :, 0], f_pre[:, :, 0], state, eps=1e-3)
    assert len(ml._STEP_CALLS) == 2  # another eps: another entry
    with pytest.raises(ValueError, match="eps"):  # a bad call is still checked
        mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i_pre[:, :, 0], f_pre[:, :, 0], state, eps=-1.0)


@pytest.mark.parametrize(
    "f_shift,i_shift",
    [(-200.0, 0.0), (0.0, 60.0), (-100.0, 80.0), (40.0, -40.0), (-1000.0, -90.0)],
    ids=["f_very_negative", "i_large", "both", "f_saturated_i_small", "everything_closed"],
)
def test_gate_extremes_stay_finite(kernel_backend, f_shift, i_shift):
    q, k, v, i_pre, f_pre, _ = make_inputs(1, 2, 40, 16, 16, seed=10, f_shift=f_shift, i_shift=i_shift)
    h, (c, n, m) = mlstm(q, k, v, i_pre, f_pre, chunk_size=16, return_state=True)
    h_ref, (c_ref, n_ref, m_ref) = np_mlstm(q, k, v, i_pre, f_pre)
    for x in (h, c, n, m):
        assert np.all(np.isfinite(to_np(x)))
    # Large gates make h ill-conditioned (exp(i - m) with |i| ~ 60 carries ulp(60) ~ 4e-6 of
    # absolute error, and small |q.n| amplify it): allow what a float32 evaluation of the
    # recurrence itself gets wrong, times 4.
    floor32 = rel_err(mlstm_reference(q, k, v, i_pre, f_pre), h_ref)
    assert rel_err(h, h_ref) < max(TOL[mx.float32], 4 * floor32)
    assert rel_err(m, m_ref) < 1e-5
    hs, _ = mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i_pre[:, :, 0], f_pre[:, :, 0], None)
    assert rel_err(hs, h_ref[:, :, 0]) < TOL[mx.float32]


# ---------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------
def _grads_ref(inputs, weights, state=None, with_state_loss=False):
    """d loss / d (q, k, v, i_pre, f_pre[, C, n, m]) of the float64 recurrent reference (CPU)."""
    w_h, w_c = weights

    def loss(*p):
        st = tuple(p[5:]) if state is not None else None
        h, (c, n, m) = mlstm_reference(*p[:5], state=st, return_state=True)
        out = (h * w_h.astype(mx.float64)).sum()
        if with_state_loss:
            out = out + (c * w_c.astype(mx.float64)).sum() + n.sum() + 0.5 * m.sum()
        return out

    args = list(inputs) + (list(state) if state is not None else [])
    with mx.stream(mx.cpu):
        args = [x.astype(mx.float32).astype(mx.float64) for x in args]  # the (rounded) inputs, in float64
        g = mx.grad(loss, argnums=list(range(len(args))))(*args)
        mx.eval(g)
    return g


@pytest.mark.parametrize("with_state", [False, True])
def test_gradients_float32(kernel_backend, with_state):
    q, k, v, i_pre, f_pre, state = make_inputs(1, 2, 37, 16, 16, seed=11, with_state=with_state)
    rng = np.random.default_rng(12)
    w_h = mx.array(rng.standard_normal((1, 2, 37, 16)).astype(np.float32))
    w_c = mx.array(rng.standard_normal((1, 2, 16, 16)).astype(np.float32))

    def loss(*p):
        st = tuple(p[5:]) if with_state else None
        if with_state:
            h, (c, n, m) = mlstm(*p[:5], state=st, chunk_size=16, return_state=True)
            return (h * w_h).sum() + (c * w_c).sum() + n.sum() + 0.5 * m.sum()
        return (mlstm(*p[:5], chunk_size=16) * w_h).sum()

    args = [q, k, v, i_pre, f_pre] + (list(state) if with_state else [])
    grads = mx.grad(loss, argnums=list(range(len(args))))(*args)
    refs = _grads_ref([q, k, v, i_pre, f_pre], (w_h, w_c), state, with_state_loss=with_state)
    names = ["q", "k", "v", "i_pre", "f_pre", "C", "n", "m"]
    for name, g, r, a in zip(names, grads, refs, args):
        assert g.shape == a.shape and g.dtype == a.dtype, name
        assert rel_err(g, np.asarray(r)) < GRAD_TOL[mx.float32], name


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
def test_gradients_low_precision(kernel_backend, dtype):
    q, k, v, i_pre, f_pre, _ = make_inputs(1, 2, 24, 16, 16, dtype=dtype, seed=13)
    w_h = mx.array(np.random.default_rng(14).standard_normal((1, 2, 24, 16)).astype(np.float32))
    grads = mx.grad(lambda *p: (mlstm(*p, chunk_size=16).astype(mx.float32) * w_h).sum(), argnums=[0, 1, 2, 3, 4])(
        q, k, v, i_pre, f_pre
    )
    refs = _grads_ref([q, k, v, i_pre, f_pre], (w_h, None))
    for name, g, r, a in zip(["q", "k", "v", "i_pre", "f_pre"], grads, refs, [q, k, v, i_pre, f_pre]):
        assert g.dtype == a.dtype, name
        assert rel_err(g, np.asarray(r)) < GRAD_TOL[dtype], name


def test_step_gradients(kernel_backend):
    q, k, v, i_pre, f_pre, state = make_inputs(2, 2, 1, 16, 16, seed=15, with_state=True)
    args = [x[:, :, 0] for x in (q, k, v, i_pre, f_pre)] + list(state)
    w = mx.array(np.random.default_rng(16).standard_normal((2, 2, 16)).astype(np.float32))

    def loss(*p):
        h, (c, n, m) = mlstm_step(*p[:5], tuple(p[5:]))
        return (h * w).sum() + c.sum() + n.sum()

    def loss_ref(*p):
        p = [x.astype(mx.float64) for x in p]
        h, (c, n, m) = mlstm_step_reference(*p[:5], tuple(p[5:]))
        return (h * w.astype(mx.float64)).sum() + c.sum() + n.sum()

    grads = mx.grad(loss, argnums=list(range(8)))(*args)
    with mx.stream(mx.cpu):
        refs = mx.grad(loss_ref, argnums=list(range(8)))(*args)
        mx.eval(refs)
    for name, g, r in zip(["q", "k", "v", "i_pre", "f_pre", "C", "n", "m"], grads, refs):
        assert rel_err(g, np.asarray(r)) < GRAD_TOL[mx.float32], name


# ---------------------------------------------------------------------------
# backends, validation
# ---------------------------------------------------------------------------
def test_reference_backend_matches_numpy():
    q, k, v, i_pre, f_pre, state = make_inputs(1, 2, 30, 16, 16, seed=17, with_state=True)
    h_ref, st_ref = np_mlstm(q, k, v, i_pre, f_pre, state)
    with runtime.use_backend("reference"):
        h, st = mlstm(q, k, v, i_pre, f_pre, state=state, chunk_size=8, return_state=True)
        hs, st_s = mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i_pre[:, :, 0], f_pre[:, :, 0], state)
        big = mlstm(q, k, v, i_pre, f_pre, state=state, chunk_size=1000)  # any chunk size on the reference
    assert rel_err(h, h_ref) < TOL[mx.float32]
    assert rel_err(big, h_ref) < TOL[mx.float32]
    assert rel_err(st[0], st_ref[0]) < TOL[mx.float32]
    h1_ref, _ = np_mlstm(*[x[:, :, :1] for x in (q, k, v, i_pre, f_pre)], state)
    assert rel_err(hs, h1_ref[:, :, 0]) < TOL[mx.float32]


def test_empty_sequence(kernel_backend):
    q, k, v, i_pre, f_pre, state = make_inputs(1, 2, 0, 16, 8, with_state=True)
    h, st = mlstm(q, k, v, i_pre, f_pre, state=state, return_state=True)
    assert h.shape == (1, 2, 0, 8)
    assert rel_err(st[0], state[0]) == 0.0


def _bad(name):
    q, k, v, i_pre, f_pre, state = make_inputs(1, 2, 8, 16, 16, with_state=True)
    args = dict(q=q, k=k, v=v, i_pre=i_pre, f_pre=f_pre)
    kw = {"state": state}
    if name == "k_shape":
        args["k"] = k[..., :8]
    elif name == "v_shape":
        args["v"] = v[:, :, :4]
    elif name == "i_shape":
        args["i_pre"] = i_pre[..., None]
    elif name == "f_shape":
        args["f_pre"] = f_pre[:, :1]
    elif name == "q_ndim":
        args["q"] = q[0]
    elif name == "dtype_mix":
        args["k"] = k.astype(mx.float16)
    elif name == "int_dtype":
        args["v"] = v.astype(mx.int32)
    elif name == "state_c":
        kw["state"] = (state[0][..., :8], state[1], state[2])
    elif name == "state_m":
        kw["state"] = (state[0], state[1], state[2][..., None])
    elif name == "state_tuple":
        kw["state"] = state[:2]
    elif name == "chunk_zero":
        kw["chunk_size"] = 0
    elif name == "chunk_float":
        kw["chunk_size"] = 16.0
    elif name == "eps":
        kw["eps"] = -1.0
    return args, kw


@pytest.mark.parametrize(
    "name,exc,match",
    [
        ("k_shape", ValueError, r"k must have q's shape"),
        ("v_shape", ValueError, r"v must have shape \(B, NH, S, DHV\)"),
        ("i_shape", ValueError, r"i_pre must have 3 dimensions"),
        ("f_shape", ValueError, r"f_pre must have shape \(B, NH, S\) = \(1, 2, 8\)"),
        ("q_ndim", ValueError, r"q must have 4 dimensions"),
        ("dtype_mix", TypeError, r"q \(mlx.core.float32\) and k \(mlx.core.float16\) must have the same dtype"),
        ("int_dtype", TypeError, r"v has dtype mlx.core.int32"),
        ("state_c", ValueError, r"state C must have shape \(1, 2, 16, 16\)"),
        ("state_m", ValueError, r"state m must have shape \(1, 2\)"),
        ("state_tuple", TypeError, r"state must be a tuple \(C, n, m\)"),
        ("chunk_zero", ValueError, r"chunk_size must be a positive int"),
        ("chunk_float", ValueError, r"chunk_size must be a positive int"),
        ("eps", ValueError, r"eps must be"),
    ],
)
def test_validation(kernel_backend, name, exc, match):
    args, kw = _bad(name)
    with pytest.raises(exc, match=match):
        mlstm(**args, **kw)


def test_step_validation(kernel_backend):
    q, k, v, i_pre, f_pre, state = make_inputs(1, 2, 1, 16, 16, with_state=True)
    q, k, v, i_pre, f_pre = (x[:, :, 0] for x in (q, k, v, i_pre, f_pre))
    with pytest.raises(ValueError, match=r"v must have shape \(B, NH, DHV\)"):
        mlstm_step(q, k, v[:1, :1], i_pre, f_pre, state)
    with pytest.raises(ValueError, match=r"i_pre must have shape \(B, NH\) = \(1, 2\)"):
        mlstm_step(q, k, v, i_pre[:, :1], f_pre, state)
    with pytest.raises(ValueError, match=r"state n must have shape \(1, 2, 16\)"):
        mlstm_step(q, k, v, i_pre, f_pre, (state[0], state[1][..., :3], state[2]))


def test_chunk_size_limit_on_kernels(backend):
    if backend == "reference":
        pytest.skip("the reference backend takes any chunk size")
    q, k, v, i_pre, f_pre, _ = make_inputs(1, 1, 130, 8, 8)
    with runtime.use_backend(backend), pytest.raises(ValueError, match=r"chunk_size=200 is larger than the kernels support"):
        mlstm(q, k, v, i_pre, f_pre, chunk_size=200)


# ---------------------------------------------------------------------------
# the emulator's race / bounds checks on each kernel
# ---------------------------------------------------------------------------
@pytest.mark.emulator_only
def test_check_schedules():
    """Each kernel gives bit-identical outputs under every thread order, with bounds checks:
    partial state tiles (DHQK = 40, DHV = 24), two row blocks per chunk, a tail chunk of 6
    whose second row block leaves early."""
    from xlstm_kernels.emulate import check_schedules

    bh, s, dk, dv, L = 2, 70, 40, 24, 64
    nc = -(-s // L)
    q, k, v, i_pre, f_pre, state = make_inputs(1, bh, s, dk, dv, dtype=mx.float16, seed=18, with_state=True)
    st_tmpl, out_tmpl, bq = _chunk_configs(L, dk, dv)
    q3, k3, v3 = q.reshape(bh, s, dk), k.reshape(bh, s, dk), v.reshape(bh, s, dv)
    ig, fg = i_pre.reshape(bh, s), f_pre.reshape(bh, s)
    c0, n0, m0 = state[0].reshape(bh, dk, dv), state[1].reshape(bh, dk), state[2].reshape(bh)
    c_st, n_st, m_st = check_schedules(
        runtime.get_kernel(STATES, "emulate"),
        inputs=[k3, v3, ig, fg, c0, n0, m0, mx.array([s, L, nc, dk, dv], dtype=mx.int32)],
        output_shapes=[(bh, nc + 1, dk, dv), (bh, nc + 1, dk), (bh, nc + 1)],
        output_dtypes=[mx.float32] * 3,
        grid=(128 * -(-dv // 32), -(-dk // 32), bh), threadgroup=(128, 1, 1),
        template=[("T", mx.float16), *st_tmpl], check_bounds=True,
    )
    nrb = -(-L // bq)
    bv = dict(out_tmpl)["BV"]
    (h,) = check_schedules(
        runtime.get_kernel(OUTPUTS, "emulate"),
        inputs=[q3, k3, v3, ig, fg, c_st, n_st, m_st, mx.array([s, L, nc, dk, dv, nrb], dtype=mx.int32),
                mx.array([dk ** -0.5, 1e-6], dtype=mx.float32)],
        output_shapes=[(bh, s, dv)], output_dtypes=[mx.float16],
        grid=(128 * -(-dv // bv), nrb * nc, bh), threadgroup=(128, 1, 1),
        template=[("T", mx.float16), *out_tmpl], check_bounds=True,
    )
    h_ref, (c_ref, _, _) = np_mlstm(q, k, v, i_pre, f_pre, state)
    assert rel_err(h.reshape(1, bh, s, dv), h_ref) < TOL[mx.float16]
    assert rel_err(c_st[:, nc].reshape(1, bh, dk, dv), c_ref) < TOL[mx.float16]

    hs, c1, n1, m1 = check_schedules(
        runtime.get_kernel(STEP, "emulate"),
        inputs=[q3[:, 0], k3[:, 0], v3[:, 0], ig[:, 0], fg[:, 0], c0, n0, m0,
                mx.array([dk, dv], dtype=mx.int32), mx.array([dk ** -0.5, 1e-6], dtype=mx.float32)],
        output_shapes=[(bh, dv), (bh, dk, dv), (bh, dk), (bh,)],
        output_dtypes=[mx.float16, mx.float32, mx.float32, mx.float32],
        grid=(32 * -(-dv // 32), 8, bh), threadgroup=(32, 8, 1),
        template=[("T", mx.float16)], check_bounds=True,
    )
    h1_ref, _ = np_mlstm(*[x[:, :, :1] for x in (q, k, v, i_pre, f_pre)], state)
    assert rel_err(hs.reshape(1, bh, dv), h1_ref[:, :, 0]) < TOL[mx.float16]
