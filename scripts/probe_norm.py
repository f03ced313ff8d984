"""Probe: RMSNorm / LayerNorm forward and RMSNorm VJP vs MLX's own, plus host cost per call.

    python3 scripts/probe_norm.py --out $OUT/norm.json          # on the GPU (backend cuda)
    XLSTM_KERNELS_BACKEND=emulate python3 scripts/probe_norm.py --tiny   # logic check

Variants go through the knob environment variables (XLSTM_RMS_NORM_N_READS, ...), which
apply to the next call (the call memo keys on the environment), and pseudo-variables set
as module attributes of ops.norm: FULL=0 (FULL_ROWS off: the general rms_norm /
rms_norm_vjp path on rows of exactly tpr * n_reads), VJP_THREADS / VJP_MAX_READS (the
backward layout). rms_off1: x and w as views one element into their buffers (misaligned). Prints one table row per
(op, shape, dtype, variant): sync ms (one call per mx.eval), queued ms (20 calls per
mx.eval), GB/s (queued), ratio = MLX time / ours (> 1: ours faster), max rel err vs MLX.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import mlx.core as mx
import numpy as np

import xlstm_kernels as xk
from xlstm_kernels.ops import norm as norm_mod

REPS = 20
QUEUE = 20


def timed(fn, reps=REPS, queue=QUEUE):
    for _ in range(3):
        mx.eval(fn())
    sync = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        sync.append(time.perf_counter() - t0)
    queued = []
    for _ in range(max(5, reps // 4)):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(queue)])
        queued.append((time.perf_counter() - t0) / queue)
    return float(np.median(sync)) * 1e3, float(np.median(queued)) * 1e3


def rel_err(a, b):
    a = np.asarray(a.astype(mx.float32), dtype=np.float64)
    b = np.asarray(b.astype(mx.float32), dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def set_env(env):
    """Knob variables, plus the pseudo-variable FULL ("0": RMSNorm's general path even for
    rows of exactly tpr * n_reads elements, i.e. ops.norm.FULL_ROWS = False)."""
    env = dict(env)
    state = (env.pop("FULL", "1") != "0", int(env.pop("VJP_THREADS", "256")), int(env.pop("VJP_MAX_READS", "16")))
    if (norm_mod.FULL_ROWS, norm_mod.VJP_THREADS, norm_mod.VJP_MAX_READS) != state:
        norm_mod.FULL_ROWS, norm_mod.VJP_THREADS, norm_mod.VJP_MAX_READS = state
        norm_mod._CALLS.clear()  # memoised (replayed, mx.compile'd) calls were planned with the old values
    for k in list(os.environ):
        if k.startswith("XLSTM_RMS_NORM_") or k.startswith("XLSTM_LAYER_NORM_"):
            del os.environ[k]
    os.environ.update(env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    global REPS
    if args.tiny:
        REPS = 2
        shapes = [(8, 256), (4, 1031)]
        variants = {"rms_norm": [{}, {"FULL": "0"}, {"XLSTM_RMS_NORM_N_READS": "8"}],
                    "rms_off1": [{}, {"FULL": "0"}], "layer_norm": [{}],
                    "rms_vjp": [{}, {"FULL": "0"}, {"VJP_THREADS": "512", "VJP_MAX_READS": "8"}]}
    else:
        shapes = [(16384, 4096), (4096, 4096), (4096, 1024), (1024, 8192)]
        nr = [{}, {"FULL": "0"}, {"XLSTM_RMS_NORM_N_READS": "16"}, {"XLSTM_RMS_NORM_N_READS": "16", "FULL": "0"}]
        variants = {"rms_norm": nr, "rms_off1": [{}, {"FULL": "0"}], "layer_norm": [{}],
                    "rms_vjp": [{}, {"FULL": "0"}, {"VJP_THREADS": "512", "VJP_MAX_READS": "8"},
                                {"VJP_THREADS": "512", "VJP_MAX_READS": "8", "FULL": "0"}]}
    rows = []
    eps = 1e-5
    t_start = time.perf_counter()

    # device copy bandwidth: x * 2 on 256 MiB (fp32)
    if not args.tiny:
        c = mx.random.normal((64 * 1024 * 1024,))
        mx.eval(c)
        s, q = timed(lambda: c * 2)
        print(f"copy x*2 256 MiB: sync {s:.3f} ms ({2 * c.nbytes / s / 1e6:.0f} GB/s), "
              f"queued {q:.3f} ms ({2 * c.nbytes / q / 1e6:.0f} GB/s)")
        rows.append({"op": "copy", "sync_ms": s, "queued_ms": q, "gbps": 2 * c.nbytes / q / 1e6})
        del c

    hdr = f"{'op':10s} {'shape':12s} {'dtype':9s} {'variant':28s} {'ours ms':>8s} {'mlx ms':>8s} " \
          f"{'ours q':>8s} {'mlx q':>8s} {'GB/s q':>7s} {'ratio':>6s} {'ratio q':>7s} {'relerr':>8s}"
    print(hdr)
    for shape in shapes:
        for dt_name, dt in (("float32", mx.float32), ("bfloat16", mx.bfloat16)):
            rng = np.random.default_rng(0)
            x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)
            w = mx.array(rng.standard_normal(shape[-1:]).astype(np.float32)).astype(dt)
            b = mx.array(rng.standard_normal(shape[-1:]).astype(np.float32)).astype(dt)
            g = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)
            # x and w as views one element into their buffers (not 16-byte aligned)
            xo = mx.concatenate([mx.zeros((1,), dtype=dt), x.reshape(-1)])[1:].reshape(shape)
            wo = mx.concatenate([mx.zeros((1,), dtype=dt), w])[1:]
            mx.eval(x, w, b, g, xo, wo)
            nbytes = x.nbytes
            ops = {
                "rms_norm": (lambda: xk.rms_norm(x, w, eps), lambda: mx.fast.rms_norm(x, w, eps), 2 * nbytes),
                "rms_off1": (lambda: xk.rms_norm(xo, wo, eps), lambda: mx.fast.rms_norm(xo, wo, eps), 2 * nbytes),
                "layer_norm": (lambda: xk.layer_norm(x, w, b, eps), lambda: mx.fast.layer_norm(x, w, b, eps),
                               2 * nbytes),
                "rms_vjp": (lambda: mx.vjp(lambda a, c: xk.rms_norm(a, c, eps), [x, w], [g])[1],
                            lambda: mx.vjp(lambda a, c: mx.fast.rms_norm(a, c, eps), [x, w], [g])[1],
                            4 * nbytes),  # reads x, g (and x again for stats), writes dx; dw small
            }
            for op, (ours, theirs, moved) in ops.items():
                set_env({})
                ms_s, mq = timed(theirs) if not args.tiny else (1.0, 1.0)
                ref = theirs()
                for var in variants[op]:
                    set_env(var)
                    os_, oq = timed(ours)
                    out = ours()
                    err = max(rel_err(o, r) for o, r in zip(out if isinstance(out, list) else [out],
                                                             ref if isinstance(ref, list) else [ref]))
                    gbps = moved / oq / 1e6
                    name = ",".join(f"{k.replace('XLSTM_RMS_NORM_', '').lower()}={v}" for k, v in var.items()) or "default"
                    print(f"{op:10s} {'x'.join(map(str, shape)):12s} {dt_name:9s} {name:28s} {os_:8.4f} "
                          f"{ms_s:8.4f} {oq:8.4f} {mq:8.4f} {gbps:7.0f} {ms_s / os_:6.2f} {mq / oq:7.2f} "
                          f"{err:8.1e}")
                    rows.append({"op": op, "shape": list(shape), "dtype": dt_name, "variant": var,
                                 "ours_ms": os_, "mlx_ms": ms_s, "ours_queued_ms": oq, "mlx_queued_ms": mq,
                                 "gbps_queued": gbps, "ratio": ms_s / os_, "ratio_queued": mq / oq,
                                 "max_rel_err": err})
                set_env({})
            if time.perf_counter() - t_start > 70:
                print("stopping early: time budget")
                break
        else:
            continue
        break

    # host cost per call (graph building only, no evaluation inside the timed loop)
    x = mx.random.normal((64, 1024))
    w = mx.random.normal((1024,))
    q = mx.random.normal((1, 8, 128, 64))
    mx.eval(x, w, q)
    host = {
        "xk.rms_norm": lambda: xk.rms_norm(x, w, eps),
        "mx.fast.rms_norm": lambda: mx.fast.rms_norm(x, w, eps),
        "xk.layer_norm": lambda: xk.layer_norm(x, w, None, eps),
        "xk.rope": lambda: xk.rope(q, 64, traditional=False, base=10000.0, scale=1.0, offset=3),
        "mx.fast.rope": lambda: mx.fast.rope(q, 64, traditional=False, base=10000.0, scale=1.0, offset=3),
    }
    for name, f in host.items():
        for _ in range(50):
            f()
        n = 200 if args.tiny else 2000
        outs = []
        t0 = time.perf_counter()
        for _ in range(n):
            outs.append(f())
        us = (time.perf_counter() - t0) / n * 1e6
        mx.eval(outs[-1])
        del outs
        print(f"host {name:20s} {us:7.2f} us per call")
        rows.append({"op": "host", "name": name, "us_per_call": us})

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"device": str(mx.default_device()), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
