#!/usr/bin/env python3
"""Where the cuda backend loses time on memory-bound ops and GEMM (an NVIDIA GPU probe).

Each case is timed two ways, median over repeats after warm-up:
  sync    one launch, then mx.eval (what `xlstm-kernels bench` reports: launch latency included)
  queued  20 launches chained, one mx.eval, divided by 20 (kernel throughput)

Cases:
  copy    y = x * 2 with MLX ops; Metal-body copies through the cuda factory with 1 element
          per thread, 4 consecutive elements per thread (the norm kernels' pattern) and
          4 elements strided by the threadgroup width
  norm    mx.fast.rms_norm / layer_norm vs ours (float32, bfloat16)
  gemm    mx.matmul vs ours (float16, bfloat16; a few simd tile configs)

    python scripts/cuda_probe.py [--out probe.json] [--only copy,norm,gemm]
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
import numpy as np  # noqa: E402

COPY_BODIES = {
    "one": """
const uint i = thread_position_in_grid.x;
if (i < n) { y[i] = x[i] * 2.0f; }
""",
    "consecutive4": """
const uint i = thread_position_in_grid.x * 4;
for (uint j = 0; j < 4; j++) { if (i + j < n) { y[i + j] = x[i + j] * 2.0f; } }
""",
    "strided4": """
