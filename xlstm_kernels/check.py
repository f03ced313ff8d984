"""``xlstm-kernels check``: run every shipped kernel against float64 references.

Each case draws fresh random inputs, runs the op on the active backend, computes the
same math in float64 NumPy from the (rounded) inputs, and compares with a relative
error bound that fits the dtype. The result is a table and an exit status.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from . import ops
from .ops import mlstm as mlstm_mod
from .ops import rope as rope_mod
from .ops import slstm as slstm_mod
from .runtime import current_backend

__all__ = ["CheckCase", "CheckResult", "CASES", "TOLERANCE", "relative_error", "run_checks", "format_table"]

# Max |out - ref| / max |ref| allowed per output dtype.
TOLERANCE = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 2e-2}
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def to_f64(x: mx.array) -> np.ndarray:
    """An mx.array as float64 NumPy (exact for every float dtype)."""
    return np.asarray(x.astype(mx.float32)).astype(np.float64)


def relative_error(out: mx.array, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref| (NaN anywhere gives inf)."""
    o = to_f64(out)
    if o.shape != ref.shape:
        raise ValueError(f"output shape {o.shape} != reference shape {ref.shape}")
    if not np.all(np.isfinite(o)):
        return float("inf")
    scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0, 1e-30)
    return float(np.max(np.abs(o - ref))) / scale if ref.size else 0.0


@dataclass(frozen=True)
class CheckCase:
    """One op at one shape: `make` draws inputs, `run` calls the op, `reference` is float64."""

    op: str
    shape: str
    make: Callable[[np.random.Generator, mx.Dtype], tuple]
    run: Callable[..., mx.array]
    reference: Callable[..., np.ndarray]


@dataclass
class CheckResult:
    op: str
    shape: str
    dtype: str
    backend: str
    error: float
    tolerance: float
    seconds: float
    message: str = ""

    @property
    def ok(self) -> bool:
        return not self.message and self.error <= self.tolerance


def _normal(rng: np.random.Generator, shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _rms_case(rows: int, d: int) -> CheckCase:
    def make(rng, dtype):
        return _normal(rng, (rows, d), dtype), _normal(rng, (d,), dtype)

    def reference(x, w):
        x64, w64 = to_f64(x), to_f64(w)
        return w64 * x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5)

    return CheckCase("rms_norm", f"{rows}x{d}", make, lambda x, w: ops.rms_norm(x, w, 1e-5), reference)


def _gemm_case(op: str, m: int, n: int, k: int) -> CheckCase:
    """`op` on operands of its own layout; the shape reads as in the op's docstring."""
    a_shape, b_shape = {
        "gemm_av": ((m, n), (n, k)),
        "gemm_at_b": ((m, n), (m, k)),
        "gemm_a_bt": ((m, k), (n, k)),
    }[op]

    def make(rng, dtype):
        return _normal(rng, a_shape, dtype), _normal(rng, b_shape, dtype)

    def reference(a, b):
        a64, b64 = to_f64(a), to_f64(b)
        return {"gemm_av": lambda: a64 @ b64, "gemm_at_b": lambda: a64.T @ b64, "gemm_a_bt": lambda: a64 @ b64.T}[op]()

    return CheckCase(op, f"{m}x{n}x{k}", make, getattr(ops, op), reference)


def _linear_case(rows: int, d_in: int, d_out: int) -> CheckCase:
    def make(rng, dtype):
        return (_normal(rng, (rows, d_in), dtype), _normal(rng, (d_out, d_in), dtype), _normal(rng, (d_out,), dtype),
                _normal(rng, (rows, d_out), dtype))

    def reference(x, w, b, r):
        from math import erf

        z = to_f64(x) @ to_f64(w).T + to_f64(b)
        return 0.5 * z * (1.0 + np.vectorize(erf)(z / np.sqrt(2.0))) + to_f64(r)

    return CheckCase(
        "linear", f"{rows}x{d_in}x{d_out}", make,
        lambda x, w, b, r: ops.linear(x, w, b, activation="gelu", residual=r), reference,
    )


