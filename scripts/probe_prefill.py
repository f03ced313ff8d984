"""Prefill attention: our kernels (the tile prefill per tile plan, and attention_prefill) vs
mx.fast.scaled_dot_product_attention, on the device (CUDA) or, with --tiny, the emulator.

Per shape / dtype / mask / variant: queued us (QN calls per mx.eval, median), TFLOP/s of the
visible score pairs (4 * B * Hq * D * pairs), ratio MLX / ours (> 1: ours faster), max rel err
against MLX's output.
Variants: "auto" (the shipped plan), "noswz" (the plan with padded, unswizzled tiles:
ops.attention.PREFILL_MMA_SWIZZLE off), "WMxRBxBKxST" (ops.attention.PREFILL_MMA_TILES), and
"simd8" (attention_prefill, knob prefill_mma off), "wg" (warpgroup products:
ops.attention.PREFILL_MMA_WARPGROUP on) and "wg<WM>x<ST>[x<BK>]" (with PREFILL_WG_TILES (WM, 1, BK, ST),
BK 64 when left out).
Run: python3 scripts/probe_prefill.py --out $OUT/prefill.json [--budget S] [--tiny]
Variables: PROBE_PREFILL_TILES="4x2x64x2 4x1x64x2 ..." replaces the tile variants;
PROBE_PREFILL_SHAPES="1x32x32x1024x1024x64 ..." (B x Hq x Hkv x Lq x Lk x D) the shapes;
PROBE_PREFILL_VARIANTS="auto wg ..." the whole variant list.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mlx.core as mx  # noqa: E402

import xlstm_kernels as xk  # noqa: E402
from xlstm_kernels.ops import attention as A  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out")
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--budget", type=float, default=150.0)
args = ap.parse_args()

SHAPES = [(1, 32, 32, 1024, 1024, 64), (1, 32, 32, 2048, 2048, 128), (1, 32, 8, 2048, 2048, 128),
          (4, 32, 8, 4096, 4096, 128)]
MASKS = [None, "causal"]
DTYPES = [mx.float16, mx.bfloat16]
TILES = ["4x2x64x2", "4x1x64x2", "4x2x32x3", "4x2x64x3", "8x1x64x2", "4x2x128x2"]
REPS, QN = 7, 10
if os.environ.get("PROBE_PREFILL_TILES"):
    TILES = os.environ["PROBE_PREFILL_TILES"].split()
if os.environ.get("PROBE_PREFILL_SHAPES"):
    SHAPES = [tuple(int(x) for x in s.split("x")) for s in os.environ["PROBE_PREFILL_SHAPES"].split()]
if args.tiny:
    SHAPES = [(1, 2, 1, 70, 90, 64)]
    DTYPES = [mx.float16]
    TILES = ["2x1x32x1"]
    REPS, QN = 2, 2
VARIANTS = os.environ.get("PROBE_PREFILL_VARIANTS", "").split() or ["auto", "noswz", "simd8"] + TILES
WG_DEFAULT, WG_TILES = A.PREFILL_MMA_WARPGROUP, A.PREFILL_WG_TILES
t_start = time.perf_counter()


def pairs(lq, lk, mask):
    if mask != "causal":
        return lq * lk
    off = lk - lq
    return sum(max(0, min(lk, i + off + 1)) for i in range(lq))


def time_queued(f):
    mx.eval([f() for _ in range(QN)])
    ts = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        mx.eval([f() for _ in range(QN)])
        ts.append((time.perf_counter() - t0) / QN)
    return statistics.median(ts) * 1e6


def variant(name):
    """(PREFILL_MMA_TILES, knobs) of a variant name."""
    if name == "auto":
        return None, None
    if name == "simd8":
        return None, {"prefill_mma": False}
    if name == "noswz" or name.startswith("wg"):
        return None, None
    return tuple(int(x) for x in name.split("x")), None


def wg_tiles(name):
    """PREFILL_WG_TILES of a "wg<WM>x<ST>[x<BK>]" variant (BK 64 when left out); WG_TILES for "wg"."""
    if not (name.startswith("wg") and "x" in name):
        return WG_TILES
    wm, st, *bk = (int(x) for x in name[2:].split("x"))
    return wm, 1, bk[0] if bk else 64, st


rows = []
print(f"{'shape':26s} {'mask':6s} {'dt':5s} {'variant':>10s} {'us':>9s} {'TFLOP/s':>8s} {'mlx us':>9s} {'ratio':>6s} {'err':>9s}")
stop = False
for (b, hq, hkv, lq, lk, d) in SHAPES:
    for mask in MASKS:
        for dt in DTYPES:
            if time.perf_counter() - t_start > args.budget:
                stop = True
            if stop:
                break
            q = mx.random.normal((b, hq, lq, d)).astype(dt)
            k = mx.random.normal((b, hkv, lk, d)).astype(dt)
            v = mx.random.normal((b, hkv, lk, d)).astype(dt)
            mx.eval(q, k, v)
            scale = d ** -0.5
            flops = 4.0 * b * hq * d * pairs(lq, lk, mask)
            ref = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)  # noqa: E731
            o_ref = ref().astype(mx.float32)
            mx.eval(o_ref)
            tm = time_queued(ref)
            name = f"{b}x{hq}x{hkv}x{lq}x{lk}x{d}"
            dts = "fp16" if dt == mx.float16 else "bf16"
            print(f"{name:26s} {str(mask):6s} {dts:5s} {'mlx':>10s} {tm:9.1f} {flops / tm / 1e6:8.1f}")
            for vname in VARIANTS:
                if time.perf_counter() - t_start > args.budget:
                    print("(time budget reached)")
                    stop = True
                    break
                tiles, knobs = variant(vname)
                A.PREFILL_MMA_TILES = tiles
                A.PREFILL_MMA_SWIZZLE = vname != "noswz"
                A.PREFILL_MMA_WARPGROUP = vname.startswith("wg")
                A.PREFILL_WG_TILES = wg_tiles(vname)
                A._CALLS.clear()
                f = lambda: xk.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, knobs=knobs)  # noqa: E731
                row = dict(shape=name, mask=str(mask), dtype=dts, variant=vname, mlx_us=tm,
                           mlx_tflops=flops / tm / 1e6)
                try:
                    o = f().astype(mx.float32)
                    mx.eval(o)
                    err = (mx.abs(o - o_ref).max() / mx.maximum(mx.abs(o_ref).max(), 1e-6)).item()
                    t = time_queued(f)
                    row.update(us=t, tflops=flops / t / 1e6, ratio=tm / t, max_rel_err=err)
                    print(f"{'':26s} {'':6s} {dts:5s} {vname:>10s} {t:9.1f} {flops / t / 1e6:8.1f} {tm:9.1f} "
                          f"{tm / t:6.2f} {err:9.2e}")
                except Exception as e:  # a variant that does not fit this shape
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"{'':26s} {'':6s} {dts:5s} {vname:>10s} ERROR {row['error'][:100]}")
                rows.append(row)
            A.PREFILL_MMA_TILES = None
            A.PREFILL_MMA_SWIZZLE = True
            A.PREFILL_MMA_WARPGROUP = WG_DEFAULT
            A.PREFILL_WG_TILES = WG_TILES
            A._CALLS.clear()
print(f"total {time.perf_counter() - t_start:.1f} s")
if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "env": {k: v for k, v in os.environ.items() if k.startswith(("XLSTM", "PROBE"))}},
                  fh, indent=1)
