"""Probe: the M == 1 gemm_a_bt (B as (N, K) rows) against mx.matmul: device time against
the time a decode loop pays per call (session 18).

    python3 scripts/probe_gemv.py [--out gemv.json]      # on the GPU

Per shape, dtype and variant (``ours``: xk.gemm_a_bt; ``mlx``: ``a @ b.T``), microseconds per call, interleaved (every repeat times each variant once, the
order rotating); the fastest quarter (q25) of the repeats:

* ``pipe``: ``timing.measure_pipelined`` (the next batch built while the last runs: a
  decode loop's steady state, host work included);
* ``dev``: 16 calls with 16 different A rows inside one ``mx.compile``'d function, timed
  the same way and divided by 16 (the per-call Python is gone: about the device time);
* ``%copy``: B's bytes over ``dev``, as a share of PROBE_GEMV_COPY_GBPS (default 2950, an
  H100's copy; B may stay in L2 between calls, so this can pass 100%).

PROBE_GEMV_SHAPES ("1x4096x4096,1x4096x14336"), PROBE_GEMV_DTYPES, PROBE_GEMV_REPEATS.

Session 18 (H100) also timed 1, 2, 4 and 8 runs of A a lane in flight before their
products (the kernel waits for each run's loads before the next run's): as fast at
1x4096x4096, slower at 1x14336x4096 (bf16 dev 27 -> 39 us) and float32 1x4096x14336
(45 -> 57 us); dropped. At 1x4096x4096 16-bit ours took 8 us of device time against MLX's
5.7, but 14.4 us a call pipelined against MLX's 6.9: the host's work per call decides there.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import fastest_quarter, measure_pipelined

REPEATS = int(os.environ.get("PROBE_GEMV_REPEATS", "7"))
COPY = float(os.environ.get("PROBE_GEMV_COPY_GBPS", "2950"))
FANOUT = 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = os.environ.get("PROBE_GEMV_SHAPES", "1x4096x4096,1x4096x14336,1x14336x4096").split(",")
    dtypes = os.environ.get("PROBE_GEMV_DTYPES", "bfloat16,float16,float32").split(",")
    variants = ["mlx", "ours"]
    rows = []
    t0 = time.perf_counter()
    for shape in shapes:
        _, n, k = (int(v) for v in shape.split("x"))
        for dname in dtypes:
            dtype = getattr(mx, dname)
            b = mx.random.normal((n, k)).astype(dtype)
            a_rows = [mx.random.normal((1, k)).astype(dtype) for _ in range(FANOUT)]
            mx.eval(b, *a_rows)
            ref = (a_rows[0].astype(mx.float32) @ b.astype(mx.float32).T)
            times: dict[str, dict[str, list[float]]] = {v: {"pipe": [], "dev": []} for v in variants}
            errs = {}
            for r in range(REPEATS):
                shift = r % len(variants)
                for name in variants[shift:] + variants[:shift]:
                    if name == "mlx":
                        op = lambda a: a @ b.T  # noqa: E731
                    else:
                        op = lambda a: xk.gemm_a_bt(a, b)  # noqa: E731
                    fan = mx.compile(lambda *aa: [op(a) for a in aa])
                    out = op(a_rows[0])
                    mx.eval(out, fan(*a_rows))
                    if r == 0:
                        errs[name] = float(mx.max(mx.abs(out.astype(mx.float32) - ref)) / mx.max(mx.abs(ref)))
                    times[name]["pipe"].append(measure_pipelined(lambda: op(a_rows[0]), calls=20, batches=6, repeats=1))
                    times[name]["dev"].append(measure_pipelined(lambda: fan(*a_rows), calls=4, batches=6, repeats=1) / FANOUT)
            mlx_dev = fastest_quarter(times["mlx"]["dev"])
            mlx_pipe = fastest_quarter(times["mlx"]["pipe"])
            print(f"{shape} {dname}: B {n * k * dtype.size / 2**20:.0f} MiB")
            for name in variants:
                dev, pipe = fastest_quarter(times[name]["dev"]), fastest_quarter(times[name]["pipe"])
                pct = n * k * dtype.size / dev / (COPY * 1e9) * 100
                row = {"shape": shape, "dtype": dname, "variant": name, "dev_us": dev * 1e6, "pipe_us": pipe * 1e6,
                       "pct_copy_dev": pct, "ratio_dev": mlx_dev / dev, "ratio_pipe": mlx_pipe / pipe,
                       "max_rel_err": errs[name]}
                rows.append(row)
                print(f"  {name:4s} dev {dev * 1e6:7.2f} us ({pct:5.1f}% copy, x{mlx_dev / dev:5.2f})  "
                      f"pipe {pipe * 1e6:7.2f} us (x{mlx_pipe / pipe:5.2f})  err {errs[name]:.1e}", flush=True)
            if args.out:
                with open(args.out, "w") as fh:
                    json.dump({"rows": rows, "repeats": REPEATS}, fh, indent=1)
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
