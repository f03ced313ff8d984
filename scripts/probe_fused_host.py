"""Host time of building (not evaluating) one fused_norm_linear call and its parts.

    python scripts/probe_fused_host.py [--backend cuda|metal|emulate] [--rows 1] [--calls 20000]

Session 45: on an H200 the op as shipped (knob single_kernel off: the unfused sequence)
ran 0.055 ms a call pipelined against 0.030 ms for the same sequence called directly
(1x4096x4096 float16; `bench --ops fused`), i.e. host-bound with ~25 us more host work
per call. This prints the graph-building time of each piece, median of 5 runs of
`--calls` calls, so the wrapper's share is measured where it runs. The emulator launches
eagerly, so there only the pieces without a launch mean anything.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx


def _per_call_us(fn, calls: int) -> float:
    for _ in range(min(200, calls)):
        fn()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default=None)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()

    from xlstm_kernels import runtime, tiles
    from xlstm_kernels.ops import fused as fu
    from xlstm_kernels.ops import gemm as lin
    from xlstm_kernels.ops import norm as nm

    dt = mx.float16
    x = mx.random.normal((args.rows, args.k)).astype(dt)
    g = mx.random.normal((args.k,)).astype(dt)
    w = (mx.random.normal((args.n, args.k)) * args.k ** -0.5).astype(dt)
    mx.eval(x, g, w)
    backend = args.backend or runtime.current_backend()
    with runtime.use_backend(backend):
        xn = nm.rms_norm(x, g, 1e-5)
        mx.eval(xn)
        pieces = {
            "fused_norm_linear (as shipped)": lambda: fu.fused_norm_linear(x, g, w, None, 1e-5),
            "unfused_norm_linear (the sequence)": lambda: fu.unfused_norm_linear(x, g, w, None, 1e-5),
            "rms_norm": lambda: nm.rms_norm(x, g, 1e-5),
            "linear": lambda: lin.linear(xn, w),
            "knob_values": lambda: fu.knob_values(args.rows, dt),
            "_validate_linear": lambda: fu._validate_linear(x, g, w, None, 1e-5),
            "resolve_gemm_config": lambda: tiles.resolve_gemm_config("gemm_a_bt", 1, 1, 1, dt, None),
        }
        print(f"backend {backend}, rows {args.rows}, K {args.k}, N {args.n}, float16; host us per call "
              f"(graph building only, median of 5 x {args.calls})")
        for name, fn in pieces.items():
            print(f"  {name:<36} {_per_call_us(fn, args.calls):8.2f}")


if __name__ == "__main__":
    main()
