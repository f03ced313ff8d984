"""Probe (session 28): does a backward whose constants are host arrays (managed memory) wait
on them outside the profiler? Times one evaluation per training-like step (mx.vjp of the op,
then mx.eval: host and GPU together, as a step loop without overlap) with the constants made
on the helper thread (shipped) and with the old fallback to host arrays, interleaved.

    python3 scripts/probe_backward_consts.py            # on the GPU (XLSTM_KERNELS_BACKEND=cuda)

Each variant runs in a fresh call signature (the memos are cleared, so its backward is
planned again under its own rule); median and q25 of PROBE_BC_REPEATS rounds of
PROBE_BC_STEPS steps, us a step."""

from __future__ import annotations

import os
import statistics
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.cuda import constants
from xlstm_kernels.ops import norm

STEPS = int(os.environ.get("PROBE_BC_STEPS", "50"))
REPEATS = int(os.environ.get("PROBE_BC_REPEATS", "9"))
_shipped = constants._made_off_thread


def _case(kind: str, rows: int, n: int, dtype):
    x, g = (mx.random.normal((rows, n)).astype(dtype) for _ in range(2))
    w, b = (mx.random.normal((n,)).astype(dtype) for _ in range(2))
    mx.eval(x, g, w, b)
    if kind == "rms":
        return lambda f: mx.vjp(lambda a, c: f(a, c, 1e-5), [x, w], [g])[1]
    return lambda f: mx.vjp(lambda a, c, d: f(a, c, d, 1e-5), [x, w, b], [g])[1]


def _use(variant: str) -> None:
    constants._made_off_thread = _shipped if variant == "shipped" else (lambda *a: None)
    constants.clear()
    norm._CALLS.clear()


def main() -> None:
    cases = [("rms", 4096, 4096, mx.bfloat16), ("ln", 2048, 8192, mx.bfloat16), ("ln", 4096, 4096, mx.float32)]
    for kind, rows, n, dtype in cases:
        step = _case(kind, rows, n, dtype)
        ours = xk.rms_norm if kind == "rms" else xk.layer_norm
        theirs = mx.fast.rms_norm if kind == "rms" else mx.fast.layer_norm
        times = {"shipped": [], "host consts": [], "mlx": []}
        for r in range(REPEATS):
            for variant in (list(times) if r % 2 == 0 else list(times)[::-1]):
                fn = theirs if variant == "mlx" else ours
                if variant != "mlx":
                    _use(variant)
                mx.eval(step(fn))
                mx.eval(step(fn))
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    mx.eval(step(fn))
                times[variant].append((time.perf_counter() - t0) / STEPS * 1e6)
        _use("shipped")
        name = f"{kind}_vjp {rows}x{n} {str(dtype).split('.')[-1]}"
        print(name + ": " + "  ".join(f"{v} med {statistics.median(t):.1f} q25 {sorted(t)[len(t) // 4]:.1f}"
                                      for v, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
