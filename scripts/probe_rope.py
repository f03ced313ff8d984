"""Probe: RoPE vs mx.fast.rope per shape: sync / queued / host-only time, rows per thread.

    python3 scripts/probe_rope.py --out $OUT/rope.json                       # on the GPU
    XLSTM_KERNELS_BACKEND=emulate python3 scripts/probe_rope.py --tiny      # logic check

Variants: N = rows per thread (ops.rope.ROWS_PER_THREAD) and T = threads per threadgroup at
most (ops.rope._MAX_THREADS, MAX_THREADS emptied), set as module attributes (the call memo is cleared for
each); PROBE_ROPE_VARIANTS="4/256,2/256" picks them. Columns: sync ms (one call per
mx.eval), queued ms (20 calls per mx.eval), pipelined ms (the next 20 calls built while the
device runs the last: max of host and device time), host us (building the 20 calls' graph,
no eval), GB/s (pipelined), ratios = MLX / ours (> 1: ours faster), max rel err vs
mx.fast.rope.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import mlx.core as mx
import numpy as np

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import measure_pipelined
from xlstm_kernels.ops import rope as rope_mod

QUEUE = 20
SHIPPED = (rope_mod.ROWS_PER_THREAD, rope_mod._MAX_THREADS, rope_mod.MAX_THREADS)


def timed(fn, reps):
    for _ in range(3):
        mx.eval(fn())
    sync, queued, host = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        sync.append(time.perf_counter() - t0)
    for _ in range(max(5, reps // 4)):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(QUEUE)]
        t1 = time.perf_counter()
        mx.eval(outs)
        queued.append((time.perf_counter() - t0) / QUEUE)
        host.append((t1 - t0) / QUEUE)
    pipe = measure_pipelined(fn, calls=QUEUE, batches=4, repeats=3 if reps > 2 else 1)
    return (float(np.median(sync)) * 1e3, float(np.median(queued)) * 1e3, float(np.median(host)) * 1e6,
            pipe * 1e3)


def rel_err(a, b):
    a = np.asarray(a.astype(mx.float32), dtype=np.float64)
    b = np.asarray(b.astype(mx.float32), dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    # (shape, dims, traditional, offset kind): the bench's rope rows
    cases = [((1, 32, 2048, 128), 128, False, "int"), ((1, 32, 2048, 128), 128, True, "int"),
             ((32, 32, 1, 128), 128, False, "batch"), ((1, 32, 2048, 128), 64, False, "int"),
             ((4, 32, 1024, 64), 64, False, "int"), ((2, 32, 4096, 128), 128, False, "batch")]
    variants = [tuple(int(t) for t in v.split("/")) for v in
                os.environ.get("PROBE_ROPE_VARIANTS", "4/256,2/256,8/256,4/128,4/512").split(",") if v]
    reps = 20
    if args.tiny:
        cases = [((2, 3, 5, 16), 16, False, "int"), ((3, 2, 1, 16), 8, True, "batch")]
        variants, reps = [(1, 256), (4, 64)], 2
    rows = []
    print(f"{'shape':>18} {'dims':>4} {'trad':>4} {'off':>5} {'N/T':>6} {'ours sync':>9} {'mlx sync':>8} "
          f"{'ours q':>8} {'mlx q':>8} {'ours p':>8} {'mlx p':>8} {'host us':>7} {'mlx host':>8} {'GB/s p':>7} "
          f"{'ratio':>5} {'ratio q':>7} {'ratio p':>7} {'err':>8}")
    for shape, dims, trad, off in cases:
        x = mx.random.normal(shape).astype(mx.bfloat16)
        offset = mx.array(np.arange(shape[0]) * 7 + 3, dtype=mx.int32) if off == "batch" else 5
        mx.eval(x)

        def mlx():
            return mx.fast.rope(x, dims, traditional=trad, base=10000.0, scale=1.0, offset=offset)

        m_sync, m_q, m_host, m_p = timed(mlx, reps)
        ref = mlx()
        for n, t in variants:
            rope_mod.ROWS_PER_THREAD = n
            rope_mod._MAX_THREADS, rope_mod.MAX_THREADS = t, {}  # t on every backend
            rope_mod._CALLS.clear()

            def ours():
                return xk.rope(x, dims, traditional=trad, base=10000.0, scale=1.0, offset=offset)

            o_sync, o_q, o_host, o_p = timed(ours, reps)
            err = rel_err(ours(), ref)
            gbs = 2 * x.nbytes / (o_p * 1e-3) / 1e9
            row = dict(shape=list(shape), dims=dims, traditional=trad, offset=off, n=n, max_threads=t,
                       ours_sync_ms=o_sync, mlx_sync_ms=m_sync, ours_q_ms=o_q, mlx_q_ms=m_q, ours_p_ms=o_p,
                       mlx_p_ms=m_p, ours_host_us=o_host, mlx_host_us=m_host, gbps_p=gbs, ratio=m_sync / o_sync,
                       ratio_q=m_q / o_q, ratio_p=m_p / o_p, err=err)
            rows.append(row)
            print(f"{'x'.join(map(str, shape)):>18} {dims:>4} {int(trad):>4} {off:>5} {f'{n}/{t}':>6} {o_sync:9.4f} "
                  f"{m_sync:8.4f} {o_q:8.4f} {m_q:8.4f} {o_p:8.4f} {m_p:8.4f} {o_host:7.1f} {m_host:8.1f} {gbs:7.0f} "
                  f"{m_sync / o_sync:5.2f} {m_q / o_q:7.2f} {m_p / o_p:7.2f} {err:8.1e}", flush=True)
    rope_mod.ROWS_PER_THREAD, rope_mod._MAX_THREADS, rope_mod.MAX_THREADS = SHIPPED
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(mx.default_device()), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
