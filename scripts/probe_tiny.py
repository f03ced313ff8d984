"""Probe: decode-size ops (a few KiB to 256 KiB), eager and inside a compiled decode step.

    python3 scripts/probe_tiny.py              # on the GPU (backend cuda); env PROBE_TINY_K (chain length)

At these sizes an op's time is the host's: building the call (Python) and evaluating it
(MLX's C++ walks the graph and records the launch), not the kernel. Per op and
implementation (ours, MLX's), microseconds per call:

* ``q`` / ``host``: 20 calls built, then evaluated together; host = the building part;
* ``pipe``: the next batch built while the last one runs (``mx.async_eval``);
* ``step``: a chain of K calls inside one ``mx.compile``'d function (how a decode loop
  that compiles its step sees an op: no per-call Python), time per op in the chain,
  with ``step host`` its building part;
* ``floor``: a bare ``mx.fast.cuda_kernel`` copy of x (the least any custom kernel costs).

RoPE also runs with graph replay off (XLSTM_KERNELS_REPLAY=0) to show what replay saves.
Session 12 (H200) also timed fewer rows / pairs per thread for the decode launch (more
threads: 2048 -> 8192-65536): every split was slower than N = 4 rows x 8 pairs, inside the
compiled step 7.3-11 against 6.8 us per op, in Nsight Compute 27.8 against 8.3 us
(N = 1, P = 2), so the split stayed as it was.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import measure_pipelined

Q = 20
K = int(os.environ.get("PROBE_TINY_K", "16"))


def queued(fn, reps=25):
    """(us per call, host us per call) of Q calls built then evaluated, median of reps."""
    for _ in range(3):
        mx.eval([fn() for _ in range(Q)])
    tot, host = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(Q)]
        t1 = time.perf_counter()
        mx.eval(outs)
        tot.append((time.perf_counter() - t0) / Q)
        host.append((t1 - t0) / Q)
    return statistics.median(tot) * 1e6, statistics.median(host) * 1e6


def chain(op):
    """A compiled step applying `op` K times in a chain: x -> op(x) -> op(op(x)) ..."""
    def step(x):
        for _ in range(K):
            x = op(x)
        return x

    return mx.compile(step)


_copy = mx.fast.cuda_kernel(name="xk_probe_tiny_copy", input_names=["x", "n"], output_names=["y"],
                            source="size_t i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n[0]) y[i] = x[i];")
_sizes: dict = {}


def copy(x):
    n = _sizes.get(x.size)
    if n is None:
        n = _sizes[x.size] = mx.array([x.size], dtype=mx.int32)
        mx.eval(n)
    return _copy(inputs=[x, n], output_shapes=[x.shape], output_dtypes=[x.dtype], grid=(x.size, 1, 1),
                 threadgroup=(256, 1, 1))[0]


def cases():
    def rnd(shape, dtype):
        a = mx.random.normal(shape).astype(dtype)
        mx.eval(a)
        return a

    out = []
    for dtype in (mx.bfloat16, mx.float32):
        for rows in (1, 32):
            x, w, b = rnd((rows, 4096), dtype), rnd((4096,), dtype), rnd((4096,), dtype)
            name = f"{rows}x4096 {'bf16' if dtype == mx.bfloat16 else 'f32'}"
            out.append((f"rms_norm {name}", x, lambda a, w=w: xk.rms_norm(a, w, 1e-5),
                        lambda a, w=w: mx.fast.rms_norm(a, w, 1e-5)))
            if rows == 1:
                out.append((f"layer_norm {name}", x, lambda a, w=w, b=b: xk.layer_norm(a, w, b, 1e-5),
                            lambda a, w=w, b=b: mx.fast.layer_norm(a, w, b, 1e-5)))
    x = rnd((32, 32, 1, 128), mx.bfloat16)
    offs = mx.array([7 * i + 3 for i in range(32)], dtype=mx.int32)
    mx.eval(offs)
    out.append(("rope 32x32x1x128 bf16 batch off", x, lambda a: xk.rope(a, 128, base=10000.0, offset=offs),
                lambda a: mx.fast.rope(a, 128, traditional=False, base=10000.0, scale=1.0, offset=offs)))
    out.append(("rope 32x32x1x128 bf16 int off", x, lambda a: xk.rope(a, 128, base=10000.0, offset=17),
                lambda a: mx.fast.rope(a, 128, traditional=False, base=10000.0, scale=1.0, offset=17)))
    return out


def main() -> int:
    print(f"# scripts/probe_tiny.py: {mx.device_info().get('device_name', '?') if hasattr(mx, 'device_info') else '?'}, "
          f"MLX {mx.__version__}, backend {xk.current_backend() if hasattr(xk, 'current_backend') else '?'}, K={K}")
    print(f"{'case':34s} {'impl':8s} {'q':>7s} {'host':>6s} {'pipe':>7s} {'step':>7s} {'st host':>7s}  (us per call / per op)")
    for name, x, ours, mlx in cases():
        rows = {"ours": ours, "mlx": mlx, "floor": copy}
        if name.startswith("rope"):
            rows["ours r0"] = ours
        for impl, op in rows.items():
            if impl == "ours r0":
                os.environ["XLSTM_KERNELS_REPLAY"] = "0"
            try:
                q, h = queued(lambda: op(x))
                p = measure_pipelined(lambda: op(x), calls=Q, batches=8, repeats=3) * 1e6
                step = chain(op)
                sq, sh = queued(lambda: step(x), reps=15)
                print(f"{name:34s} {impl:8s} {q:7.1f} {h:6.1f} {p:7.1f} {sq / K:7.2f} {sh / K:7.2f}", flush=True)
            except Exception as e:  # noqa: BLE001 - a probe reports and goes on
                print(f"{name:34s} {impl:8s} failed: {type(e).__name__}: {e}", flush=True)
            finally:
                os.environ.pop("XLSTM_KERNELS_REPLAY", None)
        err = mx.abs(ours(x).astype(mx.float32) - mlx(x).astype(mx.float32)).max().item()
        print(f"{name:34s} max abs diff ours vs mlx {err:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
