"""Norm family vs MLX, in the same run: rms_norm and layer_norm vs mx.fast.rms_norm /
mx.fast.layer_norm, multihead_layer_norm vs an mx-ops composite (reshape to heads,
mx.fast.layer_norm without affine, reshape back, * weight + bias), forward and backward
(mx.vjp of each side).

    xlstm-kernels bench --ops norm [--backend metal|emulate] [--dtypes float32,float16,bfloat16] [--quick]

`run(backend, dtypes, quick)` returns one dict per (op, shape, dtype): op, shape, dtype,
ours_ms, mlx_ms, ratio (mlx_ms / ours_ms, > 1 = ours faster), gbps, pct_roofline,
max_rel_err (vs float64 NumPy, or vs the float32 reference ops' gradients for *_vjp rows);
on a GPU also the queued and pipelined ratios (timing.throughput) and, for *_vjp rows,
ours_step_ms / mlx_step_ms / ratio_step: the VJP inside an ``mx.compile``'d function,
pipelined, as a training loop that compiles its step runs it (no per-call Python: the
eager VJP's host time, ~25-45 us a call for ours against MLX's ~5-8 on an H200 host,
scripts/probe_vjp.py, is gone there), and ours_kept_ms / mlx_kept_ms / ratio_kept: that
compiled VJP as backprop through a stack of norms runs it, each call's cotangent the last
call's dx (every dx kept referenced), the backward rows' steady state since session 23, as
the forward rows' is their chain with outputs kept. Independent pipelined calls may
overlap on the GPU, which no layer of a backward pass does, and the eager pipelined time is
the host's build and encode where that exceeds the kernels' (scripts/probe_eager_vjp.py).
GB/s counts the bytes the op must move: x read + y written + weight/bias read (forward);
x, g read + dx written + weight read + dweight/dbias written (backward); % of
`tiles.roofline()["bandwidth_gbs"]`. On the emulator there is no GPU to time: rows report
correctness and `emulated_s` (wall time of the emulated launch) only.

Design target: >= 1.0x mx.fast on Apple GPUs (not measured here: no Apple GPU in this
environment; bench/bench_ops.py runs this module on a Mac). What the design relies on:
* The same minimum traffic as MLX: the forward reads x once (rows up to 4096 stay in
  registers, N_READS = 4 contiguous elements per thread, through the reductions and the
  write) and writes y once; one launch, no extra pass. MLX's single-row kernels re-read x
  for the write (from cache), so at best this matches them and removes that L1/L2 read.
* Cheaper reductions: simd_sum, one threadgroup round trip and a simd_sum that every
  simdgroup does itself, alternating scratch arrays, so one barrier per reduction
  (MLX: two or three). LayerNorm's two-pass statistics run on registers, at no traffic.
* Short rows and heads (n <= 128, e.g. xLSTM heads) run one simdgroup per row, 8 rows per
  threadgroup, no barriers; MLX launches a 32-thread threadgroup per row, which caps the
  resident threads per core by the threadgroup limit. This is where multi-head LN gains
  most against a composite that needs reshapes plus a separate affine pass.
* Backward: one kernel computes dx and per-group partial dweight/dbias sums kept in
  registers over rpg rows, so the (groups, D) partials (float32, or bfloat16 for 16-bit
  rows) stay near 2 MiB; MLX's VJP
  writes a per-row g * xhat matrix of x's size and reduces it. Expect the largest
  ratios there.
Risks on hardware: the looped variant (rows > 4096) re-reads x 2-4 times from cache, as
MLX does; small rows are launch-bound for both sides.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from xlstm_kernels.benchmarks.kind import bench_kind
from xlstm_kernels import runtime, tiles
from xlstm_kernels.benchmarks.timing import (chained_repeats, marginal_fields, measure_chained_pair,
                                             measure_marginal_pair, measure_pipelined_pair, throughput)
from xlstm_kernels.ops import norm as norm_ops

EPS = 1e-5
# (op, rows, d, num_heads)
METAL_CASES = [
    ("rms_norm", 1, 4096, 1),
    ("rms_norm", 4096, 4096, 1),
    ("rms_norm", 16384, 1024, 1),
    ("rms_norm", 2048, 8192, 1),
    ("rms_norm", 16384, 4096, 1),  # 256 MiB in fp32: bandwidth-bound for both sides
    ("layer_norm", 4096, 4096, 1),
    ("layer_norm", 16384, 1024, 1),
    ("layer_norm", 2048, 8192, 1),
    ("layer_norm", 16384, 4096, 1),
    ("multihead_layer_norm", 8192, 4 * 64, 4),
    ("multihead_layer_norm", 4096, 8 * 512, 8),
]
METAL_QUICK = [METAL_CASES[1], METAL_CASES[4], METAL_CASES[7], METAL_CASES[8]]
EMULATE_CASES = [
    ("rms_norm", 8, 100, 1),
    ("rms_norm", 4, 1031, 1),
    ("rms_norm", 2, 4097, 1),
    ("layer_norm", 8, 100, 1),
    ("layer_norm", 4, 1031, 1),
    ("layer_norm", 2, 4097, 1),
    ("multihead_layer_norm", 6, 4 * 48, 4),
]
EMULATE_QUICK = [EMULATE_CASES[1], EMULATE_CASES[4], EMULATE_CASES[6]]


def _ours(op, x, w, b, nh):
    if op == "rms_norm":
        return norm_ops.rms_norm(x, w, EPS)
    if op == "layer_norm":
        return norm_ops.layer_norm(x, w, b, EPS)
    return norm_ops.multihead_layer_norm(x, w, b, nh, EPS)


def _mlx(op, x, w, b, nh):
    if op == "rms_norm":
        return mx.fast.rms_norm(x, w, EPS)
    if op == "layer_norm":
        return mx.fast.layer_norm(x, w, b, EPS)
    shape = x.shape
    y = mx.fast.layer_norm(x.reshape(*shape[:-1], nh, shape[-1] // nh), None, None, EPS).reshape(shape)
    return y * w + b


def _ref64(op, x, w, b, nh):
    x = np.asarray(x.astype(mx.float32), dtype=np.float64)
    w = np.asarray(w.astype(mx.float32), dtype=np.float64)
    if op == "rms_norm":
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
    b = np.asarray(b.astype(mx.float32), dtype=np.float64)
    xh = x.reshape(*x.shape[:-1], nh, x.shape[-1] // nh)
    mean = xh.mean(-1, keepdims=True)
    y = ((xh - mean) / np.sqrt(((xh - mean) ** 2).mean(-1, keepdims=True) + EPS)).reshape(x.shape)
    return y * w + b


def _rel(out, ref) -> float:
    out = np.asarray(out.astype(mx.float32), dtype=np.float64)
    ref = np.asarray(ref.astype(mx.float32), dtype=np.float64) if isinstance(ref, mx.array) else ref
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _timed(fn, repeats: int) -> float:
    mx.eval(fn())  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _vjp_fn(fwd, op, x, w, b, nh, cot):
    args = [x, w] if op == "rms_norm" else [x, w, b]

    def f(*a):
        return fwd(op, a[0], a[1], a[2] if len(a) > 2 else None, nh)

    return lambda: mx.vjp(f, args, [cot])[1]


def _vjp_step_fn(fwd, op, x, w, b, nh, cot):
    """The VJP inside an ``mx.compile``'d function, as a compiled training step runs it (no
    per-call Python): what a training loop that compiles its step pays per backward."""
    args = [x, w] if op == "rms_norm" else [x, w, b]

    def f(*a):
        return fwd(op, a[0], a[1], a[2] if len(a) > 2 else None, nh)

    step = mx.compile(lambda *a: mx.vjp(f, list(a[:-1]), [a[-1]])[1])
    return lambda: step(*args, cot)


def _vjp_chain_fn(fwd, op, x, w, b, nh):
    """g -> dx: the VJP at (x, w, b) for cotangent g inside ``mx.compile``, one layer of a
    backward pass through a stack of norms (the next layer's cotangent is this dx). Chained
    (``timing.measure_chained``), no two backward kernels overlap, as in backprop, where
    independent pipelined calls (``ratio_pipelined``, ``ratio_step``) may overlap on the GPU."""
    args = [x, w] if op == "rms_norm" else [x, w, b]

    def f(*a):
        return fwd(op, a[0], a[1], a[2] if len(a) > 2 else None, nh)

    step = mx.compile(lambda *a: mx.vjp(f, list(a[:-1]), [a[-1]])[1][0])
    return lambda g: step(*args, g)


def _bench_case(op, rows, d, nh, dtype, emulated, repeats, roof, rng) -> list[dict]:
    x = mx.array(rng.standard_normal((rows, d)).astype(np.float32)).astype(dtype)
    w = mx.array(rng.standard_normal((d,)).astype(np.float32)).astype(dtype)
    b = mx.array(rng.standard_normal((d,)).astype(np.float32)).astype(dtype)
    cot = mx.array(rng.standard_normal((rows, d)).astype(np.float32)).astype(dtype)
    item = x.itemsize
    nparams = 1 if op == "rms_norm" else 2
    fwd_bytes = 2 * rows * d * item + nparams * d * item
    bwd_bytes = 3 * rows * d * item + d * item + nparams * d * item
    dtype_name = str(dtype).split(".")[-1]
    base = {"shape": [rows, d] if nh == 1 else [rows, nh, d // nh], "dtype": dtype_name}
    out = []

    fwd = lambda: _ours(op, x, w, b, nh)  # noqa: E731
    bwd = _vjp_fn(_ours, op, x, w, b, nh, cot)
    fwd_err = _rel(fwd(), _ref64(op, x, w, b, nh))
    got = bwd()
    with runtime.use_backend("reference"):
        f32 = [a.astype(mx.float32) for a in (x, w, b)]
        want = _vjp_fn(_ours, op, *f32, nh, cot.astype(mx.float32))()
    bwd_err = max(_rel(g, r) for g, r in zip(got, want))

    for name, fn, mlx_fn, nbytes, err in (
        (op, fwd, lambda: _mlx(op, x, w, b, nh), fwd_bytes, fwd_err),
        (op + "_vjp", bwd, _vjp_fn(_mlx, op, x, w, b, nh, cot), bwd_bytes, bwd_err),
    ):
        row = {"op": name, **base, "max_rel_err": err}
        if emulated:
            t0 = time.perf_counter()
            mx.eval(fn())
            row["emulated_s"] = time.perf_counter() - t0
            print(f"{name:<26} {dtype_name:<9} {str(row['shape']):<18} emulated {row['emulated_s']:8.3f} s  err {err:.1e}")
        else:
            t_ours = _timed(fn, repeats)
            t_mlx = _timed(mlx_fn, repeats)
            tp = throughput(fn, mlx_fn, repeats=repeats)  # queued and pipelined (a model's steady state)
            step = ""
            if name.endswith("_vjp"):  # and inside a compiled training step, pipelined
                n = max(3, repeats // 4)
                s_ours, s_mlx = measure_pipelined_pair(_vjp_step_fn(_ours, op, x, w, b, nh, cot),
                                                       _vjp_step_fn(_mlx, op, x, w, b, nh, cot), calls=20, repeats=n)
                tp.update({"ours_step_ms": s_ours * 1e3, "mlx_step_ms": s_mlx * 1e3, "ratio_step": s_mlx / s_ours})
                # and as backprop through a stack of norms runs it: compiled, each call's
                # cotangent the last call's dx, every dx kept referenced (the steady state)
                chain_ours, chain_mlx = _vjp_chain_fn(_ours, op, x, w, b, nh), _vjp_chain_fn(_mlx, op, x, w, b, nh)
                k_ours, k_mlx = measure_chained_pair(chain_ours, chain_mlx, cot,
                                                     repeats=chained_repeats(repeats), keep=True)
                tp.update({"ours_kept_ms": k_ours * 1e3, "mlx_kept_ms": k_mlx * 1e3, "ratio_kept": k_mlx / k_ours,
                           "gbps_kept": nbytes / k_ours / 1e9})
                # the same chain in its steady state (the host encoding ahead of the GPU)
                tp.update(marginal_fields(*measure_marginal_pair(chain_ours, chain_mlx, cot,
                                                                 repeats=chained_repeats(repeats), keep=True), nbytes,
                                          keep=True))
                step = (f"  step x{s_mlx / s_ours:5.2f}  backprop x{k_mlx / k_ours:5.2f}"
                        f"  marginal x{tp['ratio_marginal']:5.2f}")
            else:  # chained: each call normalises the last one's output (a layer stack's shape)
                n = chained_repeats(repeats)
                step_ours, step_mlx = (lambda y: _ours(op, y, w, b, nh)), (lambda y: _mlx(op, y, w, b, nh))
                c_ours, c_mlx = measure_chained_pair(step_ours, step_mlx, x, repeats=n)
                # and with every output kept referenced (a residual stream: no buffer donation)
                k_ours, k_mlx = measure_chained_pair(step_ours, step_mlx, x, repeats=n, keep=True)
                tp.update({"ours_chained_ms": c_ours * 1e3, "mlx_chained_ms": c_mlx * 1e3,
                           "ratio_chained": c_mlx / c_ours, "gbps_chained": nbytes / c_ours / 1e9,
                           "ours_kept_ms": k_ours * 1e3, "mlx_kept_ms": k_mlx * 1e3, "ratio_kept": k_mlx / k_ours,
                           "gbps_kept": nbytes / k_ours / 1e9})
                # the kept chain in its steady state (the host encoding ahead of the GPU)
                tp.update(marginal_fields(*measure_marginal_pair(step_ours, step_mlx, x, repeats=n, keep=True), nbytes,
                                          keep=True))
                step = (f"  chained x{c_mlx / c_ours:5.2f}  kept x{k_mlx / k_ours:5.2f}"
                        f"  marginal x{tp['ratio_marginal']:5.2f}")
            gbps = nbytes / t_ours / 1e9
            row.update({
                "ours_ms": t_ours * 1e3, "mlx_ms": t_mlx * 1e3, "ratio": t_mlx / t_ours, "gbps": gbps,
                "pct_roofline": 100.0 * gbps / roof["bandwidth_gbs"], **tp,
                "gbps_queued": nbytes / tp["ours_queued_ms"] / 1e6,
                "gbps_pipelined": nbytes / tp["ours_pipelined_ms"] / 1e6,
            })
            print(f"{name:<26} {dtype_name:<9} {str(row['shape']):<18} {row['ours_ms']:8.3f} ms "
                  f"{row['mlx_ms']:8.3f} ms  x{row['ratio']:5.2f} {gbps:8.1f} GB/s "
                  f"{row['pct_roofline']:5.1f}%  queued x{row['ratio_queued']:5.2f} "
                  f"{row['gbps_queued']:8.1f} GB/s  pipelined x{row['ratio_pipelined']:5.2f} "
                  f"{row['gbps_pipelined']:8.1f} GB/s{step}  err {err:.1e}")
        out.append(row)
    return out


def run(backend: str, dtypes: list, quick: bool) -> list[dict]:
    """Benchmark rows for `backend` ("metal" or "emulate") and `dtypes` (mx dtypes or names)."""
    emulated = backend == "emulate"
    if bench_kind(backend) != "gpu":  # the emulator, or reference ops on a CPU: small cases
        cases = EMULATE_QUICK if quick else EMULATE_CASES
    else:
        cases = METAL_QUICK if quick else METAL_CASES
    repeats = 5 if quick else 20
    roof = tiles.roofline()
    rng = np.random.default_rng(0)
    rows = []
    with runtime.use_backend(backend):
        for dtype in dtypes:
            dtype = getattr(mx, dtype) if isinstance(dtype, str) else dtype
            for op, r, d, nh in cases:
                rows.extend(_bench_case(op, r, d, nh, dtype, emulated, repeats, roof, rng))
    return rows
