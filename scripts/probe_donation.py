"""Probe (session 48): does MLX's norm gain from writing over its donated input in a chain?

    python3 scripts/probe_donation.py          # on the GPU (backend cuda)

MLX's ``rms_norm`` / ``layer_norm`` on CUDA write their output over a donatable input, so a
chain ``x = f(x)`` of them keeps one buffer; a custom kernel's outputs are always new buffers,
so our chain alternates two. Each case times marginal chains (``timing.measure_chained_variants``,
interleaved, fastest quarter / median us a call over PROBE_DN_REPEATS rounds) of MLX's op and
ours, each as usual and with every call's output kept alive until the chain is evaluated
(``keep``: nothing can be donated). Where donation explains MLX's lead, its kept chain slows to
ours. Cases (PROBE_DN_CASES, ``op:ROWSxN:dtype``, op rms or ln).
"""

from __future__ import annotations

import os
import statistics
import sys

import mlx.core as mx
import numpy as np

import xlstm_kernels as xk
from xlstm_kernels.benchmarks import timing

REPEATS = int(os.environ.get("PROBE_DN_REPEATS", "9"))
CASES = os.environ.get("PROBE_DN_CASES", "rms:4096x4096:bfloat16 rms:16384x4096:bfloat16 ln:4096x4096:bfloat16").split()


def make(spec: str):
    op, shape, dtype = spec.split(":")
    rows, n = (int(v) for v in shape.split("x"))
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((rows, n)).astype(np.float32)).astype(dt)
    w = mx.array(rng.standard_normal((n,)).astype(np.float32)).astype(dt)
    b = mx.array(rng.standard_normal((n,)).astype(np.float32)).astype(dt)
    if op == "rms":
        return x, (lambda y: xk.rms_norm(y, w, 1e-5)), (lambda y: mx.fast.rms_norm(y, w, 1e-5))
    return x, (lambda y: xk.layer_norm(y, w, b, 1e-5)), (lambda y: mx.fast.layer_norm(y, w, b, 1e-5))


def main() -> int:
    if not mx.cuda.is_available():
        print("probe_donation: needs MLX's CUDA backend", file=sys.stderr)
        return 2
    for spec in CASES:
        x, ours, mlx = make(spec)
        line = []
        for keep in (False, True):
            t = timing.measure_chained_variants([("mlx", lambda: mlx), ("ours", lambda: ours)], x,
                                                repeats=REPEATS, keep=keep, marginal=True)
            for side, s in t.items():
                line.append(f"{side}{' kept' if keep else ''} {timing.fastest_quarter(s) * 1e6:.2f}/"
                            f"{statistics.median(s) * 1e6:.2f}")
        print(f"{spec:28s} " + "  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
