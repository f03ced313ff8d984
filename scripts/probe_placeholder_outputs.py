"""Probe (session 44): do the one-element placeholder outputs cost a GEMM launch on cuda?

    python3 scripts/probe_placeholder_outputs.py [--out probe.json]      # on the GPU (backend cuda)

A GEMM launch with SPLIT == 1 has a (1,) float output P it does not use, set by one thread
(metal_src/gemm.metal). MLX's CUDA allocator puts every array of at most 8 bytes in a managed
scalar pool, which the GPU reaches over the host link (session 44: RoPE's offsets read from it
cost ~9 us a call). Variants (PROBE_PO_VARIANTS, ``|``-separated): ``auto`` (as shipped) and
``padN`` (every (1,) output of the GEMM's launches made (N,): N * 4 > 8 bytes is device memory;
the body still sets element 0 only, which is all a timing needs).
Cases (PROBE_PO_CASES, space-separated ``N:dtype``): square C = A.B chains, y <- gemm_av(y, W),
against mx.matmul; the % of copy column counts A, W and C once.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from marginal_probe import parse_variants, run_probe  # noqa: E402

import xlstm_kernels as xk  # noqa: E402
from xlstm_kernels.ops import gemm as gemm_ops  # noqa: E402

REPEATS = int(os.environ.get("PROBE_PO_REPEATS", "9"))
CASES = os.environ.get("PROBE_PO_CASES", "256:bfloat16 512:bfloat16 1024:bfloat16 2048:bfloat16").split()
VARIANTS = parse_variants(os.environ.get("PROBE_PO_VARIANTS", "auto|pad4"))
_SHIPPED = gemm_ops.prepare_launch
_PAD = [0]


def _patched(spec, **kw):
    if _PAD[0] and "output_shapes" in kw:
        kw = dict(kw, output_shapes=[(_PAD[0],) if tuple(s) == (1,) else s for s in kw["output_shapes"]])
    return _SHIPPED(spec, **kw)


gemm_ops.prepare_launch = _patched


def configure(settings: list[str]) -> None:
    """One side's padding (``padN``: N; anything else: 0, as shipped) and empty GEMM memos."""
    name = settings[0] if settings else "auto"
    _PAD[0] = int(name[3:]) if name.startswith("pad") else 0
    gemm_ops._CALLS.clear()
    gemm_ops._LAUNCHERS.clear()


def _case(spec: str):
    n, dtype = spec.split(":")
    n = int(n)
    dt = getattr(mx, dtype)
    x = (mx.random.normal((n, n)) / n**0.5).astype(dt)
    w = (mx.random.normal((n, n)) / n**0.5).astype(dt)
    mx.eval(x, w)
    return x, (lambda a: xk.gemm_av(a, w)), (lambda a: mx.matmul(a, w)), 3 * x.nbytes


def main() -> int:
    return run_probe("probe_placeholder_outputs", CASES, _case, configure, [(n, [n]) for n, _ in VARIANTS], REPEATS)


if __name__ == "__main__":
    sys.exit(main())
