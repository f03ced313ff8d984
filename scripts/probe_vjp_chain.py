"""Probe: where the norm backward's chained time goes, against floors of its own bytes
(session 24).

    python3 scripts/probe_vjp_chain.py      # on the GPU (backend cuda)
    PROBE_VC_VARIANTS="base t64" PROBE_VC_CASES="4" PROBE_VC_REPEATS=9 python3 scripts/probe_vjp_chain.py

Session 23's target report left five float32 backward rows below 80% of the copy bandwidth
where a copy of their bytes reaches 83-85% (RMSNorm / LayerNorm 4096x4096 and 2048x8192,
multi-head LayerNorm 4096x8x512). Each row here is a chain of 20 compiled VJPs, each call's
cotangent the last call's dx, every output kept (the bench's backprop steady state), the
variants interleaved (``timing.measure_chained_variants``, first quartile of the repeats):

* floors of the same bytes: ``add`` (MLX's ``x + g``: reads x and g, writes one array, as
  the backward does) and ``copy`` (``copy_words`` of 1.5 arrays: the bench's copy@size);
* ``mlx``: MLX's VJP;
* ours with module constants patched (the call memo cleared): ``base`` as shipped; ``u2``
  two units a SM; ``t64`` / ``t32`` / ``t256`` staged units of that many threads where the
  row allows; ``s3`` / ``s4`` / ``s6`` that many stages (rows copied NS - 1 ahead, fewer
  where they pass RMS_VJP_STAGE_BYTES); ``t64s4``; ``two`` two stages everywhere (session
  23's plan); ``all`` RMS_VJP_STAGES whatever the row; ``big3`` 192 KiB of stages (three for
  rows of 64 KiB of x and g); ``consec`` consecutive rows a unit instead of strided ones;
  ``mom0`` LayerNorm's statistics from two reductions (LN_MOMENTS off; session 25's merged
  moments are one); ``sm128`` ... ``sm64`` (session 33) plan the staged units for that many
  SMs instead of 132 (fewer units: fewer dw / db partial rows, each unit more rows); ``f32p``
  (session 35) float32 partials for 16-bit rows (PARTIALS_BF16 and PARTIALS_FP16 off, the plans before);
* ``+dw`` (PROBE_VC_DW=1): the chain also keeps and evaluates dweight (and dbias), as a
  training step must; the bench's chain returns dx only, and ``mx.compile`` drops the
  partial sums' kernel then;
* the forward (PROBE_VC_FWD=1): chains of the norm itself (each call normalises the last
  one's output, every output kept; the bench's forward steady state); ``copy`` then copies
  one array's bytes, and ``add`` does not apply.

Prints us a call and the share of the copy bandwidth (``copy_rate.measure_copy_rate``).
"""

from __future__ import annotations

import os
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.copy_rate import copy_words, measure_copy_rate
from xlstm_kernels.benchmarks.timing import fastest_quarter
from xlstm_kernels.ops import norm as norm_mod

F32, BF16 = mx.float32, mx.bfloat16
CASES = [("rms", 4096, 1, 4096, F32), ("rms", 2048, 1, 8192, F32), ("ln", 4096, 1, 4096, F32),
         ("ln", 2048, 1, 8192, F32), ("mhln", 4096, 8, 512, F32), ("rms", 16384, 1, 1024, F32),
         ("ln", 16384, 1, 1024, F32), ("rms", 16384, 1, 4096, F32), ("ln", 16384, 1, 4096, F32),
         ("mhln", 8192, 4, 64, F32),
         ("rms", 4096, 1, 4096, BF16), ("rms", 2048, 1, 8192, BF16), ("ln", 4096, 1, 4096, BF16),
         ("ln", 2048, 1, 8192, BF16), ("mhln", 4096, 8, 512, BF16), ("rms", 16384, 1, 1024, BF16),
         ("ln", 16384, 1, 1024, BF16), ("rms", 16384, 1, 4096, BF16), ("ln", 16384, 1, 4096, BF16),
         ("ln", 32768, 1, 512, F32), ("ln", 8192, 1, 2048, F32), ("ln", 32768, 1, 512, BF16),
         ("ln", 8192, 1, 2048, BF16), ("mhln", 8192, 4, 64, BF16)]
