"""Probe: staged norm backward units per SM for rows that hold few elements a thread (session 23).

    python3 scripts/probe_vjp_units.py      # on the GPU (backend cuda)
    PROBE_VU_VARIANTS="base u8" PROBE_VU_REPEATS=3 python3 scripts/probe_vjp_units.py

The staged backward (``ops.norm._vjp_plan``: RMSNorm and LayerNorm, multi-head too) plans
RMS_VJP_STAGED_UNITS_PER_SM = 3 units of 128+ threads a SM, tuned on 4096-element rows (32
elements a thread at the RMS_VJP_STAGED_REGISTERS = 160 hint). A multi-head LayerNorm of
512-element heads holds 4 a thread, and read 60-63% of copy in the bench where a copy of its
bytes reads 72-82%. Variants (module constants, the call memo cleared between them):

* ``base``: as shipped;
* ``u6`` / ``u8`` / ``u12`` / ``u16``: that many units a SM (the register hint 65536 / (units x 128));
* ``unstaged``: the cached layout (RMS_VJP_STAGED_CUDA = LN_VJP_STAGED_CUDA = False);
* ``t64`` / ``t64u6``: staged units of 64 threads a row where the rows allow (short rows),
  3 / 6 a SM.

Each: the VJP inside ``mx.compile`` (a compiled training step: device time, no per-call
Python), ours against MLX's, ``timing.measure_pipelined_pair``; us a call and MLX's time
over ours.
"""

from __future__ import annotations

import os

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import measure_chained_pair, measure_pipelined_pair
from xlstm_kernels.ops import norm as norm_mod

CASES = [("mhln", 4096, 8, 512, mx.float32), ("mhln", 4096, 8, 512, mx.bfloat16), ("mhln", 8192, 4, 64, mx.float32),
         ("mhln", 16384, 8, 128, mx.bfloat16), ("ln", 4096, 1, 4096, mx.float32), ("rms", 16384, 1, 1024, mx.bfloat16),
         ("rms", 16384, 1, 1024, mx.float32), ("rms", 4096, 1, 4096, mx.bfloat16)]
VARIANTS = {
    "base": {},
    "u6": {"RMS_VJP_STAGED_UNITS_PER_SM": 6, "RMS_VJP_STAGED_REGISTERS": 80},
    "u8": {"RMS_VJP_STAGED_UNITS_PER_SM": 8, "RMS_VJP_STAGED_REGISTERS": 64},
    "u12": {"RMS_VJP_STAGED_UNITS_PER_SM": 12, "RMS_VJP_STAGED_REGISTERS": 40},
    "u16": {"RMS_VJP_STAGED_UNITS_PER_SM": 16, "RMS_VJP_STAGED_REGISTERS": 32},
    "unstaged": {"RMS_VJP_STAGED_CUDA": False, "LN_VJP_STAGED_CUDA": False},
    "t64": {"RMS_VJP_STAGED_THREADS_CUDA": 64},
    "t64u6": {"RMS_VJP_STAGED_THREADS_CUDA": 64, "RMS_VJP_STAGED_UNITS_PER_SM": 6, "RMS_VJP_STAGED_REGISTERS": 80},
}
# PROBE_VU_MODE=chained: each call's cotangent the last call's dx (timing.measure_chained_pair,
# outputs kept): device time with no two backward kernels overlapping, as in backprop
MODE = os.environ.get("PROBE_VU_MODE", "pipelined")
CASES_ENV = os.environ.get("PROBE_VU_CASES")  # e.g. "0 4": indices into CASES


def step_fns(kind, rows, nh, n, dt):
    d = nh * n
    x, w, b, g = (mx.random.normal(s).astype(dt) for s in ((rows, d), (d,), (d,), (rows, d)))
    mx.eval(x, w, b, g)
    if kind == "rms":
        ours = lambda a, c: xk.rms_norm(a, c, 1e-5)  # noqa: E731
        mlx = lambda a, c: mx.fast.rms_norm(a, c, 1e-5)  # noqa: E731
        args = [x, w]
    else:
        def ours(a, c, e):
            return xk.multihead_layer_norm(a, c, e, nh, 1e-5)

        def mlx(a, c, e):
            if nh == 1:
                return mx.fast.layer_norm(a, c, e, 1e-5)
            return mx.fast.layer_norm(a.reshape(rows, nh, n), None, None, 1e-5).reshape(a.shape) * c + e
        args = [x, w, b]

    def make(f):
        step = mx.compile(lambda *a: mx.vjp(f, list(a[:-1]), [a[-1]])[1])
        if MODE == "chained":
            return lambda gg: step(*args, gg)[0]
        return lambda: step(*args, g)

    return make(ours), make(mlx), 3 * x.nbytes, g


def main() -> None:
    chosen = os.environ.get("PROBE_VU_VARIANTS", " ".join(VARIANTS)).split()
    repeats = int(os.environ.get("PROBE_VU_REPEATS", "3"))
    saved = {k: getattr(norm_mod, k) for v in VARIANTS.values() for k in v}
    cases = CASES if not CASES_ENV else [CASES[int(i)] for i in CASES_ENV.split()]
    for kind, rows, nh, n, dt in cases:
        for name in chosen:
            for k, v in saved.items():
                setattr(norm_mod, k, v)
            for k, v in VARIANTS[name].items():
                setattr(norm_mod, k, v)
            norm_mod._CALLS.clear()
            ours, mlx, nbytes, g = step_fns(kind, rows, nh, n, dt)
            if MODE == "chained":
                a, m = measure_chained_pair(ours, mlx, g, repeats=2 * repeats + 1, keep=True)
            else:
                mx.eval(ours()), mx.eval(mlx())
                a, m = measure_pipelined_pair(ours, mlx, calls=20, repeats=repeats)
            print(f"{str(dt).split('.')[-1]:8s} {kind:4s} {rows}x{nh}x{n:<5d} {name:8s} ours {a * 1e6:7.1f} us "
                  f"({nbytes / a / 1e9:6.0f} GB/s)  mlx {m * 1e6:7.1f}  x{m / a:5.2f}", flush=True)
    for k, v in saved.items():
        setattr(norm_mod, k, v)


if __name__ == "__main__":
    main()
