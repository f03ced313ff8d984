"""Probe (session 41): RMSNorm at decode size (1 and 8 rows of 4096) in marginal chains, ours
against MLX's ``mx.fast.rms_norm`` and the least a custom kernel costs: a bare one-input
``mx.fast.cuda_kernel`` copy of x (one thread an element, no parameters).

    python3 scripts/probe_rms_decode.py [LABEL]     # on the GPU (backend cuda)

Each line: the median / min over 15 rounds of each side's marginal time a call (us;
``timing.measure_chained_variants``, marginal), the three sides interleaved. At these sizes a
marginal time is the difference of two ~1 ms chains, so single readings move by several us
(a min can read below zero); compare sides within a line. Needs a cuda GPU.
"""

from __future__ import annotations

import statistics
import sys

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks import timing

REPEATS = 15


def _copy_kernel():
    return mx.fast.cuda_kernel(name="xk_probe_copy1", input_names=["x"], output_names=["y"],
                               source="size_t i = blockIdx.x * blockDim.x + threadIdx.x; y[i] = x[i];")


def main() -> int:
    if not mx.cuda.is_available():
        print("probe_rms_decode: needs MLX's CUDA backend", file=sys.stderr)
        return 2
    label = sys.argv[1] if len(sys.argv) > 1 else ""
    kernel = _copy_kernel()

    def copy(x):  # the grid is exactly x.size threads (4096 or 32768: whole blocks of 256)
        return kernel(inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype], grid=(x.size, 1, 1),
                      threadgroup=(256, 1, 1))[0]

    for dt in (mx.float32, mx.bfloat16):
        for rows in (1, 8):
            x, w = mx.random.normal((rows, 4096)).astype(dt), mx.random.normal((4096,)).astype(dt)
            mx.eval(x, w)
            err = mx.abs(xk.rms_norm(x, w, 1e-5).astype(mx.float32)
                         - mx.fast.rms_norm(x, w, 1e-5).astype(mx.float32)).max().item()
            sides = [("ours", lambda: (lambda a: xk.rms_norm(a, w, 1e-5))),
                     ("mlx", lambda: (lambda a: mx.fast.rms_norm(a, w, 1e-5))), ("copy", lambda: copy)]
            t = timing.measure_chained_variants(sides, x, repeats=REPEATS, marginal=True)
            print(f"{label} {rows}x4096 {dt}: max |ours - mlx| {err:.1e}  "
                  + "  ".join(f"{n} {statistics.median(s) * 1e6:.2f}/{min(s) * 1e6:.2f}" for n, s in t.items()),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
