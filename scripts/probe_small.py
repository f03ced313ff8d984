"""Probe: where a small op's time goes on the GPU backend (queued: 20 calls per mx.eval).

    python3 scripts/probe_small.py            # on the GPU (backend cuda)

Rows, each at RoPE's decode shape 32x32x1x128 bfloat16 (256 KiB) and at 1x32x2048x128:
mx.fast.rope; xk.rope (replay on / off); a bare mx.fast.cuda_kernel copy of x (the floor
of any custom kernel); mx.fast.rms_norm and xk.rms_norm over the same data.
"""

from __future__ import annotations

import os
import statistics
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.ops import rope as rope_mod

Q = 20


def queued(fn, reps=30):
    for _ in range(5):
        mx.eval([fn() for _ in range(Q)])
    out, host = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(Q)]
        t1 = time.perf_counter()
        mx.eval(outs)
        out.append((time.perf_counter() - t0) / Q)
        host.append((t1 - t0) / Q)
    return statistics.median(out) * 1e6, statistics.median(host) * 1e6


copy = mx.fast.cuda_kernel(name="xk_probe_copy", input_names=["x"], output_names=["y"],
                           source="size_t i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_size) y[i] = x[i];")

for shape in [(32, 32, 1, 128), (1, 32, 2048, 128)]:
    x = mx.random.normal(shape).astype(mx.bfloat16)
    w = mx.random.normal((shape[-1],)).astype(mx.bfloat16)
    offs = mx.array(list(range(shape[0])), dtype=mx.int32)
    mx.eval(x, w, offs)
    n = x.size
    rows = {
        "mx.fast.rope": lambda: mx.fast.rope(x, 128, traditional=False, base=10000.0, scale=1.0, offset=offs if shape[0] > 1 else 3),
        "xk.rope": lambda: xk.rope(x, 128, base=10000.0, offset=offs if shape[0] > 1 else 3),
        "bare cuda_kernel copy": lambda: copy(inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype],
                                              grid=(n, 1, 1), threadgroup=(256, 1, 1))[0],
        "mx.fast.rms_norm": lambda: mx.fast.rms_norm(x, w, 1e-5),
        "xk.rms_norm": lambda: xk.rms_norm(x, w, 1e-5),
    }
    for name, fn in rows.items():
        t, h = queued(fn)
        print(f"{'x'.join(map(str, shape)):>14} {name:24s} queued {t:7.1f} us/call  host {h:5.1f} us/call", flush=True)
    os.environ["XLSTM_KERNELS_REPLAY"] = "0"
    t, h = queued(rows["xk.rope"])
    print(f"{'x'.join(map(str, shape)):>14} {'xk.rope replay off':24s} queued {t:7.1f} us/call  host {h:5.1f} us/call")
    del os.environ["XLSTM_KERNELS_REPLAY"]