PATCHES = {
    "base": {},
    "u2": {"RMS_VJP_STAGED_UNITS_PER_SM": 2, "RMS_VJP_STAGED_REGISTERS": 255},
    "t64": {"RMS_VJP_STAGED_THREADS_CUDA": 64},
    "t32": {"RMS_VJP_STAGED_THREADS_CUDA": 32},
    "t256": {"RMS_VJP_STAGED_THREADS_CUDA": 256, "RMS_VJP_STAGED_REGISTERS": 80},
    "s3": {"RMS_VJP_STAGES": 3},
    "s4": {"RMS_VJP_STAGES": 4},
    "s6": {"RMS_VJP_STAGES": 6},
    "t64s4": {"RMS_VJP_STAGED_THREADS_CUDA": 64, "RMS_VJP_STAGES": 4},
    "two": {"RMS_VJP_STAGES": 2},  # session 23's plan: two stages everywhere
    "all": {"RMS_VJP_TWO_STAGES": (0, 0)},  # RMS_VJP_STAGES whatever the row
    "big3": {"RMS_VJP_STAGE_BYTES": 196608},  # 64 KiB rows of x and g: three stages (192 KiB)
    "consec": {"RMS_VJP_STAGED_STRIDED": False},
    "mom0": {"LN_MOMENTS": False},
    "s6b": {"RMS_VJP_STAGES": 6, "RMS_VJP_STAGE_BYTES": 196608},
    "ln160": {"LN_VJP_STAGED_REGISTERS": 160},
    "sm128": {"RMS_VJP_SMS_CUDA": 128},  # session 33: fewer units (fewer dw / db partial rows)
    "sm112": {"RMS_VJP_SMS_CUDA": 112},
    "sm96": {"RMS_VJP_SMS_CUDA": 96},
    "sm80": {"RMS_VJP_SMS_CUDA": 80},
    "sm64": {"RMS_VJP_SMS_CUDA": 64},
    "f32p": {"PARTIALS_BF16": False, "PARTIALS_FP16": False},  # float32 partials for 16-bit rows (as before sessions 35 / 52)
    "mr16": {"RMS_VJP_STAGED_MAX_READS": 16},  # twice the threads a staged row, 16 elements each  # before session 26: LayerNorm units at RMSNorm's register hint  # 4096-element float32 rows: six stages
}
FLOORS = ("add", "copy", "mlx")
# PROBE_VC_MARGINAL=1 (session 26): each time is the chain's steady state (what a chain of 2n calls
# takes beyond one of n, timing.marginal_calls' n) instead of a 20-call chain's, which also counts
# the host's encoding (MLX's CUDA backend launches its first graph only after up to 100 calls).
MARGINAL = os.environ.get("PROBE_VC_MARGINAL", "0") == "1"
DW = os.environ.get("PROBE_VC_DW", "0") == "1"
FWD = os.environ.get("PROBE_VC_FWD", "0") == "1"


def _fns(kind, nh, ours: bool):
    if kind == "rms":
        return (lambda a, c, e: xk.rms_norm(a, c, 1e-5)) if ours else (lambda a, c, e: mx.fast.rms_norm(a, c, 1e-5))
    if ours:
        if nh == 1:
            return lambda a, c, e: xk.layer_norm(a, c, e, 1e-5)
        return lambda a, c, e: xk.multihead_layer_norm(a, c, e, nh, 1e-5)
    if nh == 1:
        return lambda a, c, e: mx.fast.layer_norm(a, c, e, 1e-5)
    return lambda a, c, e: mx.fast.layer_norm(a.reshape(a.shape[0], nh, -1), None, None, 1e-5).reshape(a.shape) * c + e


def _vjp_step(kind, nh, x, w, b, ours: bool):
    f = _fns(kind, nh, ours)
    if FWD:
        return lambda y: [f(y, w, b)]
    args = [x, w] if kind == "rms" else [x, w, b]
    fwd = (lambda a, c: f(a, c, None)) if kind == "rms" else f
    step = mx.compile(lambda *a: mx.vjp(fwd, list(a[:-1]), [a[-1]])[1])
    if DW:
        return lambda g: step(*args, g)
    return lambda g: step(*args, g)[:1]


