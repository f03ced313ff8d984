"""Probe: mLSTM chunkwise at two chunk sizes, interleaved call by call (session 16).

    python3 scripts/probe_mlstm_chunk.py [--out r.json]     # on the GPU (backend cuda)

Per shape and dtype: median ms of synchronised calls of ``mlstm(..., chunk_size=c)`` for
each c in PROBE_MLSTM_CHUNKS (default "32 64"), the chunk sizes alternating call by call
(so that clock or host drift falls on all alike), PROBE_MLSTM_REPEATS (default 25) each.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx
import numpy as np

from xlstm_kernels.ops.mlstm import mlstm

SHAPES = [(1, 8, 512, 64), (1, 8, 1024, 128), (2, 8, 1024, 256), (2, 8, 2048, 128), (1, 16, 2048, 256),
          (4, 8, 4096, 64), (2, 8, 4096, 128), (1, 8, 4096, 256), (2, 16, 4096, 128)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    chunks = [int(c) for c in os.environ.get("PROBE_MLSTM_CHUNKS", "32 64").split()]
    reps = int(os.environ.get("PROBE_MLSTM_REPEATS", "25"))
    dtypes = [getattr(mx, d) for d in os.environ.get("PROBE_MLSTM_DTYPES", "bfloat16 float32").split()]
    rng = np.random.default_rng(0)
    rows = []
    for b, nh, s, d in SHAPES:
        for dt in dtypes:
            q, k, v = (mx.array(rng.standard_normal((b, nh, s, d)).astype(np.float32)).astype(dt) for _ in range(3))
            ig = mx.array(rng.standard_normal((b, nh, s)).astype(np.float32))
            fg = mx.array((rng.standard_normal((b, nh, s)) + 3.0).astype(np.float32))
            mx.eval(q, k, v, ig, fg)
            times = {c: [] for c in chunks}
            for c in chunks:
                mx.eval(mlstm(q, k, v, ig, fg, chunk_size=c))
            for _ in range(reps):
                for c in chunks:
                    t0 = time.perf_counter()
                    mx.eval(mlstm(q, k, v, ig, fg, chunk_size=c))
                    times[c].append((time.perf_counter() - t0) * 1e3)
            med = {c: statistics.median(t) for c, t in times.items()}
            rows.append(dict(shape=[b, nh, s, d], dtype=str(dt), ms=med))
            base = med[chunks[-1]]
            print(f"{b}x{nh}x{s}x{d:<4} {str(dt):15s} " + "  ".join(
                f"c{c} {m:7.3f} ms ({base / m:4.2f}x)" for c, m in med.items()), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
