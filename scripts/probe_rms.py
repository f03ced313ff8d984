"""Probe: RMSNorm forward variants against mx.fast.rms_norm, measured interleaved.

    python3 scripts/probe_rms.py --out $OUT/rms.json            # on the GPU (backend cuda)
    XLSTM_KERNELS_BACKEND=emulate python3 scripts/probe_rms.py --tiny   # logic check here

Each round times every variant once: Q calls build the graph, then one mx.eval runs it;
"ms med" is the eval time / Q (device time plus launches; the graph-building host time
is apart, in "host us"). ROUNDS rounds alternate the variants, so that a drift of the
clock or of the machine hits all of them alike; the table gives the median and the best
round. Variants are module
settings of ops.norm (the call memo is cleared between them):
  full        rows of exactly tpr * n_reads elements take the FULL path for every dtype
              (with the shipped occupancy hint on CUDA: FORWARD_BASE_REGISTERS + bytes / 4)
  full_nohint full without the hint
  general     FULL_ROWS off: the general path (bounds code in every run)
  t64         about 64 threads per row (CACHED_THREADS; 4096 bfloat16: 64 elements each, held
              to 56 registers: 18 rows resident per SM against 12 at 128 threads)
  t256        about 256 threads per row
  default     what the op does as shipped (FULL for the dtypes in FULL_FORWARD_DTYPES)
  staged      session 19: FULL rows staged (RMS_FWD_STAGED_CUDA: persistent units, the next
              row copied into shared memory with cp.async while this one is reduced);
              staged_uK: at most K units per SM; unstaged: the switch off
and of the backward (dx and dw of mx.vjp, against mx.vjp of mx.fast.rms_norm):
  vjp_512     512 threads x 8 elements (every dtype)
  vjp_256     256 threads per row for every dtype (16-bit rows before session 7)
  vjp         as shipped: on CUDA one wave of units (132 SMs x 2 blocks: no partial last wave;
              session 6, "vjp_1wave" then: +0.5-8% over 131072 threads), 512 threads per
              16-bit row (session 7)
  vjp_2wave   131072 threads of units (before session 6: 512 units, 1.94 waves on an H100)
Session 7 changed the kernels under every variant: full-warp reductions and the hardware rsqrt
on CUDA, the uniform row index, T * T weight products (forward: bfloat16 16384x4096 "full"
0.94 -> 0.98x MLX, bit-identical to mx.fast.rms_norm now), eps read behind the x loads, and
FULL rows held as 32-bit words (bfloat16 4096: 48 -> 37 registers unhinted), with the hint
FORWARD_BASE_REGISTERS + bytes / 4 (session 6: a flat 48 up to 64 bytes a thread; the
variants "full_r40", "nr16" and "nr8" of that kernel: 0.93-0.99x of "full"). Session 12 (H200)
tried the prefetch again on the session 6/7 layouts, the next row held as loaded (T): float32
0.97-1.01x of the shipped kernel, bfloat16 0.67-0.78x (96 registers against 64) -- dropped
again.
PROBE_RMS_VARIANTS / PROBE_RMS_VJP_VARIANTS / PROBE_RMS_SHAPES / PROBE_RMS_DTYPES pick.
PROBE_RMS_KEEP=1 with it (session 19): the chain's outputs all stay referenced (the bench's
"kept"). PROBE_RMS_CHAIN=1 (session 15): the forward's Q calls are chained (each normalises the last
one's output, as a layer stack does: no two kernels overlap on the GPU), where by default
they are independent (a CUDA graph may run them concurrently).
Tried and dropped (H100, session 5): x read again for the output instead of kept in
registers (30-34 registers, 0.67-0.85x of the kept version), and the backward prefetching
a unit's next row (+1-2% float32, -25-40% bfloat16). Session 6: the weight runs loaded
with x before the reduction (84 registers unhinted: 0.82-0.96x of "full"), and "full_r40"
(spills: 0.72-0.90x).
ratio = MLX time / ours (> 1: ours faster); GB/s = bytes moved (forward: x read, y
written; backward: x, g read, dx written) / time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx
import numpy as np

import xlstm_kernels as xk
from xlstm_kernels.ops import norm as norm_mod

SHIPPED = norm_mod.FULL_FORWARD_DTYPES
SHIPPED_BASE_REGISTERS = norm_mod.FORWARD_BASE_REGISTERS
SHIPPED_THREADS = norm_mod.CACHED_THREADS
SHIPPED_FWD_STAGED = norm_mod.RMS_FWD_STAGED_CUDA
SHIPPED_FWD_UNITS = norm_mod.RMS_FWD_STAGED_UNITS_PER_SM
_VJP_KNOBS = ("VJP_THREADS", "VJP_MAX_READS", "VJP_REGISTERS", "RMS_VJP_TARGET_THREADS_CUDA",
              "RMS_VJP_THREADS_CUDA_16BIT", "RMS_VJP_THREADS_CUDA_32BIT", "RMS_VJP_STAGED_CUDA",
              "RMS_VJP_STAGE_BYTES", "RMS_VJP_STAGED_THREADS_CUDA", "RMS_VJP_STAGED_MAX_READS",
              "RMS_VJP_STAGED_UNITS_PER_SM", "RMS_VJP_STAGED_REGISTERS", "RMS_VJP_STAGED_STRIDED",
              "RMS_VJP_STAGE_L1")
SHIPPED_VJP = {k: getattr(norm_mod, k) for k in _VJP_KNOBS}
# the backward's settings per variant (ops.norm attributes; the others as shipped)
VJP_VARIANTS = {
    "vjp": {},
    "vjp_512": dict(VJP_THREADS=512, VJP_MAX_READS=8, RMS_VJP_THREADS_CUDA_16BIT=512, RMS_VJP_THREADS_CUDA_32BIT=512),
    "vjp_256": dict(VJP_THREADS=256, VJP_MAX_READS=16, RMS_VJP_THREADS_CUDA_16BIT=256, RMS_VJP_THREADS_CUDA_32BIT=256),
    "vjp_2wave": dict(VJP_THREADS=256, VJP_MAX_READS=16, RMS_VJP_TARGET_THREADS_CUDA=131072,
                      RMS_VJP_THREADS_CUDA_16BIT=256, RMS_VJP_THREADS_CUDA_32BIT=256),
    # session 12: units per SM for 16-bit rows (512 threads: 64 registers, two blocks fit an SM;
    # the shipped thread target gives them one), and 1024 threads x 4
    "vjp_u2": dict(RMS_VJP_TARGET_THREADS_CUDA=132 * 2 * 512),
    "vjp_1024u2": dict(RMS_VJP_THREADS_CUDA_16BIT=1024, RMS_VJP_TARGET_THREADS_CUDA=132 * 2 * 1024),
    # session 13: the staged backward laid out as MLX's (128 threads x up to 32 elements a row,
    # three units per SM, next row of x and g staged with cp.async) = "vjp"; variants:
    "vjp_nostage": dict(RMS_VJP_STAGED_CUDA=False),  # session 12 as shipped (512 x 8 for 16-bit rows)
    "vjp_128": dict(RMS_VJP_STAGED_CUDA=False, RMS_VJP_THREADS_CUDA_16BIT=128, RMS_VJP_THREADS_CUDA_32BIT=128,
                    VJP_MAX_READS=32, RMS_VJP_TARGET_THREADS_CUDA=132 * 3 * 128, VJP_REGISTERS=160),  # unstaged
    "vjp_st2": dict(RMS_VJP_STAGED_UNITS_PER_SM=2),
    "vjp_st4": dict(RMS_VJP_STAGED_UNITS_PER_SM=4, RMS_VJP_STAGED_REGISTERS=128),
    "vjp_st_nohint": dict(RMS_VJP_STAGED_REGISTERS=0),
    "vjp_st256": dict(RMS_VJP_STAGED_THREADS_CUDA=256, RMS_VJP_STAGED_REGISTERS=112),
    # stages up to 64 / 128 KiB: float32 4096 and 16-bit 8192 rows / float32 8192 rows staged too
    "vjp_st32k": dict(RMS_VJP_STAGE_BYTES=32768),
    "vjp_st64k": dict(RMS_VJP_STAGE_BYTES=65536),
    "vjp_st128k": dict(RMS_VJP_STAGE_BYTES=131072),
    "vjp_consec": dict(RMS_VJP_STAGED_STRIDED=False),  # each unit its consecutive rows (round 1-2)
    "vjp_l1": dict(RMS_VJP_STAGE_L1=True),  # the stage copies through L1 (cp.async.ca)
}


def configure(name: str) -> None:
    for k, v in {**SHIPPED_VJP, **VJP_VARIANTS.get(name, {})}.items():
        setattr(norm_mod, k, v)
    norm_mod.FULL_ROWS = name != "general"
    every = (mx.float32, mx.float16, mx.bfloat16)
    norm_mod.FULL_FORWARD_DTYPES = SHIPPED if name == "default" else every
    norm_mod.FORWARD_BASE_REGISTERS = 0 if name == "full_nohint" else SHIPPED_BASE_REGISTERS
    norm_mod.CACHED_THREADS = {"t32": 32, "t64": 64, "t256": 256, "t512": 512, "t1024": 1024}.get(name, SHIPPED_THREADS)
    # session 19: the staged forward ("staged": as the switch ships; "staged_uK": at most K units per SM;
    # "unstaged": the switch off)
    if name.startswith("staged") or name == "unstaged":
        norm_mod.RMS_FWD_STAGED_CUDA = name != "unstaged"
        norm_mod.RMS_FWD_STAGED_UNITS_PER_SM = int(name[8:]) if name.startswith("staged_u") else SHIPPED_FWD_UNITS
    else:
        norm_mod.RMS_FWD_STAGED_CUDA = SHIPPED_FWD_STAGED
        norm_mod.RMS_FWD_STAGED_UNITS_PER_SM = SHIPPED_FWD_UNITS
    norm_mod._CALLS.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in t.split("x")) for t in
              os.environ.get("PROBE_RMS_SHAPES", "16384x4096,4096x4096").split(",") if t]
    rounds, q = 5, 20
    if args.tiny:
        shapes, rounds, q = [(8, 256)], 2, 2
    variants = [v for v in os.environ.get("PROBE_RMS_VARIANTS", "default,full_nohint,t64,t256,general").split(",") if v]
    eps = 1e-5
    rows = []
    if not args.tiny:
        c = mx.random.normal((64 * 1024 * 1024,))
        mx.eval(c)
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            mx.eval([c * 2 for _ in range(q)])
            ts.append((time.perf_counter() - t0) / q)
        print(f"copy x*2 256 MiB queued: {2 * c.nbytes / statistics.median(ts) / 1e9:.0f} GB/s (median), "
              f"{2 * c.nbytes / min(ts) / 1e9:.0f} GB/s (best)")
        rows.append({"op": "copy", "gbps_median": 2 * c.nbytes / statistics.median(ts) / 1e9})
        del c
    print(f"{'shape':12s} {'dtype':9s} {'variant':11s} {'ms med':>8s} {'ms best':>8s} {'GB/s':>6s} "
          f"{'mlx med':>8s} {'ratio':>6s} {'relerr':>8s} {'host us':>7s}")
    for shape in shapes:
        for dt in [getattr(mx, t) for t in os.environ.get("PROBE_RMS_DTYPES", "float32,bfloat16,float16").split(",")]:
            rng = np.random.default_rng(1)
            x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)
            w = mx.array(rng.standard_normal(shape[-1:]).astype(np.float32)).astype(dt)
            mx.eval(x, w)
            g = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)
            mx.eval(g)

            def vjp_of(f):
                return lambda: mx.vjp(lambda a, b: f(a, b, eps), [x, w], [g])[1]

            vjp_names = [v for v in os.environ.get("PROBE_RMS_VJP_VARIANTS", ",".join(VJP_VARIANTS)).split(",") if v]
            for kind, names in (("fwd", variants), ("vjp", vjp_names)):
                chain = kind == "fwd" and os.environ.get("PROBE_RMS_CHAIN") == "1"
                keep = chain and os.environ.get("PROBE_RMS_KEEP") == "1"
                if kind == "fwd":
                    mlx_fn = lambda a=x: mx.fast.rms_norm(a, w, eps)  # noqa: E731
                    ours_fn = lambda a=x: xk.rms_norm(a, w, eps)  # noqa: E731
                    nbytes = 2 * x.nbytes
                else:
                    mlx_fn, ours_fn = vjp_of(mx.fast.rms_norm), vjp_of(xk.rms_norm)
                    nbytes = 3 * x.nbytes
                want = [a.astype(mx.float32) for a in (mlx_fn() if kind == "vjp" else [mlx_fn()])]
                times: dict[str, list[float]] = {v: [] for v in ["mlx", *names]}
                host: dict[str, list[float]] = {v: [] for v in ["mlx", *names]}
                errs = {}
                for r in range(rounds):
                    for v in ["mlx", *names]:
                        fn = mlx_fn
                        if v != "mlx":
                            configure(v)
                            fn = ours_fn
                            if r == 0:
                                got = fn()
                                got = got if kind == "vjp" else [got]
                                errs[v] = max((mx.abs(a.astype(mx.float32) - b).max() / mx.abs(b).max()).item()
                                              for a, b in zip(got, want))
                        mx.eval([fn() for _ in range(2)])
                        t0 = time.perf_counter()
                        if chain:
                            outs = [x]
                            for _ in range(q):
                                # PROBE_RMS_KEEP=1 (session 19): every output stays referenced, as
                                # the bench's "kept" (MLX's op cannot write into its input then)
                                outs = [fn(outs[-1])] if not keep else outs + [fn(outs[-1])]
                        else:
                            outs = [fn() for _ in range(q)]
                        t1 = time.perf_counter()
                        mx.eval(outs)
                        times[v].append((time.perf_counter() - t1) / q)
                        host[v].append((t1 - t0) / q)
                mlx_med = statistics.median(times["mlx"])
                for v in ["mlx", *names]:
                    med, best = statistics.median(times[v]), min(times[v])
                    print(f"{'x'.join(map(str, shape)):12s} {str(dt).split('.')[-1]:9s} {v:11s} {med * 1e3:8.4f} "
                          f"{best * 1e3:8.4f} {nbytes / med / 1e9:6.0f} {mlx_med * 1e3:8.4f} {mlx_med / med:6.3f} "
                          f"{errs.get(v, 0.0):8.1e} {statistics.median(host[v]) * 1e6:7.1f}")
                    rows.append({"shape": list(shape), "dtype": str(dt), "variant": v, "kind": kind, "chain": chain,
                                 "median_ms": med * 1e3, "best_ms": best * 1e3, "mlx_median_ms": mlx_med * 1e3,
                                 "ratio": mlx_med / med, "gbps": nbytes / med / 1e9, "relerr": errs.get(v),
                                 "host_us": statistics.median(host[v]) * 1e6})
    configure("default")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
