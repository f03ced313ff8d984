"""Probe (session 42): norm forward / backward layouts in marginal chains (the bench's steady
state), interleaved with MLX's op, our other norm and a plain copy of the same bytes.

    python3 scripts/probe_norm_marginal.py [--out probe.json]      # on the GPU (backend cuda)

Cases (PROBE_NM_CASES, space-separated ``op:shape:dtype``; op ln, mhln<heads>, rms, and
``_vjp`` for the backward: dx of a fixed cotangent, chained):
``ln:16384x1024:bfloat16 mhln8:4096x4096:bfloat16`` ...
Variants (PROBE_NM_VARIANTS, ``|``-separated ``name:SETTING,SETTING``): a SETTING is
``ENV_VAR=value`` (a knob variable such as XLSTM_LAYER_NORM_N_READS) or ``ATTR=value``
(an int, bool or float module constant of ops.norm); ``auto`` is the op as shipped. Every variant resets
the others' settings and clears the norm call memo before its chains.
Each line (scripts/marginal_probe.py): fastest quarter / median over REPEATS rounds of the
marginal time a call (us) and that time as a share of the copy bandwidth measured at the
start (bytes moved: x and y forward; x, g and dx backward); the sides interleaved: ``copy``
(copy_words of x: its 2 x bytes moved, the least such a call costs), ``mlx`` (``mx.fast``'s
op), and our variants; for MLX and ours, the host's microseconds a call.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from marginal_probe import parse_variants, run_probe  # noqa: E402

import xlstm_kernels as xk  # noqa: E402
from xlstm_kernels.ops import norm as norm_ops  # noqa: E402

REPEATS = int(os.environ.get("PROBE_NM_REPEATS", "9"))
CASES = os.environ.get("PROBE_NM_CASES", "ln:16384x1024:bfloat16 mhln8:4096x4096:bfloat16 rms:16384x1024:bfloat16").split()
VARIANTS = parse_variants(os.environ.get("PROBE_NM_VARIANTS", "auto|nr16:XLSTM_LAYER_NORM_N_READS=16"))
SHIPPED = {a: getattr(norm_ops, a) for a in dir(norm_ops)
           if a.isupper() and isinstance(getattr(norm_ops, a), (int, float))}


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
            kind = type(SHIPPED[k])
            setattr(norm_ops, k, kind(float(v)) if kind is float else kind(int(v)))
        else:
            raise SystemExit(f"probe_norm_marginal: unknown setting {s!r} (an XLSTM_* variable or a numeric constant of ops.norm)")
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
    return run_probe("probe_norm_marginal", CASES, _case, configure, VARIANTS, REPEATS)


if __name__ == "__main__":
    sys.exit(main())
