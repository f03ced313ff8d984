"""Probe: the host time of one decode step of ours and of MLX's SDPA on a KV-cache slice
against contiguous K / V of the same lengths (session 22).

    python3 scripts/probe_decode_slice.py      # on the GPU (backend cuda)

``scripts/probe_decode_loop.py`` read a growing cache's step 15-25 us of host time dearer
as slices (``k_cache[:, :, :lk]``) than as contiguous arrays. Here every call has a new Lk
(the decode family's path, as in a decode loop) and the variants run interleaved on
disjoint lengths, each evaluated before the next. Variants (us of host time a call,
median and first quartile over 4 rounds of 60 steps):

* ``slice``: the two slices made inside the timed region; ``slice_then_op``: made just
  before it; ``contig``: contiguous arrays made in advance;
* ``slice_untraced``: as ``slice`` with ``ops._callcache.traced`` answering False at once
  (what the tracer check costs a call);
* ``slice_then_op_nogc``: the garbage collector off during the call;
* ``mlx_*``: MLX's op in the same three forms.

The first variant of each step is dropped (the one after the last variant's evaluation
read slow on the CPU).
"""

from __future__ import annotations

import gc
import statistics
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.ops import _callcache

NAMES = ["first (dropped)", "contig", "slice_then_op", "slice", "slice_untraced", "slice_then_op_nogc", "mlx_slice",
         "mlx_slice_then_op", "mlx_contig"]


def main() -> None:
    b, hq, hkv, d, l0, n = 1, 32, 8, 128, 4096, 60
    nv = len(NAMES)
    kc = mx.random.normal((b, hkv, l0 + nv * n + 8, d)).astype(mx.bfloat16)
    vc = mx.random.normal((b, hkv, l0 + nv * n + 8, d)).astype(mx.bfloat16)
    q = mx.random.normal((b, hq, 1, d)).astype(mx.bfloat16)
    length = lambda i, j: l0 + nv * i + j  # noqa: E731
    lengths = [length(i, j) for i in range(n) for j in range(nv)]
    ks = {lk: mx.contiguous(kc[:, :, :lk]) for lk in lengths}
    vs = {lk: mx.contiguous(vc[:, :, :lk]) for lk in lengths}
    mx.eval(kc, vc, q, list(ks.values()), list(vs.values()))
    ours = lambda a, k, v: xk.scaled_dot_product_attention(a, k, v, scale=d**-0.5)  # noqa: E731
    mlx = lambda a, k, v: mx.fast.scaled_dot_product_attention(a, k, v, scale=d**-0.5)  # noqa: E731
    for lk in lengths:  # warm-up: every length's launch plans made, kernels compiled
        mx.eval(ours(q, kc[:, :, :lk], vc[:, :, :lk]), mlx(q, ks[lk], vs[lk]))
    real_traced = _callcache.traced
    res: dict[str, list[float]] = {k: [] for k in NAMES}
    try:
        for _ in range(4):
            for i in range(n):
                for j, name in enumerate(NAMES):
                    lk = length(i, j)
                    _callcache.traced = (lambda arrays: False) if name.endswith("untraced") else real_traced
                    fn = mlx if name.startswith("mlx") else ours
                    if name.endswith("nogc"):
                        gc.disable()
                    if "then_op" in name:
                        k_, v_ = kc[:, :, :lk], vc[:, :, :lk]
                        t0 = time.perf_counter()
                        o = fn(q, k_, v_)
                    elif "contig" in name or name.startswith("first"):
                        t0 = time.perf_counter()
                        o = fn(q, ks[lk], vs[lk])
                    else:
                        t0 = time.perf_counter()
                        o = fn(q, kc[:, :, :lk], vc[:, :, :lk])
                    res[name].append((time.perf_counter() - t0) * 1e6)
                    gc.enable()
                    mx.eval(o)
    finally:
        _callcache.traced = real_traced
        gc.enable()
    for name, v in res.items():
        print(f"{name:20s} median {statistics.median(v):6.1f} us  q25 {sorted(v)[len(v) // 4]:6.1f}")


if __name__ == "__main__":
    main()
