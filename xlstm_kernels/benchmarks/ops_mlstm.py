"""mLSTM family (``xlstm_kernels.ops.mlstm``) vs the same chunkwise math in mx ops, in one run.

    xlstm-kernels bench --ops mlstm [--backend metal|emulate] [--dtypes float32,float16,bfloat16]
                              [--quick] [--out bench/results/mlstm-<backend>.json]

``run(backend, dtypes, quick)`` returns one dict per (case, dtype):

* ``op="mlstm_chunkwise"``: ``mlstm(q, k, v, i, f)`` as users call it (state kernel +
  output kernel; the chunk size from the ``chunk_size`` knob: the device's preset, else 64;
  ``chunk`` in the row) against ``mlstm_chunkwise_mx`` (the identical chunkwise algorithm
  written with mx ops: batched matmuls for the intra-chunk part, a Python loop of mx ops
  over the chunks for the states) at chunk 64 (``mlx_chunk``; a smaller chunk only adds
  iterations to its Python loop). ``mlx_ms`` is that composite as is; ``mlx_compiled_ms``
  the same under ``mx.compile`` (elementwise ops fused by MLX). ``ratio = mlx_ms / ours_ms``.
* ``op="mlstm_step"``: one decoding step, the fused step kernel against
  ``mlstm_step_reference`` (mx ops).

Columns: op, shape [B, NH, S, DH] (DHQK = DHV = DH), dtype, ours_ms, mlx_ms, ratio, tflops
(the chunkwise FLOP count below), pct_roofline (of ``tiles.roofline()`` for the dtype),
max_rel_err. The error reference is the float64 chunkwise composite on the CPU (MLX has
float64 on the CPU only; its exp is float32-accurate, which is far below the kernel's
error), or float64 NumPy's recurrence on the emulator's tiny shapes. On the emulator only
correctness and ``emulated_s`` (seconds per emulated call) are reported.

FLOPs per (batch, head) with chunk L: states 2 S DHQK DHV, inter-chunk outputs
2 S DHQK DHV, intra-chunk causal part S L (DHQK + DHV).

Design target: >= 2x the mx-ops composite at S >= 1024 on Apple GPUs. What the design
relies on:
(1) the state recurrence runs as ONE dispatch (each threadgroup keeps its 32 x 32 tile of
    C in simdgroup-matrix registers across all chunks and streams k, v once), where the
    composite issues ~6 small kernels per chunk (64 chunks at S = 4096) and round-trips C
    through device memory between them;
(2) the intra-chunk kernel never materialises the (L x L) gate matrix D, the scores
    Q Kᵀ or S∘D in device memory: they live in registers / threadgroup memory, while
    the composite writes and re-reads several (B, NH, NC, L, L) float32 tensors plus the
    gated q and both partial numerators;
(3) causal fragments above the diagonal are skipped (the composite computes full L x L);
(4) both kernels use 8x8 simdgroup MMA with float accumulation, and half/bfloat inputs
    are read as such (the composite upcasts q, k, v to float32 copies first).
Both materialise the per-chunk states (NC + 1) x DHQK x DHV float32, which bounds the
memory traffic from below; a larger chunk (128) halves it at the cost of a larger
intra-chunk part. Not yet measured on an Apple GPU (developed on the CPU emulator).
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from xlstm_kernels.benchmarks.kind import bench_kind
from xlstm_kernels import runtime, tiles
from xlstm_kernels.ops.mlstm import knob_values, mlstm, mlstm_chunkwise_mx, mlstm_step, mlstm_step_reference

REPEATS = 10
CHUNK = 64

# (B, NH, S, DH)
METAL_CASES = [
    (1, 8, 512, 64),
    (1, 8, 1024, 128),
    (2, 8, 1024, 256),
    (2, 8, 2048, 128),
    (1, 16, 2048, 256),
    (4, 8, 4096, 64),
    (2, 8, 4096, 128),
    (1, 8, 4096, 256),
    (2, 16, 4096, 128),
]
METAL_QUICK = [(1, 8, 1024, 128), (2, 8, 2048, 128), (1, 8, 4096, 256)]
METAL_STEP = [(8, 64), (16, 128), (32, 256)]  # (B*NH, DH) for the decoding step
EMULATE_CASES = [(1, 2, 64, 16), (1, 2, 100, 32), (2, 2, 37, 16)]
EMULATE_QUICK = EMULATE_CASES[:1]
EMULATE_STEP = [(4, 32)]


def _dtype(d) -> mx.Dtype:
    return getattr(mx, d) if isinstance(d, str) else d


def _name(dtype) -> str:
    return str(dtype).split(".")[-1]


WARM_S = 0.05  # GPU busy time before a case is timed (see _timed)


def _timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` synchronised calls, after calls for at least WARM_S.

    A case follows seconds of CPU work (the float64 reference) with the GPU idle; timed at
    once, millisecond calls ran up to 2x slower than when interleaved with others (H100,
    session 16: mLSTM bf16 2x8x1024x256 2.1-2.6 ms against 1.06-1.20 in
    scripts/probe_mlstm_chunk.py), as the GPU's clocks come back up."""
    mx.eval(fn())  # warm-up (compiles)
    t_end = time.perf_counter() + WARM_S
    while time.perf_counter() < t_end:
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _inputs(b, nh, s, dh, dtype, rng):
    q, k, v = (mx.array(rng.standard_normal((b, nh, s, dh)).astype(np.float32)).astype(dtype) for _ in range(3))
    i_pre = mx.array(rng.standard_normal((b, nh, s)).astype(np.float32))
    f_pre = mx.array((rng.standard_normal((b, nh, s)) + 3.0).astype(np.float32))
    return q, k, v, i_pre, f_pre


