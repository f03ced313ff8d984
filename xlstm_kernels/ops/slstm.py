"""sLSTM recurrence ops backed by ``metal_src/slstm.metal``: slstm, slstm_step.

Shapes (B batch, S steps, NH heads, DH units per head; gate order i, f, z, o)::

    wx     (B, S, 4, NH, DH)   input projections W x_t, float32/float16/bfloat16
    r      (NH, DH, 4, DH)     block-diagonal recurrent matrix:
                               raw[b, g, h, j] += sum_i y[b, h, i] * r[h, i, g, j]
    b      (4, NH, DH)         gate biases
    state  (y, c, n, m)        each (B, NH, DH), float32
    y      (B, S, NH, DH)      in wx's dtype

Per step, per unit (all math in float32; R and wx are read in wx's dtype)::

    raw = wx_t + R y_{t-1} + b
    lfm = m_{t-1} + logsigmoid(f_raw)
    m_t = i_raw                  if n_{t-1} == 0
        = max(i_raw, lfm)        otherwise
    i = exp(i_raw - m_t);  f = exp(lfm - m_t) (0 if n_{t-1} == 0);  o = sigmoid(o_raw)
    c_t = f c_{t-1} + i tanh(z_raw);  n_t = f n_{t-1} + i;  y_t = o c_t / n_t

Initial state and the first step: with ``state=None`` the sequence starts from
y = c = n = m = 0. A unit whose normaliser n_{t-1} is exactly 0 holds no memory; its
step uses m_t = i_raw and drops the forget term (f = 0; c_{t-1} is 0 there anyway).
So the first step from the zero state uses m_t = i_raw, as NX-AI/xlstm does (NX-AI
tests ``all(n == 0)`` over the whole batch; this tests it per unit, which gives the
same result for the zero state and for every state a previous call returned, since
n_t >= 1 after one step). A given state with n > 0 enters the max formula as is, so a
state carried from ``return_state=True`` continues the sequence exactly
(split sequence + carried state == whole sequence; bit for bit in the emulator). Passing the zero
state explicitly is the same as ``state=None``.

Kernels (one threadgroup per (batch, head), DH*K threads, K lanes per unit splitting
the recurrent dot products; see the metal file for the full layout):

* ``slstm_fwd``: the whole time loop in one dispatch; y_{t-1} double-buffered in
  threadgroup memory (one barrier per step); R either held in registers for the whole
  sequence (4 * ceil(DH/K) values per thread, chosen when they fit in 128 bytes:
  DH <= 64 by default) or streamed from device memory each step (larger DH: one head's
  R is 4*DH*DH values, 256 KiB in float32 for DH = 128, too big for threadgroup memory,
  and re-read from the GPU caches every step).
* ``slstm_step``: one step for decoding (R read once from device memory).
* ``slstm_bwd``: backward through time in one dispatch (exact derivative, the
  stabiliser m included, so it matches MLX autodiff of :func:`slstm_reference`).

Differentiation (both ops, through ``mx.custom_function``): the VJP re-runs
``slstm_fwd`` with SAVE to record the per-step raw gates and states (the inference
forward stores nothing), runs ``slstm_bwd`` for d wx (the raw-gate gradients) and the
initial-state gradient, then forms d r = sum_{b,t} y_{t-1} (x) d raw with one batched
``mx.matmul`` per head and d b = sum_{b,t} d raw. Gradients flow to wx, r, b and the
initial state (y, c, n, m), and from cotangents of y and of the returned final state.
The step at which i_raw == lfm exactly sends the gradient of m_t to lfm, like
``mx.maximum``.

Knobs (:mod:`xlstm_kernels.tiles.knobs`, op ``slstm``, shape class by DH):
``threads_per_unit`` (K) and ``r_in_registers``, resolved by :func:`plan` field by field:
the ``config=`` argument, then ``XLSTM_SLSTM_THREADS_PER_UNIT`` /
``XLSTM_SLSTM_R_IN_REGISTERS``, then the presets, then the heuristic below. A K with
DH*K > 1024 is an error from the argument or a variable, and skipped from a preset.

The ``reference`` backend runs :func:`slstm_reference` (per-step mx-ops loop in float32,
differentiable by MLX).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from ..runtime import KernelSpec, const_array, current_backend, launch, prepare_launch
from ..tiles.gemm import dtype_name
from ..tiles.knobs import resolve_knobs, slstm_fits
from ._callcache import CallCache, replayable
from ._validate import check_array

__all__ = ["SLSTMConfig", "plan", "slstm", "slstm_reference", "slstm_step", "slstm_step_reference"]

FWD = KernelSpec("slstm", "slstm_fwd", ("wx", "r", "bias", "s0", "params"), ("y", "s_out", "G", "H"))
BWD = KernelSpec("slstm", "slstm_bwd", ("dy", "ds_out", "G", "H", "s0", "r", "params"), ("dG", "ds0"))
STEP = KernelSpec("slstm", "slstm_step", ("wx", "r", "bias", "s0", "params"), ("y", "s_out"))

MAX_DH = 512  # slstm_bwd keeps 8 * DH floats in threadgroup memory (16 KiB at 512)
_MAX_THREADS = 512  # threads per threadgroup the default plan stays within
_RREG_BYTES = 128  # registers per thread the default plan gives to R


@dataclass(frozen=True)
class SLSTMConfig:
    """How the kernels split a head.

    Attributes:
        threads_per_unit: K, lanes per unit (a power of two <= 32); the threadgroup has
            DH * K <= 1024 threads and each lane sums ceil(DH / K) recurrent terms.
        r_in_registers: keep R in registers for the whole sequence (else stream it from
            device memory each step).
    """

    threads_per_unit: int
    r_in_registers: bool


def plan(dh: int, dtype: mx.Dtype = mx.float32, config: Any = None) -> SLSTMConfig:
    """The kernel configuration for DH units per head.

    Default: K = the power of two nearest DH / 8 (about 8 dot-product terms per lane),
    at most 32 and with DH * K <= 512 threads; R in registers when its 4 * ceil(DH / K)
    values per lane fit in 128 bytes of the input dtype. That gives DH = 8: K = 1,
    DH = 32: K = 4, DH = 64: K = 8 (512 threads, 32 R values per lane), all with R in
    registers; DH = 128: K = 4 and DH = 256: K = 2, streaming R, in every dtype.
    The limits are conservative on purpose: MLX raises at evaluation when the threadgroup
    exceeds the pipeline's maxTotalThreadsPerThreadgroup, which shrinks as a kernel uses
    more registers (about 100 32-bit registers per thread still allow 512 threads on
    Apple GPUs). ``config`` (an :class:`SLSTMConfig` or a dict with either field)
    overrides field by field; below it come the knobs' variables and presets
    (``XLSTM_SLSTM_THREADS_PER_UNIT``, ``XLSTM_SLSTM_R_IN_REGISTERS``; see the module
    docstring). ``xlstm-kernels tune --op slstm`` measures them on the device.
    """
    if config is None:
        fields: dict = {}
    elif isinstance(config, SLSTMConfig):
        fields = {"threads_per_unit": config.threads_per_unit, "r_in_registers": config.r_in_registers}
    elif isinstance(config, dict):
        unknown = set(config) - {"threads_per_unit", "r_in_registers"}
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}; expected threads_per_unit, r_in_registers")
        fields = dict(config)
    else:
        raise TypeError(f"config must be an SLSTMConfig, a dict or None, got {type(config).__name__}")
    if "threads_per_unit" in fields:
        k = fields["threads_per_unit"]
        if not isinstance(k, int) or isinstance(k, bool) or k < 1 or k > 32 or k & (k - 1):
            raise ValueError(f"config: threads_per_unit must be a power of two in 1..32, got {k!r}")
        if dh * k > 1024:
            raise ValueError(f"config: threads_per_unit={k} gives DH*K = {dh * k} threads per threadgroup (max 1024)")
    if "r_in_registers" in fields and not isinstance(fields["r_in_registers"], bool):
        raise ValueError(f"config: r_in_registers must be a bool, got {fields['r_in_registers']!r}")
    v = resolve_knobs("slstm", dtype, dh, args=fields, fits=slstm_fits(dh)).values
    k = v["threads_per_unit"]
    if k is None:
        k = 1
        while k < 32 and k * 2 * 8 <= dh and dh * k * 2 <= _MAX_THREADS:
            k *= 2
    rreg = v["r_in_registers"]
    if rreg is None:
        itemsize = 4 if dtype_name(dtype) == "float32" else 2
        rreg = 4 * (-(-dh // k)) * itemsize <= _RREG_BYTES
    return SLSTMConfig(k, rreg)


# ---------------------------------------------------------------------------
# Reference (plain mx ops)
# ---------------------------------------------------------------------------
def _logsigmoid(x: mx.array) -> mx.array:
    return -mx.logaddexp(mx.zeros_like(x), -x)


def _cell_reference(raw: mx.array, state: Sequence[mx.array]) -> tuple[mx.array, ...]:
    """One pointwise step; raw (B, 4, NH, DH) float32, state (y, c, n, m)."""
    _, c, n, m = state
    ir, fr, zr, orr = raw[:, 0], raw[:, 1], raw[:, 2], raw[:, 3]
    empty = n == 0
    lfm = m + _logsigmoid(fr)
    mt = mx.where(empty, ir, mx.maximum(ir, lfm))
    ig = mx.exp(ir - mt)
    # where() twice keeps the gradient finite for an empty unit, where lfm - i_raw may be huge
    fg = mx.where(empty, 0.0, mx.exp(mx.where(empty, 0.0, lfm - mt)))
    og = mx.sigmoid(orr)
    c = fg * c + ig * mx.tanh(zr)
    n = fg * n + ig
    y = og * c / n
    return y, c, n, mt


def _recurrent_reference(y: mx.array, r: mx.array) -> mx.array:
    """R y for y (B, NH, DH), r (NH, DH, 4, DH) -> (B, 4, NH, DH), float32."""
    nh, dh = r.shape[0], r.shape[1]
    ry = mx.matmul(y.transpose(1, 0, 2), r.reshape(nh, dh, 4 * dh))  # (NH, B, 4*DH)
    return ry.reshape(nh, y.shape[0], 4, dh).transpose(1, 2, 0, 3)  # (B given: NH or DH may be 0)


def _zero_state(bsz: int, nh: int, dh: int) -> tuple[mx.array, ...]:
    z = mx.zeros((bsz, nh, dh), dtype=mx.float32)
    return (z, z, z, z)


def slstm_reference(
    wx: mx.array,
    r: mx.array,
    b: mx.array,
    *,
    state: Sequence[mx.array] | None = None,
    return_state: bool = False,
):
    """:func:`slstm` as a per-step loop of mx ops in float32 (the ``reference`` backend)."""
    bsz, s, _, nh, dh = _check(wx, r, b, state, "slstm")
    rf = r.astype(mx.float32)
    bf = b.astype(mx.float32)
    st = tuple(x.astype(mx.float32) for x in state) if state is not None else _zero_state(bsz, nh, dh)
    ys = []
    for t in range(s):
        raw = wx[:, t].astype(mx.float32) + _recurrent_reference(st[0], rf) + bf
        st = _cell_reference(raw, st)
        ys.append(st[0])
    y = (mx.stack(ys, axis=1) if ys else mx.zeros((bsz, 0, nh, dh), dtype=mx.float32)).astype(wx.dtype)
    return (y, st) if return_state else y


def slstm_step_reference(wx_t: mx.array, r: mx.array, b: mx.array, state: Sequence[mx.array]):
    """:func:`slstm_step` with mx ops in float32."""
    _check_step(wx_t, r, b, state)
    st = tuple(x.astype(mx.float32) for x in state)
    raw = wx_t.astype(mx.float32) + _recurrent_reference(st[0], r.astype(mx.float32)) + b.astype(mx.float32)
    st = _cell_reference(raw, st)
    return st[0].astype(wx_t.dtype), st


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------
def _check_params(r: mx.array, b: mx.array, nh: int, dh: int, op: str) -> None:
    check_array(r, "r", ndim=4)
    if tuple(r.shape) != (nh, dh, 4, dh):
        raise ValueError(f"{op}: r must have shape (NH, DH, 4, DH) = {(nh, dh, 4, dh)} to match wx, got {tuple(r.shape)}")
    check_array(b, "b", ndim=3)
    if tuple(b.shape) != (4, nh, dh):
        raise ValueError(f"{op}: b must have shape (4, NH, DH) = {(4, nh, dh)} to match wx, got {tuple(b.shape)}")


def _check_state(state: Any, bsz: int, nh: int, dh: int, op: str) -> None:
    if not isinstance(state, (tuple, list)) or len(state) != 4:
        raise TypeError(f"{op}: state must be a tuple (y, c, n, m) of 4 arrays, got {type(state).__name__}"
                        + (f" of length {len(state)}" if isinstance(state, (tuple, list)) else ""))
    for name, s in zip(("y", "c", "n", "m"), state):
        check_array(s, f"state.{name}", ndim=3)
        if tuple(s.shape) != (bsz, nh, dh):
            raise ValueError(f"{op}: state.{name} must have shape (B, NH, DH) = {(bsz, nh, dh)}, got {tuple(s.shape)}")


def _check(wx, r, b, state, op: str) -> tuple[int, int, int, int, int]:
    check_array(wx, "wx", ndim=5)
    bsz, s, four, nh, dh = wx.shape
    if four != 4:
        raise ValueError(f"{op}: wx must have shape (B, S, 4, NH, DH) with the gates (i, f, z, o) on axis 2, "
                         f"got {tuple(wx.shape)}")
    if dh > MAX_DH:
        raise ValueError(f"{op}: DH = {dh} units per head is above the supported {MAX_DH}")
    _check_params(r, b, nh, dh, op)
    if state is not None:
        _check_state(state, bsz, nh, dh, op)
    return bsz, s, four, nh, dh


def _check_step(wx_t, r, b, state) -> tuple[int, int, int]:
    check_array(wx_t, "wx_t", ndim=4)
    bsz, four, nh, dh = wx_t.shape
    if four != 4:
        raise ValueError(f"slstm_step: wx_t must have shape (B, 4, NH, DH) with the gates (i, f, z, o) on axis 1, "
                         f"got {tuple(wx_t.shape)}")
    if dh > MAX_DH:
        raise ValueError(f"slstm_step: DH = {dh} units per head is above the supported {MAX_DH}")
    _check_params(r, b, nh, dh, "slstm_step")
    if state is None:
        raise TypeError("slstm_step: state (y, c, n, m) is required (use zeros of shape (B, NH, DH) to start)")
    _check_state(state, bsz, nh, dh, "slstm_step")
    return bsz, nh, dh


# ---------------------------------------------------------------------------
# Kernel launches
# ---------------------------------------------------------------------------
def _forward(wx, r, bias, s0, cfg: SLSTMConfig, save: bool, backend: str):
    """slstm_fwd: wx (B,S,4,NH,DH) T, r T, bias f32, s0 (4,B,NH,DH) f32 -> y, s_out, G, H."""
    bsz, s, _, nh, dh = wx.shape
    k = cfg.threads_per_unit
    saved = (bsz, s, 4, nh, dh) if save else (1,)
    return launch(
        FWD,
        inputs=[wx, r, bias, s0, const_array([bsz, s, nh], mx.int32)],
        output_shapes=[(bsz, s, nh, dh), (4, bsz, nh, dh), saved, saved],
        output_dtypes=[wx.dtype, mx.float32, mx.float32, mx.float32],
        grid=(dh * k, nh, bsz),
        threadgroup=(dh * k, 1, 1),
        template=[("T", wx.dtype), ("DH", dh), ("K", k), ("RREG", cfg.r_in_registers), ("SAVE", save)],
        backend=backend,
    )


def _backward(wx, r, bias, s0, dy, ds_out, cfg: SLSTMConfig, backend: str):
    """Gradients (d wx, d r, d bias, d s0) of slstm_fwd for cotangents dy, ds_out."""
    bsz, s, _, nh, dh = wx.shape
    k = cfg.threads_per_unit
    _, _, g_raw, h_st = _forward(wx, r, bias, s0, cfg, True, backend)
    dg, ds0 = launch(
        BWD,
        inputs=[dy.astype(wx.dtype), ds_out.astype(mx.float32), g_raw, h_st, s0, r,
                const_array([bsz, s, nh], mx.int32)],
        output_shapes=[(bsz, s, 4, nh, dh), (4, bsz, nh, dh)],
        output_dtypes=[mx.float32, mx.float32],
        grid=(dh * k, nh, bsz),
        threadgroup=(dh * k, 1, 1),
        template=[("T", wx.dtype), ("DH", dh), ("K", k), ("RREG", cfg.r_in_registers)],
        backend=backend,
    )
    # y_{t-1} for every step: the initial y, then the saved y_0 .. y_{S-2}
    yprev = mx.concatenate([s0[0][:, None], h_st[:, :-1, 0]], axis=1)  # (B, S, NH, DH)
    a = yprev.transpose(2, 3, 0, 1).reshape(nh, dh, bsz * s)
    d = dg.transpose(3, 0, 1, 2, 4).reshape(nh, bsz * s, 4 * dh)
    dr = mx.matmul(a, d).reshape(nh, dh, 4, dh)
    dbias = dg.sum(axis=(0, 1))
    return dg.astype(wx.dtype), dr.astype(r.dtype), dbias.astype(bias.dtype), ds0


def _stack_state(state, bsz: int, nh: int, dh: int) -> mx.array:
    if state is None:
        return mx.zeros((4, bsz, nh, dh), dtype=mx.float32)
    return mx.stack([x.astype(mx.float32) for x in state])


def _unstack(s: mx.array) -> tuple[mx.array, ...]:
    return (s[0], s[1], s[2], s[3])


def slstm(
    wx: mx.array,
    r: mx.array,
    b: mx.array,
    *,
    state: Sequence[mx.array] | None = None,
    return_state: bool = False,
    config: Any = None,
):
    """The sLSTM recurrence over a whole sequence (fused: one kernel dispatch).

    Args:
        wx: (B, S, 4, NH, DH) gate inputs W x_t in gate order (i, f, z, o); float32,
            float16 or bfloat16 (sets the kernel's input dtype).
        r: (NH, DH, 4, DH) recurrent matrix, raw[b, g, h, j] += sum_i y[b, h, i] r[h, i, g, j];
            cast to wx's dtype.
        b: (4, NH, DH) bias (added in float32).
        state: optional (y, c, n, m), each (B, NH, DH) (cast to float32); None = zeros.
        return_state: also return the final state.
        config: optional :class:`SLSTMConfig` (or a dict of its fields): see :func:`plan`.

    Returns:
        y (B, S, NH, DH) in wx's dtype, and with ``return_state`` the final state
        (y, c, n, m), each (B, NH, DH) float32.

    Differentiable in wx, r, b and state; the backward runs the BPTT kernel
    ``slstm_bwd`` (see the module docstring).
    """
    bsz, s, _, nh, dh = _check(wx, r, b, state, "slstm")
    if not isinstance(return_state, bool):
        raise TypeError(f"slstm: return_state must be a bool, got {return_state!r}")
    cfg = plan(dh, wx.dtype, config)
    backend = current_backend()
    if backend == "reference" or bsz == 0 or nh == 0 or dh == 0:
        return slstm_reference(wx, r, b, state=state, return_state=return_state)
    s0 = _stack_state(state, bsz, nh, dh)
    if s == 0:
        y = mx.zeros((bsz, 0, nh, dh), dtype=wx.dtype)
        return (y, _unstack(s0)) if return_state else y

    @mx.custom_function
    def f(wx_, r_, b_, s0_):
        y, s_out, _, _ = _forward(wx_, r_, b_, s0_, cfg, False, backend)
        return y, s_out

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        wx_, r_, b_, s0_ = primals
        dy, ds_out = cotangents
        return _backward(wx_, r_, b_, s0_, dy, ds_out, cfg, backend)

    y, s_out = f(wx, r.astype(wx.dtype), b.astype(mx.float32), s0)
    return (y, _unstack(s_out)) if return_state else y


def slstm_step(
    wx_t: mx.array,
    r: mx.array,
    b: mx.array,
    state: Sequence[mx.array],
    *,
    config: Any = None,
):
    """One sLSTM step (decoding).

    Args:
        wx_t: (B, 4, NH, DH) gate inputs of this step, gate order (i, f, z, o).
        r: (NH, DH, 4, DH); b: (4, NH, DH): as for :func:`slstm`.
        state: (y, c, n, m), each (B, NH, DH) (zeros to start: same as ``slstm(state=None)``).
        config: as for :func:`slstm` (only threads_per_unit matters to the step kernel).

    Returns:
        (y (B, NH, DH) in wx_t's dtype, new state (y, c, n, m) float32).
        ``slstm_step`` applied S times equals ``slstm`` over the S steps.

    Differentiable; the VJP runs the sequence kernels with S = 1.
    """
    key = _step_key(wx_t, r, b, state, config)
    fn = _STEP_CALLS.get(key) if key is not None else None
    if fn is None:
        fn = _step_function(wx_t, r, b, state, config, replay=key is not None)
        if key is not None:
            _STEP_CALLS.put(key, fn)
    return fn(wx_t, r, b, state)


_STEP_CALLS = CallCache("slstm_step")


def _step_key(wx_t, r, b, state, config) -> tuple | None:
    """The memo key of a step call (what validation and the launch depend on), or None
    when an argument is not an array or config is given (such calls are checked every time)."""
    if config is not None or not isinstance(state, (tuple, list)):
        return None
    arrays = (wx_t, r, b, *state)
    if not all(isinstance(a, mx.array) for a in arrays):
        return None
    return tuple([(a.shape, a.dtype) for a in arrays])


def _step_function(wx_t, r, b, state, config, replay: bool = False):
    """Validate one step call and build fn(wx_t, r, b, state) -> (y, state) for every
    later call with the same signature."""
    bsz, nh, dh = _check_step(wx_t, r, b, state)
    cfg = plan(dh, wx_t.dtype, config)
    backend = current_backend()
    if backend == "reference" or bsz == 0 or nh == 0 or dh == 0:
        return slstm_step_reference
    k = cfg.threads_per_unit
    dims = const_array([bsz, nh], mx.int32)
    run = prepare_launch(
        STEP,
        inputs=[wx_t, r, b, wx_t, dims],
        output_shapes=[(bsz, nh, dh), (4, bsz, nh, dh)],
        output_dtypes=[wx_t.dtype, mx.float32],
        grid=(dh * k, nh, bsz),
        threadgroup=(dh * k, 1, 1),
        template=[("T", wx_t.dtype), ("DH", dh), ("K", k)],
        backend=backend,
    )

    @mx.custom_function
    def f(wx_, r_, b_, s0_):
        y, s_out = run([wx_, r_, b_, s0_, dims])
        return y, s_out

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        wx_, r_, b_, s0_ = primals
        dy, ds_out = cotangents
        dwx, dr, db, ds0 = _backward(wx_[:, None], r_, b_, s0_, dy[:, None], ds_out, cfg, backend)
        return dwx[:, 0], dr, db, ds0

    if replay:  # a memoised signature: cuda / metal record the launch once, then replay
        f = replayable(f, backend, bare=lambda wx_, r_, b_, s0_: tuple(run([wx_, r_, b_, s0_, dims])))

    def step(wx_t, r, b, state):
        s0 = _stack_state(state, bsz, nh, dh)
        y, s_out = f(wx_t, r.astype(wx_t.dtype), b.astype(mx.float32), s0)
        return y, _unstack(s_out)

    return step
