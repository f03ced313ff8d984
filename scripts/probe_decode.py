"""Decode attention (split-KV) on the GPU: block-size variants vs mx.fast SDPA; device time
estimated as eval time of 20 queued calls (graph built first, timed apart)."""
import argparse, json, time
import mlx.core as mx
import xlstm_kernels as xk

ap = argparse.ArgumentParser(); ap.add_argument("--out"); ap.add_argument("--tiny", action="store_true")
args = ap.parse_args()
shapes = [(1, 32, 8, 4096, 128), (8, 32, 8, 8192, 128), (4, 32, 8, 32768, 128), (1, 32, 32, 4096, 128),
          (16, 32, 8, 4096, 128)]
if args.tiny:
    shapes = [(1, 4, 2, 300, 16)]
rows = []


def timed(f, n=20, reps=9):
    mx.eval(f())
    best = []
    for _ in range(reps):
        t0 = time.perf_counter(); outs = [f() for _ in range(n)]; t1 = time.perf_counter(); mx.eval(outs); t2 = time.perf_counter()
        best.append(((t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6))
    best.sort(key=lambda t: t[1]); return best[len(best) // 2]


t_start = time.perf_counter()
print(f"{'B Hq Hkv Lk D':22s} {'variant':10s} {'build us':>9s} {'eval us':>9s} {'GB/s(eval)':>10s} {'mlx eval':>9s} {'ratio(eval)':>11s} {'err':>8s}")
for (b, hq, hkv, lk, d) in shapes:
    q = mx.random.normal((b, hq, 1, d)).astype(mx.float16); k = mx.random.normal((b, hkv, lk, d)).astype(mx.float16)
    v = mx.random.normal((b, hkv, lk, d)).astype(mx.float16); mx.eval(q, k, v)
    nbytes = k.nbytes + v.nbytes + 2 * q.nbytes
    scale = d ** -0.5
    ref = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: E731
    o_ref = ref(); mx.eval(o_ref)
    mb, me = timed(ref)
    for bs in (None, 64, 128, 256, 512, 1024):
        if time.perf_counter() - t_start > 85:
            break
        kn = None if bs is None else {"split_kv_block_size": bs}
        f = lambda: xk.scaled_dot_product_attention(q, k, v, scale=scale, knobs=kn)  # noqa: E731
        try:
            o = f(); mx.eval(o)
            err = (mx.abs(o.astype(mx.float32) - o_ref.astype(mx.float32)).max() / mx.abs(o_ref.astype(mx.float32)).max()).item()
            ob, oe = timed(f)
        except Exception as ex:  # noqa: BLE001
            print(f"{b} {hq} {hkv} {lk} {d}", bs, "FAILED", str(ex)[:200]); continue
        name = "auto" if bs is None else f"bs{bs}"
        print(f"{b:2d} {hq:3d} {hkv:3d} {lk:6d} {d:4d}    {name:10s} {ob:9.1f} {oe:9.1f} {nbytes / oe / 1e3:10.0f} {me:9.1f} {me / oe:11.2f} {err:8.1e}")
        rows.append(dict(shape=[b, hq, hkv, lk, d], variant=name, build_us=ob, eval_us=oe, mlx_eval_us=me, mlx_build_us=mb,
                         gbs=nbytes / oe / 1e3, err=err))
if args.out:
    json.dump(rows, open(args.out, "w"), indent=1)
