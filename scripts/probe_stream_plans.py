"""Probe (session 40): one-launch decode (``attention_decode_stream``) under other tile plans
(keys a tile, simdgroups, stages), in marginal chains against the split-KV pair and MLX.

    python3 scripts/probe_stream_plans.py                      # 1x32x32x4096x128, fp16 and bf16
    PROBE_SP_SHAPES="1,32,32,8192,128" PROBE_SP_PLANS="16x12x2 16x8x3" python3 scripts/probe_stream_plans.py
    PROBE_SP_PLANS="16x12x2 16x12x2e 16x8x3e" python3 scripts/probe_stream_plans.py   # "e": early refill (session 46)

Each plan is its own prepared launch (``ops.attention._stream_launch`` with STREAM_TILES
patched to that plan alone), so no call cache stands between the plans. q is the previous
call's output in chains (``timing.measure_chained_variants``, marginal). Needs a cuda GPU.
"""

from __future__ import annotations

import os
import statistics
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from xlstm_kernels.benchmarks import timing  # noqa: E402
from xlstm_kernels.ops import attention as att  # noqa: E402
from xlstm_kernels.runtime import prepare_launch  # noqa: E402

PLANS = os.environ.get("PROBE_SP_PLANS", "16x12x2 16x8x3 16x8x2 8x16x3 8x12x4 32x6x2").split()
SHAPES = [tuple(int(x) for x in s.split(",")) for s in os.environ.get("PROBE_SP_SHAPES", "1,32,32,4096,128").split()]
DTYPES = os.environ.get("PROBE_SP_DTYPES", "float16 bfloat16").split()


def _plan_step(plan, q, k, v, scale, early=False):
    saved = att.STREAM_TILES, att.STREAM_EARLY_REFILL
    att.STREAM_TILES, att.STREAM_EARLY_REFILL = (plan,), early
    try:
        spec, kw = att._stream_launch(q, k, v, att._check_inputs(q, k, v, scale, None), scale, "cuda")
    finally:
        att.STREAM_TILES, att.STREAM_EARLY_REFILL = saved
    run, consts = prepare_launch(spec, **kw, backend="cuda"), kw["inputs"][3:]
    return lambda x: run([x, k, v, *consts])[0]


def main() -> int:
    if not mx.cuda.is_available():
        print("probe_stream_plans: needs MLX's CUDA backend", file=sys.stderr)
        return 2
    for b, hq, hkv, keys, d in SHAPES:
        for dtype in DTYPES:
            dt = getattr(mx, dtype)
            k, v = (mx.random.normal((b, hkv, keys, d)).astype(dt) for _ in range(2))
            q0 = mx.random.normal((b, hq, 1, d)).astype(dt)
            mx.eval(k, v, q0)
            scale = d**-0.5
            steps = {}
            for p in PLANS:
                plan = tuple(int(x) for x in p.rstrip("e").split("x"))  # "16x12x2e": early refill (ER)
                try:
                    steps[f"stream {p}"] = _plan_step(plan, q0, k, v, scale, early=p.endswith("e"))
                except Exception as e:  # a plan that does not fit: say so, go on
                    print(f"  stream {p}: {type(e).__name__}: {e}")
            steps["pair"] = lambda x: att.scaled_dot_product_attention(x, k, v, scale=scale,
                                                                      knobs={"split_kv_stream": False})
            steps["mlx"] = lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=scale)
            ref = mx.fast.scaled_dot_product_attention(*(a.astype(mx.float32) for a in (q0, k, v)), scale=scale)
            for name, step in list(steps.items()):
                err = mx.max(mx.abs(step(q0).astype(mx.float32) - ref)).item()
                if not err < 2e-2:
                    print(f"  {name}: max |error| {err:.2e}, dropped")
                    del steps[name]
            times = timing.measure_chained_variants([(n, lambda s=s: s) for n, s in steps.items()], q0, repeats=9,
                                                    marginal=True)
            print(f"== {b}x{hq}x{hkv}x{keys}x{d} {dtype}: marginal chains, us a call (median / min of 9)")
            for name, ts in times.items():
                print(f"  {name:16s} {statistics.median(ts) * 1e6:8.2f} {min(ts) * 1e6:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