def _layer_norm_case(rows: int, d: int, heads: int = 0) -> CheckCase:
    def make(rng, dtype):
        return _normal(rng, (rows, d), dtype), _normal(rng, (d,), dtype), _normal(rng, (d,), dtype)

    def reference(x, w, b):
        x64 = to_f64(x)
        if heads:
            x64 = x64.reshape(rows, heads, d // heads)
        mu = x64.mean(-1, keepdims=True)
        y = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
        return y.reshape(rows, d) * to_f64(w) + to_f64(b)

    if heads:
        return CheckCase("mh_layer_norm", f"{rows}x{heads}x{d // heads}", make,
                         lambda x, w, b: ops.multihead_layer_norm(x, w, b, heads, 1e-5), reference)
    return CheckCase("layer_norm", f"{rows}x{d}", make, lambda x, w, b: ops.layer_norm(x, w, b, 1e-5), reference)


def _rope_case(b: int, h: int, seq: int, d: int) -> CheckCase:
    def make(rng, dtype):
        return (_normal(rng, (b, h, seq, d), dtype),)

    def reference(x):
        x64 = to_f64(x)
        half = d // 2
        theta = (np.arange(seq)[:, None] + 3) * 10000.0 ** (-np.arange(half) / half)[None]
        c, s_ = np.cos(theta), np.sin(theta)
        a, bb = x64[..., :half], x64[..., half:]
        return np.concatenate([a * c - bb * s_, a * s_ + bb * c], axis=-1)

    return CheckCase("rope", f"{b}x{h}x{seq}x{d}", make, lambda x: rope_mod.rope(x, d, offset=3), reference)


def _attention_case(hq: int, hkv: int, lq: int, lk: int, d: int) -> CheckCase:
    def make(rng, dtype):
        return (_normal(rng, (1, hq, lq, d), dtype), _normal(rng, (1, hkv, lk, d), dtype),
                _normal(rng, (1, hkv, lk, d), dtype))

    def reference(q, k, v):
        q64, k64, v64 = to_f64(q), to_f64(k), to_f64(v)
        k64, v64 = np.repeat(k64, hq // hkv, axis=1), np.repeat(v64, hq // hkv, axis=1)
        s = q64 @ k64.swapaxes(-1, -2) / np.sqrt(d)
        s = np.where(np.arange(lk)[None] <= np.arange(lq)[:, None] + (lk - lq), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v64

    return CheckCase("attention", f"{hq}/{hkv}x{lq}x{lk}x{d}", make,
                     lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask="causal"),
                     reference)


def _logsigmoid(x: np.ndarray) -> np.ndarray:
    return np.minimum(x, 0.0) - np.log1p(np.exp(-np.abs(x)))


def _mlstm_case(b: int, nh: int, seq: int, d: int) -> CheckCase:
    def make(rng, dtype):
        return (*(_normal(rng, (b, nh, seq, d), dtype) for _ in range(3)),
                _normal(rng, (b, nh, seq), dtype), _normal(rng, (b, nh, seq), dtype))

    def reference(q, k, v, i_pre, f_pre):
        q64, k64, v64, i64, f64 = (to_f64(t) for t in (q, k, v, i_pre, f_pre))
        c = np.zeros((b, nh, d, d))
        n = np.zeros((b, nh, d))
        m = np.zeros((b, nh))
        h = np.zeros((b, nh, seq, d))
        for t in range(seq):
            lf = _logsigmoid(f64[..., t])
            m_new = np.maximum(lf + m, i64[..., t])
            fg, ig = np.exp(lf + m - m_new), np.exp(i64[..., t] - m_new)
            kt, vt, qt = k64[..., t, :], v64[..., t, :], q64[..., t, :] / np.sqrt(d)
            c = fg[..., None, None] * c + ig[..., None, None] * kt[..., :, None] * vt[..., None, :]
            n = fg[..., None] * n + ig[..., None] * kt
            den = np.maximum(np.abs((qt * n).sum(-1)), np.exp(-m_new)) + 1e-6
            h[..., t, :] = (qt[..., :, None] * c).sum(-2) / den[..., None]
            m = m_new
        return h

    return CheckCase("mlstm", f"{b}x{nh}x{seq}x{d}", make, lambda *a: mlstm_mod.mlstm(*a, chunk_size=16), reference)


def _slstm_case(b: int, seq: int, nh: int, dh: int) -> CheckCase:
    def make(rng, dtype):
        return (_normal(rng, (b, seq, 4, nh, dh), dtype), _normal(rng, (nh, dh, 4, dh), dtype) * 0.3,
                _normal(rng, (4, nh, dh), dtype))

    def reference(wx, r, bias):
        wx64, r64, b64 = to_f64(wx), to_f64(r), to_f64(bias)
        y = np.zeros((b, nh, dh))
        c = np.zeros((b, nh, dh))
        n = np.zeros((b, nh, dh))
        m = np.zeros((b, nh, dh))
        out = np.zeros((b, seq, nh, dh))
        for t in range(seq):
            raw = wx64[:, t] + np.einsum("bhi,higj->bghj", y, r64) + b64
            i_raw, f_raw, z_raw, o_raw = raw[:, 0], raw[:, 1], raw[:, 2], raw[:, 3]
            lfm = m + _logsigmoid(f_raw)
            m_new = i_raw if t == 0 else np.maximum(i_raw, lfm)
            ig, fg = np.exp(i_raw - m_new), np.exp(lfm - m_new)
            c = fg * c + ig * np.tanh(z_raw)
            n = fg * n + ig
            y = c / n / (1.0 + np.exp(-o_raw))
            m = m_new
            out[:, t] = y
        return out

    return CheckCase("slstm", f"{b}x{seq}x{nh}x{dh}", make, slstm_mod.slstm, reference)


def _rms64(x64: np.ndarray, w64: np.ndarray) -> np.ndarray:
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5) * w64


#: the fused kernels themselves, also where the presets run the unfused sequence (NVIDIA)
_FUSED_KERNEL = {"single_kernel": True}


def _fused_linear_case(rows: int, k: int, n: int) -> CheckCase:
    def make(rng, dtype):
        return _normal(rng, (rows, k), dtype), _normal(rng, (k,), dtype), _normal(rng, (n, k), dtype)

    def reference(x, nw, w):
        return _rms64(to_f64(x), to_f64(nw)) @ to_f64(w).T

    return CheckCase("norm_linear", f"{rows}x{k}x{n}", make,
                     lambda x, nw, w: ops.fused_norm_linear(x, nw, w, eps=1e-5, knobs=_FUSED_KERNEL), reference)


def _fused_qkv_case(b: int, seq: int, heads: int, kv_heads: int, d: int) -> CheckCase:
    e = 48

    def make(rng, dtype):
        return (_normal(rng, (b, seq, e), dtype), _normal(rng, (e,), dtype),
                _normal(rng, ((heads + 2 * kv_heads) * d, e), dtype))

    def rope64(t):  # (B, H, L, D), split-half pairing, offset 0
        half = d // 2
        theta = np.arange(seq)[:, None] * 10000.0 ** (-np.arange(half) / half)[None]
        a, bb = t[..., :half], t[..., half:]
        return np.concatenate([a * np.cos(theta) - bb * np.sin(theta), a * np.sin(theta) + bb * np.cos(theta)], -1)

    def reference(x, nw, w):
        qkv = _rms64(to_f64(x), to_f64(nw)) @ to_f64(w).T
        q = qkv[..., : heads * d].reshape(b, seq, heads, d).transpose(0, 2, 1, 3)
        k = qkv[..., heads * d : (heads + kv_heads) * d].reshape(b, seq, kv_heads, d).transpose(0, 2, 1, 3)
        v = qkv[..., (heads + kv_heads) * d :].reshape(b, seq, kv_heads, d).transpose(0, 2, 1, 3)
        return np.concatenate([rope64(q), rope64(k), v], axis=1)

    def run(x, nw, w):
        q, k, v = ops.fused_norm_qkv_rope(x, nw, w, heads, kv_heads, eps=1e-5, knobs=_FUSED_KERNEL)
        return mx.concatenate([q, k, v], axis=1)

    return CheckCase("norm_qkv_rope", f"{b}x{seq}x{heads}/{kv_heads}x{d}", make, run, reference)


CASES: list[CheckCase] = [
    _rms_case(3, 100),
    _rms_case(5, 1031),
    _gemm_case("gemm_av", 2, 3, 5),
    _gemm_case("gemm_av", 33, 29, 31),
    _gemm_case("gemm_av", 1, 70, 130),
    _gemm_case("gemm_at_b", 33, 29, 31),
    _gemm_case("gemm_a_bt", 64, 48, 40),
    _gemm_case("gemm_a_bt", 8, 8, 1024),
    _linear_case(21, 40, 24),
    _layer_norm_case(5, 100),
    _layer_norm_case(3, 64, heads=4),
    _rope_case(2, 3, 7, 32),
    _attention_case(4, 2, 9, 37, 64),
    _mlstm_case(1, 2, 37, 16),
    _slstm_case(2, 9, 2, 16),
    _fused_linear_case(33, 29, 31),
    _fused_qkv_case(2, 5, 4, 2, 16),
]


def run_checks(
    cases: Sequence[CheckCase] = CASES,
    dtypes: Sequence[mx.Dtype] = DTYPES,
    seed: int = 0,
    on_result: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Run `cases` x `dtypes` on the active backend; errors become failed rows."""
    rng = np.random.default_rng(seed)
    backend = current_backend()
    results = []
    for case in cases:
        for dtype in dtypes:
            args = case.make(rng, dtype)
            start = time.perf_counter()
            try:
                out = case.run(*args)
                mx.eval(out)
                seconds = time.perf_counter() - start
                err = relative_error(out, case.reference(*args))
                msg = "" if out.dtype == dtype else f"output dtype {out.dtype}, expected {dtype}"
            except Exception as e:  # reported in the table, and the exit status fails
                seconds, err, msg = time.perf_counter() - start, float("inf"), f"{type(e).__name__}: {e}"
            r = CheckResult(case.op, case.shape, str(dtype).split(".")[-1], backend, err, TOLERANCE[dtype], seconds, msg)
            results.append(r)
            if on_result:
                on_result(r)
    return results


HEADER = f"{'op':<13} {'shape':<14} {'dtype':<9} {'backend':<9} {'rel.err':>9} {'bound':>7} {'ms':>8}  result"


def format_row(r: CheckResult) -> str:
    status = "ok" if r.ok else "FAIL" + (f" ({r.message.splitlines()[0][:120]})" if r.message else "")
    return (
        f"{r.op:<13} {r.shape:<14} {r.dtype:<9} {r.backend:<9} {r.error:>9.2e} {r.tolerance:>7.0e} "
        f"{r.seconds * 1e3:>8.1f}  {status}"
    )


def format_table(results: Sequence[CheckResult]) -> str:
    return "\n".join([HEADER, *(format_row(r) for r in results)])
