"""Probe: the norms' thread layouts (threads per row, cached vs looped) against MLX's ops,
queued and pipelined, on the shapes where session 10's bench stayed below 1.0x.

    python3 scripts/probe_norm_layout.py --out $OUT/norm_layout.json        # on the GPU (cuda)
    XLSTM_KERNELS_BACKEND=emulate python3 scripts/probe_norm_layout.py --tiny  # logic check here

A variant is a dict of knob variables (XLSTM_RMS_NORM_N_READS, XLSTM_LAYER_NORM_N_READS:
elements per thread, so threads per row = n / n_reads, cached up to 1024 threads) and
module attributes of ops.norm (VJP_THREADS, VJP_MAX_READS, RMS_VJP_THREADS_CUDA_16BIT: the
backward's layout); "auto" is the op as shipped. Each round times MLX's op and every
variant once, in turn (a drift of the machine hits all alike); the table gives medians
over ROUNDS rounds of

* queued: Q calls built, then one mx.eval (host build time + device time, per call);
* pipelined: the next Q calls built while the device runs the last (mx.async_eval): max of
  host and device time per call, what a model loop sees.

ratio = MLX time / ours (> 1: ours faster); GB/s from the pipelined time (forward: x read,
y written; backward: x, g read, dx written).
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

ROUNDS = 3
Q = 20
BATCHES = 4
MODULE_ATTRS = ("VJP_THREADS", "VJP_MAX_READS", "RMS_VJP_THREADS_CUDA_16BIT")
SHIPPED = {a: getattr(norm_mod, a) for a in MODULE_ATTRS}


def configure(var: dict) -> None:
    """Apply a variant: module attributes and knob variables (others reset to shipped)."""
    for a in MODULE_ATTRS:
        setattr(norm_mod, a, int(var.get(a, SHIPPED[a])))
    for k in list(os.environ):
        if k.startswith("XLSTM_RMS_NORM_") or k.startswith("XLSTM_LAYER_NORM_"):
            del os.environ[k]
    os.environ.update({k: str(v) for k, v in var.items() if k.startswith("XLSTM_")})
    norm_mod._CALLS.clear()


def rel_err(got, want) -> float:
    got = got if isinstance(got, (list, tuple)) else [got]
    want = want if isinstance(want, (list, tuple)) else [want]
    errs = []
    for a, b in zip(got, want):
        a = np.asarray(a.astype(mx.float32), dtype=np.float64)
        b = np.asarray(b.astype(mx.float32), dtype=np.float64)
        errs.append(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30)))
    return max(errs)


def nr(kind: str, k: int) -> dict:
    return {("XLSTM_RMS_NORM_N_READS" if kind == "rms" else "XLSTM_LAYER_NORM_N_READS"): k}


def cases(tiny: bool) -> list[tuple]:
    """(op, shape, dtype, variants)."""
    if tiny:
        return [("rms", (8, 256), mx.float32, [{}, nr("rms", 8)]),
                ("ln", (4, 512), mx.bfloat16, [{}, nr("ln", 16)]),
                ("ln_vjp", (4, 512), mx.float32, [{}, {"VJP_THREADS": 64}])]
    out = []
    for dt in (mx.float32, mx.bfloat16):
        for kind in ("rms", "ln"):
            out.append((kind, (2048, 8192), dt, [{}, nr(kind, 8), nr(kind, 16), nr(kind, 32)]))
            out.append((kind, (16384, 1024), dt, [{}, nr(kind, 4)]))
        out.append(("ln_vjp", (2048, 8192), dt, [{}, {"VJP_THREADS": 512}, {"VJP_THREADS": 1024}]))
        out.append(("rms_vjp", (2048, 8192), dt, [{}, {"VJP_THREADS": 512, "RMS_VJP_THREADS_CUDA_16BIT": 1024},
                                                  {"VJP_THREADS": 1024}]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    global ROUNDS, Q, BATCHES
    if args.tiny:
        ROUNDS, Q, BATCHES = 1, 2, 2
    eps = 1e-5
    rows = []
    t_start = time.perf_counter()
    print(f"{'op':8s} {'shape':11s} {'dtype':8s} {'variant':32s} {'q ms':>8s} {'mlx q':>8s} {'ratio q':>7s} "
          f"{'p ms':>8s} {'mlx p':>8s} {'ratio p':>7s} {'GB/s p':>7s} {'relerr':>8s}", flush=True)
    for op, shape, dt, variants in cases(args.tiny):
        rng = np.random.default_rng(0)
        x, g = (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt) for _ in range(2))
        w, b = (mx.array(rng.standard_normal(shape[-1:]).astype(np.float32)).astype(dt) for _ in range(2))
        mx.eval(x, g, w, b)
        if op == "rms":
            ours, theirs, moved = (lambda: xk.rms_norm(x, w, eps)), (lambda: mx.fast.rms_norm(x, w, eps)), 2
        elif op == "ln":
            ours = lambda: xk.layer_norm(x, w, b, eps)  # noqa: E731
            theirs = lambda: mx.fast.layer_norm(x, w, b, eps)  # noqa: E731
            moved = 2
        elif op == "rms_vjp":
            ours = lambda: mx.vjp(lambda a, c: xk.rms_norm(a, c, eps), [x, w], [g])[1]  # noqa: E731
            theirs = lambda: mx.vjp(lambda a, c: mx.fast.rms_norm(a, c, eps), [x, w], [g])[1]  # noqa: E731
            moved = 3
        else:
            ours = lambda: mx.vjp(lambda a, c, d: xk.layer_norm(a, c, d, eps), [x, w, b], [g])[1]  # noqa: E731
            theirs = lambda: mx.vjp(lambda a, c, d: mx.fast.layer_norm(a, c, d, eps), [x, w, b], [g])[1]  # noqa: E731
            moved = 3
        want = theirs()
        names = ["mlx"] + [json.dumps(v) if v else "auto" for v in variants]
        tq = {n: [] for n in names}
        tp = {n: [] for n in names}
        errs = {}
        for r in range(ROUNDS):
            for name, var in zip(names, [None] + variants):
                if var is None:
                    configure({})
                    fn = theirs
                else:
                    configure(var)
                    fn = ours
                    if r == 0:
                        errs[name] = rel_err(fn(), want)
                mx.eval([fn() for _ in range(2)])  # compile, memo
                t0 = time.perf_counter()
                mx.eval([fn() for _ in range(Q)])
                tq[name].append((time.perf_counter() - t0) / Q)
                tp[name].append(measure_pipelined(fn, calls=Q, batches=BATCHES, repeats=1))
        configure({})
        mq, mp = statistics.median(tq["mlx"]), statistics.median(tp["mlx"])
        for name in names:
            q, p = statistics.median(tq[name]), statistics.median(tp[name])
            gbps = moved * x.nbytes / p / 1e9
            print(f"{op:8s} {'x'.join(map(str, shape)):11s} {str(dt).split('.')[-1]:8s} {name:32s} {q * 1e3:8.4f} "
                  f"{mq * 1e3:8.4f} {mq / q:7.3f} {p * 1e3:8.4f} {mp * 1e3:8.4f} {mp / p:7.3f} {gbps:7.0f} "
                  f"{errs.get(name, 0.0):8.1e}", flush=True)
            rows.append({"op": op, "shape": list(shape), "dtype": str(dt).split(".")[-1], "variant": name,
                         "queued_ms": q * 1e3, "mlx_queued_ms": mq * 1e3, "ratio_queued": mq / q,
                         "pipelined_ms": p * 1e3, "mlx_pipelined_ms": mp * 1e3, "ratio_pipelined": mp / p,
                         "gbps_pipelined": gbps, "max_rel_err": errs.get(name)})
    print(f"# {time.perf_counter() - t_start:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": str(mx.default_device()), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
