"""Probe: where an eager VJP's per-call cost goes, ours against MLX's (session 23).

    python3 scripts/probe_eager_vjp.py [--out result.json]     # on the GPU (backend cuda)

The norm bench's ``*_vjp`` rows time ``mx.vjp`` of the op called eagerly, pipelined (the
next 20 calls built while the GPU runs the last 20): a call costs the larger of its host
time and its device time. Two views of that, for ``xk.rms_norm`` and ``mx.fast.rms_norm``:

* ``split``: 20 calls built (``build``: our Python and MLX's graph building), handed to
  ``mx.async_eval`` (``encode``: MLX evaluates the graph on this thread, launching the
  kernels), then waited for; us a call, medians of 15 rounds (each round starts idle, so
  ``total`` is serial: build + encode + the device's time);
* ``pipelined``: ``timing.measure_pipelined_pair`` of the two, three times.

Session 23, H100: build 23-29 us ours against 5-10 MLX's, encode 9-12 against 10-19,
device time within 1-2 us: the pipelined bf16 4096x4096 call is device-bound on this
host (43.7 against 41.5 us), at the margin where a slower host makes it host-bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import measure_pipelined_pair

SHAPES = ((4096, 4096), (16384, 1024), (2048, 8192))


def split(fn, calls: int = 20, rounds: int = 15) -> dict:
    """Median us a call of building, encoding (mx.async_eval) and the whole round."""
    for _ in range(40):
        mx.eval(fn())
    b, e, t = [], [], []
    for _ in range(rounds):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [fn() for _ in range(calls)]
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        t3 = time.perf_counter()
        b.append((t1 - t0) / calls * 1e6)
        e.append((t2 - t1) / calls * 1e6)
        t.append((t3 - t0) / calls * 1e6)
    return {"build_us": statistics.median(b), "encode_us": statistics.median(e), "total_us": statistics.median(t)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    out = []
    for dt in (mx.bfloat16, mx.float32):
        for rows, d in SHAPES:
            x = mx.random.normal((rows, d)).astype(dt)
            w = mx.random.normal((d,)).astype(dt)
            g = mx.random.normal((rows, d)).astype(dt)
            mx.eval(x, w, g)
            ours = lambda: mx.vjp(lambda a, b: xk.rms_norm(a, b, 1e-5), [x, w], [g])[1]  # noqa: E731
            mlx = lambda: mx.vjp(lambda a, b: mx.fast.rms_norm(a, b, 1e-5), [x, w], [g])[1]  # noqa: E731
            name = f"{str(dt).split('.')[-1]} {rows}x{d}"
            row = {"case": name, "ours": split(ours), "mlx": split(mlx)}
            row["pipelined_us"] = [[a * 1e6, b * 1e6] for a, b in
                                   (measure_pipelined_pair(ours, mlx, calls=20, repeats=3) for _ in range(3))]
            out.append(row)
            o, m = row["ours"], row["mlx"]
            print(f"{name:18s} build {o['build_us']:5.1f} / {m['build_us']:5.1f}  encode {o['encode_us']:5.1f} / "
                  f"{m['encode_us']:5.1f}  serial {o['total_us']:6.1f} / {m['total_us']:6.1f} us (ours / MLX)  "
                  "pipelined " + "  ".join(f"{a:5.1f} / {b:5.1f}" for a, b in row["pipelined_us"]), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
