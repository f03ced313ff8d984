"""Emulator speed: emulated threads per second and compile time per kernel.

    python bench/bench_emulator.py [--repeats 5] [--out bench/results/emulator.json]

Workload: C = A . V with 128x256 outputs and a reduction of 64 (the `gemm_scalar` body
of metal_src/gemm.metal with 16x16 tiles and one output per thread: 32,768 threads in 128
threadgroups, 8 barriers per thread), on one worker and on every core. Times include the
Python side of a launch (argument conversion, output allocation). Compile time: fresh cache directory, several
distinct kernel texts, timed one by one (the runtime library is built first and not
counted). Targets (issue 2): >= 1 M threads/s on one core, <= 0.5 s per compile.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def _gemm_call(m: int, n: int, k: int, tile: int, rng) -> tuple[dict, np.ndarray]:
    """Arguments of the gemm_scalar kernel for C (m, k) = A (m, n) . V (n, k), one thread per output."""
    a = mx.array(rng.standard_normal((m, n)).astype(np.float32))
    v = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    z = mx.zeros((1,), dtype=mx.float32)
    params = mx.array([m, k, n, 0, 0, n, 1, 1], dtype=mx.int64)  # kernel's M, N, K = rows, cols, reduction
    template = [("T", mx.float32), ("TM", tile), ("TN", tile), ("TK", tile), ("RM", 1), ("RN", 1), ("PAD", 0),
                ("DB", False), ("VEC4", False), ("TRANS_A", False), ("TRANS_B", False),
                ("HAS_BIAS", False), ("ACT", 0), ("HAS_RES", False)]
    call = dict(inputs=[a, v, z, z, params], template=template, grid=(k, m, 1), threadgroup=(tile, tile, 1),
                output_shapes=[(1, m, k)], output_dtypes=[mx.float32])
    return call, np.asarray(a, dtype=np.float64) @ np.asarray(v, dtype=np.float64)


def bench_threads(repeats: int) -> dict:
    from xlstm_kernels.emulate import metal_kernel
    from xlstm_kernels.ops.gemm import SCALAR

    m, n, k, tile = 128, 64, 256, 16
    kernel = metal_kernel(name=SCALAR.kernel, input_names=list(SCALAR.input_names), output_names=["C"],
                          source=SCALAR.source(), header=SCALAR.full_header())
    call, ref = _gemm_call(m, n, k, tile, np.random.default_rng(0))
    kernel(**call)  # compile + warm up
    threads = m * k
    out = {}
    for workers in sorted({1, os.cpu_count() or 1}):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            (c,) = kernel(**call, workers=workers)
            times.append(time.perf_counter() - t0)
        err = float(np.max(np.abs(np.asarray(c)[0] - ref)) / np.max(np.abs(ref)))
        med = statistics.median(times)
        out[f"workers_{workers}"] = {
            "median_s": med,
            "threads_per_s": threads / med,
            "max_rel_err": err,
        }
        print(f"gemm {m}x{n}x{k}, 16x16 tiles, {workers} worker(s): {med * 1e3:7.2f} ms  "
              f"{threads / med / 1e6:5.2f} M threads/s  (rel.err {err:.1e})", flush=True)
    return {"shape": [m, n, k], "tile": tile, "threads": threads, **out}


def bench_compile(count: int) -> dict:
    from xlstm_kernels.emulate import kernel as kmod
    from xlstm_kernels.emulate import metal_kernel
    from xlstm_kernels.ops.gemm import SCALAR

    kmod._runtime()  # the runtime library is built once per machine: not counted
    call, _ = _gemm_call(16, 16, 16, 16, np.random.default_rng(1))
    times = []
    for i in range(count):
        source = f"// variant {i} {time.time_ns()}\n" + SCALAR.source()  # a new text: really compiled
        kernel = metal_kernel(name=SCALAR.kernel, input_names=list(SCALAR.input_names), output_names=["C"],
                              source=source, header=SCALAR.full_header())
        t0 = time.perf_counter()
        kernel(**call)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(f"compile + first launch of a new kernel: median {med:.3f} s over {count}", flush=True)
    return {"count": count, "median_s": med, "all_s": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compiles", type=int, default=4)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "emulator.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["XLSTM_KERNELS_EMULATE_CACHE"] = cache
        result = {
            "command": "python bench/bench_emulator.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": {"platform": platform.platform(), "processor": platform.machine(), "cpus": os.cpu_count()},
            "gemm": bench_threads(args.repeats),
            "compile": bench_compile(args.compiles),
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
