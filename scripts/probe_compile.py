"""Host cost per call: our ops called directly vs through mx.compile (graph replay)."""
import argparse, json, time
import mlx.core as mx
import xlstm_kernels as xk

ap = argparse.ArgumentParser(); ap.add_argument("--out"); ap.add_argument("--tiny", action="store_true")
args = ap.parse_args()
rows = []

def per_call(f, *a, n=2000):
    for _ in range(30): f(*a)
    t0 = time.perf_counter()
    for _ in range(n): f(*a)
    return (time.perf_counter() - t0) / n * 1e6

def queued(f, *a, n=20, reps=15):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); outs = [f(*a) for _ in range(n)]; t1 = time.perf_counter(); mx.eval(outs); t2 = time.perf_counter()
        ts.append(((t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6))
    ts.sort(key=lambda t: t[0] + t[1]); return ts[len(ts) // 2]

x = mx.random.normal((4096, 1024)); w = mx.random.normal((1024,)) ; b = mx.random.normal((1024,))
q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16); k = mx.random.normal((1, 8, 4096, 128)).astype(mx.float16)
v = mx.random.normal((1, 8, 4096, 128)).astype(mx.float16)
a16 = mx.random.normal((2048, 2048)).astype(mx.float16)
r = mx.random.normal((2, 32, 1024, 128)).astype(mx.bfloat16)
mx.eval(x, w, b, q, k, v, a16, r)
cases = {
  "rms_norm 4096x1024": ((lambda x, w: xk.rms_norm(x, w, 1e-5)), (x, w), lambda x, w: mx.fast.rms_norm(x, w, 1e-5)),
  "layer_norm 4096x1024": ((lambda x, w, b: xk.layer_norm(x, w, b, 1e-5)), (x, w, b), lambda x, w, b: mx.fast.layer_norm(x, w, b, 1e-5)),
  "rope 2x32x1024x128": ((lambda r: xk.rope(r, 128, traditional=False, base=10000.0, scale=1.0, offset=0)), (r,),
                         lambda r: mx.fast.rope(r, 128, traditional=False, base=10000.0, scale=1.0, offset=0)),
  "gemm_av 2048^3 fp16": ((lambda a: xk.gemm_av(a, a)), (a16,), lambda a: a @ a),
  "decode 1x32x8x1x4096x128": ((lambda q, k, v: xk.scaled_dot_product_attention(q, k, v, scale=0.088)), (q, k, v),
                               lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088)),
}
print(f"{'op':28s} {'direct py':>10s} {'compiled py':>12s} {'mlx py':>8s} | queued build/eval us: direct, compiled, mlx   | err direct/compiled")
for name, (f, a, ref) in cases.items():
    try:
        cf = mx.compile(f)
        o1, o2, o3 = f(*a), cf(*a), ref(*a); mx.eval(o1, o2, o3)
        e1 = (mx.abs(o1.astype(mx.float32) - o3.astype(mx.float32)).max() / (mx.abs(o3.astype(mx.float32)).max() + 1e-30)).item()
        e2 = (mx.abs(o2.astype(mx.float32) - o1.astype(mx.float32)).max()).item()
        d, c, m = per_call(f, *a), per_call(cf, *a), per_call(ref, *a)
        qd, qc, qm = queued(f, *a), queued(cf, *a), queued(ref, *a)
        print(f"{name:28s} {d:10.2f} {c:12.2f} {m:8.2f} | {qd[0]:.1f}/{qd[1]:.1f}  {qc[0]:.1f}/{qc[1]:.1f}  {qm[0]:.1f}/{qm[1]:.1f} | {e1:.1e} {e2:.1e}")
        rows.append(dict(op=name, direct_py=d, compiled_py=c, mlx_py=m, q_direct=qd, q_compiled=qc, q_mlx=qm, err=e1, err_compiled_vs_direct=e2))
    except Exception as ex:  # noqa
        print(name, "FAILED:", type(ex).__name__, str(ex)[:300]); rows.append(dict(op=name, error=str(ex)[:500]))
# gradient through a compiled call
try:
    g = mx.grad(lambda x, w: mx.compile(lambda x, w: xk.rms_norm(x, w, 1e-5))(x, w).sum(), argnums=(0, 1))(x, w)
    g0 = mx.grad(lambda x, w: mx.fast.rms_norm(x, w, 1e-5).sum(), argnums=(0, 1))(x, w)
    print("grad through compiled rms_norm, max abs diff vs mx.fast:", [mx.abs(a - b).max().item() for a, b in zip(g, g0)])
except Exception as ex:  # noqa
    print("grad through compile FAILED:", type(ex).__name__, str(ex)[:300])
if args.out: json.dump(rows, open(args.out, "w"), indent=1)
