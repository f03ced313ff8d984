"""Probe (session 44): where RoPE's per-sequence offsets live, and what the kernel pays to
read them, in marginal chains (the bench's steady state).

    python3 scripts/probe_rope_offsets.py [--out probe.json]      # on the GPU (backend cuda)

One case (PROBE_RO_CASE, ``BxHxLxD:dtype``, default 2x32x4096x128:bfloat16). Sides
(PROBE_RO_SIDES, ``|``-separated ``MEMO-OFFSETS``), each the same kernel; only the offsets it
reads and the op's call memo differ. MEMO:
  fresh   a new, empty call memo before every chain (the op rebuilt, a new device copy of
          small offsets made in the chain's warm-up call)
  kept    one memo for the side for the whole probe (as the bench keeps it for a row)
OFFSETS (per-sequence from host data, as the bench makes them, unless ``int``):
  copy    the host-made (B,) array as the op ships (8 bytes: copied to device memory first)
  raw8    the same array read directly (SMALL_OFFSETS_BYTES = 0: MLX's managed scalar pool)
  host32  a host-made (3B,) array's first B entries (24 bytes: an ordinary managed buffer)
  dev1m   a GPU-made (2^18,) array's first B entries (1 MiB: device memory)
  devsm   a GPU-made (3B,) array's first B entries, evaluated before the probe
  int     one int offset
  mk      the host-made (B,) array copied by session 43's _device_offsets expression,
          ``(offs + zeros(3, 1))[0]``, outside the op, left lazy (evaluated by the first
          chain's warm-up call, then kept): the int index is a gather into a new 8-byte array
  mkev    the same, evaluated when made
  mkv     the same copy with row 0 as a view (``[:1].reshape(-1)``, as shipped since session 44)
  catlz   a (3B,) concatenate of it and zeros on the GPU, left lazy, its first B entries
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from marginal_probe import run_probe  # noqa: E402

import xlstm_kernels as xk  # noqa: E402
from xlstm_kernels.ops import rope as rope_ops  # noqa: E402
from xlstm_kernels.ops.rope import CallCache  # noqa: E402

REPEATS = int(os.environ.get("PROBE_RO_REPEATS", "9"))
CASE = os.environ.get("PROBE_RO_CASE", "2x32x4096x128:bfloat16")
SIDES = os.environ.get("PROBE_RO_SIDES", "fresh-copy|kept-copy|fresh-raw8|fresh-devsm|kept-devsm|kept-host32").split("|")
SHIPPED_BYTES = rope_ops.SMALL_OFFSETS_BYTES
_KEPT: dict[str, CallCache] = {}
_STATE: dict = {}


def _offsets(kind: str, b: int):
    vals = np.random.default_rng(0).integers(0, 4096, size=b).astype(np.int32)
    if kind == "int":
        return 7
    if kind in ("copy", "raw8"):
        return mx.array(vals)
    if kind in ("mk", "mkev", "mkv"):
        rows = 3
        zeros = rope_ops.const_array([0] * rows, mx.int32)
        wide = mx.array(vals).reshape(1, -1) + zeros.reshape(rows, 1)
        out = wide[:1].reshape(-1) if kind == "mkv" else wide[0]
        if kind == "mkev":
            mx.eval(out)
        return out
    if kind == "catlz":
        return mx.concatenate([mx.array(vals), mx.zeros((2 * b,), mx.int32)])[:b]
    if kind == "host32":
        return mx.array(np.concatenate([vals, np.zeros(2 * b, np.int32)]))[:b]
    n = (1 << 18) if kind == "dev1m" else 3 * b
    wide = mx.concatenate([mx.array(vals), mx.zeros((n - b,), mx.int32)])
    mx.eval(wide)
    return wide[:b]


def configure(settings: list[str]) -> None:
    side = settings[0] if settings else None
    memo, kind = side.split("-") if side else ("fresh", "copy")
    rope_ops.SMALL_OFFSETS_BYTES = SHIPPED_BYTES if kind == "copy" else 0
    rope_ops._CALLS = _KEPT.setdefault(side, CallCache(f"rope-{side}")) if memo == "kept" else CallCache("rope-probe")
    _STATE["side"] = side or SIDES[0]


def _case(spec: str):
    shape, dtype = spec.split(":")
    shape = tuple(int(v) for v in shape.split("x"))
    x = mx.random.normal(shape).astype(getattr(mx, dtype))
    offs = {s: _offsets(s.split("-")[1], shape[0]) for s in SIDES}  # one array a side
    mx.eval(x, *[o for s, o in offs.items() if isinstance(o, mx.array) and s.split("-")[1] not in ("mk", "mkv", "catlz")])
    d = shape[-1]

    def ours(a):
        return xk.rope(a, d, offset=offs[_STATE["side"]])

    def mlx(a):
        return mx.fast.rope(a, d, traditional=False, base=10000.0, scale=1.0, offset=offs[SIDES[0]])

    return x, ours, mlx, 2 * x.nbytes


def main() -> int:
    for s in SIDES:
        memo, _, kind = s.partition("-")
        if memo not in ("fresh", "kept") or kind not in ("copy", "raw8", "host32", "dev1m", "devsm", "int", "mk", "mkev", "mkv", "catlz"):
            raise SystemExit(f"probe_rope_offsets: bad side {s!r} (MEMO-OFFSETS, see the docstring)")
    return run_probe("probe_rope_offsets", [CASE], _case, configure, [(s, [s]) for s in SIDES], REPEATS)


if __name__ == "__main__":
    sys.exit(main())
