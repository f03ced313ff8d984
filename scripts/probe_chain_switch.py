"""Probe: does a chain's time depend on which op's chain ran before it? (session 21)

    python3 scripts/probe_chain_switch.py [--out switch.json]      # on the GPU
    MLX_USE_CUDA_GRAPHS=0 python3 scripts/probe_chain_switch.py    # MLX without CUDA graphs

In scripts/probe_rope_consts.py the variant whose chain came right after MLX's was the
slow one, whichever it was (the shipped op in one order, the compiled custom function in
the reversed order), by ~1.5-2.5 us a call at one token. MLX records a chain's kernels
into a CUDA graph keyed by its node types and dependencies only, so a chain of 20 of our
kernels and one of 20 of MLX's share a graph key, and each updates the executable graph
the other left (or instantiates a new one). The bench's chained pairs
(timing.measure_chained_pair) time half of each side's chains right after the other
side's.

Per op, every repeat runs: MLX (untimed), ours (after MLX), ours (after ours), MLX (after
ours), MLX (after MLX). Rows: q25 and median us per call of 20 chained calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import _chain_once, fastest_quarter

CALLS = 20
REPEATS = int(os.environ.get("PROBE_CS_REPEATS", "11"))


def _cases():
    x = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    yield ("rope 1x32x1x128 bf16", x, lambda a: xk.rope(a, 128, base=10000.0, offset=4095),
           lambda a: mx.fast.rope(a, 128, traditional=False, base=10000.0, scale=1.0, offset=4095))
    h = mx.random.normal((1, 4096)).astype(mx.bfloat16)
    w = mx.random.normal((4096,)).astype(mx.bfloat16)
    yield ("rms_norm 1x4096 bf16", h, lambda a: xk.rms_norm(a, w, 1e-5), lambda a: mx.fast.rms_norm(a, w, 1e-5))
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    k = mx.random.normal((1, 8, 4096, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 8, 4096, 128)).astype(mx.bfloat16)
    s = 128**-0.5
    yield ("decode 1x32x8x4096 bf16", q, lambda a: xk.scaled_dot_product_attention(a, k, v, scale=s),
           lambda a: mx.fast.scaled_dot_product_attention(a, k, v, scale=s))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    graphs = os.environ.get("MLX_USE_CUDA_GRAPHS", "1")
    print(f"MLX_USE_CUDA_GRAPHS={graphs}; {CALLS} chained calls, {REPEATS} repeats, us per call (q25 / median)")
    rows = []
    for name, x0, ours, mlx in _cases():
        mx.eval(x0)
        for f in (ours, mlx):
            mx.eval(f(x0))
            mx.eval(f(f(x0)))
        t = {"ours after mlx": [], "ours after ours": [], "mlx after ours": [], "mlx after mlx": []}
        for _ in range(REPEATS):
            _chain_once(mlx, x0, CALLS, False)
            t["ours after mlx"].append(_chain_once(ours, x0, CALLS, False))
            t["ours after ours"].append(_chain_once(ours, x0, CALLS, False))
            t["mlx after ours"].append(_chain_once(mlx, x0, CALLS, False))
            t["mlx after mlx"].append(_chain_once(mlx, x0, CALLS, False))
        t = {k: [v * 1e6 for v in vs] for k, vs in t.items()}
        print(name)
        for k, vs in t.items():
            print(f"  {k:16s} q25 {fastest_quarter(vs):7.2f}  med {statistics.median(vs):7.2f}", flush=True)
        q = {k: fastest_quarter(vs) for k, vs in t.items()}
        print(f"  ratio mlx/ours: after the other {q['mlx after ours'] / q['ours after mlx']:.2f}, "
              f"after itself {q['mlx after mlx'] / q['ours after ours']:.2f}")
        rows.append(dict(case=name, graphs=graphs, us=t))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
