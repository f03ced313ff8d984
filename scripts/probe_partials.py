"""Probe: the norm backward's last step on the GPU, the dw partials summed over groups and
cast: ``mx.sum(axis=0).astype`` (two MLX kernels) against ``norm_partials_sum`` (one).

    python3 scripts/probe_partials.py [--out partials.json]      # on the GPU
    ncu --metrics gpu__time_duration.sum --print-units base --cache-control none --csv \
        python3 scripts/probe_partials.py --ncu-order order.json > partials.csv   # kernel durations
    python3 scripts/probe_partials.py --summary partials.csv order.json

(groups, columns) partials as the RMSNorm backward plans them (264 groups of a 4096 row on an
H100: 132 SMs x 2 units; 528 of a short row on an H200: 4 units a SM), summed into bfloat16.
Per variant, microseconds per call: 16 calls on 16 different partial buffers inside one
``mx.compile``'d function (the device time, no per-call Python). Interleaved repeats, the
fastest quarter (q25). Variants: ``partials_sum sN`` (strips of 32 columns, N simdgroups),
``by_column tN`` (norm_partials_sum_cols, N threads a column; session 46), MLX's sum + astype.
PROBE_PARTIALS_SHAPES ("264x4096,396x4096,264x1024,132x8192"), PROBE_PARTIALS_SIMDGROUPS
("8,16,32"), PROBE_PARTIALS_COLUMN_THREADS ("": none), PROBE_PARTIALS_DTYPE (float32; bfloat16:
the partials of 16-bit rows, PARTIALS_BF16 / PARTIALS_FP16).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import mlx.core as mx

from xlstm_kernels.benchmarks.timing import fastest_quarter
from xlstm_kernels.ops import norm as norm_mod
from xlstm_kernels.runtime import current_backend, prepare_launch

REPEATS = int(os.environ.get("PROBE_PARTIALS_REPEATS", "11"))
SIMDGROUPS = [int(v) for v in os.environ.get("PROBE_PARTIALS_SIMDGROUPS", "8,16,32").split(",")]
COLUMN_THREADS = [int(v) for v in os.environ.get("PROBE_PARTIALS_COLUMN_THREADS", "").split(",") if v]
PARTS_DTYPE = getattr(mx, os.environ.get("PROBE_PARTIALS_DTYPE", "float32"))


NCU_LAUNCHES = 10


def _ncu_launches(shapes, order_path: str) -> None:
    """For Nsight Compute (session 46): each (shape, variant) launched NCU_LAUNCHES times on one
    partials buffer (warm in L2, as the backward leaves them), one eval each, in the order
    written to `order_path`; ``summary`` pairs ncu's rows with it."""
    order = []
    for groups, cols in shapes:
        p = mx.random.normal((groups, cols)).astype(PARTS_DTYPE)
        mx.eval(p)
        plans = [(f"partials_sum s{sg}", sg, None) for sg in SIMDGROUPS]
        plans += [(f"by_column t{t}", None, t) for t in COLUMN_THREADS]
        for name, sg, threads in plans:
            if sg is not None:
                norm_mod.PARTIALS_SIMDGROUPS = norm_mod.PARTIALS_SIMDGROUPS_CUDA = sg
                spec, kw = norm_mod.PARTIALS_SUM, norm_mod._partials_sum_plan(groups, cols, mx.bfloat16, True, False)
            else:
                norm_mod.PARTIALS_BY_COLUMN_THREADS = threads
                spec = norm_mod.PARTIALS_SUM_COLS
                kw = norm_mod._partials_sum_cols_plan(groups, cols, mx.bfloat16, True, False)
            run = prepare_launch(spec, **kw)
            for _ in range(NCU_LAUNCHES):
                mx.eval(run([p, kw["inputs"][1], kw["inputs"][2]]))
            order.append(f"{groups}x{cols} {name}")
    mx.synchronize()
    with open(order_path, "w") as f:
        json.dump(order, f)


