"""Decode attention (split-KV) on the GPU: the two pass-1 kernels and their variants vs
mx.fast SDPA, in one run. Device time is estimated as the eval time of 20 queued calls
(graph built first, timed apart); GB/s counts K + V + 2 q. "chain": the eval time per call
of calls that each take the last one's output as query (as a decode loop: the calls cannot
overlap on the GPU, where independent queued calls may run concurrently).

    python scripts/probe_decode.py [--out result.json] [--tiny] [--budget 85]

Variants per shape: the op as users call it (memoised, graph replay on cuda), with module
constants of ops.attention patched and the call memo cleared around each variant (so each
is planned anew and then replayed; eval times compare kernels, not per-call host work):
  lane        XLSTM_ATTENTION_SPLIT_KV_MMA=0: attention_partial, the lane walk
  mma         the shipped tile pass 1 (attention_partial_mma, automatic block size: from
              SPLIT_KV_MMA_MAX_BLOCK halved until SPLIT_KV_MMA_TARGET_GROUPS groups)
  mb1024 / mb4096   SPLIT_KV_MMA_MAX_BLOCK 1024 / 4096
  tg256       SPLIT_KV_MMA_TARGET_GROUPS 256
  st2 / mb4096 st2  at most 2 threadgroup-memory stages
  kt32        32-key tiles
  tg512 / tg1024 / st3 / st4 / tg256 st3 / tg512 st3   more groups (shorter walks), more stages
PROBE_DECODE_SHAPES="B,Hq,Hkv,Lk,D B,Hq,Hkv,Lk,D" and PROBE_DECODE_VARIANTS="mma|tg256|..." (names joined by
'|') pick the shapes and variants (default: all).
`--tiny` runs one small shape (works on the emulator: XLSTM_KERNELS_BACKEND=emulate).
"""
import argparse
import json
import os
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import measure_chained
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

VARIANTS = [  # (name, environment, module constants of ops.attention to patch)
    ("lane", {"XLSTM_ATTENTION_SPLIT_KV_MMA": "0"}, {}),
    ("mma", {}, {}),
    ("mb1024", {}, {"SPLIT_KV_MMA_MAX_BLOCK": 1024}),
    ("st2", {}, {"SPLIT_KV_MMA_MAX_STAGES": 2}),
    ("tg256", {}, {"SPLIT_KV_MMA_TARGET_GROUPS": 256}),
    ("mb4096", {}, {"SPLIT_KV_MMA_MAX_BLOCK": 4096}),
    ("mb4096 st2", {}, {"SPLIT_KV_MMA_MAX_BLOCK": 4096, "SPLIT_KV_MMA_MAX_STAGES": 2}),
    ("kt32", {}, {"SPLIT_KV_MMA_TILE": 32}),
    ("tg512", {}, {"SPLIT_KV_MMA_TARGET_GROUPS": 512}),
    ("st3", {}, {"SPLIT_KV_MMA_MAX_STAGES": 3}),
    ("st4", {}, {"SPLIT_KV_MMA_MAX_STAGES": 4}),
    ("tg256 st3", {}, {"SPLIT_KV_MMA_TARGET_GROUPS": 256, "SPLIT_KV_MMA_MAX_STAGES": 3}),
    ("tg512 st3", {}, {"SPLIT_KV_MMA_TARGET_GROUPS": 512, "SPLIT_KV_MMA_MAX_STAGES": 3}),
    ("tg1024", {}, {"SPLIT_KV_MMA_TARGET_GROUPS": 1024}),
    ("tg1024 st3", {}, {"SPLIT_KV_MMA_TARGET_GROUPS": 1024, "SPLIT_KV_MMA_MAX_STAGES": 3}),
    ("tg256 st4", {}, {"SPLIT_KV_MMA_TARGET_GROUPS": 256, "SPLIT_KV_MMA_MAX_STAGES": 4}),
    ("tg512 st4", {}, {"SPLIT_KV_MMA_TARGET_GROUPS": 512, "SPLIT_KV_MMA_MAX_STAGES": 4}),
    ("tg1024 st4", {}, {"SPLIT_KV_MMA_TARGET_GROUPS": 1024, "SPLIT_KV_MMA_MAX_STAGES": 4}),
    ("st5", {}, {"SPLIT_KV_MMA_MAX_STAGES": 5}),
    ("tg256 st5", {}, {"SPLIT_KV_MMA_TARGET_GROUPS": 256, "SPLIT_KV_MMA_MAX_STAGES": 5}),
]
if os.environ.get("PROBE_DECODE_SHAPES"):
    shapes = [tuple(int(v) for v in s.split(",")) for s in os.environ["PROBE_DECODE_SHAPES"].split()]
