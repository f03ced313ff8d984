"""GEMM family vs mx.matmul, in the same run.

    python bench/bench_gemm.py [--backend metal|emulate] [--dtypes float32,float16,bfloat16]
                               [--shapes 1x4096x4096,2048x2048x2048] [--repeats 10]
                               [--out bench/results/gemm-<backend>.json]

Shapes are MxKxN of the output-centric product (M rows, K reduction, N columns); for
each layout the operands are laid out as that layout expects. On Metal each row
reports time, GFLOP/s, the ratio to mx.matmul, % of the device roofline (from the
matched preset) and the max relative error vs float64. The emulator cannot time a
GPU: there the shapes default to small ones and the rows report correctness and the
emulated rate (threads/s) only.

Design target (issue 3): the simdgroup path >= 0.9x mx.matmul for fp16/bf16 at 2048^3 on
Apple GPUs. Its structure follows MLX's steel GEMM (64x64x16 block, 2x2 simdgroups of
8x8 MMA fragments, padded threadgroup tiles, float accumulation); what it lacks vs
steel is the register-level double buffering of fragments and the aligned fast paths,
so expect it below steel until tuned on hardware.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import xlstm_kernels as xk
from xlstm_kernels import runtime, tiles

METAL_SHAPES = ["1x4096x4096", "512x1024x4096", "2048x2048x2048", "4096x1024x4096"]
EMULATE_SHAPES = ["1x256x192", "33x29x31", "64x96x80"]
LAYOUTS = ("gemm_av", "gemm_at_b", "gemm_a_bt")


def operands(layout: str, m: int, k: int, n: int, dtype, rng) -> tuple[mx.array, mx.array, np.ndarray]:
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    if layout == "gemm_at_b":
        a = np.ascontiguousarray(a.T)
    if layout == "gemm_a_bt":
        b = np.ascontiguousarray(b.T)
    return mx.array(a).astype(dtype), mx.array(b).astype(dtype), ref


def baseline(layout: str, a: mx.array, b: mx.array) -> mx.array:
    if layout == "gemm_at_b":
        return mx.matmul(a.T, b)
    if layout == "gemm_a_bt":
        return mx.matmul(a, b.T)
    return mx.matmul(a, b)


def timed(fn, repeats: int) -> float:
    mx.eval(fn())  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_one(layout, path, m, k, n, dtype, rng, emulated, repeats, roof) -> dict:
    """Time one (layout, path, shape, dtype) against mx.matmul and print its row."""
    a, b, ref = operands(layout, m, k, n, dtype, rng)
    op = getattr(xk, layout)
    tiles_arg = None if path == "preset" else {"path": path}
    if m == 1 and path == "preset":
        tiles_arg = None  # the preset picks gemv for M == 1
    info = xk.explain(layout, (m, n, k), dtype, tiles_arg)  # output rows, output columns, reduction
    fn = lambda: op(a, b, tiles=tiles_arg)  # noqa: E731
    t_ours = timed(fn, 1 if emulated else repeats)
    err = float(np.max(np.abs(np.asarray(fn().astype(mx.float32), dtype=np.float64) - ref)) / np.max(np.abs(ref)))
    shape = f"{m}x{k}x{n}"
    row = {"layout": layout, "dtype": str(dtype).split(".")[-1], "shape": [m, k, n], "path": info["path"],
           "config": info["config"], "max_rel_err": err}
    if emulated:
        threads = int(np.prod(info["grid"]))
        row.update({"emulated_s": t_ours, "emulated_threads_per_s": threads / t_ours})
        print(f"{layout:<10} {row['dtype']:<9} {shape:<16} {info['path']:<7} {t_ours * 1e3:>9.1f} "
              f"{threads / t_ours / 1e6:>8.2f}M thr/s {'-':>6} {err:>9.1e}")
    else:
        t_mx = timed(lambda: baseline(layout, a, b), repeats)
        peak = roof["fp32_tflops"] if dtype == mx.float32 else roof.get("fp16_tflops", roof["fp32_tflops"])
        gflops = 2.0 * m * n * k / t_ours / 1e9
        row.update({"ms": t_ours * 1e3, "mx_matmul_ms": t_mx * 1e3, "gflops": gflops,
                    "ratio_vs_mx": t_mx / t_ours, "pct_roofline": 100 * gflops / (peak * 1e3)})
        print(f"{layout:<10} {row['dtype']:<9} {shape:<16} {info['path']:<7} {t_ours * 1e3:>9.3f} "
              f"{gflops:>9.1f} {row['ratio_vs_mx']:>7.2f} {row['pct_roofline']:>6.1f} {err:>9.1e}")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("metal", "emulate"), default="metal" if mx.metal.is_available() else "emulate")
    p.add_argument("--dtypes", default="float32,float16,bfloat16")
    p.add_argument("--shapes", default=None)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--paths", default=None,
                   help="comma list of preset,scalar,simd (default: preset on Metal, scalar,simd on the emulator)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    emulated = args.backend == "emulate"
    shapes = (args.shapes or ",".join(EMULATE_SHAPES if emulated else METAL_SHAPES)).split(",")
    dtypes = [getattr(mx, d) for d in args.dtypes.split(",")]
    paths = (args.paths or ("scalar,simd" if emulated else "preset")).split(",")
    roof = tiles.roofline()
    rng = np.random.default_rng(0)
    rows = []
    print(f"backend {args.backend}; device family {tiles.detect_device().family_key}; roofline {roof}")
    if emulated:
        print("emulator: no GPU timing; reporting correctness and emulated threads/s")
    print(f"{'layout':<10} {'dtype':<9} {'shape':<16} {'path':<7} {'ms':>9} {'GFLOP/s':>9} {'vs mx':>7} {'%roof':>6} {'rel.err':>9}")
    with runtime.use_backend(args.backend):
        for shape in shapes:
            m, k, n = (int(v) for v in shape.split("x"))
            for dtype in dtypes:
                for path in paths:
                    for layout in LAYOUTS:
                        rows.append(bench_one(layout, path, m, k, n, dtype, rng, emulated, args.repeats, roof))
    out = Path(args.out or Path(__file__).parent / "results" / f"gemm-{args.backend}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": "python bench/bench_gemm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "backend": args.backend, "machine": platform.platform(), "mlx": mx.__version__, "rows": rows,
    }, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