def _ncu_summary(csv_path: str, order_path: str) -> None:
    """Median / min us of each (shape, variant) from ncu's --csv rows (gpu__time_duration)."""
    import csv
    import statistics

    order = json.load(open(order_path))
    with open(csv_path) as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    head = rows[0]
    ki, vi = head.index("Kernel Name"), head.index("Metric Value")
    us = [float(r[vi].replace(",", "")) / 1e3 for r in rows[1:] if "norm_partials_sum" in r[ki]]
    if len(us) != NCU_LAUNCHES * len(order):
        raise SystemExit(f"probe_partials: {len(us)} partials kernels in {csv_path}, expected "
                         f"{NCU_LAUNCHES * len(order)}")
    for i, name in enumerate(order):
        t = us[i * NCU_LAUNCHES:(i + 1) * NCU_LAUNCHES]
        print(f"{name:32s} med {statistics.median(t):6.2f} min {min(t):6.2f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--ncu-order", help="launch for Nsight Compute, writing the launch order here")
    ap.add_argument("--summary", nargs=2, metavar=("CSV", "ORDER"), help="summarise an ncu --csv run")
    args = ap.parse_args()
    if args.summary:
        _ncu_summary(*args.summary)
        return
    shapes = [tuple(int(v) for v in s.split("x"))
              for s in os.environ.get("PROBE_PARTIALS_SHAPES", "264x4096,396x4096,264x1024,132x8192").split(",")]
    if args.ncu_order:
        _ncu_launches(shapes, args.ncu_order)
        return
    rows = []
    for groups, cols in shapes:
        parts = [mx.random.normal((groups, cols)).astype(PARTS_DTYPE) for _ in range(16)]
        mx.eval(parts)
        variants = {"sum+astype": lambda p: p.astype(mx.float32).sum(axis=0).astype(mx.bfloat16)}
        for sg in SIMDGROUPS:  # norm_partials_sum with sg simdgroups a threadgroup
            norm_mod.PARTIALS_SIMDGROUPS = norm_mod.PARTIALS_SIMDGROUPS_CUDA = sg
            kw = norm_mod._partials_sum_plan(groups, cols, mx.bfloat16, True, False)
            run = prepare_launch(norm_mod.PARTIALS_SUM, **kw)
            absent, sizes = kw["inputs"][1], kw["inputs"][2]
            variants[f"partials_sum s{sg}"] = lambda p, run=run, absent=absent, sizes=sizes: run([p, absent, sizes])[0]
        for threads in COLUMN_THREADS:  # norm_partials_sum_cols, `threads` threads a column
            norm_mod.PARTIALS_BY_COLUMN_THREADS = threads
            kw = norm_mod._partials_sum_cols_plan(groups, cols, mx.bfloat16, True, False)
            run = prepare_launch(norm_mod.PARTIALS_SUM_COLS, **kw)
            absent, sizes = kw["inputs"][1], kw["inputs"][2]
            variants[f"by_column t{threads}"] = lambda p, run=run, absent=absent, sizes=sizes: run([p, absent, sizes])[0]
        ref = variants["sum+astype"](parts[0]).astype(mx.float32)
        err = max((mx.abs(v(parts[0]).astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()
                  for v in variants.values())
        wrap = mx.compile if current_backend() == "cuda" else (lambda f: f)  # the emulator runs eagerly
        compiled = {k: wrap(lambda *ps, f=f: [f(p) for p in ps]) for k, f in variants.items()}
        times = {k: [] for k in variants}
        for r in range(REPEATS):
            order = list(variants)[r % len(variants):] + list(variants)[:r % len(variants)]
            for k in order:
                mx.eval(compiled[k](*parts))
                t0 = time.perf_counter()
                mx.eval(compiled[k](*parts))
                times[k].append((time.perf_counter() - t0) / 16 * 1e6)
        line = f"{groups}x{cols}: " + "  ".join(f"{k} {fastest_quarter(v):6.2f}" for k, v in times.items())
        print(line + f"  err {err:.1e}", flush=True)
        rows.append({"groups": groups, "cols": cols, "us": times, "err": err})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
