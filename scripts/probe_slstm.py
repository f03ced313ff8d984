"""Probe: the fused sLSTM forward per (threads_per_unit K, R in registers) vs the per-step loop.

    python3 scripts/probe_slstm.py --out $OUT/slstm.json                     # on the GPU
    XLSTM_KERNELS_BACKEND=emulate python3 scripts/probe_slstm.py --tiny     # logic check

Variants through ``config=`` of xk.slstm (K, r_in_registers). Prints eval ms per call
(median), the reference loop's (xlstm_kernels.ops.slstm.slstm_reference, mx ops per
step), their ratio and the max rel err of ours vs the loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

import xlstm_kernels as xk
from xlstm_kernels.ops.slstm import slstm_reference


def timed(fn, reps):
    mx.eval(fn())
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    cases = [(2, 512, 4, 256), (8, 512, 4, 256), (2, 512, 4, 128), (8, 512, 4, 128)]
    variants = {256: [(1, False), (2, False), (4, False), (4, True)], 128: [(2, False), (4, False), (8, False), (8, True)]}
    reps = 5
    if args.tiny:
        cases, variants, reps = [(2, 5, 2, 16)], {16: [(2, False), (4, True)]}, 1
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'shape':>14} {'K':>2} {'rreg':>4} {'ours ms':>9} {'loop ms':>9} {'ratio':>7} {'err':>8}")
    for bsz, s, nh, dh in cases:
        wx = mx.array(rng.standard_normal((bsz, s, 4, nh, dh)).astype(np.float32))
        r = mx.array((rng.standard_normal((nh, dh, 4, dh)) / np.sqrt(dh)).astype(np.float32))
        b = mx.array((0.5 * rng.standard_normal((4, nh, dh))).astype(np.float32))
        loop_ms = timed(lambda: slstm_reference(wx, r, b), max(1, reps // 2))
        ref = np.asarray(slstm_reference(wx, r, b), dtype=np.float64)
        for k, rreg in variants[dh]:
            cfg = {"threads_per_unit": k, "r_in_registers": rreg}
            try:
                ms = timed(lambda: xk.slstm(wx, r, b, config=cfg), reps)
                out = np.asarray(xk.slstm(wx, r, b, config=cfg), dtype=np.float64)
            except Exception as e:  # noqa: BLE001 - a probe reports and goes on
                print(f"{bsz}x{s}x{nh}x{dh:<4} K={k} rreg={rreg}: {type(e).__name__}: {e}"[:200])
                continue
            err = float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))
            rows.append(dict(shape=[bsz, s, nh, dh], k=k, rreg=rreg, ours_ms=ms, loop_ms=loop_ms, ratio=loop_ms / ms, err=err))
            print(f"{bsz}x{s}x{nh}x{dh:<5} {k:>2} {int(rreg):>4} {ms:9.3f} {loop_ms:9.3f} {loop_ms / ms:7.2f} {err:8.1e}",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(mx.default_device()), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
