"""Decode attention (Lq=1, split-KV) ours vs mx.fast.scaled_dot_product_attention.

Per shape / dtype / split_kv_block_size variant: sync us (one call per mx.eval), queued us (20 calls
per mx.eval), GB/s of K+V+Q+O bytes (queued), ratio MLX/ours (>1: ours faster), max rel err vs MLX,
and the Python-only cost of building one call (graph only, no eval).
Run: python3 scripts/probe_attention.py --out $OUT/attention.json   (--tiny: emulator-sized check)
"""
import argparse, json, os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mlx.core as mx
import xlstm_kernels as xk
from xlstm_kernels.ops import attention as A
DEFAULT_RULE = (A._PARTIAL_REG_BUDGET, A.SPLIT_KV_TARGET_GROUPS)


def set_rule(rule):
    A._PARTIAL_REG_BUDGET, A.SPLIT_KV_TARGET_GROUPS = rule
    A._CALLS.clear()

ap = argparse.ArgumentParser()
ap.add_argument("--out")
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--budget", type=float, default=80.0)
args = ap.parse_args()

SHAPES = [(1, 32, 8, 4096, 128), (8, 32, 8, 8192, 128), (4, 32, 8, 32768, 128), (1, 32, 32, 4096, 128)]
DTYPES = [mx.float16, mx.bfloat16]
BLOCKS = [None, 64, 128, 256, 512, 1024]
# host-rule variants (module constants of ops.attention, patched per variant, plans re-made):
# name -> (_PARTIAL_REG_BUDGET, SPLIT_KV_TARGET_GROUPS); block size automatic.
RULES = {"R<=2": (150, 512), "R=1": (110, 512), "tg1024": (200, 1024), "tg2048": (200, 2048)}
REPS, QN = 21, 20
if args.tiny:
    SHAPES = [(1, 4, 2, 300, 16), (2, 4, 4, 130, 64)]
    DTYPES = [mx.float16]
    BLOCKS = [None, 64]
    RULES = {"R=1": (110, 512)}
    REPS, QN = 3, 2

t_start = time.perf_counter()


def med(xs):
    return statistics.median(xs)


def time_sync(f):
    mx.eval(f()); mx.eval(f())
    ts = []
    for _ in range(REPS):
        t0 = time.perf_counter(); mx.eval(f()); ts.append(time.perf_counter() - t0)
    return med(ts) * 1e6


def time_queued(f):
    mx.eval([f() for _ in range(QN)])
    ts = []
    for _ in range(max(5, REPS // 2)):
        t0 = time.perf_counter(); mx.eval([f() for _ in range(QN)]); ts.append((time.perf_counter() - t0) / QN)
    return med(ts) * 1e6


def time_python(f, n=200):
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e6


rows = []
hdr = f"{'B Hq Hkv Lk D':20s} {'dt':5s} {'block':>6s} {'sync us':>9s} {'queued us':>10s} {'GB/s(q)':>8s} {'mlx sync':>9s} {'mlx q':>8s} {'r sync':>7s} {'r q':>6s} {'py us':>7s} {'err':>9s}"
print(hdr)
for (b, hq, hkv, lk, d) in SHAPES:
    for dt in DTYPES:
        if time.perf_counter() - t_start > args.budget:
            break
        q = mx.random.normal((b, hq, 1, d)).astype(dt)
        k = mx.random.normal((b, hkv, lk, d)).astype(dt)
        v = mx.random.normal((b, hkv, lk, d)).astype(dt)
        mx.eval(q, k, v)
        nbytes = k.nbytes + v.nbytes + 2 * q.nbytes
        scale = d ** -0.5
        ref = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
        o_ref = ref().astype(mx.float32); mx.eval(o_ref)
        ms, mq = time_sync(ref), time_queued(ref)
        mpy = time_python(ref)
        name = f"{b}x{hq}x{hkv}x1x{lk}x{d}"
        dts = "fp16" if dt == mx.float16 else "bf16"
        print(f"{name:20s} {dts:5s} {'mlx':>6s} {ms:9.1f} {mq:10.1f} {nbytes / mq / 1e3:8.0f} {'':9s} {'':8s} {'':7s} {'':6s} {mpy:7.1f}")
        variants = [(bs, DEFAULT_RULE) for bs in BLOCKS] + [(name, rule) for name, rule in RULES.items()]
        for bs, rule in variants:
            if time.perf_counter() - t_start > args.budget:
                print("(time budget reached)"); break
            set_rule(rule)
            kn = None if (bs is None or isinstance(bs, str)) else {"split_kv_block_size": bs}
            f = lambda: xk.scaled_dot_product_attention(q, k, v, scale=scale, knobs=kn)
            row = dict(shape=name, dtype=dts, block=bs or "auto", mlx_sync_us=ms, mlx_queued_us=mq, mlx_python_us=mpy)
            try:
                o = f().astype(mx.float32); mx.eval(o)
                err = (mx.abs(o - o_ref).max() / mx.maximum(mx.abs(o_ref).max(), 1e-6)).item()
                s, qu, py = time_sync(f), time_queued(f), time_python(f)
                row.update(sync_us=s, queued_us=qu, python_us=py, gbps_queued=nbytes / qu / 1e3,
                           ratio_sync=ms / s, ratio_queued=mq / qu, max_rel_err=err)
                print(f"{'':20s} {dts:5s} {str(bs or 'auto'):>6s} {s:9.1f} {qu:10.1f} {nbytes / qu / 1e3:8.0f} {ms:9.1f} {mq:8.1f} {ms / s:7.2f} {mq / qu:6.2f} {py:7.1f} {err:9.2e}")
            except Exception as e:  # a variant that does not fit this shape
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"{'':20s} {dts:5s} {str(bs or 'auto'):>6s} ERROR {row['error'][:100]}")
            if not isinstance(bs, str):
                A._CALLS.clear()
            else:
                b_auto = A._auto_block_size(q, k, v)
                r_, kc_ = A._partial_rows(hq // hkv, d, d, dt)[:2]
                row.update(auto_block=b_auto, R=r_, KC=kc_)
                print(f"{'':20s} {'':5s} {'':>6s} (rule {bs}: block {b_auto}, R {r_}, KC {kc_})")
            rows.append(row)
        set_rule(DEFAULT_RULE)
print(f"total {time.perf_counter() - t_start:.1f} s")
if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "env": {k: v for k, v in os.environ.items() if k.startswith("XLSTM")}}, fh, indent=1)
