"""Probe: do our kernels pay for reading small host-made arrays (params, eps, offsets,
the xk_grid input) from managed memory? (session 14)

    python3 scripts/probe_consts.py [--out consts.json]       # on the GPU (backend cuda)
    XLSTM_KERNELS_CUDA_DEVICE_CONSTS=0 python3 scripts/probe_consts.py   # constants in managed memory

MLX's CUDA allocator puts every array made from host data (``mx.array([...])``) and every
array of at most 8 bytes in managed memory. Our launches read their shape parameters,
eps and scale from such arrays; MLX's own kernels take them by value. Since session 14
the ops make them with ``runtime.const_array`` (device-memory copies on cuda);
``XLSTM_KERNELS_CUDA_DEVICE_CONSTS=0`` restores host arrays, so the two runs compare the
same kernels. (The first measurement used a probe-only switch that copied every small
input at launch.)
Nsight Compute put 39% of the RMSNorm backward's stall samples (bf16 4096x4096) on the
first read of its params.

Per case, us per call: ``pipe`` (batches of 20 independent calls, evaluated
asynchronously while the next batch is built), ``chain`` (20 calls each taking the last
one's output: a model loop's dependency), and for the backward ``step`` (inside an
``mx.compile``'d function, pipelined). MLX's op in the same run.
"""

from __future__ import annotations

import argparse
import json
import os

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import measure_chained, measure_pipelined


def rnd(*shape, dtype=mx.bfloat16):
    a = mx.random.normal(shape).astype(dtype)
    mx.eval(a)
    return a


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    tag = "managed" if os.environ.get("XLSTM_KERNELS_CUDA_DEVICE_CONSTS") == "0" else "device"
    rows = []

    def report(case, impl, **t):
        rows.append(dict(case=case, impl=impl, consts=tag, **t))
        print(f"{case:34s} {impl:5s} {tag:8s} " + "  ".join(f"{k} {v * 1e6:8.1f}" for k, v in t.items()), flush=True)

    # RMSNorm forward and backward
    for rows_, n in ((4096, 4096), (1, 4096), (16384, 4096)):
        x, w, g = rnd(rows_, n), rnd(n), rnd(rows_, n)
        for impl, f in (("ours", xk.rms_norm), ("mlx", mx.fast.rms_norm)):
            fwd = lambda a, f=f: f(a, w, 1e-5)  # noqa: E731
            report(f"rms_norm {rows_}x{n} bf16", impl, pipe=measure_pipelined(lambda: fwd(x)),
                   chain=measure_chained(fwd, x))
            vjp = lambda a, b, c, f=f: mx.vjp(lambda p, q: f(p, q, 1e-5), [a, b], [c])[1]  # noqa: E731
            step = mx.compile(vjp)
            report(f"rms_norm_vjp {rows_}x{n} bf16", impl, pipe=measure_pipelined(lambda: vjp(x, w, g)),
                   step=measure_pipelined(lambda: step(x, w, g)),
                   chain=measure_chained(lambda a: vjp(a, w, g)[0], x))
    # RoPE at a decode step (int offset: a new host array per call on our side)
    x = rnd(32, 32, 1, 128)
    for impl, f in (("ours", lambda a: xk.rope(a, 128, traditional=False, base=10000.0, offset=37)),
                    ("mlx", lambda a: mx.fast.rope(a, 128, traditional=False, base=10000.0, scale=1.0, offset=37))):
        report("rope 32x32x1x128 bf16", impl, pipe=measure_pipelined(lambda: f(x)), chain=measure_chained(f, x))
    # decode attention
    for b, hq, hkv, lk in ((1, 32, 8, 16384), (8, 32, 8, 8192), (1, 32, 8, 4096)):
        q, k, v = rnd(b, hq, 1, 128, dtype=mx.float16), rnd(b, hkv, lk, 128, dtype=mx.float16), \
            rnd(b, hkv, lk, 128, dtype=mx.float16)
        for impl, f in (("ours", lambda a: xk.scaled_dot_product_attention(a, k, v, scale=0.088)),
                        ("mlx", lambda a: mx.fast.scaled_dot_product_attention(a, k, v, scale=0.088))):
            report(f"decode {b}x{hq}x{hkv}x{lk} fp16", impl, pipe=measure_pipelined(lambda: f(q)),
                   chain=measure_chained(f, q))
    # GEMM at M = 1 (a decode step's projection)
    a, wt = rnd(1, 4096), rnd(4096, 4096)
    for impl, f in (("ours", lambda u: xk.gemm_av(u, wt)), ("mlx", lambda u: u @ wt)):
        report("gemm_av 1x4096x4096 bf16", impl, pipe=measure_pipelined(lambda: f(a)), chain=measure_chained(f, a))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
