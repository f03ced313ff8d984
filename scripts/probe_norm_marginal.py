"""Probe (session 42): norm forward / backward layouts in marginal chains (the bench's steady
state), interleaved with MLX's op, our other norm and a plain copy of the same bytes.

    python3 scripts/probe_norm_marginal.py [--out probe.json]      # on the GPU (backend cuda)

Cases (PROBE_NM_CASES, space-separated ``op:shape:dtype``; op ln, mhln<heads>, rms, and
``_vjp`` for the backward: dx of a fixed cotangent, chained):
``ln:16384x1024:bfloat16 mhln8:4096x4096:bfloat16`` ...
Variants (PROBE_NM_VARIANTS, ``|``-separated ``name:SETTING,SETTING``): a SETTING is
``ENV_VAR=value`` (a knob variable such as XLSTM_LAYER_NORM_N_READS) or ``ATTR=value``
(an int module constant of ops.norm); ``auto`` is the op as shipped. Every variant resets
the others' settings and clears the norm call memo before its chains.
Each line: fastest quarter / median over REPEATS rounds of the marginal time a call (us;
``timing.measure_chained_variants``) and that time as a share of the copy bandwidth measured
at the start (bytes moved: x and y forward; x, g and dx backward); the sides interleaved:
``copy`` (copy_words of x: its 2 x bytes moved, the least such a call costs), ``mlx``
(``mx.fast``'s op), and our variants.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks import timing
from xlstm_kernels.benchmarks.copy_rate import copy_words, measure_copy_rate
from xlstm_kernels.ops import norm as norm_ops

REPEATS = int(os.environ.get("PROBE_NM_REPEATS", "9"))
CASES = os.environ.get("PROBE_NM_CASES", "ln:16384x1024:bfloat16 mhln8:4096x4096:bfloat16 rms:16384x1024:bfloat16").split()
VARIANTS = [(p.split(":", 1)[0], [s for s in (p.split(":", 1) + [""])[1].split(",") if s])
            for p in os.environ.get("PROBE_NM_VARIANTS", "auto|nr16:XLSTM_LAYER_NORM_N_READS=16").split("|") if p]
SHIPPED = {a: getattr(norm_ops, a) for a in dir(norm_ops) if a.isupper() and isinstance(getattr(norm_ops, a), int)}


def configure(settings: list[str]) -> None:
    """Apply one variant's settings (everything else back to shipped) and clear the memo."""
    for k in [k for k in os.environ if k.startswith(("XLSTM_RMS_NORM_", "XLSTM_LAYER_NORM_"))]:
        del os.environ[k]
    for a, v in SHIPPED.items():
        setattr(norm_ops, a, v)
    for s in settings:
        k, v = s.split("=", 1)
        if k.startswith("XLSTM_"):
            os.environ[k] = v
        elif k in SHIPPED:
            setattr(norm_ops, k, type(SHIPPED[k])(int(v)))
        else:
            raise SystemExit(f"probe_norm_marginal: unknown setting {s!r} (an XLSTM_* variable or an int constant of ops.norm)")
    norm_ops._CALLS.clear()


def _case(spec: str):
    op, shape, dtype = spec.split(":")
    shape = tuple(int(v) for v in shape.split("x"))
    dt = getattr(mx, dtype)
    vjp = op.endswith("_vjp")
    base = op[:-4] if vjp else op
    n = shape[-1]
    x = mx.random.normal(shape).astype(dt)
    w = (1 + 0.1 * mx.random.normal((n,))).astype(dt)
    b = (0.1 * mx.random.normal((n,))).astype(dt)
    if base == "rms":
        ours, mlx = (lambda a: xk.rms_norm(a, w, 1e-5)), (lambda a: mx.fast.rms_norm(a, w, 1e-5))
    elif base == "ln":
        ours, mlx = (lambda a: xk.layer_norm(a, w, b, 1e-5)), (lambda a: mx.fast.layer_norm(a, w, b, 1e-5))
    elif base.startswith("mhln"):
        h = int(base[4:])
        ours = lambda a: xk.multihead_layer_norm(a, w, b, h, 1e-5)  # noqa: E731

        def mlx(a):
            y = mx.fast.layer_norm(a.reshape(*a.shape[:-1], h, n // h), None, None, 1e-5).reshape(a.shape)
            return y * w + b
    else:
        raise SystemExit(f"probe_norm_marginal: unknown op {op!r}")
    moved = 2 * x.nbytes
    if vjp:
        g = mx.random.normal(shape).astype(dt)
        mx.eval(g)
        ours, mlx = [(lambda f: lambda a: mx.vjp(f, [a], [g])[1][0])(f) for f in (ours, mlx)]
        moved = 3 * x.nbytes
    mx.eval(x, w, b)
    return x, ours, mlx, moved


def main() -> int:
    if not mx.cuda.is_available():
        print("probe_norm_marginal: needs MLX's CUDA backend", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.perf_counter()
    copy = measure_copy_rate()
    gbps = copy["gbps"]
    print(f"device {mx.device_info().get('device_name', '?')}; copy {gbps:,.0f} GB/s; variants "
          + " | ".join(f"{n}: {','.join(s) or 'shipped'}" for n, s in VARIANTS), flush=True)
    rows = []
    for spec in CASES:
        x, ours, mlx, moved = _case(spec)
        sides = [("copy", lambda: (configure([]), copy_words)[1]), ("mlx", lambda: (configure([]), mlx)[1])]
        sides += [(name, (lambda s: lambda: (configure(s), ours)[1])(settings)) for name, settings in VARIANTS]
        configure([])
        t = timing.measure_chained_variants(sides, x, repeats=REPEATS, marginal=True)
        line = {}
        for name, s in t.items():
            q, med = timing.fastest_quarter(s), statistics.median(s)
            nbytes = 2 * x.nbytes if name == "copy" else moved
            line[name] = {"q25_us": q * 1e6, "median_us": med * 1e6, "pct_copy_q25": 100 * nbytes / q / 1e9 / gbps}
        rows.append({"case": spec, "sides": line})
        print(f"{spec:28s} " + "  ".join(f"{n} {v['q25_us']:.2f}/{v['median_us']:.2f} ({v['pct_copy_q25']:.0f}%)"
                                         for n, v in line.items()), flush=True)
    configure([])
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"copy": copy, "variants": VARIANTS, "rows": rows, "seconds": time.perf_counter() - t0}, fh, indent=1)
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
