"""Probe: where a memoised op call's host time goes on the GPU backend (graph building only).

    python3 scripts/probe_host.py --out $OUT/host.json       # on the GPU (backend cuda)
    XLSTM_KERNELS_BACKEND=emulate python3 scripts/probe_host.py --tiny

For small inputs (the GPU time is not measured: calls build the graph, one mx.eval per
batch runs it outside the timed part), per call in microseconds: MLX's op, ours with graph
replay on and off, and a bare ``mx.fast.cuda_kernel`` with the same number of inputs
(the floor of any custom kernel). Then cProfile of ours (replay on) by own time, to tell
our Python from MLX's C++ (``compile`` / ``custom_function`` / kernel calls).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.runtime import current_backend

N = 200


def build_us(fn, n=N, reps=7):
    """Median microseconds per call of `fn` (graph building; evaluated between batches)."""
    outs = [fn() for _ in range(min(n, 10))]
    mx.eval(outs)
    ts = []
    for _ in range(2 if N < 10 else reps):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(n)]
        ts.append((time.perf_counter() - t0) / n * 1e6)
        mx.eval(outs)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    global N
    if args.tiny:
        N = 3
    d = mx.float16
    x = mx.random.normal((8, 4096)).astype(d)
    w = mx.random.normal((4096,)).astype(d)
    g = mx.random.normal((8, 4096)).astype(d)
    q = mx.random.normal((1, 32, 1, 128)).astype(d)
    kv = mx.random.normal((1, 8, 64 if args.tiny else 4096, 128)).astype(d)
    a = mx.random.normal((64, 256)).astype(d)
    b = mx.random.normal((256, 128)).astype(d)
    a1 = mx.random.normal((1, 4096)).astype(d)  # a decode step's GEMV: B as (N, K) rows
    bn = mx.random.normal((64 if args.tiny else 4096, 4096)).astype(d)
    bias = mx.random.normal((bn.shape[0],)).astype(d)
    mx.eval(x, w, g, q, kv, a, b, a1, bn, bias)
    cases = {
        "rms_norm": (lambda: xk.rms_norm(x, w, 1e-5), lambda: mx.fast.rms_norm(x, w, 1e-5)),
        "rms_norm_vjp": (lambda: mx.vjp(lambda u, v: xk.rms_norm(u, v, 1e-5), [x, w], [g])[1],
                         lambda: mx.vjp(lambda u, v: mx.fast.rms_norm(u, v, 1e-5), [x, w], [g])[1]),
        "layer_norm": (lambda: xk.layer_norm(x, w, w, 1e-5), lambda: mx.fast.layer_norm(x, w, w, 1e-5)),
        "rope": (lambda: xk.rope(q, 128, base=10000.0, offset=3),
                 lambda: mx.fast.rope(q, 128, traditional=False, base=10000.0, scale=1.0, offset=3)),
        "decode_attention": (lambda: xk.scaled_dot_product_attention(q, kv, kv, scale=0.088),
                             lambda: mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.088)),
        "gemm_av": (lambda: xk.gemm_av(a, b), lambda: a @ b),
        "gemm_a_bt_gemv": (lambda: xk.gemm_a_bt(a1, bn), lambda: a1 @ bn.T),
        "linear_gemv_bias": (lambda: xk.linear(a1, bn, bias), lambda: mx.addmm(bias, a1, bn.T)),
    }
    rows = []
    backend = current_backend()
    print(f"backend {backend}; us per call (graph building)")
    print(f"{'op':18s} {'mlx':>7s} {'ours':>7s} {'replay off':>10s}")
    for name, (ours, theirs) in cases.items():
        t_mlx, t_ours = build_us(theirs), build_us(ours)
        os.environ["XLSTM_KERNELS_REPLAY"] = "0"
        t_off = build_us(ours)
        del os.environ["XLSTM_KERNELS_REPLAY"]
        print(f"{name:18s} {t_mlx:7.1f} {t_ours:7.1f} {t_off:10.1f}", flush=True)
        rows.append({"op": name, "mlx_us": t_mlx, "ours_us": t_ours, "replay_off_us": t_off})
    if backend == "cuda":  # the floor: a bare cuda_kernel with rms_norm's 4 inputs
        k = mx.fast.cuda_kernel(name="xk_probe_host", input_names=["a", "b", "c", "e"], output_names=["y"],
                                source="size_t i = blockIdx.x * blockDim.x + threadIdx.x; "
                                       "if (i < size_t(a_shape[0]) * a_shape[1]) y[i] = a[i];")
        e = mx.array([1, 2, 3], dtype=mx.int32)
        eps = mx.array(1e-5)
        bare = lambda: k(inputs=[x, w, eps, e], output_shapes=[x.shape], output_dtypes=[x.dtype],  # noqa: E731
                         grid=(x.size, 1, 1), threadgroup=(256, 1, 1))[0]
        t_bare = build_us(bare)
        print(f"{'bare cuda_kernel':18s} {'':7s} {t_bare:7.1f}")
        rows.append({"op": "bare_cuda_kernel", "ours_us": t_bare})
        # MLX's own costs of the layers a memoised call goes through
        compiled_bare = mx.compile(lambda u: k(inputs=[u, w, eps, e], output_shapes=[x.shape],
                                               output_dtypes=[x.dtype], grid=(x.size, 1, 1),
                                               threadgroup=(256, 1, 1))[0])
        compiled_add = mx.compile(lambda u: u + 1)
        custom = mx.custom_function(lambda u: k(inputs=[u, w, eps, e], output_shapes=[x.shape],
                                                output_dtypes=[x.dtype], grid=(x.size, 1, 1),
                                                threadgroup=(256, 1, 1))[0])
        compiled_custom = mx.compile(custom)
        for name, fn in (("compile(x + 1)", lambda: compiled_add(x)), ("x + 1", lambda: x + 1),
                         ("compile(cuda_kernel)", lambda: compiled_bare(x)),
                         ("custom_function(kernel)", lambda: custom(x)),
                         ("compile(custom_function)", lambda: compiled_custom(x))):
            t = build_us(fn)
            print(f"{name:24s} {t:7.1f}")
            rows.append({"op": name, "ours_us": t})
    for name in ("rms_norm", "rms_norm_vjp", "decode_attention"):
        fn = cases[name][0]
        prof = cProfile.Profile()
        prof.enable()
        outs = [fn() for _ in range(N)]
        prof.disable()
        mx.eval(outs)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(10)
        print(f"== cProfile {name} ({N} calls)\n" + "\n".join(s.getvalue().splitlines()[4:22]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
