"""Probe (session 43): RoPE launch plans in marginal chains (the bench's steady state),
interleaved with MLX's ``mx.fast.rope`` and a plain copy of the same bytes.

    python3 scripts/probe_rope_marginal.py [--out probe.json]      # on the GPU (backend cuda)

Cases (PROBE_RM_CASES, space-separated ``BxHxLxD:dtype[:batch|:hostbatch]``, split-half pairs over
all D features; one int offset, or with ``batch`` one offset per batch element as an
int32 array made on the GPU, with ``hostbatch`` made from host data as the bench's large
rows make it): ``2x32x4096x128:bfloat16:batch`` ...
Variants (PROBE_RM_VARIANTS, ``|``-separated ``name:SETTING,SETTING``): a SETTING is
``ATTR=value`` for an int constant of ops.rope (ROWS_PER_THREAD, _MAX_THREADS,
SMALL_OFFSETS_BYTES, SMALL_OFFSETS_MIN_X_BYTES, SMALL_OFFSETS_COPY_ROWS) or a per-backend
dict of it (RUN_BYTES, MAX_THREADS: the cuda entry is set); ``auto`` (no settings) is the
op as shipped. Every variant resets the others' settings and clears the RoPE call memo
before its chains (PROBE_RM_NOCLEAR=1: the memo is kept, as the bench keeps it, and so one
variant a run is what can be compared).
Each line (scripts/marginal_probe.py): fastest quarter / median over REPEATS rounds of the
marginal time a call (us) and the bytes it moves (x read, y written) as a share of the copy
bandwidth measured at the start; ``copy`` is copy_words of x (the same bytes); ``host``:
microseconds a call to build 50 chained calls' graph (nothing evaluated).
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from marginal_probe import parse_variants, run_probe  # noqa: E402

import xlstm_kernels as xk  # noqa: E402
from xlstm_kernels.ops import rope as rope_ops  # noqa: E402

REPEATS = int(os.environ.get("PROBE_RM_REPEATS", "9"))
CASES = os.environ.get("PROBE_RM_CASES", "2x32x4096x128:bfloat16 2x32x4096x128:float16 4x32x8192x128:bfloat16").split()
VARIANTS = parse_variants(os.environ.get("PROBE_RM_VARIANTS", "auto|n8:ROWS_PER_THREAD=8"))
KNOBS = ("ROWS_PER_THREAD", "_MAX_THREADS", "RUN_BYTES", "MAX_THREADS", "SMALL_OFFSETS_BYTES", "SMALL_OFFSETS_MIN_X_BYTES",
         "SMALL_OFFSETS_COPY_ROWS")
SHIPPED = {a: (dict(getattr(rope_ops, a)) if isinstance(getattr(rope_ops, a), dict) else getattr(rope_ops, a))
           for a in KNOBS}


def configure(settings: list[str]) -> None:
    """Apply one variant's settings (everything else back to shipped) and clear the memo."""
    for a, v in SHIPPED.items():
        setattr(rope_ops, a, dict(v) if isinstance(v, dict) else v)
    for s in settings:
        k, v = s.split("=", 1)
        if k not in SHIPPED:
            raise SystemExit(f"probe_rope_marginal: unknown setting {s!r} (one of {', '.join(KNOBS)})")
        if isinstance(SHIPPED[k], dict):
            getattr(rope_ops, k)["cuda"] = int(v)
        else:
            setattr(rope_ops, k, int(v))
    if os.environ.get("PROBE_RM_NOCLEAR") != "1":  # 1: the memo kept, as the bench keeps it (one variant a run)
        rope_ops._CALLS.clear()


def _case(spec: str):
    """(x, ours, mlx, bytes a call moves) of ``BxHxLxD:dtype[:batch|:hostbatch]``."""
    shape, dtype, *kind = spec.split(":")
    shape = tuple(int(v) for v in shape.split("x"))
    x = mx.random.normal(shape).astype(getattr(mx, dtype))
    if kind == ["batch"]:  # made on the GPU
        offset = mx.random.randint(0, 4096, (shape[0],)).astype(mx.int32)
    elif kind == ["hostbatch"]:  # made from host data, as the bench makes it
        offset = mx.array(np.random.default_rng(0).integers(0, 4096, size=shape[0]).astype(np.int32))
    else:
        offset = 7
    mx.eval(x, offset)
    d = shape[-1]
    ours = lambda a: xk.rope(a, d, offset=offset)  # noqa: E731
    mlx = lambda a: mx.fast.rope(a, d, traditional=False, base=10000.0, scale=1.0, offset=offset)  # noqa: E731
    return x, ours, mlx, 2 * x.nbytes


def main() -> int:
    return run_probe("probe_rope_marginal", CASES, _case, configure, VARIANTS, REPEATS)


if __name__ == "__main__":
    sys.exit(main())
