"""RoPE family (``xlstm_kernels.ops.rope``) vs ``mx.fast.rope``, in the same run.

    xlstm-kernels bench --ops rope [--backend metal|emulate] [--dtypes float32,float16,bfloat16]
                             [--quick] [--out bench/results/rope-<backend>.json]

``run(backend, dtypes, quick)`` returns one dict per (case, dtype): op, shape, dtype, dims,
traditional, offset kind, ours_ms, mlx_ms, ratio (mlx_ms / ours_ms, > 1 = faster than
MLX), gbps (bytes read + written: 2 * x.nbytes per call), pct_roofline (of
``tiles.roofline()["bandwidth_gbs"]``) and max_rel_err (vs float64 NumPy). On the emulator
only correctness and ``emulated_s`` (seconds per emulated call) are reported.

Timing: after a warm-up, each sample evaluates a chain of ``CHAIN`` dependent calls
(y = rope(y)) so that the per-call host overhead of both ops is included but one eval's
synchronisation is amortised; the median of the samples, divided by CHAIN, is reported.
On a GPU the rows also carry ``benchmarks.timing.throughput``'s queued and pipelined
times and ratios (independent calls on the same x; pipelined: the next batch built while
the device runs the last, a model loop's steady state) with ``gbps_queued`` /
``gbps_pipelined``.

Design target: >= 1.0x mx.fast.rope on Apple GPUs. What the design relies on:
RoPE is purely memory-bound (4 bytes moved per bf16 pair against ~40 ALU ops for precise
sin/cos), so the kernel must (1) stream x once and y once with coalesced accesses
(threads along x walk consecutive features / pairs; the split-half halves are two
coalesced streams), (2) amortise the trig: each thread rotates the same pair of N = 4
rows sharing a position (one precise cos/sin per 4 pairs, as MLX's kernel does),
(3) read inv_freq from a tiny float32 table (base^(j/half) precomputed once on the host
in float64, cached; it stays in cache), and (4) handle dims < D in the same launch (copy
threads next to the rotation threads) where MLX copies the input first. Partial
rotary embeddings (dims < D) are therefore where we expect to beat MLX clearly; for
dims == D parity is the expectation. Not yet measured on an Apple GPU.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from xlstm_kernels.benchmarks.kind import bench_kind
from xlstm_kernels.benchmarks.timing import (chained_repeats, marginal_fields, measure_chained_pair,
                                             measure_marginal_pair, throughput)
from xlstm_kernels import runtime, tiles
from xlstm_kernels.ops.rope import rope

CHAIN = 10
REPEATS = 20

# (shape, dims, traditional, offset kind): "int" (a fixed offset), "batch" (one per batch element)
METAL_CASES = [
    ((1, 32, 2048, 128), 128, False, "int"),     # prefill, Llama layout
    ((1, 32, 2048, 128), 128, True, "int"),      # prefill, traditional pairing
    ((32, 32, 1, 128), 128, False, "batch"),     # batched decode, per-sequence positions
    ((1, 32, 2048, 128), 64, False, "int"),      # partial rotary (dims < D)
    ((4, 32, 1024, 64), 64, False, "int"),
    ((2, 32, 4096, 128), 128, False, "batch"),   # large: bandwidth-bound regime
    # prefill of 4 x 8192 tokens, 256 MiB each way: where a chained copy reaches ~90% of
    # the 1 GiB copy's rate (below ~64 MiB no op can reach 80%: copy_same_bytes_pct)
    ((4, 32, 8192, 128), 128, False, "batch"),
    ((1, 32, 2048, 128), 128, False, "int", "blhd"),  # mlx-lm's layout: (B, L, H, D) transposed
]
METAL_QUICK = [METAL_CASES[0], METAL_CASES[2], METAL_CASES[3]]
EMULATE_CASES = [
    ((1, 4, 64, 64), 64, False, "int"),
    ((4, 4, 1, 128), 128, True, "batch"),
    ((2, 3, 33, 80), 64, False, "int"),
    ((2, 3, 33, 64), 64, False, "batch", "blhd"),
]
EMULATE_QUICK = EMULATE_CASES[:2]
BASE = 10000.0


def _dtype(d) -> mx.Dtype:
    return getattr(mx, d) if isinstance(d, str) else d


def _np_rope(x: np.ndarray, dims: int, traditional: bool, offset) -> np.ndarray:
    """float64 reference (same semantics as tests/test_rope.py)."""
    half = dims // 2
    inv = BASE ** (-np.arange(half, dtype=np.float64) / half)
    off = np.asarray(offset, dtype=np.float64)
    if off.ndim == 1:
        off = off.reshape((-1,) + (1,) * (x.ndim - 3))
    theta = (off[..., None] + np.arange(x.shape[-2]))[..., None] * inv
    c, s = np.cos(theta), np.sin(theta)
    out = x.copy()
    if traditional:
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2], out[..., 1:dims:2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:dims]
        out[..., :half], out[..., half:dims] = a * c - b * s, a * s + b * c
    return out


def _timed_chain(fn, x: mx.array, repeats: int) -> float:
    """Median seconds per call of `fn`, CHAIN dependent calls per eval."""

    def chain():
        y = x
        for _ in range(CHAIN):
            y = fn(y)
        return y

    mx.eval(chain())  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(chain())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / CHAIN


def _case_row(backend, shape, dims, traditional, offset_kind, dtype, rng, roof, repeats, layout="bhld") -> dict:
    x32 = rng.standard_normal(shape).astype(np.float32)
    x = mx.array(x32).astype(dtype)
    if layout == "blhd":  # (B, L, H, D) data seen as (B, H, L, D), as mlx-lm ropes q and k
        x = mx.contiguous(x.swapaxes(1, 2)).swapaxes(1, 2)
        mx.eval(x)
    if offset_kind == "batch":
        off_np = rng.integers(0, 4096, size=shape[0])
        offset = mx.array(off_np.astype(np.int32))
    else:
        off_np = np.int64(17)
        offset = 17
    ours = lambda v: rope(v, dims, traditional=traditional, base=BASE, offset=offset)  # noqa: E731
    theirs = lambda v: mx.fast.rope(v, dims, traditional=traditional, base=BASE, scale=1.0, offset=offset)  # noqa: E731

    ref = _np_rope(np.asarray(x.astype(mx.float32), dtype=np.float64), dims, traditional, off_np)
    out = ours(x)
    err = float(np.max(np.abs(np.asarray(out.astype(mx.float32), dtype=np.float64) - ref)) / np.max(np.abs(ref)))
    row = {
        "op": ("rope_traditional" if traditional else "rope") + ("_transposed" if layout == "blhd" else ""),
        "shape": list(shape), "dtype": str(dtype).split(".")[-1], "dims": dims,
        "traditional": traditional, "offset": offset_kind, "layout": layout, "max_rel_err": err,
        # float32 angles carry an absolute error of about position * 2^-24 (any float32
        # kernel, MLX's included): the bound grows with the largest position.
        "tolerance": {"float32": 1e-5 + float(np.max(off_np) + shape[-2]) * 2.0**-23,
                      "float16": 1e-2, "bfloat16": 2e-2}[str(dtype).split(".")[-1]],
    }
    if backend == "emulate":
        t0 = time.perf_counter()
        mx.eval(ours(x))
        row["emulated_s"] = time.perf_counter() - t0
        return row
    t_ours = _timed_chain(ours, x, repeats)
    t_mlx = _timed_chain(theirs, x, repeats)
    tp = throughput(lambda: ours(x), lambda: theirs(x), repeats=repeats)
    # chained as measure_chained times it (graph building not counted), the two interleaved
    c_ours, c_mlx = measure_chained_pair(ours, theirs, x, repeats=chained_repeats(repeats))
    tp.update({"ours_chained_ms": c_ours * 1e3, "mlx_chained_ms": c_mlx * 1e3, "ratio_chained": c_mlx / c_ours,
               "gbps_chained": 2.0 * x.nbytes / c_ours / 1e9})
    nbytes = 2.0 * x.nbytes
    # the chain in its steady state (the host encoding ahead of the GPU)
    tp.update(marginal_fields(*measure_marginal_pair(ours, theirs, x, repeats=chained_repeats(repeats)), nbytes))
    gbps = nbytes / t_ours / 1e9
    row.update({
        "ours_ms": t_ours * 1e3, "mlx_ms": t_mlx * 1e3, "ratio": t_mlx / t_ours, "gbps": gbps,
        "mlx_gbps": nbytes / t_mlx / 1e9, "pct_roofline": 100.0 * gbps / roof["bandwidth_gbs"], **tp,
        "gbps_queued": nbytes / tp["ours_queued_ms"] / 1e6, "gbps_pipelined": nbytes / tp["ours_pipelined_ms"] / 1e6,
    })
    return row


def run(backend: str, dtypes: list, quick: bool) -> list[dict]:
    """Benchmark rows for `backend` ("metal" or "emulate") over `dtypes` (mx dtypes or names)."""
    emulated = backend == "emulate"
    if bench_kind(backend) != "gpu":  # the emulator, or reference ops on a CPU: small cases
        cases = EMULATE_QUICK if quick else EMULATE_CASES
    else:
        cases = METAL_QUICK if quick else METAL_CASES
    roof = tiles.roofline()
    rng = np.random.default_rng(0)
    repeats = 5 if quick else REPEATS
    rows = []
    with runtime.use_backend(backend):
        for shape, dims, traditional, offset_kind, *layout in cases:
            for d in dtypes:
                rows.append(_case_row(backend, shape, dims, traditional, offset_kind, _dtype(d), rng, roof, repeats,
                                      *layout))
    return rows


def _print(rows: list[dict]) -> None:
    for r in rows:
        head = f"{r['op']:<17} {'x'.join(map(str, r['shape'])):<16} d{r['dims']:<4} {r['offset']:<5} {r['dtype']:<9}"
        if "emulated_s" in r:
            print(f"{head} emulated {r['emulated_s'] * 1e3:9.1f} ms   rel.err {r['max_rel_err']:.1e}")
        else:
            print(f"{head} {r['ours_ms']:8.4f} ms  mx {r['mlx_ms']:8.4f} ms  x{r['ratio']:5.2f}  "
                  f"{r['gbps']:7.1f} GB/s  {r['pct_roofline']:5.1f}%  queued x{r['ratio_queued']:5.2f} "
                  f"{r['gbps_queued']:7.1f} GB/s  pipelined x{r['ratio_pipelined']:5.2f} "
                  f"{r['gbps_pipelined']:7.1f} GB/s  rel.err {r['max_rel_err']:.1e}")