def _np_recurrent(q, k, v, i_pre, f_pre, eps=1e-6):
    """float64 NumPy recurrence (tiny shapes only)."""
    q, k, v, i_pre, f_pre = (np.asarray(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v, i_pre, f_pre))
    b, nh, s, dk = q.shape
    c = np.zeros((b, nh, dk, v.shape[-1]))
    n = np.zeros((b, nh, dk))
    m = np.zeros((b, nh))
    h = np.zeros((b, nh, s, v.shape[-1]))
    for t in range(s):
        lf = np.minimum(f_pre[:, :, t], 0) - np.log1p(np.exp(-np.abs(f_pre[:, :, t])))
        m1 = np.maximum(lf + m, i_pre[:, :, t])
        fa, ia = np.exp(lf + m - m1), np.exp(i_pre[:, :, t] - m1)
        c = fa[..., None, None] * c + ia[..., None, None] * k[:, :, t, :, None] * v[:, :, t, None, :]
        n = fa[..., None] * n + ia[..., None] * k[:, :, t]
        m = m1
        qs = q[:, :, t] * dk ** -0.5
        den = np.maximum(np.abs(np.einsum("bhd,bhd->bh", qs, n)), np.exp(-m)) + eps
        h[:, :, t] = np.einsum("bhd,bhde->bhe", qs, c) / den[..., None]
    return h


def _reference(args, emulated: bool) -> np.ndarray:
    if emulated:
        return _np_recurrent(*args)
    with mx.stream(mx.cpu):
        h = mlstm_chunkwise_mx(*[x.astype(mx.float32).astype(mx.float64) for x in args], chunk_size=CHUNK)
        mx.eval(h)
    return np.asarray(h)


def _rel_err(out: mx.array, ref: np.ndarray) -> float:
    o = np.asarray(out.astype(mx.float32), dtype=np.float64)
    return float(np.max(np.abs(o - ref)) / np.max(np.abs(ref)))


def _flops(b, nh, s, dh, chunk) -> float:
    L = min(chunk, s)
    return b * nh * (4.0 * s * dh * dh + s * L * 2.0 * dh)


