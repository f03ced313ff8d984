"""sLSTM: the fused sequence kernel vs a per-step mx-ops loop, in the same run.

    xlstm-kernels bench --ops slstm [--backend metal|emulate] [--dtypes float32,float16,bfloat16] [--quick]

``run(backend, dtypes, quick)`` returns one row per (op, shape, dtype):

* ``slstm``: forward over the whole sequence (one dispatch of ``slstm_fwd``) vs
  :func:`xlstm_kernels.ops.slstm.slstm_reference` (the per-step loop: one batched
  matmul plus ~15 elementwise ops per step, all dispatched by MLX).
* ``slstm_grad`` (S <= 1024): forward + backward (recompute forward with SAVE,
  ``slstm_bwd``, one matmul for dR) vs ``mx.grad`` of the reference loop.

Shapes on Metal: S in (512, 1024, 2048, 4096), (B, NH) in ((2, 4), (8, 4)) so B*NH is 8
or 32 threadgroups, DH in (64, 128, 256). ``quick`` keeps S = 512, B*NH = 8, DH = 64.
On the emulator only tiny shapes run and the rows carry correctness (max relative
error vs a float64 NumPy loop) and ``emulated_s``, no GPU timing.

Design target on Apple GPUs: the fused kernel >= 10x the per-step loop. What it relies
on: (1) one dispatch for the whole sequence instead of ~16 dispatches per step, so the
loop's cost per step is a threadgroup barrier plus a log2(K) simd_shuffle_xor butterfly
instead of kernel launches and DRAM round-trips of the (B, NH, DH) states; (2) y_{t-1}
stays in threadgroup memory and c, n, m in registers for the whole sequence; (3) for
DH <= 64 each thread keeps its 32 entries of R in registers, so a step touches no
device memory except the 4 gate inputs (prefetched one step ahead) and the y store;
(4) for DH = 128/256 R (256 KiB / 1 MiB per head in float32) streams from the GPU caches
every step: that is the expected weak spot (cache bandwidth bound, B-fold redundant
across the batch), where the ratio is expected to drop towards a few x; a
head-per-threadgroup variant that shares R across the batch is the next step there.
``gbps`` counts compulsory DRAM traffic (wx, y, R once, states) and is far below the
roofline by nature: the recurrence is latency bound.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from xlstm_kernels.benchmarks.kind import bench_kind
from xlstm_kernels import runtime, tiles
from xlstm_kernels.ops import slstm as sl

METAL_S = (512, 1024, 2048, 4096)
METAL_BNH = ((2, 4), (8, 4))
METAL_DH = (64, 128, 256)
EMULATE_SHAPES = ((2, 9, 3, 16), (2, 17, 2, 64))  # (B, S, NH, DH)
GRAD_MAX_S = 1024


def _timed(fn, repeats: int) -> float:
    mx.eval(fn())  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _inputs(bsz, s, nh, dh, dtype, rng):
    wx = mx.array(rng.standard_normal((bsz, s, 4, nh, dh)).astype(np.float32)).astype(dtype)
    r = mx.array((rng.standard_normal((nh, dh, 4, dh)) / np.sqrt(dh)).astype(np.float32)).astype(dtype)
    b = mx.array((0.5 * rng.standard_normal((4, nh, dh))).astype(np.float32)).astype(dtype)
    return wx, r, b


def _np_forward(wx, r, b) -> np.ndarray:
    """float64 loop from the zero state (ground truth for max_rel_err)."""
    wx, r, b = (np.asarray(a.astype(mx.float32), dtype=np.float64) for a in (wx, r, b))
    bsz, s, _, nh, dh = wx.shape
    y, c, n, m = (np.zeros((bsz, nh, dh)) for _ in range(4))
    ys = []
    for t in range(s):
        raw = wx[:, t] + np.einsum("bhi,higj->bghj", y, r) + b
        ir, fr, zr, orr = raw[:, 0], raw[:, 1], raw[:, 2], raw[:, 3]
        empty = n == 0
        lfm = m - np.logaddexp(0.0, -fr)
        mt = np.where(empty, ir, np.maximum(ir, lfm))
        fg = np.where(empty, 0.0, np.exp(np.where(empty, 0.0, lfm - mt)))
        ig = np.exp(ir - mt)
        c = fg * c + ig * np.tanh(zr)
        n = fg * n + ig
        m = mt
        y = 0.5 * (1.0 + np.tanh(0.5 * orr)) * c / n
        ys.append(y)
    return np.stack(ys, axis=1)


def _rel(out: mx.array, ref: np.ndarray) -> float:
    o = np.asarray(out.astype(mx.float32), dtype=np.float64)
    return float(np.max(np.abs(o - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _bytes(bsz, s, nh, dh, dtype) -> int:
    item = 2 if dtype in (mx.float16, mx.bfloat16) else 4
    return item * (bsz * s * 4 * nh * dh + bsz * s * nh * dh + nh * dh * 4 * dh) + 4 * 8 * bsz * nh * dh


def _grad_bytes(bsz, s, nh, dh, dtype) -> int:
    """Compulsory traffic of the gradient: wx read and dwx written, dy read, r read and dr
    written, and the forward's float32 states (y, c, n, m per step) read back."""
    item = 2 if dtype in (mx.float16, mx.bfloat16) else 4
    return item * (2 * bsz * s * 4 * nh * dh + bsz * s * nh * dh + 2 * nh * dh * 4 * dh) + 4 * 4 * bsz * s * nh * dh


