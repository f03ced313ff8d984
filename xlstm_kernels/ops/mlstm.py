"""mLSTM cell ops backed by ``metal_src/mlstm.metal``: chunkwise prefill and recurrent step.

Shapes (B batch, NH heads, S steps, DHQK query/key head dim, DHV value head dim)::

    q, k      (B, NH, S, DHQK)      float32 / float16 / bfloat16 (one dtype for q, k, v)
    v         (B, NH, S, DHV)
    i_pre     (B, NH, S)            input-gate pre-activations (any float dtype)
    f_pre     (B, NH, S)            forget-gate pre-activations
    state     (C (B, NH, DHQK, DHV), n (B, NH, DHQK), m (B, NH)), float32
    h         (B, NH, S, DHV)       in q's dtype

Equations (NX-AI xLSTM, REFERENCE §6), q scaled by DHQK^-1/2 inside, states in float32::

    f~ = logsigmoid(f_pre);  m_t = max(f~ + m_{t-1}, i_pre)
    C_t = exp(f~ + m_{t-1} - m_t) C_{t-1} + exp(i_pre - m_t) k vᵀ   (n_t likewise with k)
    h_t = (q·C_t) / (max(|q·n_t|, exp(-m_t)) + eps)

The initial state (``state=None``) is C = 0, n = 0, m = 0, as in NX-AI's kernels.
``logsigmoid`` is computed as ``min(x, 0) - log1p(exp(-|x|))`` (finite for all finite x).

Entry points:

* :func:`mlstm` — chunkwise: an inter-chunk state kernel (sequential over chunks,
  parallel over the DHQK x DHV state tile) then an intra-chunk output kernel (parallel
  over chunks); any S (the last chunk may be short). S == 1 runs the step kernel.
* :func:`mlstm_step` — one fused recurrent step for decoding.
* :func:`mlstm_reference` (recurrent), :func:`mlstm_parallel_reference` (quadratic
  parallel form) and :func:`mlstm_chunkwise_mx` (the chunkwise math in plain mx ops):
  plain-mx implementations. The ``reference`` backend runs :func:`mlstm_chunkwise_mx`
  (and the recurrent step for :func:`mlstm_step`).

Knob (:mod:`xlstm_kernels.tiles.knobs`, op ``mlstm``, shape class by S): ``chunk_size``
(1..128), used when :func:`mlstm` gets ``chunk_size=None`` (the default): then
``XLSTM_MLSTM_CHUNK_SIZE``, the presets, else ``DEFAULT_CHUNK`` = 64. An explicit
``chunk_size=`` always wins.

Backward: there are no backward kernels yet. The VJP of :func:`mlstm` differentiates
:func:`mlstm_chunkwise_mx` (the same chunkwise math as the kernels, in float32 mx ops,
differentiated by MLX) and the VJP of :func:`mlstm_step` differentiates the recurrent
step in mx ops. Gradients flow to q, k, v, i_pre, f_pre and the initial state.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from ..runtime import KernelSpec, const_array, current_backend, launch, prepare_launch
from ..tiles.knobs import resolve_knobs
from ._callcache import CallCache, replayable
from ._validate import check_array, check_int32, check_same_dtype

__all__ = [
    "mlstm",
    "mlstm_step",
    "mlstm_reference",
    "mlstm_parallel_reference",
    "mlstm_chunkwise_mx",
    "mlstm_step_reference",
    "MAX_KERNEL_CHUNK",
    "DEFAULT_CHUNK",
    "knob_values",
]

MAX_KERNEL_CHUNK = 128  # the kernels hold one chunk's gates in one 128-thread threadgroup
DEFAULT_CHUNK = 64  # chunk_size when neither the argument, XLSTM_MLSTM_CHUNK_SIZE nor a preset sets it
_NEG = -1.0e30  # finite "minus infinity" for masked log-weights (exp -> 0, gradients stay finite)

STATES = KernelSpec(
    "mlstm", "mlstm_chunk_states",
    ("k", "v", "igate", "fgate", "C0", "n0", "m0", "params"),
    ("C_states", "n_states", "m_states"),
)
OUTPUTS = KernelSpec(
    "mlstm", "mlstm_chunk_outputs",
    ("q", "k", "v", "igate", "fgate", "C_states", "n_states", "m_states", "params", "fparams"),
    ("h",),
)
STEP = KernelSpec(
    "mlstm", "mlstm_step",
    ("q", "k", "v", "igate", "fgate", "C", "n", "m", "params", "fparams"),
    ("h", "C_new", "n_new", "m_new"),
)

State = tuple[mx.array, mx.array, mx.array]


# ---------------------------------------------------------------------------
# plain-mx implementations
# ---------------------------------------------------------------------------
def _logsigmoid(x: mx.array) -> mx.array:
    """log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)), finite for all finite x."""
    return mx.minimum(x, 0.0) - mx.log1p(mx.exp(-mx.abs(x)))


def _compute_dtype(*xs) -> mx.Dtype:
    """float64 if any input is float64 (for float64 ground truth on the CPU), else float32."""
    return mx.float64 if any(x is not None and x.dtype == mx.float64 for x in xs) else mx.float32


def _zero_state(b: int, nh: int, dk: int, dv: int, dtype=mx.float32) -> State:
    return (mx.zeros((b, nh, dk, dv), dtype=dtype), mx.zeros((b, nh, dk), dtype=dtype), mx.zeros((b, nh), dtype=dtype))


def mlstm_step_reference(
    q: mx.array, k: mx.array, v: mx.array, i_pre: mx.array, f_pre: mx.array, state: State | None, *, eps: float = 1e-6
) -> tuple[mx.array, State]:
    """One recurrent step in plain mx ops (float32, or float64 for float64 inputs).

    q, k (B, NH, DHQK), v (B, NH, DHV), i_pre, f_pre (B, NH). Returns (h (B, NH, DHV) in
    q's dtype, (C, n, m)) with the state in the compute dtype.
    """
    cd = _compute_dtype(q, k, v)
    b, nh, dk = q.shape
    if state is None:
        state = _zero_state(b, nh, dk, v.shape[-1], cd)
    c0, n0, m0 = (s.astype(cd) for s in state)
    qf, kf, vf = q.astype(cd) * (dk ** -0.5), k.astype(cd), v.astype(cd)
    lf = _logsigmoid(f_pre.astype(cd))
    ig = i_pre.astype(cd)
    m1 = mx.maximum(lf + m0, ig)
    fa = mx.exp(lf + m0 - m1)[..., None]
    ia = mx.exp(ig - m1)[..., None]
    c1 = fa[..., None] * c0 + ia[..., None] * (kf[..., :, None] * vf[..., None, :])
    n1 = fa * n0 + ia * kf
    num = (qf[..., :, None] * c1).sum(axis=-2)
    qn = (qf * n1).sum(axis=-1, keepdims=True)
    h = num / (mx.maximum(mx.abs(qn), mx.exp(-m1)[..., None]) + eps)
    out_dtype = q.dtype if q.dtype != mx.float64 else cd
    return h.astype(out_dtype), (c1, n1, m1)


def mlstm_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    i_pre: mx.array,
    f_pre: mx.array,
    *,
    state: State | None = None,
    eps: float = 1e-6,
    return_state: bool = False,
):
    """The recurrent form, one step at a time, in plain mx ops (float32; float64 for float64 inputs).

    Same arguments and results as :func:`mlstm`. O(S) sequential steps: a test oracle,
    not a fast path.
    """
    hs = []
    st = state
    for t in range(q.shape[2]):
        h, st = mlstm_step_reference(q[:, :, t], k[:, :, t], v[:, :, t], i_pre[:, :, t], f_pre[:, :, t], st, eps=eps)
        hs.append(h)
    b, nh, s, dk = q.shape
    if st is None:
        st = _zero_state(b, nh, dk, v.shape[-1], _compute_dtype(q, k, v))
    h = mx.stack(hs, axis=2) if hs else mx.zeros((b, nh, 0, v.shape[-1]), dtype=q.dtype)
    return (h, st) if return_state else h


def mlstm_parallel_reference(
    q: mx.array, k: mx.array, v: mx.array, i_pre: mx.array, f_pre: mx.array, *, eps: float = 1e-6
) -> mx.array:
    """The parallel (quadratic) form from a zero state, in plain mx ops.

    log D_ij = sum_{j<l<=i} logsigmoid(f_l) + i_j for j <= i, stabilised by the row max
    m_i; h = (S∘D) V / (max(|rowsum(S∘D)|, exp(-m_i)) + eps) with S = q kᵀ / sqrt(DHQK).
    Equals the recurrent form except where the zero initial state's m = 0 would be the
    recurrent stabiliser (then they differ by eps-sized terms only).
    Memory O(S²) per head.
    """
    cd = _compute_dtype(q, k, v)
    s, dk = q.shape[2], q.shape[3]
    qf, kf, vf = q.astype(cd), k.astype(cd), v.astype(cd)
    b = mx.cumsum(_logsigmoid(f_pre.astype(cd)), axis=-1)
    logd = b[..., :, None] - b[..., None, :] + i_pre.astype(cd)[..., None, :]
    mask = mx.tril(mx.ones((s, s), dtype=mx.bool_))
    logd = mx.where(mask, logd, _NEG)
    m = logd.max(axis=-1, keepdims=True)
    sd = (qf @ kf.swapaxes(-1, -2)) * (dk ** -0.5) * mx.exp(logd - m)
    den = mx.maximum(mx.abs(sd.sum(axis=-1, keepdims=True)), mx.exp(-m)) + eps
    h = (sd @ vf) / den
    return h.astype(q.dtype if q.dtype != mx.float64 else cd)


def mlstm_chunkwise_mx(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    i_pre: mx.array,
    f_pre: mx.array,
    *,
    state: State | None = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
    return_state: bool = False,
):
    """The kernels' chunkwise math in plain mx ops (float32; float64 for float64 inputs).

    Same arguments and results as :func:`mlstm`. The sequence is padded to whole chunks
    (padded steps have i = -1e30 and logsigmoid(f) = 0, so they add nothing); the state
    recurrence over chunks is a Python loop of mx ops. Differentiable by MLX: this is the
    VJP path of :func:`mlstm` and the ``reference`` backend's forward.
    """
    cd = _compute_dtype(q, k, v)
    bsz, nh, s, dk = q.shape
    dv = v.shape[-1]
    if state is None:
        state = _zero_state(bsz, nh, dk, dv, cd)
    c_k, n_k, m_k = (x.astype(cd) for x in state)
    out_dtype = q.dtype if q.dtype != mx.float64 else cd
    if s == 0:
        h = mx.zeros((bsz, nh, 0, dv), dtype=out_dtype)
        return (h, (c_k, n_k, m_k)) if return_state else h
    L = max(1, min(int(chunk_size), s))
    nc = -(-s // L)
    pad = nc * L - s
    scale = dk ** -0.5

    qf, kf, vf = q.astype(cd), k.astype(cd), v.astype(cd)
    lf = _logsigmoid(f_pre.astype(cd))
    ig = i_pre.astype(cd)
    if pad:
        widths4 = [(0, 0), (0, 0), (0, pad), (0, 0)]
        qf, kf, vf = mx.pad(qf, widths4), mx.pad(kf, widths4), mx.pad(vf, widths4)
        lf = mx.pad(lf, [(0, 0), (0, 0), (0, pad)])
        ig = mx.pad(ig, [(0, 0), (0, 0), (0, pad)], constant_values=_NEG)
    qc = qf.reshape(bsz, nh, nc, L, dk)
    kc = kf.reshape(bsz, nh, nc, L, dk)
    vc = vf.reshape(bsz, nh, nc, L, dv)
    b = mx.cumsum(lf.reshape(bsz, nh, nc, L), axis=-1)  # (B, NH, NC, L)
    ic = ig.reshape(bsz, nh, nc, L)
    g = b[..., -1]  # (B, NH, NC)
    a = g[..., None] - b + ic
    amax = a.max(axis=-1)

    # Inter-chunk states (sequential over chunks).
    c_states, n_states, m_states = [c_k], [n_k], [m_k]
    for c in range(nc):
        m_new = mx.maximum(g[..., c] + m_k, amax[..., c])
        decay = mx.exp(g[..., c] + m_k - m_new)
        kg = kc[:, :, c] * mx.exp(a[..., c, :] - m_new[..., None])[..., None]  # (B, NH, L, DK)
        c_k = decay[..., None, None] * c_k + kg.swapaxes(-1, -2) @ vc[:, :, c]
        n_k = decay[..., None] * n_k + kg.sum(axis=-2)
        m_k = m_new
        c_states.append(c_k)
        n_states.append(n_k)
        m_states.append(m_k)
    c_prev = mx.stack(c_states[:-1], axis=2)  # (B, NH, NC, DK, DV)
    n_prev = mx.stack(n_states[:-1], axis=2)  # (B, NH, NC, DK)
    m_prev = mx.stack(m_states[:-1], axis=2)  # (B, NH, NC)

    # Intra-chunk outputs (parallel over chunks).
    mask = mx.tril(mx.ones((L, L), dtype=mx.bool_))
    logd = mx.where(mask, b[..., :, None] - b[..., None, :] + ic[..., None, :], _NEG)  # (B, NH, NC, L, L)
    m_inter = b + m_prev[..., None]
    m_comb = mx.maximum(m_inter, logd.max(axis=-1))  # (B, NH, NC, L)
    sd = (qc @ kc.swapaxes(-1, -2)) * scale * mx.exp(logd - m_comb[..., None])
    qs = (scale * mx.exp(m_inter - m_comb))[..., None]
    qg = qc * qs
    num = qg @ c_prev + sd @ vc
    den = (qg @ n_prev[..., None])[..., 0] + sd.sum(axis=-1)
    den = mx.maximum(mx.abs(den), mx.exp(-m_comb)) + eps
    h = (num / den[..., None]).reshape(bsz, nh, nc * L, dv)[:, :, :s].astype(out_dtype)
    return (h, (c_k, n_k, m_k)) if return_state else h


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------
def _check_inputs(q, k, v, i_pre, f_pre, state, *, seq: bool) -> tuple[int, int, int, int, int]:
    """Validate shapes/dtypes; returns (B, NH, S, DHQK, DHV) (S = 1 for a step)."""
    lead = "(B, NH, S, " if seq else "(B, NH, "
    check_array(q, "q", ndim=4 if seq else 3)
    if seq:
        bsz, nh, s, dk = q.shape
    else:
        (bsz, nh, dk), s = q.shape, 1
    check_array(k, "k", ndim=q.ndim)
    check_array(v, "v", ndim=q.ndim)
    check_same_dtype(q, "q", k, "k")
    check_same_dtype(q, "q", v, "v")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have q's shape {lead}DHQK) = {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(v.shape[:-1]) != tuple(q.shape[:-1]):
        want = (*q.shape[:-1], "DHV")
        raise ValueError(f"v must have shape {lead}DHV) = {want}, got {tuple(v.shape)}")
    dv = v.shape[-1]
    gate_shape = tuple(q.shape[:-1])
    for name, gate in (("i_pre", i_pre), ("f_pre", f_pre)):
        check_array(gate, name, ndim=q.ndim - 1)
        if tuple(gate.shape) != gate_shape:
            raise ValueError(f"{name} must have shape {lead.rstrip(', ')}) = {gate_shape}, got {tuple(gate.shape)}")
    if dk == 0:  # (DHV == 0 is fine: h is empty)
        raise ValueError(
            f"q and k must have a positive head dimension DHQK (q is scaled by DHQK**-0.5), got q {tuple(q.shape)}"
        )
    if state is not None:
        if not isinstance(state, (tuple, list)) or len(state) != 3:
            raise TypeError("state must be a tuple (C, n, m) or None")
        for name, x, shape in (
            ("state C", state[0], (bsz, nh, dk, dv)),
            ("state n", state[1], (bsz, nh, dk)),
            ("state m", state[2], (bsz, nh)),
        ):
            check_array(x, name)
            if tuple(x.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    return bsz, nh, s, dk, dv


def _check_eps(eps: Any) -> float:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0 or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite non-negative float, got {eps!r}")
    return float(eps)


def _f32_state(state, bsz, nh, dk, dv) -> State:
    if state is None:
        return _zero_state(bsz, nh, dk, dv)
    return tuple(x.astype(mx.float32) for x in state)


# ---------------------------------------------------------------------------
# kernel launches
# ---------------------------------------------------------------------------
def _round8(x: int) -> int:
    return -(-x // 8) * 8


def _chunk_configs(L: int, dk: int, dv: int) -> tuple[list, list, int]:
    """Template arguments of the state and output kernels for chunk length L, and BQ."""
    lp = 32 if L <= 32 else 64 if L <= 64 else 128
    # Output kernel: BQ rows x BV columns per threadgroup; DHQK streamed in BK blocks.
    bq = 32
    bk = min(32 if lp <= 64 else 16, _round8(dk))
    bv = min(64, _round8(dv))
    lb = 32
    # State kernel: a 32 x 32 tile of C per threadgroup; chunk streamed LB rows at a time.
    sk = sv = 32
    slb = min(lp, 64)
    smem_out = 4 * (max(bq * (bk + 4) + lp * (bk + 4) + bk * (bv + 4), bq * (lp + 4) + lb * (bv + 4)) + 2 * lp + 3 * bq + 132)
    smem_st = 4 * (slb * (sk + 4) + slb * (sv + 4) + lp + 8)
    assert smem_out <= 32768 and smem_st <= 32768, (smem_out, smem_st)
    return (
        [("LP", lp), ("SK", sk), ("SV", sv), ("LB", slb)],
        [("LP", lp), ("BQ", bq), ("BK", bk), ("BV", bv), ("LB", lb)],
        bq,
    )


def _kernel_chunkwise(q, k, v, ig, fg, c0, n0, m0, chunk_size: int, eps: float, backend: str):
    """Chunkwise forward on a kernel backend -> (h (B,NH,S,DV), C, n, m final state)."""
    bsz, nh, s, dk = q.shape
    dv = v.shape[-1]
    bh = bsz * nh
    L = min(chunk_size, s)
    nc = -(-s // L)
    st_tmpl, out_tmpl, bq = _chunk_configs(L, dk, dv)
    dtype = q.dtype
    k3, v3 = k.reshape(bh, s, dk), v.reshape(bh, s, dv)
    ig2, fg2 = ig.astype(mx.float32).reshape(bh, s), fg.astype(mx.float32).reshape(bh, s)
    params = const_array([s, L, nc, dk, dv], mx.int32)
    c_st, n_st, m_st = launch(
        STATES,
        inputs=[k3, v3, ig2, fg2, c0.reshape(bh, dk, dv), n0.reshape(bh, dk), m0.reshape(bh), params],
        output_shapes=[(bh, nc + 1, dk, dv), (bh, nc + 1, dk), (bh, nc + 1)],
        output_dtypes=[mx.float32] * 3,
        grid=(128 * -(-dv // 32), -(-dk // 32), bh),
        threadgroup=(128, 1, 1),
        template=[("T", dtype), *st_tmpl],
        backend=backend,
    )
    nrb = -(-L // bq)
    bv = dict(out_tmpl)["BV"]
    (h,) = launch(
        OUTPUTS,
        inputs=[
            q.reshape(bh, s, dk), k3, v3, ig2, fg2, c_st, n_st, m_st,
            const_array([s, L, nc, dk, dv, nrb], mx.int32),
            const_array([dk ** -0.5, eps], mx.float32),
        ],
        output_shapes=[(bh, s, dv)],
        output_dtypes=[dtype],
        grid=(128 * -(-dv // bv), nrb * nc, bh),
        threadgroup=(128, 1, 1),
        template=[("T", dtype), *out_tmpl],
        backend=backend,
    )
    return (
        h.reshape(bsz, nh, s, dv),
        c_st[:, nc].reshape(bsz, nh, dk, dv),
        n_st[:, nc].reshape(bsz, nh, dk),
        m_st[:, nc].reshape(bsz, nh),
    )


def _prepared_step(bsz: int, nh: int, dk: int, dv: int, dtype: mx.Dtype, eps: float, backend: str):
    """One step on a kernel backend, launch planned once:
    (q, k (B,NH,DK), v (B,NH,DV), i, f (B,NH), C, n, m) -> (h, C, n, m)."""
    bh = bsz * nh
    consts = [const_array([dk, dv], mx.int32), const_array([dk ** -0.5, eps], mx.float32)]
    example = [mx.zeros((1,))] * 8 + consts
    run = prepare_launch(
        STEP,
        inputs=example,
        output_shapes=[(bh, dv), (bh, dk, dv), (bh, dk), (bh,)],
        output_dtypes=[dtype, mx.float32, mx.float32, mx.float32],
        grid=(32 * -(-dv // 32), 8, bh),
        threadgroup=(32, 8, 1),
        template=[("T", dtype)],
        backend=backend,
    )

    def step(q, k, v, ig, fg, c0, n0, m0):
        h, c1, n1, m1 = run([
            q.reshape(bh, dk), k.reshape(bh, dk), v.reshape(bh, dv),
            ig.astype(mx.float32).reshape(bh), fg.astype(mx.float32).reshape(bh),
            c0.reshape(bh, dk, dv), n0.reshape(bh, dk), m0.reshape(bh), *consts,
        ])
        return h.reshape(bsz, nh, dv), c1.reshape(bsz, nh, dk, dv), n1.reshape(bsz, nh, dk), m1.reshape(bsz, nh)

    return step


def _check_chunk(chunk_size: Any) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def knob_values(s: int, dtype: Any, chunk_size: int | None = None) -> dict[str, int]:
    """{"chunk_size": ...} a call over S steps uses (argument > XLSTM_MLSTM_CHUNK_SIZE >
    presets > DEFAULT_CHUNK)."""
    _check_chunk(chunk_size)
    v = resolve_knobs("mlstm", dtype, s, args={"chunk_size": chunk_size}).values["chunk_size"]
    return {"chunk_size": DEFAULT_CHUNK if v is None else v}


def _vjp_via(fn, primals, cotangents):
    """Gradients of `fn` (plain mx, float32) at `primals`, cast back to the primals' dtypes."""
    p32 = [p.astype(mx.float32) for p in primals]
    cots = [c.astype(mx.float32) for c in cotangents]
    _, grads = mx.vjp(fn, p32, cots)
    return tuple(g.astype(p.dtype) for g, p in zip(grads, primals))


# ---------------------------------------------------------------------------
# public ops
# ---------------------------------------------------------------------------
def mlstm(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    i_pre: mx.array,
    f_pre: mx.array,
    *,
    state: State | None = None,
    chunk_size: int | None = None,
    eps: float = 1e-6,
    return_state: bool = False,
):
    """The mLSTM cell over a sequence, chunkwise.

    Args:
        q, k: (B, NH, S, DHQK), v: (B, NH, S, DHV); float32, float16 or bfloat16 (one dtype).
        i_pre, f_pre: (B, NH, S) gate pre-activations (any float dtype; used in float32).
        state: (C (B, NH, DHQK, DHV), n (B, NH, DHQK), m (B, NH)) to start from
            (cast to float32), or None for C = 0, n = 0, m = 0.
        chunk_size: steps per chunk (> 0; at most 128 on the kernel backends). Chunks
            shorter than the sequence's remainder are fine: S needs not be a multiple.
            None (default): the ``chunk_size`` knob (``XLSTM_MLSTM_CHUNK_SIZE``, presets),
            else 64.
        eps: added to the normaliser (NX-AI: 1e-6).
        return_state: also return the final state.

    Returns:
        h (B, NH, S, DHV) in q's dtype, or (h, (C, n, m)) with a float32 state.

    Kernels: ``mlstm_chunk_states`` (C, n, m at every chunk boundary) then
    ``mlstm_chunk_outputs`` (every chunk in parallel); S == 1 runs ``mlstm_step``.
    Differentiable: the VJP runs :func:`mlstm_chunkwise_mx` through MLX's autodiff
    (no backward kernels yet).
    """
    bsz, nh, s, dk, dv = _check_inputs(q, k, v, i_pre, f_pre, state, seq=True)
    chunk_size = knob_values(s, q.dtype, chunk_size)["chunk_size"]
    eps = _check_eps(eps)
    c0, n0, m0 = _f32_state(state, bsz, nh, dk, dv)
    backend = current_backend()
    if backend == "reference" or s == 0 or bsz * nh == 0 or dv == 0:
        return mlstm_chunkwise_mx(
            q, k, v, i_pre, f_pre, state=(c0, n0, m0), chunk_size=chunk_size, eps=eps, return_state=return_state
        )
    check_int32("mlstm", "B * NH (the kernels' grid z)", bsz * nh, f"q has shape {tuple(q.shape)}")
    if chunk_size > MAX_KERNEL_CHUNK and s > MAX_KERNEL_CHUNK:
        raise ValueError(
            f"chunk_size={chunk_size} is larger than the kernels support ({MAX_KERNEL_CHUNK}); "
            f"use chunk_size <= {MAX_KERNEL_CHUNK} (the result does not depend on it beyond rounding)"
        )

    if s == 1:
        step = _prepared_step(bsz, nh, dk, dv, q.dtype, eps, backend)

        def forward(q, k, v, ig, fg, c0, n0, m0):
            h, c1, n1, m1 = step(q[:, :, 0], k[:, :, 0], v[:, :, 0], ig[:, :, 0], fg[:, :, 0], c0, n0, m0)
            return h[:, :, None], c1, n1, m1

        def ref(q, k, v, ig, fg, c0, n0, m0):
            h, (c1, n1, m1) = mlstm_step_reference(
                q[:, :, 0], k[:, :, 0], v[:, :, 0], ig[:, :, 0], fg[:, :, 0], (c0, n0, m0), eps=eps
            )
            return h[:, :, None], c1, n1, m1
    else:
        def forward(q, k, v, ig, fg, c0, n0, m0):
            return _kernel_chunkwise(q, k, v, ig, fg, c0, n0, m0, chunk_size, eps, backend)

        def ref(q, k, v, ig, fg, c0, n0, m0):
            h, st = mlstm_chunkwise_mx(
                q, k, v, ig, fg, state=(c0, n0, m0), chunk_size=chunk_size, eps=eps, return_state=True
            )
            return (h, *st)

    primals = (q, k, v, i_pre, f_pre, c0, n0, m0)
    if return_state:
        @mx.custom_function
        def f_state(*p):
            return forward(*p)

        @f_state.vjp
        def f_state_vjp(p, cotangents, outputs):
            return _vjp_via(lambda *x: ref(*x), p, cotangents)

        h, c1, n1, m1 = f_state(*primals)
        return h, (c1, n1, m1)

    @mx.custom_function
    def f(*p):
        return forward(*p)[0]

    @f.vjp
    def f_vjp(p, cotangent, output):
        return _vjp_via(lambda *x: ref(*x)[0], p, [cotangent])

    return f(*primals)


def mlstm_step(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    i_pre: mx.array,
    f_pre: mx.array,
    state: State | None,
    *,
    eps: float = 1e-6,
) -> tuple[mx.array, State]:
    """One recurrent mLSTM step (decoding), fused in one kernel.

    Args:
        q, k: (B, NH, DHQK), v: (B, NH, DHV); float32, float16 or bfloat16 (one dtype).
        i_pre, f_pre: (B, NH).
        state: (C (B, NH, DHQK, DHV), n (B, NH, DHQK), m (B, NH)), or None for zeros
            (C = 0, n = 0, m = 0, as NX-AI).
        eps: added to the normaliser.

    Returns:
        (h (B, NH, DHV) in q's dtype, (C, n, m) float32).

    Differentiable; the VJP runs :func:`mlstm_step_reference` through MLX's autodiff.
    """
    key = _step_key(q, k, v, i_pre, f_pre, state, eps)
    fn = _STEP_CALLS.get(key) if key is not None else None
    if fn is None:
        fn = _step_function(q, k, v, i_pre, f_pre, state, eps, replay=key is not None)
        if key is not None:
            _STEP_CALLS.put(key, fn)
    bsz, nh, dk = q.shape
    c0, n0, m0 = _f32_state(state, bsz, nh, dk, v.shape[-1])
    h, c1, n1, m1 = fn(q, k, v, i_pre, f_pre, c0, n0, m0)
    return h, (c1, n1, m1)


_STEP_CALLS = CallCache("mlstm_step")


def _signature(a: Any) -> Any:
    return (a.shape, a.dtype) if isinstance(a, mx.array) else a.__class__


def _step_key(q, k, v, i_pre, f_pre, state, eps) -> tuple | None:
    """The memo key of a step call (everything validation and the launch depend on), or
    None when an argument is not an array / float (such calls are checked every time)."""
    if state is not None and not (isinstance(state, tuple) and len(state) == 3):
        return None
    arrays = (q, k, v, i_pre, f_pre, *(state or ()))
    if not all(isinstance(a, mx.array) for a in arrays) or eps.__class__ not in (float, int):
        return None
    return (*[(a.shape, a.dtype) for a in arrays], state is None, eps)


def _step_function(q, k, v, i_pre, f_pre, state, eps, replay: bool = False):
    """Validate one step call and build f(q, k, v, i_pre, f_pre, C, n, m) -> (h, C, n, m),
    differentiable, for every later call with the same signature."""
    bsz, nh, _, dk, dv = _check_inputs(q, k, v, i_pre, f_pre, state, seq=False)
    eps = _check_eps(eps)
    backend = current_backend()

    def ref(q, k, v, ig, fg, c0, n0, m0):
        h, (c1, n1, m1) = mlstm_step_reference(q, k, v, ig, fg, (c0, n0, m0), eps=eps)
        return h, c1, n1, m1

    if backend == "reference" or bsz * nh == 0 or dv == 0:
        return ref
    check_int32("mlstm_step", "B * NH (the kernel's grid z)", bsz * nh, f"q has shape {tuple(q.shape)}")
    forward = _prepared_step(bsz, nh, dk, dv, q.dtype, eps, backend)

    @mx.custom_function
    def f(*p):
        return forward(*p)

    @f.vjp
    def f_vjp(p, cotangents, outputs):
        return _vjp_via(ref, p, cotangents)

    return replayable(f, backend, bare=forward) if replay else f  # cuda / metal: record once, replay
