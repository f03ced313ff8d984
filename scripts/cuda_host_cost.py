#!/usr/bin/env python3
"""Per-call host cost of our ops vs MLX's on the cuda backend (tiny inputs: the GPU time
is negligible, so the time per call is what the host spends).

For each op: `sync` = median of (call, mx.eval) pairs; `queued` = N calls, one mx.eval,
divided by N (what a model's forward pays per op when the GPU keeps up); `python` = the
call alone without evaluation (graph building: our Python + MLX's primitive).

    python scripts/cuda_host_cost.py [--out host.json] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def _measure(fn, repeats: int, queued: int = 50) -> dict:
    for _ in range(3):
        mx.eval(fn())
    sync, py, q = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        mx.eval(out)
        sync.append(time.perf_counter() - t0)
        py.append(t1 - t0)
    for _ in range(max(3, repeats // 20)):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(queued)])
        q.append((time.perf_counter() - t0) / queued)
    us = lambda v: round(statistics.median(v) * 1e6, 2)  # noqa: E731
    return {"sync_us": us(sync), "queued_us": us(q), "python_us": us(py)}


def cases():
    import xlstm_kernels as xk
    from xlstm_kernels.ops import gemm, norm, rope

    rng = np.random.default_rng(0)
    arr = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    x, w, b = arr(4, 256), arr(256), arr(256)
    xr = arr(1, 4, 8, 64)
    a, v = arr(64, 64), arr(64, 64)
    q, k, vv = arr(1, 4, 1, 64), arr(1, 4, 256, 64), arr(1, 4, 256, 64)
    yield "rms_norm", lambda: norm.rms_norm(x, w, 1e-5), lambda: mx.fast.rms_norm(x, w, 1e-5)
    yield "layer_norm", lambda: norm.layer_norm(x, w, b, 1e-5), lambda: mx.fast.layer_norm(x, w, b, 1e-5)
    yield "rope", lambda: rope.rope(xr, 64, base=10000.0, offset=3), \
        lambda: mx.fast.rope(xr, 64, traditional=False, base=10000.0, scale=1.0, offset=3)
    yield "gemm_av", lambda: gemm.gemm_av(a, v), lambda: a @ v
    yield "attention_decode", lambda: xk.scaled_dot_product_attention(q, k, vv, scale=0.125), \
        lambda: mx.fast.scaled_dot_product_attention(q, k, vv, scale=0.125)
    yield "x * 2 (MLX floor)", None, lambda: x * 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--repeats", type=int, default=200)
    a = p.parse_args(argv)
    from xlstm_kernels import runtime

    rows = []
    print(f"{'op':<20} {'ours sync':>10} {'queued':>8} {'python':>8} | {'mlx sync':>9} {'queued':>8} {'python':>8}  (us)")
    with runtime.use_backend(runtime.current_backend()):
        for name, ours, theirs in cases():
            r = {"op": name, "backend": runtime.current_backend()}
            if ours is not None:
                r["ours"] = _measure(ours, a.repeats)
            r["mlx"] = _measure(theirs, a.repeats)
            rows.append(r)
            o = r.get("ours", {})
            print(f"{name:<20} {o.get('sync_us', float('nan')):>10} {o.get('queued_us', float('nan')):>8} "
                  f"{o.get('python_us', float('nan')):>8} | {r['mlx']['sync_us']:>9} {r['mlx']['queued_us']:>8} "
                  f"{r['mlx']['python_us']:>8}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"mlx": mx.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