def _chain(step, g0, calls=20) -> float:
    g, kept = g0, []
    for _ in range(calls):
        outs = step(g)
        kept.extend(outs)
        g = outs[0]
    t0 = time.perf_counter()
    mx.eval(kept)
    return (time.perf_counter() - t0) / calls


def _timed(step, g0) -> float:
    """Seconds a call: a 20-call chain's, or with MARGINAL the chain's steady state."""
    if not MARGINAL:
        return _chain(step, g0)
    from xlstm_kernels.benchmarks.timing import marginal_calls

    n1, n2 = marginal_calls(sum(o.nbytes for o in step(g0)), keep=True)
    return (_chain(step, g0, n2) * n2 - _chain(step, g0, n1) * n1) / (n2 - n1)


def time_variants(kind, nh, x, w, b, g, half, chosen, repeats, saved, timed=None) -> dict:
    """name -> seconds a call of each of `chosen`'s variants of one case, interleaved (the
    order rotated by one place per repeat): ``add`` (MLX's x + g), ``copy`` (copy_words of
    `half`), ``mlx`` (MLX's VJP), or ours under PATCHES[name] (module constants patched,
    the call memo cleared; `saved` restores them). `timed`: step, x0 -> seconds a call
    (default a 20-call chain). Restores the module constants at the end."""
    timed = timed or _chain

    def prepare(name):
        for k, v in saved.items():
            setattr(norm_mod, k, v)
        norm_mod._CALLS.clear()
        if name == "add":
            return lambda gg: [x + gg]
        if name == "copy":
            return None
        if name == "mlx":
            return _vjp_step(kind, nh, x, w, b, ours=False)
        for k, v in PATCHES[name].items():
            setattr(norm_mod, k, v)
        return _vjp_step(kind, nh, x, w, b, ours=True)

    times = {name: [] for name in chosen}
    for r in range(repeats):
        for name in chosen[r % len(chosen):] + chosen[:r % len(chosen)]:
            step = prepare(name)
            if step is None:  # copy_words of the same bytes, chained
                cstep = lambda gg: [copy_words(gg, "cuda")]  # noqa: E731
                mx.eval(cstep(half))
                times[name].append(timed(cstep, half))
                continue
            mx.eval(step(g))
            mx.eval(step(step(g)[0]))
            times[name].append(timed(step, g))
    for k, v in saved.items():
        setattr(norm_mod, k, v)
    norm_mod._CALLS.clear()
    return times


def main() -> None:
    chosen = os.environ.get("PROBE_VC_VARIANTS", "add copy mlx base u2 t64 t32 t256 consec").split()
    repeats = int(os.environ.get("PROBE_VC_REPEATS", "9"))
    cases = [CASES[int(i)] for i in os.environ.get("PROBE_VC_CASES", "0 1 2 3 4").split()]
    saved = {k: getattr(norm_mod, k) for p in PATCHES.values() for k in p}
    copy = {"gbps": float(os.environ["PROBE_VC_COPY_GBPS"])} if "PROBE_VC_COPY_GBPS" in os.environ \
        else measure_copy_rate("cuda")
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s (dw kept: {DW}, forward: {FWD})", flush=True)
    for kind, rows, nh, n, dt in cases:
        d = nh * n
        x, w, b, g = (mx.random.normal(s).astype(dt) for s in ((rows, d), (d,), (d,), (rows, d)))
        mx.eval(x, w, b, g)
        nbytes = (2 if FWD else 3) * x.nbytes  # read + written
        half = mx.random.uniform(shape=(nbytes // 8,))
        mx.eval(half)

        times = time_variants(kind, nh, x, w, b, g, half, chosen, repeats, saved, _timed)
        label = f"{kind} {rows}x{nh}x{n}" if nh > 1 else f"{kind} {rows}x{n}"
        for name in chosen:
            t = fastest_quarter(times[name])
            print(f"{str(dt).split('.')[-1]:8s} {label:18s} {name:7s} {t * 1e6:7.1f} us  {100 * nbytes / t / 1e9 / copy['gbps']:5.1f}% of copy"
                  f"  (median {sorted(times[name])[len(times[name]) // 2] * 1e6:7.1f})", flush=True)


if __name__ == "__main__":
    main()