if os.environ.get("PROBE_DECODE_VARIANTS"):
    _pick = os.environ["PROBE_DECODE_VARIANTS"].split("|")
    VARIANTS = [v for v in VARIANTS if v[0] in _pick]


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


def chained(f, q0):
    """Eval us per call of `calls` calls each taking the last one's output as its query (a
    decode loop's dependency: the calls cannot overlap on the GPU), built first; median rep."""
    return measure_chained(f, q0, calls=calls, repeats=reps) * 1e6


def plan_of(q, k, v, env):
    """What the variant launches: kernel, block size, R, stages / simdgroups."""
    backend = xk.runtime.current_backend() if hasattr(xk, "runtime") else "cuda"
    mma = att._use_mma(None if "XLSTM_ATTENTION_SPLIT_KV_MMA" not in env else False, q, k, v, backend)
    bs = None
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
      f"{'mlx us':>8s} {'ratio':>6s} {'err':>8s} {'chain us':>9s} {'mlx chain':>9s} {'ratio':>6s}")
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
    mc = chained(lambda qq: mx.fast.scaled_dot_product_attention(qq, k, v, scale=scale), q)
    tag = f"{b} {hq} {hkv} {lk} {d}"
    print(f"{tag:20s} {'mlx':11s} {'mx.fast SDPA':28s} {mb:9.1f} {me:9.1f} {nbytes / me / 1e3:6.0f} {me:8.1f} {1.0:6.2f} {'':8s} {mc:9.1f} {mc:9.1f} {1.0:6.2f}")
    rows.append(dict(shape=[b, hq, hkv, lk, d], variant="mlx", eval_us=me, build_us=mb, gbs=nbytes / me / 1e3,
                     chain_us=mc))
    for name, env, patch in VARIANTS:
        if time.perf_counter() - t_start > args.budget:
            print(f"{tag:20s} {name:11s} skipped (time budget)")
            continue
        saved = {key: getattr(att, key) for key in patch}
        try:
            for key, val in patch.items():
                setattr(att, key, val)
            os.environ.update(env)
            att._CALLS.clear()
            plan = plan_of(q, k, v, env)
            f = lambda: xk.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: E731
            o = f()
            mx.eval(o)
            err = (mx.abs(o.astype(mx.float32) - o_ref.astype(mx.float32)).max()
                   / mx.abs(o_ref.astype(mx.float32)).max()).item()
            ob, oe = timed(f)
            oc = chained(lambda qq: xk.scaled_dot_product_attention(qq, k, v, scale=scale), q)
        except Exception as ex:  # noqa: BLE001
            print(f"{tag:20s} {name:11s} FAILED {str(ex)[:200]}")
            continue
        finally:
            for key, val in saved.items():
                setattr(att, key, val)
            for key in env:
                os.environ.pop(key, None)
            att._CALLS.clear()
        print(f"{tag:20s} {name:11s} {plan:28s} {ob:9.1f} {oe:9.1f} {nbytes / oe / 1e3:6.0f} {me:8.1f} "
              f"{me / oe:6.2f} {err:8.1e} {oc:9.1f} {mc:9.1f} {mc / oc:6.2f}")
        rows.append(dict(shape=[b, hq, hkv, lk, d], variant=name, plan=plan, build_us=ob, eval_us=oe, mlx_eval_us=me,
                         mlx_build_us=mb, gbs=nbytes / oe / 1e3, ratio=me / oe, err=err, chain_us=oc, mlx_chain_us=mc))
print(f"total {time.perf_counter() - t_start:.1f} s")
if args.out:
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
