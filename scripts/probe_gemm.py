#!/usr/bin/env python3
"""Probe: gemm_simd tile candidates against mx.matmul (cuBLAS on the cuda backend).

    python3 scripts/probe_gemm.py --out $OUT/gemm.json          # on the H100 (backend cuda)
    XLSTM_KERNELS_BACKEND=emulate python3 scripts/probe_gemm.py --tiny   # logic check on a CPU

Every candidate is passed as ``tiles=`` (bm, bn, bk, wm, wn, split_k), so one run compares
them all. On cuda the body now pipelines up to 4 stages in 48 KiB (XK_GEMM_STAGE_BYTES /
XK_GEMM_MAX_STAGES): the "stages" column is ops.gemm.simd_stages for the backend.
Timing: `queued` = seconds per call with 20 calls per mx.eval (median of 5 batches, after a
warm-up batch), `sync` = median of 20 synchronised calls. TFLOP/s from the queued time;
ratio = MLX time / ours (> 1: we are faster). err = max |ours - mx.matmul| / max |mx.matmul|.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mlx.core as mx  # noqa: E402

import xlstm_kernels as xk  # noqa: E402
from xlstm_kernels.ops import gemm as gemm_mod  # noqa: E402
from xlstm_kernels.runtime import current_backend  # noqa: E402

# name: (bm, bn, bk, wm, wn, split_k); "auto": tiles=None (what the op resolves itself:
# the preset, plus the waves rule's split-K on under-filled grids)
CONFIGS = {
    "auto": None,
    "p128x128x16_w2x4": (128, 128, 16, 2, 4, 1),  # the nvidia_hopper preset: 4 stages, ~117 regs (2 blocks / SM)
    "c128x256x16_w4x4": (128, 256, 16, 4, 4, 1),  # 16 warps, warp tile 32x64, 3 stages (a_bt 2), 128 regs
    "c256x128x16_w4x4": (256, 128, 16, 4, 4, 1),  # 16 warps, warp tile 64x32, 2 stages (at_b 3), ~118 regs
    "c128x128x32_w2x4": (128, 128, 32, 2, 4, 1),  # half the barriers, 2 stages in 37 KiB, ~128 regs
    "c96x128x32_w2x4": (96, 128, 32, 2, 4, 1),    # 3 stages in 48 KiB (av; a_bt 2), ~120 regs; at_b not fast
    "c96x128x32_w2x2": (96, 128, 32, 2, 2, 1),    # 4 warps, warp tile 48x64, 3 stages, ~166 regs (3 blocks / SM)
    "c128x64x32_w2x2": (128, 64, 32, 2, 2, 1),    # 3 stages in 44 KiB, ~126 regs
    "c128x256x16_w2x4": (128, 256, 16, 2, 4, 1),  # 8 warps, warp tile 64x64, 3 stages, ~190 regs (1 block / SM)
}
# Variants of the body's compile-time switches, launched directly (gemm_av only) with header
# macros redefined: name -> (config, {macro: value}).
#   _3st: at most 3 stages (the schedule before the 48 KiB budget; run on request with --only)
#   _g8:  XK_GEMM_GROUP_M 8: threadgroups walk bands of 8 tile rows column by column (L2 reuse)
RAW_CONFIGS = {
    "p128x128x16_w2x4_g8": ((128, 128, 16, 2, 4, 1), {"XK_GEMM_GROUP_M": 8}),
    "c128x256x16_w4x4_g8": ((128, 256, 16, 4, 4, 1), {"XK_GEMM_GROUP_M": 8}),
    "p128x128x16_w2x4_3st": ((128, 128, 16, 2, 4, 1), {"XK_GEMM_MAX_STAGES": 3}),
}
ON_REQUEST = {"p128x128x16_w2x4_3st"}
SPLIT_CONFIGS = {  # only for the under-filled 512x1024x4096
    "p128x128x16_w2x4_s4": (128, 128, 16, 2, 4, 4),
    "c128x128x32_w2x4_s4": (128, 128, 32, 2, 4, 4),
    "c64x128x32_w2x2_s2": (64, 128, 32, 2, 2, 2),
}
SHAPES = [(4096, 4096, 4096), (2048, 2048, 2048), (4096, 4096, 1024), (512, 1024, 4096)]
# (dtype, op) -> candidates run, most informative first (the --budget-s cut-off skips the rest):
# the full list for fp16 gemm_av, subsets elsewhere (each new (config, dtype, op) is one
# kernel compile, ~1-3 s).
PLAN = {
    ("float16", "gemm_av"): list(CONFIGS) + [c for c in RAW_CONFIGS if c not in ON_REQUEST],
    ("bfloat16", "gemm_av"): ["auto", "p128x128x16_w2x4", "c128x256x16_w4x4", "c128x128x32_w2x4", "c96x128x32_w2x4"],
    ("float16", "gemm_at_b"): ["auto", "p128x128x16_w2x4", "c128x256x16_w4x4", "c256x128x16_w4x4", "c128x128x32_w2x4"],
    ("bfloat16", "gemm_at_b"): ["auto", "p128x128x16_w2x4", "c128x256x16_w4x4"],
}
TINY_SHAPES = [(160, 136, 72), (33, 29, 31)]


_RAW_KERNELS: dict = {}


def raw_gemm_av(a, b, tiles, defines, backend):
    """gemm_av(a, b) (2-D, no epilogue) through gemm_simd with the header's macros `defines`."""
    spec = gemm_mod.SIMD
    key = (tuple(sorted(defines.items())), backend)
    kern = _RAW_KERNELS.get(key)
    if kern is None:
        if backend == "cuda":
            from xlstm_kernels.cuda import metal_kernel as factory
        elif backend == "emulate":
            from xlstm_kernels.emulate import metal_kernel as factory
        else:
            raise RuntimeError(f"no raw launches on backend {backend!r}")
        header = "".join(f"#undef {k}\n#define {k} {v}\n" for k, v in defines.items()) + spec.full_header()
        kern = factory(name=spec.kernel, input_names=list(spec.input_names), output_names=list(spec.output_names),
                       source=spec.source(), header=header, ensure_row_contiguous=spec.ensure_row_contiguous,
                       atomic_outputs=spec.atomic_outputs)
        _RAW_KERNELS[key] = kern
    (m, k), n = a.shape, b.shape[1]
    bm, bn, bk, wm, wn = (tiles[f] for f in ("bm", "bn", "bk", "wm", "wn"))
    params = mx.array([m, n, k, m * k, k * n, k, 1, 1], dtype=mx.int64)
    ph = mx.zeros((1,), dtype=a.dtype)
    out = kern(inputs=[a, b, ph, ph, params], output_shapes=[(1, m, n), (1,)], output_dtypes=[a.dtype, mx.float32],
               grid=(32 * wn * -(-n // bn), wm * -(-m // bm), 1), threadgroup=(32 * wn, wm, 1),
               template=[("T", a.dtype), ("BM", bm), ("BN", bn), ("BK", bk), ("WM", wm), ("WN", wn),
                         ("TRANS_A", False), ("TRANS_B", False), ("HAS_BIAS", False), ("ACT", 0),
                         ("HAS_RES", False), ("SPLIT", 1)],
               init_value=0.0)
    return out[0].reshape(m, n)


def queued(fn, calls=20, batches=5):
    mx.eval([fn() for _ in range(calls)])
    ts = []
    for _ in range(batches):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        ts.append((time.perf_counter() - t0) / calls)
    return statistics.median(ts)


def synced(fn, reps=20):
    mx.eval(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--tiny", action="store_true", help="small shapes, few reps (emulator logic check)")
    ap.add_argument("--only", default=None, help="comma-separated candidate names to run (default: the plan)")
    ap.add_argument("--budget-s", type=float, default=80.0, help="skip remaining rows after this many seconds")
    args = ap.parse_args()
    backend = current_backend()
    shapes = TINY_SHAPES if args.tiny else SHAPES
    calls, batches, reps = (2, 1, 2) if args.tiny else (20, 5, 20)
    only = set(args.only.split(",")) if args.only else None
    dev = mx.device_info() if hasattr(mx, "device_info") else {}
    print(f"backend={backend} device={dev.get('device_name', '?')} mlx={mx.__version__}")
    t_start = time.perf_counter()
    rows = []
    hdr = (f"{'dtype':8} {'op':9} {'M x N x K':16} {'candidate':22} {'st':>2} {'queued us':>9} {'TFLOP/s':>8} "
           f"{'mlx us':>8} {'mlx TF':>7} {'ratio':>6} {'sync us':>8} {'mlx sync':>8} {'err':>8}")
    print(hdr)
    for (dt_name, op), names in PLAN.items():
        dtype = getattr(mx, dt_name)
        for (m, n, k) in shapes:
            mx.random.seed(m * 7 + n * 3 + k)
            if op == "gemm_av":
                a = mx.random.normal((m, k)).astype(dtype)
                b = mx.random.normal((k, n)).astype(dtype)
                theirs = lambda a=a, b=b: mx.matmul(a, b)  # noqa: E731
                ours_f = xk.gemm_av
            else:
                a = mx.random.normal((k, m)).astype(dtype)
                b = mx.random.normal((k, n)).astype(dtype)
                theirs = lambda a=a, b=b: mx.matmul(a.T, b)  # noqa: E731
                ours_f = xk.gemm_at_b
            mx.eval(a, b)
            ref = theirs().astype(mx.float32)
            mx.eval(ref)
            scale = mx.max(mx.abs(ref)).item()
            q_mlx = queued(theirs, calls, batches)
            s_mlx = synced(theirs, reps)
            flops = 2.0 * m * n * k
            cands = list(names)
            if (m, n, k) == shapes[-1 if not args.tiny else 0] and dt_name == "float16" and op == "gemm_av":
                cands += list(SPLIT_CONFIGS)
            if op == "gemm_av" and only is not None:  # variants run on request only
                cands += [c for c in ON_REQUEST if c in only]
            if args.tiny:
                raw = [c for c in cands if c in RAW_CONFIGS and (only is None or c in only)]
                cands = cands[:3] + [c for c in cands if c in SPLIT_CONFIGS][:1] + raw[:2]
            for name in cands:
                if only is not None and name not in only:
                    continue
                if time.perf_counter() - t_start > args.budget_s:
                    print(f"  (time budget spent: skipping {dt_name} {op} {m}x{n}x{k} {name})")
                    continue
                defines = None
                if name in RAW_CONFIGS:
                    spec, defines = RAW_CONFIGS[name]
                else:
                    spec = {**CONFIGS, **SPLIT_CONFIGS}[name]
                if spec is None:
                    tiles = None
                    cfg = xk.tiles.resolve_gemm_config(op, m, n, k, dtype).config
                else:
                    bm, bn, bk, wm, wn, split = spec
                    tiles = dict(bm=bm, bn=bn, bk=bk, wm=wm, wn=wn, split_k=split)
                    if args.tiny:  # emulator: tiles that fit its shapes quickly
                        tiles = dict(bm=min(bm, 32), bn=min(bn, 32), bk=min(bk, 16), wm=min(wm, 2), wn=min(wn, 2),
                                     split_k=split)
                    cfg = xk.tiles.GemmConfig(path="simd", **tiles)
                if cfg.path != "simd":
                    stages = 0
                    name_cfg = cfg.path
                else:
                    name_cfg = f"{cfg.bm}x{cfg.bn}x{cfg.bk} w{cfg.wm}x{cfg.wn} s{cfg.split_k}"
                if cfg.path == "simd":
                    stages = gemm_mod.simd_stages(cfg, dtype, op == "gemm_at_b", False, backend)
                ours = lambda a=a, b=b, t=tiles: ours_f(a, b, tiles=t)  # noqa: E731
                if defines is not None:
                    stages = min(stages, defines.get("XK_GEMM_MAX_STAGES", stages))
                    ours = lambda a=a, b=b, t=tiles, d=defines: raw_gemm_av(a, b, t, d, backend)  # noqa: E731
                try:
                    out = ours().astype(mx.float32)
                    err = (mx.max(mx.abs(out - ref)).item()) / max(scale, 1e-30)
                    q = queued(ours, calls, batches)
                    s = synced(ours, reps)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"  {dt_name} {op} {m}x{n}x{k} {name}: FAILED {type(e).__name__}: {e}")
                    rows.append(dict(dtype=dt_name, op=op, m=m, n=n, k=k, candidate=name, error=str(e)))
                    continue
                row = dict(dtype=dt_name, op=op, m=m, n=n, k=k, candidate=name, config=name_cfg, stages=stages,
                           queued_s=q, mlx_queued_s=q_mlx, sync_s=s, mlx_sync_s=s_mlx,
                           tflops=flops / q / 1e12, mlx_tflops=flops / q_mlx / 1e12, ratio=q_mlx / q,
                           max_rel_err=err)
                rows.append(row)
                print(f"{dt_name:8} {op:9} {f'{m}x{n}x{k}':16} {name:22} {stages:>2} {q * 1e6:9.1f} "
                      f"{row['tflops']:8.1f} {q_mlx * 1e6:8.1f} {row['mlx_tflops']:7.1f} {row['ratio']:6.2f} "
                      f"{s * 1e6:8.1f} {s_mlx * 1e6:8.1f} {err:8.1e}" + (f"  [{name_cfg}]" if spec is None else ""),
                      flush=True)
    print("best per case (queued):")
    best: dict = {}
    for r in rows:
        if "queued_s" in r:
            key = (r["dtype"], r["op"], f"{r['m']}x{r['n']}x{r['k']}")
            if key not in best or r["queued_s"] < best[key]["queued_s"]:
                best[key] = r
    for (dt_name, op, shp), r in best.items():
        print(f"  {dt_name:8} {op:9} {shp:16} {r['candidate']:22} [{r['config']}] {r['tflops']:7.1f} TFLOP/s "
              f"= {r['ratio']:.2f}x mx.matmul")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(backend=backend, device=dev.get("device_name"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
