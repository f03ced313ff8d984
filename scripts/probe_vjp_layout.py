"""Probe: the norm backward staged (as shipped on CUDA) against the cached layout, device time
without overlap (session 23).

    python3 scripts/probe_vjp_layout.py      # on the GPU (backend cuda)

``probe_vjp_units.py`` timed compiled VJP steps as independent pipelined calls (which a
CUDA graph may overlap) and read the cached layout faster on two rows and slower on three,
against session 13's H200 tuning. Here each call's cotangent is the last call's dx (a chain
of 20 compiled steps, built then evaluated: no two backward kernels overlap), both layouts
and MLX's VJP interleaved, medians of 7; then the eager VJP pipelined (the bench's
``*_vjp`` steady state) for both layouts. us a call.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import measure_pipelined
from xlstm_kernels.ops import norm as norm_mod

CASES = [("rms", 4096, 4096, mx.bfloat16), ("rms", 16384, 1024, mx.bfloat16), ("rms", 2048, 8192, mx.bfloat16),
         ("rms", 16384, 4096, mx.bfloat16), ("rms", 4096, 4096, mx.float32), ("rms", 16384, 1024, mx.float32),
         ("rms", 2048, 8192, mx.float32), ("rms", 16384, 4096, mx.float32), ("ln", 4096, 4096, mx.bfloat16),
         ("ln", 16384, 1024, mx.float32)]
LAYOUTS = {"staged": {}, "cached": {"RMS_VJP_STAGED_CUDA": False, "LN_VJP_STAGED_CUDA": False}}
SAVED = {"RMS_VJP_STAGED_CUDA": norm_mod.RMS_VJP_STAGED_CUDA, "LN_VJP_STAGED_CUDA": norm_mod.LN_VJP_STAGED_CUDA}


def use(layout: str) -> None:
    for k, v in {**SAVED, **LAYOUTS[layout]}.items():
        setattr(norm_mod, k, v)
    norm_mod._CALLS.clear()


def fns(kind, dt, ours: bool):
    if kind == "rms":
        return (lambda a, c, e: xk.rms_norm(a, c, 1e-5)) if ours else (lambda a, c, e: mx.fast.rms_norm(a, c, 1e-5))
    return (lambda a, c, e: xk.layer_norm(a, c, e, 1e-5)) if ours else (lambda a, c, e: mx.fast.layer_norm(a, c, e, 1e-5))


def chain_time(step, x, w, b, g, calls=20) -> float:
    gi = g
    outs = []
    for _ in range(calls):
        dx = step(x, w, b, gi)
        outs.append(dx)
        gi = dx
    t0 = time.perf_counter()
    mx.eval(gi)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    for kind, rows, d, dt in CASES:
        x, w, b, g = (mx.random.normal(s).astype(dt) for s in ((rows, d), (d,), (d,), (rows, d)))
        mx.eval(x, w, b, g)
        steps = {}
        for name in ("staged", "cached", "mlx"):
            use("staged" if name == "mlx" else name)
            f = fns(kind, dt, name != "mlx")
            steps[name] = mx.compile(lambda a, c, e, gg, f=f: mx.vjp(f, [a, c, e], [gg])[1][0])
            mx.eval(steps[name](x, w, b, g))  # traced and planned under this layout
        times = {k: [] for k in steps}
        for r in range(7):
            order = list(steps) if r % 2 == 0 else list(reversed(steps))
            for name in order:
                times[name].append(chain_time(steps[name], x, w, b, g))
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        eager = {}
        for name in ("staged", "cached"):
            use(name)
            f = fns(kind, dt, True)
            fn = lambda f=f: mx.vjp(f, [x, w, b], [g])[1]  # noqa: E731
            mx.eval(fn())
            eager[name] = measure_pipelined(fn, calls=20, repeats=3) * 1e6
        mf = fns(kind, dt, False)
        eager["mlx"] = measure_pipelined(lambda: mx.vjp(mf, [x, w, b], [g])[1], calls=20, repeats=3) * 1e6
        use("staged")
        print(f"{str(dt).split('.')[-1]:8s} {kind:3s} {rows}x{d:<5d} chained compiled: staged {med['staged']:6.1f} "
              f"cached {med['cached']:6.1f} mlx {med['mlx']:6.1f}   eager pipelined: staged {eager['staged']:6.1f} "
              f"cached {eager['cached']:6.1f} mlx {eager['mlx']:6.1f}", flush=True)


if __name__ == "__main__":
    main()