def _chunkwise_row(backend, case, dtype, rng, roof, repeats) -> dict:
    b, nh, s, dh = case
    args = _inputs(b, nh, s, dh, dtype, rng)
    emulated = backend == "emulate"
    chunk = knob_values(s, dtype)["chunk_size"]  # what mlstm(...) without chunk_size= uses
    ours = lambda: mlstm(*args)  # noqa: E731
    out = ours()
    row = {"op": "mlstm_chunkwise", "shape": [b, nh, s, dh], "dtype": _name(dtype), "chunk": chunk,
           "mlx_chunk": CHUNK, "max_rel_err": _rel_err(out, _reference(args, emulated))}
    if emulated:
        t0 = time.perf_counter()
        mx.eval(ours())
        row["emulated_s"] = time.perf_counter() - t0
        return row
    theirs = lambda: mlstm_chunkwise_mx(*args, chunk_size=CHUNK)  # noqa: E731
    compiled = mx.compile(lambda *a: mlstm_chunkwise_mx(*a, chunk_size=CHUNK))
    t_ours = _timed(ours, repeats)
    t_mlx = _timed(theirs, repeats)
    t_comp = _timed(lambda: compiled(*args), repeats)
    tflops = _flops(b, nh, s, dh, chunk) / t_ours / 1e12
    peak = roof.get({"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[_name(dtype)] + "_tflops")
    row.update({
        "ours_ms": t_ours * 1e3, "mlx_ms": t_mlx * 1e3, "mlx_compiled_ms": t_comp * 1e3,
        "ratio": t_mlx / t_ours, "ratio_compiled": t_comp / t_ours, "tflops": tflops,
        "pct_roofline": 100.0 * tflops / peak if peak else None,
    })
    return row


def _step_row(backend, case, dtype, rng, roof, repeats) -> dict:
    bh, dh = case
    q, k, v = (mx.array(rng.standard_normal((1, bh, dh)).astype(np.float32)).astype(dtype) for _ in range(3))
    i_pre, f_pre = (mx.array(rng.standard_normal((1, bh)).astype(np.float32)) for _ in range(2))
    state = (mx.array(rng.standard_normal((1, bh, dh, dh)).astype(np.float32)),
             mx.array(rng.standard_normal((1, bh, dh)).astype(np.float32)),
             mx.array(rng.standard_normal((1, bh)).astype(np.float32)))
    ours = lambda: mlstm_step(q, k, v, i_pre, f_pre, state)  # noqa: E731
    h, _ = ours()
    with mx.stream(mx.cpu):
        ref, _ = mlstm_step_reference(*[x.astype(mx.float32).astype(mx.float64) for x in (q, k, v, i_pre, f_pre)],
                                      tuple(x.astype(mx.float64) for x in state))
        mx.eval(ref)
    row = {"op": "mlstm_step", "shape": [1, bh, 1, dh], "dtype": _name(dtype),
           "max_rel_err": _rel_err(h, np.asarray(ref))}
    if backend == "emulate":
        t0 = time.perf_counter()
        mx.eval(ours())
        row["emulated_s"] = time.perf_counter() - t0
        return row
    theirs = lambda: mlstm_step_reference(q, k, v, i_pre, f_pre, state)  # noqa: E731
    t_ours = _timed(ours, repeats)
    t_mlx = _timed(theirs, repeats)
    nbytes = 2 * bh * dh * dh * 4  # C read and written: the step is memory-bound
    gbps = nbytes / t_ours / 1e9
    row.update({"ours_ms": t_ours * 1e3, "mlx_ms": t_mlx * 1e3, "ratio": t_mlx / t_ours, "gbps": gbps,
                "pct_roofline": 100.0 * gbps / roof["bandwidth_gbs"] if "bandwidth_gbs" in roof else None})
    return row


def run(backend: str, dtypes: list, quick: bool) -> list[dict]:
    """Benchmark rows for `backend` ("metal" or "emulate") over `dtypes` (mx dtypes or names)."""
    if bench_kind(backend) != "gpu":  # the emulator, or reference ops on a CPU: small cases
        cases, steps = (EMULATE_QUICK if quick else EMULATE_CASES), EMULATE_STEP
    else:
        cases, steps = (METAL_QUICK if quick else METAL_CASES), METAL_STEP
    roof = tiles.roofline()
    rng = np.random.default_rng(0)
    repeats = 3 if quick else REPEATS
    rows = []
    with runtime.use_backend(backend):
        for case in cases:
            for d in dtypes:
                rows.append(_chunkwise_row(backend, case, _dtype(d), rng, roof, repeats))
        for case in steps:
            for d in dtypes:
                rows.append(_step_row(backend, case, _dtype(d), rng, roof, repeats))
    return rows


def _print(rows: list[dict]) -> None:
    for r in rows:
        head = f"{r['op']:<16} {'x'.join(map(str, r['shape'])):<16} {r['dtype']:<9}"
        if "emulated_s" in r:
            print(f"{head} emulated {r['emulated_s'] * 1e3:9.1f} ms   rel.err {r['max_rel_err']:.1e}")
        else:
            extra = f"  compiled x{r['ratio_compiled']:5.2f}" if "ratio_compiled" in r else ""
            rate = f"{r['tflops']:6.2f} TFLOP/s" if "tflops" in r else f"{r['gbps']:7.1f} GB/s"
            print(f"{head} {r['ours_ms']:8.3f} ms  mx {r['mlx_ms']:8.3f} ms  x{r['ratio']:5.2f}{extra}  "
                  f"{rate}  rel.err {r['max_rel_err']:.1e}")
