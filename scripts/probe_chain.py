"""Probe: what a chained call costs, and where (session 17).

    python3 scripts/probe_chain.py [--out chain.json]      # on the GPU (backend cuda)

A chained call (``x = op(x)``, 20 calls built, then evaluated: the bench's ``chained``
time) of a small op costs far more than its bytes: one sequence of decode attention at
4096 keys took ~37 us on the H100, ours and MLX's alike, for ~5.5 us of K / V traffic.
Two questions:

1. Copy floor: what does a plain copy reach, chained the same way, at each size? Our
   ``copy_words`` kernel and MLX's elementwise ``x + 0``, 256 KiB to 1 GiB, as GB/s
   (read + write) and as a share of the 1 GiB rate (the bench's copy bandwidth).
2. Wrapper cost: each differentiable op of ours is an ``mx.custom_function`` (a
   ``CustomTransforms`` node and one ``StopGradient`` per output in the graph). Variant
   ``bare`` builds the ops with ``mx.custom_function`` replaced by a pass-through (no VJP;
   forward only), ``ours`` as shipped, ``mlx`` MLX's op; the three interleaved, the order
   rotating, median us per call of PROBE_CHAIN_REPEATS chains.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.copy_rate import copy_words
from xlstm_kernels.benchmarks.timing import measure_chained_variants
from xlstm_kernels.ops._callcache import CallCache

CALLS = 20
REPEATS = int(os.environ.get("PROBE_CHAIN_REPEATS", "9"))
_real_custom_function = mx.custom_function


class _PassThrough:
    """Stands in for mx.custom_function: calls the function, ignores the transforms."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def vjp(self, g):
        return g

    def jvp(self, g):
        return g

    def vmap(self, g):
        return g


def _clear_memos() -> None:
    """Drop every prepared call (so the next call builds under the current wrapper)."""
    for obj in gc.get_objects():
        if isinstance(obj, CallCache):
            obj.clear()
    from xlstm_kernels.ops import attention
    attention._LAST_FAMILY[0] = None


def _use(variant: str) -> None:
    mx.custom_function = _PassThrough if variant == "bare" else _real_custom_function
    _clear_memos()


