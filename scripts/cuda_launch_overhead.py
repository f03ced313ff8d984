#!/usr/bin/env python3
"""Per-launch cost of the cuda backend's wrapper on an NVIDIA GPU.

Times y = 2 * x + 1 (float32) for a small and a large x, each launch synchronised with
mx.eval (median of N runs after warm-up), through:

* ``factory``: xlstm_kernels.cuda.metal_kernel (the Metal body, compat.h header, prologue);
* ``factory-noeval``: 20 launches queued, one mx.eval (launch throughput, not latency);
* ``cuda_kernel``: mx.fast.cuda_kernel with a hand-written CUDA body and no header;
* ``cuda_kernel+hdr``: the same CUDA body with compat.h as header (header size cost);
* ``mx``: 2 * x + 1 with MLX ops.

    python scripts/cuda_launch_overhead.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from xlstm_kernels.cuda import compat_header, metal_kernel  # noqa: E402

METAL_BODY = """\
const uint i = thread_position_in_grid.x;
if (i < n) {
  y[i] = 2.0f * x[i] + 1.0f;
}
"""
CUDA_BODY = """\
const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
if (i < n[0]) {
  y[i] = 2.0f * x[i] + 1.0f;
}
"""


def _median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    fac = metal_kernel(name="xk_overhead", input_names=["x", "n"], output_names=["y"], source=METAL_BODY)
    raw = mx.fast.cuda_kernel(name="xk_overhead_raw", input_names=["x", "n"], output_names=["y"], source=CUDA_BODY)
    raw_h = mx.fast.cuda_kernel(name="xk_overhead_hdr", input_names=["x", "n"], output_names=["y"], source=CUDA_BODY,
                                header="#define XK_MAX_THREADS 256\n" + compat_header())
    rows = []
    for size in (1024, 1 << 24):
        x = mx.random.normal((size,))
        n_arr = mx.array(size, dtype=mx.uint32)
        grid = ((size + 255) // 256 * 256, 1, 1)
        common = dict(output_shapes=[(size,)], output_dtypes=[mx.float32], grid=grid, threadgroup=(256, 1, 1))
        cases = {
            "factory": lambda: fac(inputs=[x, n_arr], **common)[0],
            "cuda_kernel": lambda: raw(inputs=[x, n_arr], **common)[0],
            "cuda_kernel+hdr": lambda: raw_h(inputs=[x, n_arr], **common)[0],
            "mx": lambda: 2.0 * x + 1.0,
        }
        ref = 2.0 * x + 1.0
        for name, fn in cases.items():
            err = mx.max(mx.abs(fn() - ref)).item()
            ms = _median_ms(fn, 10, a.repeats)
            rows.append({"case": name, "size": size, "ms": round(ms, 4), "max_abs_err": err})
            print(f"{name:<16} n={size:<9} {ms:8.4f} ms  err {err:.1e}", flush=True)

        def queued():
            outs = [fac(inputs=[x, n_arr], **common)[0] for _ in range(20)]
            return outs

        for _ in range(3):
            mx.eval(queued())
        t0 = time.perf_counter()
        for _ in range(10):
            mx.eval(queued())
        per = (time.perf_counter() - t0) / 200 * 1e3
        rows.append({"case": "factory-noeval", "size": size, "ms": round(per, 4)})
        print(f"{'factory-noeval':<16} n={size:<9} {per:8.4f} ms per launch (20 queued per eval)", flush=True)
        t0 = time.perf_counter()
        for _ in range(2000):
            fac(inputs=[x, n_arr], **common)
        py = (time.perf_counter() - t0) / 2000 * 1e3
        rows.append({"case": "factory-python-only", "size": size, "ms": round(py, 4)})
        print(f"{'factory-python':<16} n={size:<9} {py:8.4f} ms per call (graph building only, no eval)", flush=True)
        mx.eval(x)
    doc = {"device": mx.device_info(), "mlx": mx.__version__, "header_bytes": len(compat_header()), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
