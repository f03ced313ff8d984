#!/usr/bin/env python3
"""Probe: gemm_simd tile candidates against mx.matmul (cuBLAS on the cuda backend).

    python3 scripts/probe_gemm.py --out $OUT/gemm.json          # on the H100 (backend cuda)
    XLSTM_KERNELS_BACKEND=emulate python3 scripts/probe_gemm.py --tiny   # logic check on a CPU

Every candidate is passed as ``tiles=`` (bm, bn, bk, wm, wn, stages and, where given,
split_k), so one run compares them all with the preset and mx.matmul. On cuda gemm_simd's
tiles live in dynamic shared memory: a candidate's explicit ``stages`` may take up to 227 KiB
(``stages`` 0: as many as fit 48 KiB, at most 4); the "st" column is the STAGES launched.
Ops: gemm_av, gemm_at_b, gemm_a_bt and linear (gemm_a_bt with a bias, vs mx.addmm).
Rows are written to --out as they come (a timeout keeps what ran); --budget-s (130 s)
skips the rest of the plan once spent.
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

# name: (bm, bn, bk, wm, wn, split_k, stages); "auto": tiles=None (what the op resolves itself:
# the preset, plus the waves rule's split-K on under-filled grids). split_k None: not given,
# so the waves rule still splits K where the grid under-fills the 132 SMs (512x1024x4096);
# stages 0: as many as fit CUDA's 48 KiB budget (at most 4). ptxas sm_90a figures (registers,
# hot-loop non-HMMA instructions per HMMA from scripts/cuda_sass.py, fp16 gemm_av / at_b /
# a_bt) and the dynamic shared memory of gemm_av. Rationale: L2 -> SM bytes per FLOP (Nsight
# Compute: L2 throughput 88.5% is the preset's limiter) and request width (gemm_av's A rows
# are BK * 2 bytes: 32 B at BK 16; gemm_at_b, whose rows are all 256 B, runs 20% faster).
CONFIGS = {
    "auto": None,
    # the nvidia_hopper preset: 64x32 per warp, 4 stages (41 KB), 119/118/118 regs (2 blocks / SM), 2.66 others/HMMA
    "p128x128x16_w2x4": (128, 128, 16, 2, 4, None, 0),
    # 8 warps of 64x64: 25% fewer L2 bytes per FLOP, 64-B A rows, 64 HMMA per barrier; 80 KB, 220/216/226 regs, 1.24
    "c128x256x32_w2x4_s3": (128, 256, 32, 2, 4, None, 3),
    # the same with 4 stages (106 KB), 218/214/222 regs, 1.24
    "c128x256x32_w2x4_s4": (128, 256, 32, 2, 4, None, 4),
    # the transposed block (A-heavy: 256 rows of A per tile), 86 KB, 220/216/226 regs, 1.21
    "c256x128x32_w4x2_s3": (256, 128, 32, 4, 2, None, 3),
    # BK 64: full 128-B lines per A row (and per row of both operands in gemm_a_bt), half the barriers; 153 KB,
    # 228/226/240 regs, 1.01 (one stage is 51 KB: cuda only)
    "c128x256x64_w2x4_s3": (128, 256, 64, 2, 4, None, 3),
    "c256x128x64_w4x2_s3": (256, 128, 64, 4, 2, None, 3),  # 159 KB, 228/226/240 regs, 1.01
    # the same with 4 stages (212 KB of 227): Nsight Compute (session 6) put 25% of the
    # preset's stalls on "long scoreboard" (tiles not yet copied in)
    "c256x128x64_w4x2_s4": (256, 128, 64, 4, 2, None, 4),
    "c128x256x64_w2x4_s4": (128, 256, 64, 2, 4, None, 4),
    # today's warp tile with BK 32 and 4 stages (74 KB): isolates BK / stages; 128/127/124 regs (2 blocks / SM), 1.95
    "c128x128x32_w2x4_s4": (128, 128, 32, 2, 4, None, 4),
    # 4 warps of 64x64 at 2 blocks / SM (74 KB each): 226/224/228 regs, 1.34
    "c128x128x32_w2x2_s4": (128, 128, 32, 2, 2, None, 4),
    # 16 warps of 32x64 (one block / SM at 128 regs): more warps to hide latency; 106 KB, 128 regs, 1.86
    "c128x256x32_w4x4_s4": (128, 256, 32, 4, 4, None, 4),
    # swizzled BK 64 at half the block (session 7): twice the blocks of the 256x128 tiles on the
    # mid shapes (2048^2: 256 blocks, not 128 on 132 SMs); 96 KB, 2 blocks / SM if registers allow
    "c128x128x64_w2x4_s3": (128, 128, 64, 2, 4, None, 3),
    "c128x128x64_w2x2_s3": (128, 128, 64, 2, 2, None, 3),
    # warpgroup products (session 9: wgmma on sm_90a; an 8th field True): 16 rows per warp, one
    # product spans the tile's columns. 128x256 with 2 warpgroups (48 KB a stage), 256x128 with
    # 4 (512 threads), 128x128 at 2 blocks / SM with 3 stages (96 KB)
    "g128x256_w8_s4": (128, 256, 64, 8, 1, None, 4, True),
    "g128x256_w8_s3": (128, 256, 64, 8, 1, None, 3, True),
    "g256x128_w16_s4": (256, 128, 64, 16, 1, None, 4, True),
    "g256x128_w16_s3": (256, 128, 64, 16, 1, None, 3, True),
    "g128x128_w8_s3": (128, 128, 64, 8, 1, None, 3, True),
    "g128x128_w8_s4": (128, 128, 64, 8, 1, None, 4, True),
    # smaller warpgroup tiles for the medium shapes (session 10: more blocks on 132 SMs)
    "g64x128_w4_s4": (64, 128, 64, 4, 1, None, 4, True),
    "g128x64_w8_s4": (128, 64, 64, 8, 1, None, 4, True),
    "g64x64_w4_s4": (64, 64, 64, 4, 1, None, 4, True),
    "g64x256_w4_s3": (64, 256, 64, 4, 1, None, 3, True),
}
WG = ["g128x256_w8_s4", "g128x256_w8_s3", "g256x128_w16_s4", "g256x128_w16_s3", "g128x128_w8_s3", "g128x128_w8_s4",
      "g64x128_w4_s4", "g128x64_w8_s4", "g64x64_w4_s4", "g64x256_w4_s3"]
# Variants of the body's compile-time switches, launched directly (gemm_av only) with header
# macros redefined: name -> (config, {macro: value}).
#   _g8:  XK_GEMM_GROUP_M 8: threadgroups walk bands of 8 tile rows column by column (L2 reuse)
RAW_CONFIGS = {
    "p128x128x16_w2x4_g8": ((128, 128, 16, 2, 4, 1, 0), {"XK_GEMM_GROUP_M": 8}),
    "c128x256x64_w2x4_s3_g8": ((128, 256, 64, 2, 4, 1, 3), {"XK_GEMM_GROUP_M": 8}),
    # _pad: XK_TILE_SWIZZLE 0, the padded tiles of every backend before session 6 (CUDA now
    # swizzles the fast path's unpadded tiles)
    "c256x128x64_w4x2_s3_pad": ((256, 128, 64, 4, 2, 1, 3), {"XK_TILE_SWIZZLE": 0}),
    "c256x128x64_w4x2_s3_swz": ((256, 128, 64, 4, 2, 1, 3), {}),
    # _nofence: warpgroup tiles without the proxy fence before each tile's barrier
    "g128x256_w8_s4_nofence": ((128, 256, 64, 8, 1, 1, 4, True), {"XK_WG_PROXY_FENCE": 0}),
}
ON_REQUEST: set = set()
SPLIT_CONFIGS = {  # only for the under-filled 512x1024x4096 (fp16 gemm_av)
    "p128x128x16_w2x4_s4": (128, 128, 16, 2, 4, 4, 0),
    "c128x128x32_w2x4_s4_k8": (128, 128, 32, 2, 4, 8, 4),  # 256 blocks of K 512
    "c128x256x32_w2x4_s3_k8": (128, 256, 32, 2, 4, 8, 3),  # 128 blocks of K 512
}
SHAPES = [(4096, 4096, 4096), (2048, 2048, 2048), (4096, 4096, 1024), (512, 1024, 4096)]
# PROBE_GEMM_SHAPES="1024x1024x1024,512x512x512": other shapes (M x N x K)
if os.environ.get("PROBE_GEMM_SHAPES"):
    SHAPES = [tuple(int(d) for d in s.split("x")) for s in os.environ["PROBE_GEMM_SHAPES"].split(",")]
# (dtype, op) -> candidates run, most informative first (the --budget-s cut-off skips the rest):
# the full list for fp16 gemm_av, subsets elsewhere (each new (config, dtype, op) is one
# kernel compile, ~1-3 s). "linear" is gemm_a_bt with a bias (nn.Linear: x · wᵀ + b).
BIG = ["c128x256x32_w2x4_s3", "c128x256x64_w2x4_s3", "c256x128x64_w4x2_s3", "c256x128x64_w4x2_s4",
       "c128x128x64_w2x4_s3", "c128x128x64_w2x2_s3",
       "c128x256x64_w2x4_s4"]
PLAN = {
    ("float16", "gemm_av"): list(CONFIGS) + [c for c in RAW_CONFIGS if c not in ON_REQUEST],
    ("float16", "gemm_at_b"): ["auto", *WG, "p128x128x16_w2x4", *BIG, "c256x128x32_w4x2_s3", "c128x128x32_w2x4_s4"],
    ("float16", "gemm_a_bt"): ["auto", *WG, "p128x128x16_w2x4", *BIG, "c128x128x32_w2x4_s4"],
    ("bfloat16", "gemm_av"): ["auto", *WG, "p128x128x16_w2x4", *BIG],
    ("bfloat16", "gemm_at_b"): ["auto", *WG, "p128x128x16_w2x4", *BIG],
    ("bfloat16", "gemm_a_bt"): ["auto", *WG, "p128x128x16_w2x4", *BIG],
    ("float16", "linear"): ["auto", *WG, "p128x128x16_w2x4", *BIG],
    ("bfloat16", "linear"): ["auto", *WG, *BIG],
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
    cfg = xk.tiles.GemmConfig(**{**tiles, "path": "simd", "split_k": 1})
    params = mx.array([m, n, k, m * k, k * n, k, 1, 1], dtype=mx.int64)
    ph = mx.zeros((1,), dtype=a.dtype)
    extra = {"shared_memory": cfg.simd_threadgroup_bytes(a.dtype, False, False, backend)} if backend == "cuda" else {}
    out = kern(inputs=[a, b, ph, ph, params], output_shapes=[(1, m, n), (1,)], output_dtypes=[a.dtype, mx.float32],
               grid=(32 * wn * -(-n // bn), wm * -(-m // bm), 1), threadgroup=(32 * wn, wm, 1),
               template=[("T", a.dtype), ("BM", bm), ("BN", bn), ("BK", bk), ("WM", wm), ("WN", wn),
                         ("STAGES", cfg.simd_stages(a.dtype, False, False, backend)),
                         ("TRANS_A", False), ("TRANS_B", False), ("HAS_BIAS", False), ("ACT", 0),
                         ("HAS_RES", False), ("SPLIT", 1), ("WG", cfg.uses_warpgroup(a.dtype))],
               **extra)
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


def operands_for(op, m, n, k, dtype):
    """(a, b, bias, mx reference fn, our fn) for one op: C (m x n) = op(A) op(B), reduction k."""
    bias = None
    if op == "gemm_av":
        a, b = mx.random.normal((m, k)).astype(dtype), mx.random.normal((k, n)).astype(dtype)
        return a, b, bias, (lambda: mx.matmul(a, b)), (lambda t: xk.gemm_av(a, b, tiles=t))
    if op == "gemm_at_b":
        a, b = mx.random.normal((k, m)).astype(dtype), mx.random.normal((k, n)).astype(dtype)
        return a, b, bias, (lambda: mx.matmul(a.T, b)), (lambda t: xk.gemm_at_b(a, b, tiles=t))
    a, b = mx.random.normal((m, k)).astype(dtype), mx.random.normal((n, k)).astype(dtype)
    if op == "gemm_a_bt":
        return a, b, bias, (lambda: mx.matmul(a, b.T)), (lambda t: xk.gemm_a_bt(a, b, tiles=t))
    bias = mx.random.normal((n,)).astype(dtype)  # linear: x (m, k), w (n, k), bias (n,)
    return a, b, bias, (lambda: mx.addmm(bias, a, b.T)), (lambda t: xk.linear(a, b, bias, tiles=t))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the rows as JSON here (after every row)")
    ap.add_argument("--tiny", action="store_true", help="small shapes, few reps (emulator logic check)")
    ap.add_argument("--only", default=os.environ.get("PROBE_GEMM_ONLY"),
                    help="comma-separated candidate names to run (default: the plan; also PROBE_GEMM_ONLY)")
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("PROBE_GEMM_BUDGET_S", 130)),
                    help="skip remaining rows after this many seconds (also PROBE_GEMM_BUDGET_S)")
    ap.add_argument("--ops", default=os.environ.get("PROBE_GEMM_OPS"),
                    help="comma-separated dtype:op entries of the plan to run, e.g. float16:gemm_a_bt "
                         "(default: all; also PROBE_GEMM_OPS)")
    args = ap.parse_args()
    backend = current_backend()
    shapes = TINY_SHAPES if args.tiny else SHAPES
    calls, batches, reps = (2, 1, 2) if args.tiny else (20, 5, 20)
    only = set(args.only.split(",")) if args.only else None
    dev = mx.device_info() if hasattr(mx, "device_info") else {}
    print(f"backend={backend} device={dev.get('device_name', '?')} mlx={mx.__version__}")
    t_start = time.perf_counter()
    rows = []

    def save():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(dict(backend=backend, device=dev.get("device_name"), rows=rows), f, indent=1)

    hdr = (f"{'dtype':8} {'op':9} {'M x N x K':16} {'candidate':24} {'st':>2} {'queued us':>9} {'TFLOP/s':>8} "
           f"{'mlx us':>8} {'mlx TF':>7} {'ratio':>6} {'sync us':>8} {'mlx sync':>8} {'err':>8}")
    print(hdr)
    plan = PLAN
    if args.ops:
        want = {tuple(e.split(":")) for e in args.ops.split(",")}
        plan = {key: names for key, names in PLAN.items() if key in want}
    for (dt_name, op), names in plan.items():
        dtype = getattr(mx, dt_name)
        kop = "gemm_a_bt" if op == "linear" else op  # the kernel layout
        ta, tb = kop == "gemm_at_b", kop == "gemm_a_bt"
        for (m, n, k) in shapes:
            cands = list(names)
            if (m, n, k) == shapes[-1 if not args.tiny else 0] and dt_name == "float16" and op == "gemm_av":
                cands += list(SPLIT_CONFIGS)
            if op == "gemm_av" and only is not None:  # variants run on request only
                cands += [c for c in ON_REQUEST if c in only]
            if args.tiny:
                raw = [c for c in cands if c in RAW_CONFIGS and (only is None or c in only)]
                cands = cands[:3] + [c for c in cands if c in SPLIT_CONFIGS][:1] + raw[:2]
            cands = [c for c in cands if only is None or c in only]
            if not cands:
                continue
            if time.perf_counter() - t_start > args.budget_s:
                print(f"  (time budget spent: skipping {dt_name} {op} {m}x{n}x{k}: {', '.join(cands)})")
                continue
            mx.random.seed(m * 7 + n * 3 + k)
            a, b, bias, theirs, ours_f = operands_for(op, m, n, k, dtype)
            mx.eval(a, b, *([bias] if bias is not None else []))
            ref = theirs().astype(mx.float32)
            mx.eval(ref)
            scale = mx.max(mx.abs(ref)).item()
            q_mlx = queued(theirs, calls, batches)
            s_mlx = synced(theirs, reps)
            flops = 2.0 * m * n * k
            for name in cands:
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
                    cfg = xk.tiles.resolve_gemm_config(kop, m, n, k, dtype, backend=backend).config
                else:
                    bm, bn, bk, wm, wn, split, st, *more = spec
                    wg = bool(more and more[0])
                    if args.tiny and wg:  # emulator: the smallest warpgroup tiles (a CUDA-sized launch)
                        bm, bn, wm, st = 64, 64, 4, 3
                    elif args.tiny:  # emulator: tiles that fit its shapes quickly (and its 32 KiB)
                        bm, bn, bk, wm, wn, st = min(bm, 32), min(bn, 32), min(bk, 16), min(wm, 2), min(wn, 2), min(st, 3)
                    tiles = dict(path="simd", bm=bm, bn=bn, bk=bk, wm=wm, wn=wn, stages=st, warpgroup=wg)
                    if split is not None:
                        tiles["split_k"] = split
                    # what the op runs: split_k from the waves rule where not given
                    cfg = xk.tiles.resolve_gemm_config(kop, m, n, k, dtype, tiles, backend=backend).config
                stages = cfg.simd_stages(dtype, ta, tb, backend) if cfg.path == "simd" else 0
                name_cfg = (f"{cfg.bm}x{cfg.bn}x{cfg.bk} w{cfg.wm}x{cfg.wn} k{cfg.split_k} st{stages}"
                            f"{' wg' if cfg.uses_warpgroup(dtype) else ''}" if cfg.path == "simd" else cfg.path)
                ours = lambda t=tiles: ours_f(t)  # noqa: E731
                if defines is not None:
                    ours = lambda a=a, b=b, t=tiles, d=defines: raw_gemm_av(a, b, t, d, backend)  # noqa: E731
                try:
                    out = ours().astype(mx.float32)
                    err = (mx.max(mx.abs(out - ref)).item()) / max(scale, 1e-30)
                    q = queued(ours, calls, batches)
                    s = synced(ours, reps)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"  {dt_name} {op} {m}x{n}x{k} {name}: FAILED {type(e).__name__}: {e}")
                    rows.append(dict(dtype=dt_name, op=op, m=m, n=n, k=k, candidate=name, error=str(e)))
                    save()
                    continue
                row = dict(dtype=dt_name, op=op, m=m, n=n, k=k, candidate=name, config=name_cfg, stages=stages,
                           queued_s=q, mlx_queued_s=q_mlx, sync_s=s, mlx_sync_s=s_mlx,
                           tflops=flops / q / 1e12, mlx_tflops=flops / q_mlx / 1e12, ratio=q_mlx / q,
                           max_rel_err=err)
                rows.append(row)
                save()
                print(f"{dt_name:8} {op:9} {f'{m}x{n}x{k}':16} {name:24} {stages:>2} {q * 1e6:9.1f} "
                      f"{row['tflops']:8.1f} {q_mlx * 1e6:8.1f} {row['mlx_tflops']:7.1f} {row['ratio']:6.2f} "
                      f"{s * 1e6:8.1f} {s_mlx * 1e6:8.1f} {err:8.1e}  [{name_cfg}]", flush=True)
    print("best per case (queued):")
    best: dict = {}
    for r in rows:
        if "queued_s" in r:
            key = (r["dtype"], r["op"], f"{r['m']}x{r['n']}x{r['k']}")
            if key not in best or r["queued_s"] < best[key]["queued_s"]:
                best[key] = r
    for (dt_name, op, shp), r in best.items():
        print(f"  {dt_name:8} {op:9} {shp:16} {r['candidate']:24} [{r['config']}] {r['tflops']:7.1f} TFLOP/s "
              f"= {r['ratio']:.2f}x mx.matmul")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    save()


if __name__ == "__main__":
    main()
