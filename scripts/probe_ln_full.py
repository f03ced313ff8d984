"""Probe: LayerNorm's FULL path against its general path and MLX, kept chains interleaved
(session 17).

    python3 scripts/probe_ln_full.py [--out ln_full.json]      # on the GPU

A kept chain (``timing.measure_chained(keep=True)``: every output stays referenced, as a
residual stream) of 20 calls per repeat for each of: ``full`` (ops.norm.LN_FULL_ROWS on,
the shipped plan), ``general`` (off), MLX's ``mx.fast.layer_norm``, the order rotating;
rows: fastest quarter (q25) and median us per call and the share of the copy bandwidth
PROBE_LN_COPY_GBPS (GB/s, default 2950: the H100's) those reach.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import fastest_quarter, measure_chained_variants
from xlstm_kernels.ops import norm as norm_ops

CALLS = 20
REPEATS = int(os.environ.get("PROBE_LN_REPEATS", "11"))
COPY = float(os.environ.get("PROBE_LN_COPY_GBPS", "2950"))
# PROBE_LN_VJP=1: the backward instead (dx of a fixed cotangent, chained), "full" = the
# staged backward (LN_VJP_STAGED_CUDA), "general" = the unstaged one; the %: x, g, dx.
VJP = os.environ.get("PROBE_LN_VJP") == "1"
# PROBE_LN_SETS="name:ATTR=v,ATTR=v|name2:..." (session 20): instead of full / general, one
# variant per set of ops.norm module constants (ints; the others at their shipped values),
# e.g. "t256:RMS_VJP_STAGED_MAX_READS=16,RMS_VJP_STAGED_REGISTERS=80".
SETS = [(part.split(":", 1)[0], dict(kv.split("=") for kv in part.split(":", 1)[1].split(",") if kv))
        for part in os.environ.get("PROBE_LN_SETS", "").split("|") if part]
PROBE_SHAPES = [tuple(int(v) for v in s.split("x")) for s in
                os.environ.get("PROBE_LN_SHAPES", "4096x4096,16384x1024,2048x8192,16384x4096").split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    t0 = time.perf_counter()
    for dtype in (mx.bfloat16, mx.float32):
        for shape in PROBE_SHAPES:
            x = mx.random.normal(shape).astype(dtype)
            w = (1 + 0.1 * mx.random.normal((shape[1],))).astype(dtype)
            b = (0.1 * mx.random.normal((shape[1],))).astype(dtype)
            mx.eval(x, w, b)
            ours = lambda a: xk.layer_norm(a, w, b, 1e-5)  # noqa: E731
            mlx = lambda a: mx.fast.layer_norm(a, w, b, 1e-5)  # noqa: E731
            flag = "LN_FULL_ROWS"
            if VJP:  # the chain's next input is dx (a cotangent g fixed per shape)
                g = mx.random.normal(shape).astype(dtype)
                mx.eval(g)
                ours = (lambda f: lambda a: mx.vjp(lambda t: f(t, w, b, 1e-5), [a], [g])[1][0])(xk.layer_norm)
                mlx = (lambda f: lambda a: mx.vjp(lambda t: f(t, w, b, 1e-5), [a], [g])[1][0])(mx.fast.layer_norm)
                flag = "LN_VJP_STAGED_CUDA"
            shipped = {k: getattr(norm_ops, k) for _, kv in SETS for k in kv}

            def use(full: bool, consts: dict | None = None):
                setattr(norm_ops, flag, full)
                for k, v in shipped.items():
                    setattr(norm_ops, k, int((consts or {}).get(k, v)))
                norm_ops._CALLS.clear()
                return ours

            if SETS:
                plan = [(name, (lambda kv=kv: use(True, kv))) for name, kv in SETS] + [("mlx", lambda: mlx)]
            else:
                plan = [("full", lambda: use(True)), ("general", lambda: use(False)), ("mlx", lambda: mlx)]
            variants = tuple(name for name, _ in plan)
            times = measure_chained_variants(plan, x, calls=CALLS, repeats=REPEATS, keep=True)
            times = {v: [t * 1e6 for t in ts] for v, ts in times.items()}
            use(True)
            moved = (3 if VJP else 2) * x.nbytes + w.nbytes + b.nbytes
            tag = f"{shape[0]}x{shape[1]} {dtype}"
            q = {v: fastest_quarter(times[v]) for v in variants}
            print(f"{tag:24s} " + "  ".join(
                f"{v} {q[v]:7.1f} ({statistics.median(times[v]):7.1f}) {100 * moved / (q[v] * 1e3) / COPY:5.1f}%"
                for v in variants) + f"  {variants[0]}/mlx {q['mlx'] / q[variants[0]]:.2f}", flush=True)
            rows.append(dict(shape=list(shape), dtype=str(dtype), **{f"{v}_us": times[v] for v in variants}))
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
