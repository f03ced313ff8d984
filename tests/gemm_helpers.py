"""Helpers for tests/test_gemm.py: inputs, float64 references, tolerances, launch spy.

Notation as in ``metal_src/gemm.metal``: the output has M rows and N columns and the
reduction runs over K, whatever the op's operand layout.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from launch_spies import spy_prepared_launches
from xlstm_kernels.ops import gemm as gemm_mod
from xlstm_kernels.tiles import GemmConfig

OPS = ("gemm_av", "gemm_at_b", "gemm_a_bt")
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
ACTIVATIONS = (None, "relu", "gelu", "gelu_approx", "silu")
ACT_CODE = {None: 0, "none": 0, "relu": 1, "gelu": 2, "gelu_approx": 3, "silu": 4}
OP_FN = {"gemm_av": gemm_mod.gemm_av, "gemm_at_b": gemm_mod.gemm_at_b, "gemm_a_bt": gemm_mod.gemm_a_bt}


# ---------------------------------------------------------------------------------------
# Inputs and references
# ---------------------------------------------------------------------------------------


def seed_of(*parts: Any) -> int:
    """A fixed seed derived from the test's parameters (stable across runs and processes)."""
    return zlib.crc32(repr(parts).encode())


def rand(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> mx.array:
    """Fresh standard-normal data in `dtype`, no zeros: values under 1e-4 in magnitude
    (which float16 may round to 0) become 0.5 before scaling."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[np.abs(x) < 1e-4] = 0.5
    x *= scale
    out = mx.array(x).astype(dtype)
    assert x.size == 0 or np.all(f64(out) != 0), "an input rounded to zero"
    return out


def f64(x: mx.array) -> np.ndarray:
    """An mx array's values (as stored in its dtype) in float64."""
    return np.asarray(x.astype(mx.float32)).astype(np.float64)


def operand_shapes(op: str, m: int, n: int, k: int, lead_a=(), lead_b=()) -> tuple[tuple, tuple]:
    """The two operand shapes of `op` for an M x N output and reduction K."""
    if op == "gemm_av":  # a (m, K) v (K, n)
        return (*lead_a, m, k), (*lead_b, k, n)
    if op == "gemm_at_b":  # a (K, m) b (K, n)
        return (*lead_a, k, m), (*lead_b, k, n)
    return (*lead_a, m, k), (*lead_b, n, k)  # gemm_a_bt: a (m, K) b (n, K)


def operands(op, m, n, k, dtype, seed, lead_a=(), lead_b=()):
    rng = np.random.default_rng(seed)
    sa, sb = operand_shapes(op, m, n, k, lead_a, lead_b)
    return rand(rng, sa, dtype), rand(rng, sb, dtype)


def np_product(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float64 op(a, b) with NumPy matmul broadcasting."""
    if op == "gemm_at_b":
        a = np.swapaxes(a, -1, -2)
    if op == "gemm_a_bt":
        b = np.swapaxes(b, -1, -2)
    return np.matmul(a, b)


_erf = np.vectorize(math.erf, otypes=[np.float64])


def np_activation(x: np.ndarray, act: str | None) -> np.ndarray:
    if act in (None, "none"):
        return x
    if act == "relu":
        return np.maximum(x, 0.0)
    if act == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if act == "gelu_approx":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if act == "silu":
        return x / (1.0 + np.exp(-x))
    raise ValueError(act)


def np_reference(op, a, b, bias=None, act=None, residual=None) -> np.ndarray:
    """float64 reference of the fused op from the (already dtype-rounded) inputs."""
    out = np_product(op, f64(a), f64(b))
    if bias is not None:
        out = out + f64(bias)
    out = np_activation(out, act)
    if residual is not None:
        out = out + f64(residual)
    return out


# ---------------------------------------------------------------------------------------
# Tolerances
# ---------------------------------------------------------------------------------------


def tolerance(dtype, k: int) -> float:
    """max|out - ref| / max|ref| bound: 1e-5 fp32, 1e-2 fp16/bf16, 2e-2 bf16 with K >= 256."""
    if dtype == mx.float32:
        return 1e-5
    if dtype == mx.bfloat16 and k >= 256:
        return 2e-2
    return 1e-2


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    diff = float(np.max(np.abs(out - ref))) if ref.size else 0.0
    return diff / scale if scale > 0 else diff


def assert_close(out: mx.array, ref: np.ndarray, dtype, k: int, what: str = "", tol: float | None = None) -> float:
    """Shape, dtype, finiteness and relative error of `out` against the float64 `ref`."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == dtype, f"{what}: dtype {out.dtype} != {dtype}"
    got = f64(out)
    assert np.all(np.isfinite(got)), f"{what}: non-finite values in the output"
    assert ref.size == 0 or np.max(np.abs(ref)) > 0, f"{what}: degenerate all-zero reference"
    tol = tolerance(dtype, k) if tol is None else tol
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e} (dtype {dtype}, K={k})"
    return err


# ---------------------------------------------------------------------------------------
# Configs and shapes
# ---------------------------------------------------------------------------------------


def tile_dims(cfg: GemmConfig) -> tuple[int, int, int]:
    """(tile rows, tile cols, tile depth) of the path `cfg` runs."""
    if cfg.path == "scalar":
        return cfg.tm, cfg.tn, cfg.tk
    if cfg.path == "simd":
        return cfg.bm, cfg.bn, cfg.bk
    return 1, cfg.gemv_threads // 32, 32  # gemv: one row, ROWS columns per threadgroup, 32 lanes over K


def spanning_shape(cfg: GemmConfig, extra=(3, 5, 7), k_tiles: int = 2) -> tuple[int, int, int]:
    """(M, N, K) covering >= 2 tiles in M and N and `k_tiles`+ tiles in K, last ones partial."""
    tm, tn, tk = tile_dims(cfg)
    return tm + extra[0], tn + extra[1], k_tiles * tk + extra[2]


# ---------------------------------------------------------------------------------------
# What the ops launch
# ---------------------------------------------------------------------------------------


@dataclass
class Launch:
    kernel: str
    grid: tuple
    threadgroup: tuple
    template: dict
    kwargs: dict = field(repr=False)
    spec: Any = field(repr=False)


class LaunchSpy:
    """Records every kernel launch of xlstm_kernels.ops.gemm (and still runs it)."""

    def __init__(self, monkeypatch):
        self.calls: list[Launch] = []
        def record(spec, kwargs):
            tmpl = dict(kwargs.get("template") or [])
            self.calls.append(Launch(spec.kernel, tuple(kwargs["grid"]), tuple(kwargs["threadgroup"]), tmpl,
                                     kwargs, spec))

        spy_prepared_launches(monkeypatch, gemm_mod, record)  # the op prepares once, then runs per call

    def clear(self) -> None:
        self.calls.clear()

    def kernels(self) -> list[str]:
        return [c.kernel for c in self.calls]

    def only(self, kernel: str | None = None) -> Launch:
        assert len(self.calls) == 1, f"expected one launch, got {self.calls}"
        if kernel is not None:
            assert self.calls[0].kernel == kernel, self.calls
        return self.calls[0]


# ---------------------------------------------------------------------------------------
# The raw kernel calls of one op (a reproduction of _kernel_gemm for 2-D operands)
# ---------------------------------------------------------------------------------------


def raw_calls(op: str, a: mx.array, b: mx.array, cfg: GemmConfig, bias=None, act: int = 0, residual=None,
              backend: str = "emulate"):
    """[(spec, kwargs)] for the kernel launches gemm.<op>(a, b) makes with config `cfg`
    (2-D operands, one batch), as ``xlstm_kernels.ops.gemm._kernel_gemm`` builds them on
    `backend` (whose budget picks the simd kernel's STAGES when ``cfg.stages`` is 0), with
    the simd launch's ``shared_memory`` (cuda's dynamic buffer; the emulator's limit).

    For split-K the reduce call's `inputs[0]` is None: it is the partial-sum output of
    the first call.
    """
    trans_a, trans_b = op == "gemm_at_b", op == "gemm_a_bt"
    if op == "gemm_av":
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
    elif op == "gemm_at_b":
        k, m, n = a.shape[0], a.shape[1], b.shape[1]
    else:
        m, k, n = a.shape[0], a.shape[1], b.shape[0]
    dtype = a.dtype
    bias_in = bias.astype(dtype) if bias is not None else mx.zeros((1,), dtype=dtype)
    res_in = residual.astype(dtype) if residual is not None else mx.zeros((1,), dtype=dtype)
    epilogue = [("HAS_BIAS", bias is not None), ("ACT", act), ("HAS_RES", residual is not None)]
    split = cfg.split_k if cfg.path == "simd" else 1
    kps = -(-k // split) if split > 1 else k
    params = mx.array([m, n, k, m * k, k * n, kps, split, 1], dtype=mx.int64)
    inputs = [a, b, bias_in, res_in, params]
    if cfg.path == "gemv":
        assert m == 1
        rows = cfg.gemv_threads // 32
        # a row-major B takes column blocks of COLS threads x one 16-byte run (COLS > 0)
        cols = cfg.gemv_cols(n, dtype, trans_b)  # (N, K) rows: columns a simdgroup; else column blocks
        per_group = rows * cols if trans_b else cols * min(8, 16 // dtype.size)
        return [(gemm_mod.GEMV, dict(
            inputs=inputs, output_shapes=[(1, n)], output_dtypes=[dtype],
            grid=(32, rows * -(-n // per_group), 1), threadgroup=(32, rows, 1),
            template=[("T", dtype), ("ROWS", rows), ("TRANS_B", trans_b), *epilogue, ("COLS", cols)],
        ))]
    if cfg.path == "simd":
        calls = [(gemm_mod.SIMD, dict(
            inputs=inputs,
            output_shapes=[(m, n) if split == 1 else (1,), (split, 1, m, n) if split > 1 else (1,)],
            output_dtypes=[dtype, mx.float32],
            grid=(32 * cfg.wn * -(-n // cfg.bn), cfg.wm * -(-m // cfg.bm), split),
            threadgroup=(32 * cfg.wn, cfg.wm, 1),
            template=[("T", dtype), ("BM", cfg.bm), ("BN", cfg.bn), ("BK", cfg.bk), ("WM", cfg.wm), ("WN", cfg.wn),
                      ("STAGES", cfg.simd_stages(dtype, trans_a, trans_b, backend)),
                      ("TRANS_A", trans_a), ("TRANS_B", trans_b), *epilogue, ("SPLIT", split),
                      ("WG", cfg.uses_warpgroup(dtype))],
            shared_memory=cfg.simd_threadgroup_bytes(dtype, trans_a, trans_b, backend),
        ))]
        if split > 1:
            total = m * n
            calls.append((gemm_mod.SPLIT_REDUCE, dict(
                inputs=[None, bias_in, res_in, params], output_shapes=[(m, n)], output_dtypes=[dtype],
                grid=(total, 1, 1), threadgroup=(min(256, total), 1, 1),
                template=[("T", dtype), *epilogue],
            )))
        return calls
    rt, ct = cfg.tm // cfg.rm, cfg.tn // cfg.rn
    return [(gemm_mod.SCALAR, dict(
        inputs=inputs, output_shapes=[(m, n)], output_dtypes=[dtype],
        grid=(ct * -(-n // cfg.tn), rt * -(-m // cfg.tm), 1), threadgroup=(ct, rt, 1),
        template=[("T", dtype), ("TM", cfg.tm), ("TN", cfg.tn), ("TK", cfg.tk), ("RM", cfg.rm), ("RN", cfg.rn),
                  ("PAD", cfg.pad), ("DB", cfg.double_buffer), ("VEC4", cfg.vec4),
                  ("TRANS_A", trans_a), ("TRANS_B", trans_b), *epilogue],
    ))]


def same_launch(recorded: Launch, spec, kwargs) -> None:
    """Assert that a recorded op launch equals a reproduced raw call (arrays by value)."""
    assert recorded.spec == spec, (recorded.spec, spec)
    rk = recorded.kwargs
    assert [tuple(s) for s in rk["output_shapes"]] == [tuple(s) for s in kwargs["output_shapes"]]
    assert tuple(rk["grid"]) == tuple(kwargs["grid"]), (rk["grid"], kwargs["grid"])
    assert tuple(rk["threadgroup"]) == tuple(kwargs["threadgroup"]), (rk["threadgroup"], kwargs["threadgroup"])
    assert list(rk["output_dtypes"]) == list(kwargs["output_dtypes"])
    assert list(rk["template"]) == list(kwargs["template"]), (rk["template"], kwargs["template"])
    assert rk.get("init_value") == kwargs.get("init_value")
    assert len(rk["inputs"]) == len(kwargs["inputs"])
    for x, y in zip(rk["inputs"], kwargs["inputs"]):
        if y is None:  # the partial sums of the split-K pass
            continue
        assert x.shape == y.shape and x.dtype == y.dtype
        assert np.array_equal(np.asarray(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x),
                              np.asarray(y.astype(mx.float32) if y.dtype == mx.bfloat16 else y))
