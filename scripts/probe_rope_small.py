"""Probe: RoPE's launch shape at decode sizes (one position per sequence), chained and
interleaved with MLX (session 17).

    python3 scripts/probe_rope_small.py [--out rope_small.json]      # on the GPU

At 32x32x1x128 bf16 the kernel runs 2048 threads (N = 4 rows x P = 8 pairs each: 8
threadgroups of 256 in session 17; cuda ships 128-thread threadgroups since session 29), and a chained call costs ~3-4 us more than MLX's rope. Variants
patch ops.rope's ROWS_PER_THREAD (nN) and pairs_per_thread (p/k: the 16-byte-run P divided by k; the
shipped cuda plan is n4 p/2, 8-byte runs: ops.rope.RUN_BYTES), the memo
cleared around each; every repeat runs one chain (20 calls) of each variant and of MLX's
op, the order rotating. Rows: the fastest quarter (q25) and median us per call.
PROBE_RS_MARGINAL=1 (session 26): each time is the chain's steady state (timing.measure_marginal)
instead of a 20-call chain's (which also counts the host's encoding: MLX's CUDA backend launches
its first graph only after up to 100 encoded calls). PROBE_RS_BATCH=1: one offset per sequence;
PROBE_RS_WIDEN=0: small offset arrays not copied to device memory (ops.rope.SMALL_OFFSETS_BYTES = 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import fastest_quarter, measure_chained_variants
from xlstm_kernels.ops import rope as rope_ops
from xlstm_kernels.runtime import current_backend

CALLS = 20
REPEATS = int(os.environ.get("PROBE_RS_REPEATS", "11"))
_ppt = rope_ops.pairs_per_thread
_rows = rope_ops.ROWS_PER_THREAD
_tmax = rope_ops.MAX_THREADS.get(current_backend(), rope_ops._MAX_THREADS)  # the backend's shipped cap


def _use(n: int, p_div: int, tmax: int = _tmax) -> None:
    rope_ops.ROWS_PER_THREAD = n
    rope_ops._MAX_THREADS, rope_ops.MAX_THREADS = tmax, {}  # tmax on every backend
    rope_ops.pairs_per_thread = lambda dtype, trad, half, run_bytes=16: max(1, _ppt(dtype, trad, half) // p_div)
    rope_ops._CALLS.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = [(32, 32, 1, 128), (1, 32, 1, 128), (8, 32, 1, 128), (4, 32, 1, 64), (1, 32, 2048, 128)]
    if os.environ.get("PROBE_RS_SHAPES"):  # "B,H,L,D[,dtype[,t]] ...": t = traditional
        shapes = [tuple(s.split(",")) for s in os.environ["PROBE_RS_SHAPES"].split()]
    variants = [("mlx", 0, 0, 0)] + [(f"n{n} p/{p}", n, p, _tmax) for n in (1, 2, 4) for p in (1, 2, 4)]
    # session 20: threadgroups of at most t threads (more of them, on more SMs, at decode sizes)
    variants += [(f"n{n} p/2 t{t}", n, 2, t) for n in (1, 4) for t in (32, 64, 128)]
    if os.environ.get("PROBE_RS_VARIANTS"):  # "n4 p/1|n4 p/2"
        pick = os.environ["PROBE_RS_VARIANTS"].split("|")
        variants = [v for v in variants if v[0] == "mlx" or v[0] in pick]
    rows = []
    t0 = time.perf_counter()
    for spec in shapes:
        shape = tuple(int(v) for v in spec[:4])
        dtype = getattr(mx, spec[4]) if len(spec) > 4 else mx.bfloat16
        trad = len(spec) > 5 and spec[5] == "t"
        x = mx.random.normal(shape).astype(dtype)
        mx.eval(x)
        d = shape[-1]
        off = 4095
        if os.environ.get("PROBE_RS_BATCH", "0") == "1":  # one offset per sequence (an int32 array)
            off = mx.array([4095 - 17 * i for i in range(shape[0])], dtype=mx.int32)
        if os.environ.get("PROBE_RS_WIDEN", "1") == "0":  # offsets of <= 8 bytes read where MLX put them
            rope_ops.SMALL_OFFSETS_BYTES = 0
        ours = lambda a: xk.rope(a, d, traditional=trad, base=10000.0, offset=off)  # noqa: E731
        mlx = lambda a: mx.fast.rope(a, d, traditional=trad, base=10000.0, scale=1.0, offset=off)  # noqa: E731
        ref = mlx(x).astype(mx.float32)
        errs = {}

        def prepare(name, n, p, t):
            if name == "mlx":
                return mlx
            _use(n, p, t)
            if name not in errs:
                o = ours(x).astype(mx.float32)
                errs[name] = (mx.abs(o - ref).max() / mx.abs(ref).max()).item()
            return ours

        times = measure_chained_variants([(v[0], (lambda v=v: prepare(*v))) for v in variants], x, calls=CALLS,
                                         repeats=REPEATS, marginal=os.environ.get("PROBE_RS_MARGINAL", "0") == "1")
        times = {k: [t * 1e6 for t in ts] for k, ts in times.items()}
        _use(_rows, 1)
        rope_ops.pairs_per_thread = _ppt
        tag = "x".join(map(str, shape)) + f" {dtype}" + (" traditional" if trad else "")
        m = fastest_quarter(times["mlx"])
        print(f"{tag}: mlx q25 {m:.1f} med {statistics.median(times['mlx']):.1f} us")
        for name, n, p, t in variants[1:]:
            a = fastest_quarter(times[name])
            print(f"  {name:8s} q25 {a:6.1f} med {statistics.median(times[name]):6.1f}  ratio(q25) "
                  f"{m / a:5.2f}  err {errs[name]:.1e}", flush=True)
            rows.append(dict(shape=list(shape), dtype=str(dtype), traditional=trad, variant=name, all_us=times[name], mlx_us=times["mlx"], err=errs[name]))
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
