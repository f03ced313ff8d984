"""Probe: norms of short rows (multi-head LayerNorm of 32-64-element heads, RMSNorm and
LayerNorm of 64-128-element rows), ours against MLX's, outputs kept (session 23).

    python3 scripts/probe_short_rows.py      # on the GPU (backend cuda)

Rows of fewer than 32 16-byte runs take one simdgroup each (most of whose lanes hold no
data). Session 23 tried packing them (32 / runs rows a simdgroup, one thread a run, row sums
by shuffles within a row's lanes; passed the emulator's checks) and ran this probe on one
H100, base against packed, twice each: no difference beyond the run-to-run spread (bf16
multi-head 8192x4x64: 10.4, 9.9 us base, 9.5, 12.1 packed; 65536x128 RMSNorm 18.0, 20.9 against
18.6, 16.9), both near a copy of the same bytes, where the launch dominates. The packing
was not kept. Chains of 20 calls (``timing.measure_chained_pair``, keep=True), medians of 9.
"""

from __future__ import annotations

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import measure_chained_pair

CASES = [("mhln", 8192, 4, 64), ("mhln", 16384, 8, 64), ("mhln", 8192, 16, 32), ("rms", 32768, 1, 64),
         ("rms", 65536, 1, 128), ("ln", 32768, 1, 64), ("ln", 65536, 1, 128), ("rms", 4096, 1, 128)]


def main() -> None:
    for dt in (mx.bfloat16, mx.float32):
        for kind, rows, nh, n in CASES:
            d = nh * n
            x, w, b = (mx.random.normal(s).astype(dt) for s in ((rows, d), (d,), (d,)))
            mx.eval(x, w, b)
            if kind == "mhln":
                def ours(y, nh=nh, w=w, b=b):
                    return xk.multihead_layer_norm(y, w, b, nh, 1e-5)

                def mlx(y, nh=nh, n=n, w=w, b=b):
                    return mx.fast.layer_norm(y.reshape(-1, nh, n), None, None, 1e-5).reshape(y.shape) * w + b
            elif kind == "rms":
                def ours(y, w=w):
                    return xk.rms_norm(y, w, 1e-5)

                def mlx(y, w=w):
                    return mx.fast.rms_norm(y, w, 1e-5)
            else:
                def ours(y, w=w, b=b):
                    return xk.layer_norm(y, w, b, 1e-5)

                def mlx(y, w=w, b=b):
                    return mx.fast.layer_norm(y, w, b, 1e-5)
            a, m = measure_chained_pair(ours, mlx, x, repeats=9, keep=True)
            print(f"{str(dt).split('.')[-1]:8s} {kind:5s} {rows}x{nh}x{n}: ours {a * 1e6:7.2f} us "
                  f"({2 * x.nbytes / a / 1e9:6.0f} GB/s)  mlx {m * 1e6:7.2f} us  x{m / a:5.2f}", flush=True)


if __name__ == "__main__":
    main()
