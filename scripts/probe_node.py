"""Probe: what the mx.custom_function node of a replayed call costs on the GPU backend.

    python3 scripts/probe_node.py [--out node.json]      # on the GPU (backend cuda)

A tiny copy kernel (PROBE_NODE_ELEMS elements, default 32*128*32: a decode batch's RoPE
input) called through ``mx.compile`` of the bare ``cuda_kernel`` call and of an
``mx.custom_function`` around it (what a memoised op of ours replays): per call, chained
(each call takes the last one's output; built, then evaluated: evaluation only) and
pipelined (``timing.measure_pipelined``: building included). Then MLX's RoPE and ours at
the same size, chained. Interleaved repeats, the fastest quarter (q25), microseconds.

Session 21: its custom function has no VJP, and MLX calls such a custom function as a plain
function (no graph node), so this probe compares two identical graphs. With a VJP the
custom function adds a StopGradient and a CustomTransforms node per output (~0.5 us a call:
scripts/probe_rope_consts.py, ccf against ccfv).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import measure_chained, measure_pipelined

N = int(os.environ.get("PROBE_NODE_ELEMS", str(32 * 128 * 32)))
REPEATS = int(os.environ.get("PROBE_NODE_REPEATS", "9"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    k = mx.fast.cuda_kernel(name="xk_probe_node", input_names=["a"], output_names=["y"],
                            source="size_t i = blockIdx.x * blockDim.x + threadIdx.x; "
                                   "if (i < size_t(a_shape[0])) y[i] = a[i];")
    launch = lambda u: k(inputs=[u], output_shapes=[u.shape], output_dtypes=[u.dtype],  # noqa: E731
                         grid=(u.size, 1, 1), threadgroup=(256, 1, 1))[0]
    custom = mx.custom_function(launch)
    bare_c, custom_c = mx.compile(launch), mx.compile(custom)
    x = mx.random.normal((N,)).astype(mx.bfloat16)
    q = mx.random.normal((32, 32, 1, 128)).astype(mx.bfloat16)
    mx.eval(x, q)
    cases = {
        "compile(kernel)": (bare_c, x),
        "compile(custom_function(kernel))": (custom_c, x),
        "mlx rope 32x32x1x128": (lambda u: mx.fast.rope(u, 128, traditional=False, base=10000.0, scale=1.0,
                                                         offset=5), q),
        "ours rope 32x32x1x128": (lambda u: xk.rope(u, 128, base=10000.0, offset=5), q),
    }
    res = {name: {"chained": [], "pipelined": []} for name in cases}
    for r in range(REPEATS):
        names = list(cases)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            fn, inp = cases[name]
            res[name]["chained"].append(measure_chained(fn, inp, calls=20, repeats=3) * 1e6)
            res[name]["pipelined"].append(measure_pipelined(lambda: fn(inp), calls=20, batches=6, repeats=2) * 1e6)
    rows = []
    for name, d in res.items():
        q25 = {m: sorted(v)[len(v) // 4] for m, v in d.items()}
        med = {m: statistics.median(v) for m, v in d.items()}
        print(f"{name:36s} chained q25 {q25['chained']:6.2f} med {med['chained']:6.2f}   "
              f"pipelined q25 {q25['pipelined']:6.2f} med {med['pipelined']:6.2f} us", flush=True)
        rows.append({"case": name, "q25_us": q25, "median_us": med})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
