"""Attention family (``xlstm_kernels.ops.attention``) vs ``mx.fast.scaled_dot_product_attention``,
in the same run.

    xlstm-kernels bench --ops attention [--backend metal|emulate] [--dtypes float32,float16,bfloat16]
                                  [--quick] [--out bench/results/attention-<backend>.json]

``run(backend, dtypes, quick)`` returns one dict per (case, dtype): op (``attention_prefill``,
``attention_decode``, or ``attention_decode_cache``: K and V slices of a longer KV cache,
as a decode loop passes them), shape [B, Hq, Hkv, Lq, Lk, D], dtype, mask, path (the kernels
that ran: prefill, or split-KV partial + reduce), ours_ms, mlx_ms, ratio (mlx_ms /
ours_ms, > 1 = faster than MLX), tflops (prefill: 4·D flops per visible (query, key)
pair, so causal counts about half the square) or gbps (decode: q + K + V + o bytes),
decode rows also ratio_queued / ratio_pipelined (independent calls, which may overlap on
the GPU) and ratio_chained (each call's query the last one's output: a decode loop's
latency per step), pct_roofline (of ``tiles.roofline()``: the dtype's peak TFLOP/s, or bandwidth_gbs) and
max_rel_err (vs float64 NumPy on the emulator's tiny shapes; on Metal vs
mx.fast.scaled_dot_product_attention run in float32 on the same inputs, and
baseline_rel_err for mx.fast in the benchmarked dtype against the same reference). On
the emulator only correctness and ``emulated_s`` (seconds per emulated call) are
reported: nothing there times a GPU.

Design target: >= 0.9x mx.fast.scaled_dot_product_attention on Apple GPUs (not yet
measured on one). What the design relies on:

* Prefill follows MLX's steel attention: BQ = 32 queries per threadgroup (4 simdgroups of
  8 rows), BK = 32 keys per tile (16 from head dim 128), 8x8 simdgroup_matrix MMAs with
  float accumulation, exp2 online softmax with log2(e)-scaled scores, causal tiles past
  the diagonal skipped. It differs in keeping Q in registers as float fragments (no Q
  tile in threadgroup memory, one rounding less for bf16) and K and V in separate
  threadgroup tiles when both fit in 32 KiB (two barriers per KV tile instead of four).
  What it lacks vs steel: the K tile is read transposed from a row-major tile (steel
  stores Kᵀ), and there are no aligned fast paths or function-constant specialisations;
  expect parity at best for D = 64/128 until tuned on hardware.
* Decode (Lq <= 8, Lk >= 1024) follows MLX's sdpa_vector 2-pass: one threadgroup of
  8 simdgroups per (256-key block, head, query), a simd_sum per key, then a reduce over
  blocks through the per-block log-sum-exp. It is bandwidth-bound: K and V are streamed
  once per query head (GQA heads re-read their shared K/V from cache), with each lane
  reading D/32 contiguous elements, so the bar is the memory roofline; the number of
  blocks (Lk / 256) must give enough threadgroups to fill the GPU, which it does from
  Lk = 4096 with 32 heads.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from xlstm_kernels.benchmarks.kind import bench_kind
from xlstm_kernels import runtime, tiles
from xlstm_kernels.benchmarks.timing import (chained_repeats, marginal_fields, measure_chained_pair,
                                             measure_marginal_pair, throughput)
from xlstm_kernels.ops import attention as att

REPEATS = 20

# (op, (B, Hq, Hkv, Lq, Lk, D), mask)
METAL_CASES = [
    ("attention_prefill", (1, 32, 32, 1024, 1024, 64), None),
    ("attention_prefill", (1, 32, 32, 1024, 1024, 64), "causal"),
    ("attention_prefill", (1, 32, 32, 2048, 2048, 128), None),
    ("attention_prefill", (1, 32, 32, 2048, 2048, 128), "causal"),
    ("attention_prefill", (1, 32, 8, 2048, 2048, 128), "causal"),   # GQA 4
    ("attention_decode", (1, 32, 32, 1, 4096, 128), None),
    ("attention_decode", (1, 32, 8, 1, 4096, 128), None),           # GQA 4
    ("attention_decode", (1, 32, 8, 1, 16384, 128), None),
    ("attention_decode", (1, 32, 32, 1, 16384, 64), None),
    ("attention_decode", (1, 32, 8, 4, 4096, 128), "causal"),       # short speculative run
    ("attention_decode", (8, 32, 8, 1, 8192, 128), None),           # batched: 256 MiB of K/V
    # K / V as slices of a KV cache (k_cache[:, :, :lk], capacity lk + 256 as mlx-lm's
    # cache grows): read in place by ours and by MLX's op
    ("attention_decode_cache", (1, 32, 8, 1, 4096, 128), None),
    ("attention_decode_cache", (8, 32, 8, 1, 8192, 128), None),
]
METAL_QUICK = [METAL_CASES[1], METAL_CASES[3], METAL_CASES[6], METAL_CASES[7]]
EMULATE_CASES = [
    ("attention_prefill", (1, 4, 2, 33, 37, 64), "causal"),
    ("attention_prefill", (1, 4, 1, 19, 45, 128), None),
    ("attention_decode", (1, 4, 1, 1, 1100, 64), None),
    ("attention_decode", (1, 8, 1, 3, 1030, 128), "causal"),
    ("attention_decode_cache", (1, 4, 2, 1, 1100, 64), None),
]
EMULATE_QUICK = [EMULATE_CASES[0], EMULATE_CASES[2]]
CACHE_SLACK = 256  # the _cache cases' unused cache rows past Lk


def _dtype(d) -> mx.Dtype:
    return getattr(mx, d) if isinstance(d, str) else d


def _visible_pairs(lq: int, lk: int, mask) -> int:
    """(query, key) pairs that are computed; causal: key j <= i + Lk - Lq."""
    if mask != "causal":
        return lq * lk
    i = np.arange(lq)
    return int(np.clip(i + lk - lq + 1, 0, lk).sum())


def _np_reference(q, k, v, scale, mask) -> np.ndarray:
    qd, kd, vd = (np.asarray(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
    g = qd.shape[1] // kd.shape[1]
    kd, vd = np.repeat(kd, g, axis=1), np.repeat(vd, g, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", qd, kd) * scale
    if mask == "causal":
        lq, lk = s.shape[-2:]
        allowed = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq)
        s = np.where(allowed, s, np.finfo(np.float64).min)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ vd


def _rel_err(out: mx.array, ref: np.ndarray) -> float:
    got = np.asarray(out.astype(mx.float32), dtype=np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def _timed(fn, repeats: int) -> float:
    mx.eval(fn())  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _case_row(backend, op, shape, mask, dtype, rng, roof, repeats) -> dict:
    b, hq, hkv, lq, lk, d = shape
    q = mx.array(rng.standard_normal((b, hq, lq, d)).astype(np.float32)).astype(dtype)
    cap = lk + CACHE_SLACK if op.endswith("_cache") else lk  # a cache slice: k_cache[:, :, :lk]
    k = mx.array(rng.standard_normal((b, hkv, cap, d)).astype(np.float32)).astype(dtype)[:, :, :lk]
    v = mx.array(rng.standard_normal((b, hkv, cap, d)).astype(np.float32)).astype(dtype)[:, :, :lk]
    scale = d**-0.5
    split = lq <= att.SPLIT_KV_MAX_QUERIES and lk >= att.SPLIT_KV_MIN_KEYS
    ours = lambda: att.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)  # noqa: E731
    theirs = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)  # noqa: E731
    row = {
        "op": op, "shape": list(shape), "dtype": str(dtype).split(".")[-1], "mask": mask or "none",
        "path": "split_kv" if split else "prefill",
        "baseline": "mx.fast.scaled_dot_product_attention",
    }
    if backend == "emulate":
        t0 = time.perf_counter()
        out = ours()
        mx.eval(out)
        row["emulated_s"] = time.perf_counter() - t0
        row["max_rel_err"] = _rel_err(out, _np_reference(q, k, v, scale, mask))
        return row
    f32 = [x.astype(mx.float32) for x in (q, k, v)]
    ref = np.asarray(mx.fast.scaled_dot_product_attention(*f32, scale=scale, mask=mask), dtype=np.float64)
    row["max_rel_err"] = _rel_err(ours(), ref)
    row["baseline_rel_err"] = _rel_err(theirs(), ref)
    t_ours = _timed(ours, repeats)
    t_mlx = _timed(theirs, repeats)
    row.update({"ours_ms": t_ours * 1e3, "mlx_ms": t_mlx * 1e3, "ratio": t_mlx / t_ours, "repeats": repeats})
    if op.startswith("attention_decode"):  # queued and pipelined: a decoding model's steady state
        row.update(throughput(ours, theirs, repeats=repeats))
        if v.shape[-1] == d:  # chained: each call's query is the last one's output (a decode loop)
            step_ours = lambda x: att.scaled_dot_product_attention(x, k, v, scale=scale, mask=mask)  # noqa: E731
            step_mlx = lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=scale, mask=mask)  # noqa: E731
            c_ours, c_mlx = measure_chained_pair(step_ours, step_mlx, q, repeats=chained_repeats(repeats))
            row.update({"ours_chained_ms": c_ours * 1e3, "mlx_chained_ms": c_mlx * 1e3, "ratio_chained": c_mlx / c_ours})
            # the chain in its steady state (the host encoding ahead of the GPU)
            row.update(marginal_fields(*measure_marginal_pair(step_ours, step_mlx, q, repeats=chained_repeats(repeats)),
                                       q.nbytes * 2 + k.nbytes + v.nbytes))
    if op == "attention_prefill":
        flops = 4.0 * b * hq * d * _visible_pairs(lq, lk, mask)
        peak = roof["fp32_tflops"] if dtype == mx.float32 else roof["bf16_tflops" if dtype == mx.bfloat16 else "fp16_tflops"]
        row.update({"tflops": flops / t_ours / 1e12, "mlx_tflops": flops / t_mlx / 1e12,
                    "pct_roofline": 100.0 * flops / t_ours / 1e12 / peak, "bound": "compute"})
    else:
        nbytes = q.nbytes * 2 + k.nbytes + v.nbytes  # q in, o out (same size), K and V once
        if "ours_queued_ms" in row:
            row["gbps_queued"] = nbytes / row["ours_queued_ms"] / 1e6
            row["gbps_pipelined"] = nbytes / row["ours_pipelined_ms"] / 1e6
        if "ours_chained_ms" in row:
            row["gbps_chained"] = nbytes / row["ours_chained_ms"] / 1e6
        row.update({"gbps": nbytes / t_ours / 1e9, "mlx_gbps": nbytes / t_mlx / 1e9,
                    "pct_roofline": 100.0 * nbytes / t_ours / 1e9 / roof["bandwidth_gbs"], "bound": "memory"})
    return row


def run(backend: str, dtypes: list, quick: bool) -> list[dict]:
    """Benchmark rows for `backend` ("metal" or "emulate") over `dtypes` (mx dtypes or names)."""
    if bench_kind(backend) != "gpu":  # the emulator, or reference ops on a CPU: small cases
        cases = EMULATE_QUICK if quick else EMULATE_CASES
    else:
        cases = METAL_QUICK if quick else METAL_CASES
    roof = tiles.roofline()
    rng = np.random.default_rng(0)
    repeats = 5 if quick else REPEATS
    rows = []
    with runtime.use_backend(backend):
        for op, shape, mask in cases:
            for dt in dtypes:
                rows.append(_case_row(backend, op, shape, mask, _dtype(dt), rng, roof, repeats))
    return rows


def _print(rows: list[dict]) -> None:
    for r in rows:
        head = f"{r['op']:<18} {'x'.join(map(str, r['shape'])):<24} {r['mask']:<7} {r['path']:<9} {r['dtype']:<9}"
        if "emulated_s" in r:
            print(f"{head} emulated {r['emulated_s'] * 1e3:9.1f} ms   rel.err {r['max_rel_err']:.1e}")
        else:
            rate = f"{r['tflops']:6.2f} TFLOP/s" if "tflops" in r else f"{r['gbps']:7.1f} GB/s"
            print(f"{head} {r['ours_ms']:8.3f} ms  mx {r['mlx_ms']:8.3f} ms  x{r['ratio']:5.2f}  {rate}  "
                  f"{r['pct_roofline']:5.1f}%  rel.err {r['max_rel_err']:.1e} (mx {r['baseline_rel_err']:.1e})"
                  + (f"  queued x{r['ratio_queued']:5.2f} {r['gbps_queued']:7.1f} GB/s  pipelined "
                     f"x{r['ratio_pipelined']:5.2f} {r['gbps_pipelined']:7.1f} GB/s" if "ratio_queued" in r else "")
                  + (f"  chained x{r['ratio_chained']:5.2f} {r['gbps_chained']:7.1f} GB/s" if "ratio_chained" in r else ""))
