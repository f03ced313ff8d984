"""Probe: a decode loop as mlx-lm runs it, where the KV cache grows by one key a step
(``k_cache[:, :, :lk]``) and RoPE's offset moves with it (session 14).

    python3 scripts/probe_decode_loop.py [--out loop.json]      # on the GPU (backend cuda)

Every step is a new call signature for attention (Lk changes) and a new offset for RoPE,
where the bench repeats one shape and one offset. Per op, us per step: ``pipe`` (each
step's op built while the last one runs, ``mx.async_eval``; what mlx-lm's generate does)
and ``host`` (the building part alone), ours and MLX's, over 64 steps (PROBE_LOOP_STEPS) from Lk = 4096
(after 8 warm-up steps at other lengths; PROBE_LOOP_WARM_RANGE=1: after one pass over the
measured lengths).
"""

from __future__ import annotations

import argparse
import json
import os

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import measure_step_loop


# 1: warm up over the measured lengths themselves. By default (0) the growing cache warms
# up at other lengths (from 1000 + 4096), so its timed steps also make the launch plans of
# their split-KV block counts (two new plans in the 64 steps from 4096: ~0.3-1 ms each,
# which a real decode loop pays once per block-count change, every 256 keys at these
# shapes). Session 22: this made part of the 15-25 us a step by which "growing cache" read
# dearer than "growing contig" (32.4 -> 25.6 us with 1, against 16.2 / 14.8), the loops'
# order more; scripts/probe_decode_slice.py found no cost of the slices themselves.
WARM_RANGE = os.environ.get("PROBE_LOOP_WARM_RANGE", "0") == "1"


loop = measure_step_loop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    b, hq, hkv, d, l0, n = 1, 32, 8, 128, 4096, int(os.environ.get("PROBE_LOOP_STEPS", "64"))
    kc = mx.random.normal((b, hkv, l0 + 2 * n + 64, d)).astype(mx.bfloat16)
    vc = mx.random.normal((b, hkv, l0 + 2 * n + 64, d)).astype(mx.bfloat16)
    q = mx.random.normal((b, hq, 1, d)).astype(mx.bfloat16)
    x = mx.random.normal((b, hq, 1, d)).astype(mx.bfloat16)
    mx.eval(kc, vc, q, x)
    # contiguous K / V of every length (no slice copy inside the op): a separate factor
    nc = min(n, 64)
    ks = [mx.contiguous(kc[:, :, : l0 + i]) for i in range(nc)]
    vs = [mx.contiguous(vc[:, :, : l0 + i]) for i in range(nc)]
    mx.eval(ks, vs)
    cases = {
        "sdpa growing cache": (lambda f: (lambda i: f(q, kc[:, :, : l0 + i], vc[:, :, : l0 + i]))),
        "sdpa fixed cache": (lambda f: (lambda i: f(q, kc[:, :, :l0], vc[:, :, :l0]))),
        "sdpa growing contig": (lambda f: (lambda i: f(q, ks[i % nc], vs[i % nc]))),
    }
    impls = {"ours": lambda a, k, v: xk.scaled_dot_product_attention(a, k, v, scale=d**-0.5),
             "mlx": lambda a, k, v: mx.fast.scaled_dot_product_attention(a, k, v, scale=d**-0.5)}
    for case, mk in cases.items():
        for impl, f in impls.items():
            step = mk(f)
            if WARM_RANGE:  # every measured length once: its launch plans made before timing
                loop(step, n)
            else:
                loop(lambda i: step(1000 + i) if "contig" not in case else step(nc - 1 - i), 8)  # warm-up (JIT)
            pipe, host = loop(step, n)
            rows.append(dict(case=case, impl=impl, pipe_us=pipe, host_us=host))
            print(f"{case:22s} {impl:5s} pipe {pipe:8.1f} host {host:8.1f} us/step", flush=True)
    ropes = {"ours": lambda a, off: xk.rope(a, d, traditional=False, base=10000.0, offset=off),
             "mlx": lambda a, off: mx.fast.rope(a, d, traditional=False, base=10000.0, scale=1.0, offset=off)}
    for impl, f in ropes.items():
        loop(lambda i: f(x, 10 + i), 8)
        for case, step in (("rope moving offset", lambda i: f(x, l0 + i)), ("rope fixed offset", lambda i: f(x, l0))):
            pipe, host = loop(step, n)
            rows.append(dict(case=case, impl=impl, pipe_us=pipe, host_us=host))
            print(f"{case:22s} {impl:5s} pipe {pipe:8.1f} host {host:8.1f} us/step", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
