"""Probe: the norm backward's last step on the GPU, the dw partials summed over groups and
cast: ``mx.sum(axis=0).astype`` (two MLX kernels) against ``norm_partials_sum`` (one).

    python3 scripts/probe_partials.py [--out partials.json]      # on the GPU

(groups, columns) float32 partials as the RMSNorm backward plans them on an H100 (264 groups
of a 4096 row: 132 SMs x 2 units), summed into bfloat16. Per variant, microseconds per call:
``dev``, 16 calls on 16 different partial buffers inside one ``mx.compile``'d function (the
device time, no per-call Python). Interleaved repeats, the fastest quarter (q25).
PROBE_PARTIALS_SHAPES ("264x4096,396x4096,264x1024,132x8192").
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x"))
              for s in os.environ.get("PROBE_PARTIALS_SHAPES", "264x4096,396x4096,264x1024,132x8192").split(",")]
    rows = []
    for groups, cols in shapes:
        parts = [mx.random.normal((groups, cols)) for _ in range(16)]
        mx.eval(parts)
        variants = {"sum+astype": lambda p: p.sum(axis=0).astype(mx.bfloat16)}
        for sg in SIMDGROUPS:  # norm_partials_sum with sg simdgroups a threadgroup
            norm_mod.PARTIALS_SIMDGROUPS = norm_mod.PARTIALS_SIMDGROUPS_CUDA = sg
            kw = norm_mod._partials_sum_plan(groups, cols, mx.bfloat16, True, False)
            run = prepare_launch(norm_mod.PARTIALS_SUM, **kw)
            absent, sizes = kw["inputs"][1], kw["inputs"][2]
            variants[f"partials_sum s{sg}"] = lambda p, run=run, absent=absent, sizes=sizes: run([p, absent, sizes])[0]
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
