"""Probe: where the RMSNorm backward's time goes in a model loop (host vs device).

    python3 scripts/probe_vjp.py [--out vjp.json]      # on the GPU (backend cuda)
    PROBE_VJP_SHAPES=1x4096,4096x4096 PROBE_VJP_DTYPES=bfloat16 python3 scripts/probe_vjp.py

scripts/probe_rms.py times the evaluation of queued VJPs (device time); the bench's
pipelined ratio also pays the host's work per call. Per case, microseconds per call:

* ``q``: 20 calls built, then evaluated (build + evaluation); ``host``: the building part;
  ``eval``: the evaluation part (the GPU time once the launches are recorded);
* ``pipe``: the next batch built while the last runs (``mx.async_eval``): max(host, device)
  when they overlap;
* implementations: ``mlx`` (mx.vjp of mx.fast.rms_norm), ``ours`` (mx.vjp of
  xlstm_kernels.rms_norm), ``ours_r0`` (graph replay off, XLSTM_KERNELS_REPLAY=0),
  ``kernel`` (our backward's launch and partial sums called directly: no mx.vjp, no
  forward), and ``*_step`` (the VJP inside an ``mx.compile``'d training-step function:
  no per-call Python).
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
from xlstm_kernels.benchmarks.timing import measure_pipelined
from xlstm_kernels.ops import norm as norm_mod
from xlstm_kernels.runtime import prepare_launch

Q = 20
EPS = 1e-5


def queued(fn, reps=15):
    """(q, host, eval) us per call: Q calls built then evaluated, medians of reps."""
    for _ in range(3):
        mx.eval([fn() for _ in range(Q)])
    tot, host, ev = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(Q)]
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        tot.append((t2 - t0) / Q)
        host.append((t1 - t0) / Q)
        ev.append((t2 - t1) / Q)
    med = lambda v: statistics.median(v) * 1e6  # noqa: E731
    return med(tot), med(host), med(ev)


def kernel_only(x, w, g):
    """Our backward's launch and partial sums, called directly (what f_vjp runs)."""
    spec, kw, _ = norm_mod._vjp_plan("rms", x, w, False, g, EPS)
    run = prepare_launch(spec, **kw)
    consts = kw["inputs"][3:]

    def fn():
        dx, dwp = run([x, w, g, *consts])
        return [dx, dwp.sum(axis=0).astype(x.dtype)]

    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in t.split("x")) for t in
              os.environ.get("PROBE_VJP_SHAPES", "1x4096,4096x4096,2048x8192,16384x4096").split(",") if t]
    dtypes = [getattr(mx, t) for t in os.environ.get("PROBE_VJP_DTYPES", "bfloat16,float32").split(",") if t]
    rows = []
    print(f"{'shape':12s} {'dtype':9s} {'impl':10s} {'q':>8s} {'host':>8s} {'eval':>8s} {'pipe':>8s}  (us per call)")
    for shape in shapes:
        for dt in dtypes:
            rng = np.random.default_rng(0)
            x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)
            w = mx.array(rng.standard_normal(shape[-1:]).astype(np.float32)).astype(dt)
            g = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)
            mx.eval(x, w, g)

            def vjp_of(f):
                return lambda: mx.vjp(lambda a, b: f(a, b, EPS), [x, w], [g])[1]

            def step_of(f):
                stepped = mx.compile(lambda a, b, c: mx.vjp(lambda u, v: f(u, v, EPS), [a, b], [c])[1])
                return lambda: stepped(x, w, g)

            impls = {"mlx": vjp_of(mx.fast.rms_norm), "ours": vjp_of(xk.rms_norm), "ours_r0": vjp_of(xk.rms_norm),
                     "kernel": kernel_only(x, w, g), "mlx_step": step_of(mx.fast.rms_norm),
                     "ours_step": step_of(xk.rms_norm)}
            for name, fn in impls.items():
                os.environ["XLSTM_KERNELS_REPLAY"] = "0" if name == "ours_r0" else "1"
                norm_mod._CALLS.clear()
                q, host, ev = queued(fn)
                pipe = measure_pipelined(fn, calls=Q, batches=6, repeats=3) * 1e6
                print(f"{'x'.join(map(str, shape)):12s} {str(dt).split('.')[-1]:9s} {name:10s} "
                      f"{q:8.1f} {host:8.1f} {ev:8.1f} {pipe:8.1f}", flush=True)
                rows.append({"shape": list(shape), "dtype": str(dt), "impl": name, "q_us": q, "host_us": host,
                             "eval_us": ev, "pipe_us": pipe})
            os.environ.pop("XLSTM_KERNELS_REPLAY", None)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