def copy_floor(rows: list) -> float:
    """Chained copies at each size; returns the 1 GiB rate (max of the two kinds)."""
    top_bytes = int(os.environ.get("PROBE_CHAIN_MAX_BYTES", str(1 << 30)))  # smaller for a CPU smoke run
    sizes = [s for s in (1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28, 1 << 30) if s <= top_bytes]
    rates = {}
    for nbytes in sizes:
        x = mx.random.uniform(shape=(nbytes // 4,))
        mx.eval(x)
        kinds = {"copy_words": lambda y: copy_words(y, "cuda"), "mlx x+0": lambda y: y + 0.0}
        times = measure_chained_variants([(k, (lambda f=f: f)) for k, f in kinds.items()], x, calls=8,
                                         repeats=REPEATS)
        for k in kinds:
            t = statistics.median(times[k])
            rates[(k, nbytes)] = 2 * nbytes / t / 1e9
        del x
    top = max(rates[(k, sizes[-1])] for k in ("copy_words", "mlx x+0"))
    print(f"copy floor (chained, 8 calls; % of the {sizes[-1] >> 20} MiB rate {top:,.0f} GB/s)")
    for nbytes in sizes:
        a, b = rates[("copy_words", nbytes)], rates[("mlx x+0", nbytes)]
        print(f"  {nbytes / 2**20:8.2f} MiB  copy_words {a:8,.0f} GB/s ({100 * a / top:5.1f}%)  "
              f"mlx {b:8,.0f} GB/s ({100 * b / top:5.1f}%)  us/call {2 * nbytes / a / 1e3:8.1f} / {2 * nbytes / b / 1e3:8.1f}",
              flush=True)
        rows.append(dict(kind="copy", bytes=nbytes, copy_words_gbps=a, mlx_gbps=b, pct_words=100 * a / top,
                         pct_mlx=100 * b / top))
    return top


def cases() -> dict:
    """name -> (x0, ours(x), mlx(x), bytes moved per call)."""
    out = {}
    for lk in (4096, 16384):
        k = mx.random.normal((1, 8, lk, 128)).astype(mx.bfloat16)
        v = mx.random.normal((1, 8, lk, 128)).astype(mx.bfloat16)
        q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
        mx.eval(k, v, q)
        out[f"decode 1x32x8x{lk}"] = (
            q, (lambda k, v: lambda a: xk.scaled_dot_product_attention(a, k, v, scale=128**-0.5))(k, v),
            (lambda k, v: lambda a: mx.fast.scaled_dot_product_attention(a, k, v, scale=128**-0.5))(k, v),
            2 * k.nbytes + 2 * q.nbytes)
    for shape in ((32, 32, 1, 128), (1, 32, 2048, 128)):
        x = mx.random.normal(shape).astype(mx.bfloat16)
        mx.eval(x)
        out["rope " + "x".join(map(str, shape))] = (
            x, lambda a: xk.rope(a, 128, traditional=False, base=10000.0, offset=7),
            lambda a: mx.fast.rope(a, 128, traditional=False, base=10000.0, scale=1.0, offset=7), 2 * x.nbytes)
    # the one-token row with its offset in device memory (an int offset is a host-made
    # array, which MLX's CUDA allocator keeps in managed memory)
    x = mx.random.normal((32, 32, 1, 128)).astype(mx.bfloat16)
    off = mx.zeros((), dtype=mx.int32) + 7
    mx.eval(x, off)
    out["rope 32x32x1x128 dev off"] = (
        x, lambda a: xk.rope(a, 128, traditional=False, base=10000.0, offset=off),
        lambda a: mx.fast.rope(a, 128, traditional=False, base=10000.0, scale=1.0, offset=off), 2 * x.nbytes)
    for shape in ((1, 4096), (4096, 4096)):
        x = mx.random.normal(shape).astype(mx.bfloat16)
        w = (1 + 0.1 * mx.random.normal((shape[-1],))).astype(mx.bfloat16)
        mx.eval(x, w)
        out["rms_norm " + "x".join(map(str, shape))] = (
            x, (lambda w: lambda a: xk.rms_norm(a, w, 1e-5))(w), (lambda w: lambda a: mx.fast.rms_norm(a, w, 1e-5))(w),
            2 * x.nbytes + w.nbytes)
    tiny = mx.random.normal((1, 4096)).astype(mx.bfloat16)
    mx.eval(tiny)
    out["tiny floor 1x4096"] = (tiny, lambda a: copy_words(a, "cuda"), lambda a: a + 0, 2 * tiny.nbytes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    xk.use_backend("cuda")
    rows: list = []
    t0 = time.perf_counter()
    top = copy_floor(rows) if os.environ.get("PROBE_CHAIN_COPY", "1") == "1" else 2900.0
    variants = ("ours", "bare", "mlx")
    print(f"\nchained us per call ({CALLS} calls a chain, median of {REPEATS}; bare = ours without mx.custom_function)")
    print(f"  {'case':24s} {'ours':>8s} {'bare':>8s} {'mlx':>8s}  {'ours %copy':>10s} {'mlx %copy':>9s}")
    for name, (x0, ours, theirs, moved) in cases().items():
        def prepare(v, ours=ours, theirs=theirs):
            if v == "mlx":
                return theirs
            _use(v)
            return ours

        times = measure_chained_variants([(v, (lambda v=v: prepare(v))) for v in variants], x0, calls=CALLS,
                                         repeats=REPEATS)
        times = {v: [t * 1e6 for t in ts] for v, ts in times.items()}
        _use("ours")
        med = {v: statistics.median(times[v]) for v in variants}
        pct = {v: 100 * moved / (med[v] * 1e3) / top for v in variants}
        print(f"  {name:24s} {med['ours']:8.1f} {med['bare']:8.1f} {med['mlx']:8.1f}  {pct['ours']:10.1f} "
              f"{pct['mlx']:9.1f}", flush=True)
        rows.append(dict(kind="chain", case=name, bytes=moved, **{f"{v}_us": med[v] for v in variants},
                         spread={v: [min(times[v]), max(times[v])] for v in variants}))
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
