"""Probe: where the host time of a decode step or an eager VJP goes (cProfile, on the GPU).

    python3 scripts/probe_host_profile.py [--out prof.json]
    PROBE_HP_CASES="slice contig vjp" PROBE_HP_TOP=25 python3 scripts/probe_host_profile.py

``scripts/probe_decode_loop.py`` found a growing-cache attention step's host time 15-25 us
higher with the cache as slices (``k_cache[:, :, :lk]``) than as contiguous arrays of the
same lengths, on the H100 only (locally, stub kernels: 1-2 us). Cases, each a pipelined
loop as the decode-loop probe runs it (the step built, ``mx.async_eval``, the last step
evaluated):

* ``slice`` / ``contig``: ``xk.scaled_dot_product_attention`` on a growing cache, as
  slices or as contiguous arrays; ``slice_mlx`` / ``contig_mlx``: MLX's op;
* ``vjp``: an eager ``mx.vjp`` of ``xk.rms_norm`` (bf16 4096x4096); ``vjp_mlx``: MLX's;
  ``vjp_triv``: an ``mx.custom_function`` whose VJP returns precomputed arrays (the floor
  of any custom VJP).

Per case: us per step of the whole loop and of the building alone, then the functions
with the most time of their own (cProfile's tottime, per step) over a second, profiled
loop: C++ entry points show as built-in methods (``async_eval``, ``eval``, the kernel
object's call).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import measure_step_loop

STEPS = int(os.environ.get("PROBE_HP_STEPS", "256"))
TOP = int(os.environ.get("PROBE_HP_TOP", "22"))


loop = measure_step_loop


def top_functions(step, n: int) -> list[tuple[str, float, float, int]]:
    """(function, tottime us per step, cumtime us per step, calls per step) of a profiled loop."""
    prof = cProfile.Profile()
    prof.enable()
    loop(step, n)
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = []
    for (file, line, name), (cc, nc, tt, ct, _) in stats.items():
        where = name if file == "~" else f"{os.path.basename(file)}:{line}({name})"
        rows.append((where, tt / n * 1e6, ct / n * 1e6, round(nc / n, 2)))
    rows.sort(key=lambda r: -r[1])
    return rows[:TOP]


def cases() -> dict:
    b, hq, hkv, d, l0 = 1, 32, 8, 128, 4096
    n = STEPS
    kc = mx.random.normal((b, hkv, l0 + 2 * n + 64, d)).astype(mx.bfloat16)
    vc = mx.random.normal((b, hkv, l0 + 2 * n + 64, d)).astype(mx.bfloat16)
    q = mx.random.normal((b, hq, 1, d)).astype(mx.bfloat16)
    ks = [mx.contiguous(kc[:, :, : l0 + i]) for i in range(n)]
    vs = [mx.contiguous(vc[:, :, : l0 + i]) for i in range(n)]
    mx.eval(kc, vc, q, ks, vs)
    s = d**-0.5
    ours = lambda a, k, v: xk.scaled_dot_product_attention(a, k, v, scale=s)  # noqa: E731
    mlx = lambda a, k, v: mx.fast.scaled_dot_product_attention(a, k, v, scale=s)  # noqa: E731
    x = mx.random.normal((4096, 4096)).astype(mx.bfloat16)
    w = mx.random.normal((4096,)).astype(mx.bfloat16)
    g = mx.random.normal((4096, 4096)).astype(mx.bfloat16)
    dx0, dw0 = mx.zeros_like(x), mx.zeros_like(w)
    mx.eval(x, w, g, dx0, dw0)

    @mx.custom_function
    def triv(a, b):
        return a

    @triv.vjp
    def triv_vjp(primals, cotangent, output):
        return dx0, dw0

    return {
        "slice": lambda i: ours(q, kc[:, :, : l0 + i], vc[:, :, : l0 + i]),
        "contig": lambda i: ours(q, ks[i], vs[i]),
        "slice_mlx": lambda i: mlx(q, kc[:, :, : l0 + i], vc[:, :, : l0 + i]),
        "contig_mlx": lambda i: mlx(q, ks[i], vs[i]),
        "vjp": lambda i: mx.vjp(lambda a, b: xk.rms_norm(a, b, 1e-5), [x, w], [g])[1],
        "vjp_mlx": lambda i: mx.vjp(lambda a, b: mx.fast.rms_norm(a, b, 1e-5), [x, w], [g])[1],
        "vjp_triv": lambda i: mx.vjp(triv, [x, w], [g])[1],
    }


def memo_costs() -> dict:
    """us per call of the call memo's configuration check and its environment snapshot."""
    from xlstm_kernels.ops import _callcache
    from xlstm_kernels.tiles import env as env_mod

    out = {"environ_vars": len(os.environ), "environ_bytes": sum(len(k) + len(v) for k, v in os.environ.items())}
    for name, fn in (("env_snapshot", _callcache._all_env), ("config_token", _callcache.config_token),
                     ("gemm_snapshot", env_mod.snapshot)):
        fn()
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(20000):
                fn()
            best.append((time.perf_counter() - t0) / 20000 * 1e6)
        out[name + "_us"] = min(best)
    print("memo check:", ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()),
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    chosen = os.environ.get("PROBE_HP_CASES", "slice contig slice_mlx contig_mlx vjp vjp_mlx vjp_triv").split()
    all_cases = cases()
    out = {"memo": memo_costs()}
    for name in chosen:
        step = all_cases[name]
        loop(step, min(16, STEPS))  # warm-up: kernels compiled, families and replays recorded
        pipe, host = loop(step, STEPS)
        pipe2, host2 = loop(step, STEPS)
        top = top_functions(step, STEPS)
        out[name] = {"pipe_us": [pipe, pipe2], "host_us": [host, host2], "top": top}
        print(f"== {name}: pipe {pipe:.1f}, {pipe2:.1f} us/step; host {host:.1f}, {host2:.1f} us/step", flush=True)
        for where, tt, ct, nc in top:
            print(f"   {tt:8.2f} {ct:8.2f}  x{nc:<5} {where}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