def _grad_tolerance(dtype, s: int) -> float:
    """Bound on kernel-vs-reference gradient differences: both sides are float32 (or the
    low-precision dtype) evaluations of an S-step recurrence, whose rounding differences
    grow with S; tests/test_slstm.py uses 1e-4 (float32) for S <= 64."""
    if dtype in (mx.float16, mx.bfloat16):
        return 3e-2
    return 1e-4 * max(1.0, s / 64)


def _row(op, shape, dtype, **kw) -> dict:
    row = {"op": op, "shape": list(shape), "dtype": str(dtype).split(".")[-1], "ours_ms": None, "mlx_ms": None,
           "ratio": None, "gbps": None, "pct_roofline": None, "max_rel_err": None}
    row.update(kw)
    return row


def run(backend: str, dtypes: list, quick: bool) -> list[dict]:
    """Benchmark rows for the sLSTM ops on `backend` ("metal" or "emulate")."""
    emulated = backend == "emulate"
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    with runtime.use_backend(backend):
        if emulated:
            shapes = EMULATE_SHAPES[:1] if quick else EMULATE_SHAPES
            for (bsz, s, nh, dh) in shapes:
                for dtype in dtypes:
                    wx, r, b = _inputs(bsz, s, nh, dh, dtype, rng)
                    mx.eval(sl.slstm(wx[:, :1], r, b))  # builds the kernel outside the timing
                    t0 = time.perf_counter()
                    y = sl.slstm(wx, r, b)
                    mx.eval(y)
                    dt = time.perf_counter() - t0
                    err = _rel(y, _np_forward(wx, r, b))
                    cfg = sl.plan(dh, dtype)
                    rows.append(_row("slstm", (bsz, s, nh, dh), dtype, max_rel_err=err, emulated_s=dt,
                                     threads_per_unit=cfg.threads_per_unit, r_in_registers=cfg.r_in_registers))
                    # gradient correctness vs autodiff of the reference loop
                    w = mx.array(rng.standard_normal((bsz, s, nh, dh)).astype(np.float32))
                    t0 = time.perf_counter()
                    g = mx.grad(lambda x, rr, bb: (sl.slstm(x, rr, bb).astype(mx.float32) * w).sum(),
                                argnums=(0, 1, 2))(wx, r, b)
                    mx.eval(g)
                    dt = time.perf_counter() - t0
                    g_ref = mx.grad(lambda x, rr, bb: (sl.slstm_reference(x, rr, bb).astype(mx.float32) * w).sum(),
                                    argnums=(0, 1, 2))(wx, r, b)
                    err = max(_rel(a, np.asarray(c.astype(mx.float32), dtype=np.float64)) for a, c in zip(g, g_ref))
                    rows.append(_row("slstm_grad", (bsz, s, nh, dh), dtype, max_rel_err=err, emulated_s=dt))
            return rows

        roof = tiles.roofline()
        repeats = 3 if quick else 5
        s_list = METAL_S[:1] if quick else METAL_S
        bnh_list = METAL_BNH[:1] if quick else METAL_BNH
        dh_list = METAL_DH[:1] if quick else METAL_DH
        if bench_kind(backend) == "cpu":  # reference ops on a CPU: the emulator's sizes
            s_list, bnh_list, dh_list = [EMULATE_SHAPES[0][1]], [EMULATE_SHAPES[0][::2]], [EMULATE_SHAPES[0][3]]
        for dh in dh_list:
            for (bsz, nh) in bnh_list:
                for s in s_list:
                    for dtype in dtypes:
                        wx, r, b = _inputs(bsz, s, nh, dh, dtype, rng)
                        ours = _timed(lambda: sl.slstm(wx, r, b), repeats)
                        base = _timed(lambda: sl.slstm_reference(wx, r, b), repeats)
                        err = _rel(sl.slstm(wx, r, b), _np_forward(wx, r, b)) if s <= 1024 else None
                        gbps = _bytes(bsz, s, nh, dh, dtype) / ours / 1e9
                        cfg = sl.plan(dh, dtype)
                        rows.append(_row(
                            "slstm", (bsz, s, nh, dh), dtype, ours_ms=ours * 1e3, mlx_ms=base * 1e3,
                            ratio=base / ours, gbps=gbps, pct_roofline=100 * gbps / roof["bandwidth_gbs"],
                            max_rel_err=err, threads_per_unit=cfg.threads_per_unit,
                            r_in_registers=cfg.r_in_registers,
                        ))
                        if s <= GRAD_MAX_S:
                            w = mx.array(rng.standard_normal((bsz, s, nh, dh)).astype(np.float32))
                            gk = mx.grad(lambda x, rr, bb: (sl.slstm(x, rr, bb).astype(mx.float32) * w).sum(),
                                         argnums=(0, 1, 2))
                            gr = mx.grad(lambda x, rr, bb: (sl.slstm_reference(x, rr, bb).astype(mx.float32) * w).sum(),
                                         argnums=(0, 1, 2))
                            ours_g = _timed(lambda: gk(wx, r, b), repeats)
                            base_g = _timed(lambda: gr(wx, r, b), repeats)
                            err_g = max(_rel(a, np.asarray(c.astype(mx.float32), dtype=np.float64))
                                        for a, c in zip(gk(wx, r, b), gr(wx, r, b)))
                            gbps_g = _grad_bytes(bsz, s, nh, dh, dtype) / ours_g / 1e9
                            rows.append(_row("slstm_grad", (bsz, s, nh, dh), dtype, ours_ms=ours_g * 1e3,
                                             mlx_ms=base_g * 1e3, ratio=base_g / ours_g, max_rel_err=err_g,
                                             gbps=gbps_g, pct_roofline=100 * gbps_g / roof["bandwidth_gbs"],
                                             tolerance=_grad_tolerance(dtype, s)))
                        print(_fmt(rows[-1] if rows[-1]["op"] == "slstm" else rows[-2]), flush=True)
    return rows


def _fmt(row: dict) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    return (f"{row['op']:<11} {str(row['shape']):<20} {row['dtype']:<9} {f(row['ours_ms'], '10.3f')} "
            f"{f(row['mlx_ms'], '10.3f')} {f(row['ratio'], '7.1f')} {f(row['max_rel_err'], '9.1e')}"
            + (f" emulated {row['emulated_s']:.2f}s" if "emulated_s" in row else ""))
