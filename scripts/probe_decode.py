"""Decode attention (split-KV) on the GPU: the two pass-1 kernels and their variants vs
mx.fast SDPA, in one run. Device time is estimated as the eval time of 20 queued calls
(graph built first, timed apart); GB/s counts K + V + 2 q.

    python scripts/probe_decode.py [--out result.json] [--tiny] [--budget 85]

Variants per shape (knobs passed per call, so the call memo is bypassed; module constants
patched around a variant are restored after it):
  lane        split_kv_mma=False: attention_partial, the lane walk (automatic block size)
  mma         split_kv_mma=True: attention_partial_mma, the tile pass 1 (automatic block size)
  mma bs256 / mma bs1024    the tile pass 1 at a fixed block size
  mma st2     at most 2 threadgroup-memory stages (default 3)
  mma kt32    32-key tiles (2 stages of 17 KiB on CUDA at D = 128)
  auto        the op as users call it (memoised, graph replay on cuda; the default walk)
`--tiny` runs one small shape (works on the emulator: XLSTM_KERNELS_BACKEND=emulate).
"""
import argparse
import json
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.ops import attention as att

ap = argparse.ArgumentParser()
ap.add_argument("--out")
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--budget", type=float, default=85.0, help="seconds after which remaining variants are skipped")
args = ap.parse_args()
shapes = [(8, 32, 8, 8192, 128), (4, 32, 8, 32768, 128), (16, 32, 8, 4096, 128), (1, 32, 32, 4096, 128),
          (1, 32, 8, 4096, 128)]
reps, calls = 9, 20
if args.tiny:
    shapes = [(1, 4, 2, 300, 16)]
    reps, calls = 2, 2

VARIANTS = [  # (name, knobs, module constants of ops.attention to patch)
    ("lane", {"split_kv_mma": False}, {}),
    ("mma", {"split_kv_mma": True}, {}),
    ("mma bs256", {"split_kv_mma": True, "split_kv_block_size": 256}, {}),
    ("mma bs1024", {"split_kv_mma": True, "split_kv_block_size": 1024}, {}),
    ("mma st2", {"split_kv_mma": True}, {"SPLIT_KV_MMA_MAX_STAGES": 2}),
    ("mma kt32", {"split_kv_mma": True}, {"SPLIT_KV_MMA_TILE": 32}),
    ("auto", None, {}),
]


def timed(f):
    """(build us, eval us) per call: the median rep of `calls` queued calls per mx.eval."""
    mx.eval(f())
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [f() for _ in range(calls)]
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        best.append(((t1 - t0) / calls * 1e6, (t2 - t1) / calls * 1e6))
    best.sort(key=lambda t: t[1])
    return best[len(best) // 2]


def plan_of(q, k, v, kn):
    """What the variant launches: kernel, block size, R, stages / simdgroups."""
    backend = xk.runtime.current_backend() if hasattr(xk, "runtime") else "cuda"
    mma = att._use_mma((kn or {}).get("split_kv_mma"), q, k, v, backend)
    bs = (kn or {}).get("split_kv_block_size")
    if mma:
        bs = bs or att._auto_block_size_mma(q, k, v, backend)
        _, kw = att._partial_mma_launch(q, k, v, att._Mask(0), 0.1, bs, backend)
        t = dict(kw["template"])
        return f"tiles bs{bs} R{t['R']} KT{t['KT']} ST{t['ST']}"
    bs = bs or att._auto_block_size(q, k, v)
    _, kw = att._partial_launch(q, k, v, att._Mask(0), 0.1, bs)
    t = dict(kw["template"])
    return f"lane bs{bs} R{t['R']} NSG{t['NSG']}"


t_start = time.perf_counter()
rows = []
print(f"backend {xk.runtime.current_backend()}, device {mx.default_device()}")
print(f"{'B Hq Hkv Lk D':20s} {'variant':11s} {'plan':28s} {'build us':>9s} {'eval us':>9s} {'GB/s':>6s} "
      f"{'mlx us':>8s} {'ratio':>6s} {'err':>8s}")
for (b, hq, hkv, lk, d) in shapes:
    if time.perf_counter() - t_start > args.budget:
        print(f"{b} {hq} {hkv} {lk} {d}: skipped (time budget)")
        continue
    q = mx.random.normal((b, hq, 1, d)).astype(mx.float16)
    k = mx.random.normal((b, hkv, lk, d)).astype(mx.float16)
    v = mx.random.normal((b, hkv, lk, d)).astype(mx.float16)
    mx.eval(q, k, v)
    nbytes = k.nbytes + v.nbytes + 2 * q.nbytes
    scale = d**-0.5
    ref = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: E731
    o_ref = ref()
    mx.eval(o_ref)
    mb, me = timed(ref)
    tag = f"{b} {hq} {hkv} {lk} {d}"
    print(f"{tag:20s} {'mlx':11s} {'mx.fast SDPA':28s} {mb:9.1f} {me:9.1f} {nbytes / me / 1e3:6.0f} {me:8.1f} {1.0:6.2f}")
    rows.append(dict(shape=[b, hq, hkv, lk, d], variant="mlx", eval_us=me, build_us=mb, gbs=nbytes / me / 1e3))
    for name, kn, patch in VARIANTS:
        if time.perf_counter() - t_start > args.budget:
            print(f"{tag:20s} {name:11s} skipped (time budget)")
            continue
        saved = {key: getattr(att, key) for key in patch}
        try:
            for key, val in patch.items():
                setattr(att, key, val)
            plan = plan_of(q, k, v, kn)
            f = lambda: xk.scaled_dot_product_attention(q, k, v, scale=scale, knobs=kn)  # noqa: E731
            o = f()
            mx.eval(o)
            err = (mx.abs(o.astype(mx.float32) - o_ref.astype(mx.float32)).max()
                   / mx.abs(o_ref.astype(mx.float32)).max()).item()
            ob, oe = timed(f)
        except Exception as ex:  # noqa: BLE001
            print(f"{tag:20s} {name:11s} FAILED {str(ex)[:200]}")
            continue
        finally:
            for key, val in saved.items():
                setattr(att, key, val)
        print(f"{tag:20s} {name:11s} {plan:28s} {ob:9.1f} {oe:9.1f} {nbytes / oe / 1e3:6.0f} {me:8.1f} "
              f"{me / oe:6.2f} {err:8.1e}")
        rows.append(dict(shape=[b, hq, hkv, lk, d], variant=name, plan=plan, build_us=ob, eval_us=oe, mlx_eval_us=me,
                         mlx_build_us=mb, gbs=nbytes / oe / 1e3, ratio=me / oe, err=err))
print(f"total {time.perf_counter() - t_start:.1f} s")
if args.out:
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