const uint base = threadgroup_position_in_grid.x * threads_per_threadgroup.x * 4 + thread_position_in_threadgroup.x;
for (uint j = 0; j < 4; j++) {
  const uint i = base + j * threads_per_threadgroup.x;
  if (i < n) { y[i] = x[i] * 2.0f; }
}
""",
}


def _time(fn, queued: int, repeats: int) -> dict:
    mx.eval(fn())
    mx.eval(fn())
    sync, q = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        sync.append(time.perf_counter() - t0)
    for _ in range(max(3, repeats // 4)):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(queued)]
        mx.eval(outs)
        q.append((time.perf_counter() - t0) / queued)
    return {"sync_ms": statistics.median(sync) * 1e3, "queued_ms": statistics.median(q) * 1e3}


def _gbs(nbytes: int, t: dict) -> dict:
    return {**t, "sync_gbs": nbytes / t["sync_ms"] / 1e6, "queued_gbs": nbytes / t["queued_ms"] / 1e6}


def probe_copy(out: list, repeats: int) -> None:
    from xlstm_kernels.cuda import metal_kernel

    for n in (1 << 20, 1 << 24, 1 << 26):
        x = mx.random.normal((n,))
        nbytes = 2 * 4 * n
        out.append({"case": "copy", "variant": "mx x*2", "n": n, **_gbs(nbytes, _time(lambda: x * 2, 20, repeats))})
        for name, body in COPY_BODIES.items():
            k = metal_kernel(f"probe_{name}", ["x", "n"], ["y"], body)
            per = 4 if name != "one" else 1
            threads = 256
            grid = -(-n // per)
            grid = -(-grid // threads) * threads

            def fn(k=k, grid=grid):
                return k(inputs=[x, mx.array(n, dtype=mx.uint32)], output_shapes=[(n,)], output_dtypes=[mx.float32],
                         grid=(grid, 1, 1), threadgroup=(threads, 1, 1))[0]

            y = fn()
            assert np.allclose(np.array(y), 2 * np.array(x)), name
            out.append({"case": "copy", "variant": f"factory {name}", "n": n, **_gbs(nbytes, _time(fn, 20, repeats))})
        print(*[f"{r['variant']:>22} n={r['n']:>9} sync {r['sync_gbs']:7.0f} GB/s queued {r['queued_gbs']:7.0f} GB/s"
                for r in out[-4:]], sep="\n", flush=True)


def probe_norm(out: list, repeats: int) -> None:
    import xlstm_kernels as xk

    for dt in (mx.float32, mx.bfloat16):
        for rows, n in ((4096, 4096), (16384, 4096), (4096, 1024), (1024, 8192), (65536, 128)):
            x = mx.random.normal((rows, n)).astype(dt)
            w = mx.random.normal((n,)).astype(dt)
            b = mx.random.normal((n,)).astype(dt)
            nbytes = 2 * x.nbytes
            for name, fn in (("mx rms", lambda: mx.fast.rms_norm(x, w, 1e-5)), ("ours rms", lambda: xk.rms_norm(x, w, 1e-5)),
                             ("mx ln", lambda: mx.fast.layer_norm(x, w, b, 1e-5)),
                             ("ours ln", lambda: xk.layer_norm(x, w, b, 1e-5))):
                r = {"case": "norm", "variant": name, "dtype": str(dt).split(".")[-1], "shape": [rows, n],
                     **_gbs(nbytes, _time(fn, 20, repeats))}
                out.append(r)
                print(f"{name:>9} {r['dtype']:>8} {rows}x{n}: sync {r['sync_ms']:.4f} ms ({r['sync_gbs']:.0f} GB/s) "
                      f"queued {r['queued_ms']:.4f} ms ({r['queued_gbs']:.0f} GB/s)", flush=True)


GEMM_CONFIGS = (
    # the tensor-core gemm_simd (m16n8k16 pairs, ldmatrix, cp.async stages); per simdgroup
    # (BM/WM)x(BN/WN); K stages in flight for float16 gemm_av in brackets
    {"path": "simd", "bm": 128, "bn": 128, "bk": 16, "wm": 2, "wn": 4},  # 64x32 [3]: the preset
    {"path": "simd", "bm": 128, "bn": 128, "bk": 16, "wm": 4, "wn": 2},  # 32x64 [3]
    {"path": "simd", "bm": 128, "bn": 128, "bk": 16, "wm": 2, "wn": 2},  # 64x64 [3], 224 registers
    {"path": "simd", "bm": 128, "bn": 256, "bk": 16, "wm": 2, "wn": 4},  # 64x64 [2]
    {"path": "simd", "bm": 128, "bn": 64, "bk": 32, "wm": 2, "wn": 2},  # 64x32 [2]
    {"path": "simd", "bm": 64, "bn": 64, "bk": 32, "wm": 2, "wn": 2},  # 32x32 [3]
)


def probe_gemm(out: list, repeats: int) -> None:
    import xlstm_kernels as xk

    for dt in (mx.float16, mx.bfloat16):
        for m, nn, k in ((2048, 2048, 2048), (4096, 4096, 4096), (512, 4096, 4096)):
            a = mx.random.normal((m, k)).astype(dt)
            v = mx.random.normal((k, nn)).astype(dt)
            flops = 2 * m * nn * k
            ref = np.array(mx.matmul(a.astype(mx.float32), v.astype(mx.float32)))
            t = _time(lambda: mx.matmul(a, v), 5, repeats)
            out.append({"case": "gemm", "variant": "mx.matmul", "dtype": str(dt).split(".")[-1], "shape": [m, nn, k],
                        **t, "tflops": flops / t["queued_ms"] / 1e9})
            print(f"mx.matmul {out[-1]['dtype']} {m}x{nn}x{k}: {t['queued_ms']:.3f} ms {out[-1]['tflops']:.1f} TFLOP/s",
                  flush=True)
            for cfg in GEMM_CONFIGS:
                try:
                    got = np.array(xk.gemm_av(a, v, tiles=cfg).astype(mx.float32))
                    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
                    t = _time(lambda: xk.gemm_av(a, v, tiles=cfg), 5, repeats)
                except Exception as e:  # noqa: BLE001
                    print("  ", cfg, "FAILED", e, flush=True)
                    continue
                out.append({"case": "gemm", "variant": json.dumps(cfg), "dtype": str(dt).split(".")[-1],
                            "shape": [m, nn, k], **t, "tflops": flops / t["queued_ms"] / 1e9, "max_rel_err": err})
                print(f"  ours {cfg['bm']}x{cfg['bn']}x{cfg['bk']} w{cfg['wm']}x{cfg['wn']}: {t['queued_ms']:.3f} ms "
                      f"{out[-1]['tflops']:.1f} TFLOP/s err {err:.1e}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--only", default="copy,norm,gemm")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    from xlstm_kernels import runtime

    print("mlx", mx.__version__, mx.device_info() if hasattr(mx, "device_info") else "", flush=True)
    out: list = []
    with runtime.use_backend("cuda"):
        for what in a.only.split(","):
            {"copy": probe_copy, "norm": probe_norm, "gemm": probe_gemm}[what](out, a.repeats)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
