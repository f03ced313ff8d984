"""Where each memory-bound row of saved bench results stands against issue 8's two bars.

    python3 scripts/targets_report.py                      # bench/results/{norm,rope,attention}-cuda-h100.csv
    python3 scripts/targets_report.py a.csv b.csv [--parity 0.98]

Reads the rows the bench annotated (``benchmarks.copy_rate.annotate_rows``: ``pct_copy``,
``ratio_steady``, ``meets_copy``, ``meets_ratio``, ``copy_same_bytes_pct``) and sorts every
target row into what it misses and why:

* the copy bar (>= COPY_TARGET_PCT of the measured copy bandwidth): ``met``; ``unreachable``
  where a plain copy of the row's own bytes reaches less than the bar (its
  ``copy_same_bytes_pct``: small transfers never reach the large-copy rate, for any kernel);
  ``below`` otherwise;
* the ratio bar (>= 1.0x MLX at the row's steady state): ``met``; ``parity`` from `--parity`
  up; ``below`` otherwise;
* ``cached`` (copy bar): a copy of the row's own bytes beats the large copy (copy@size above
  100%), so the row's chain runs from the last-level cache and its share says nothing about
  device memory.

Since session 26 a row's steady state is its marginal chain (``timing.measure_marginal``);
the columns ``chain %`` and ``chain x`` give the 20-call chain it replaced (kept, else
chained), whose time also counts the host's encoding (MLX's CUDA backend launches its first
graph only after up to 100 encoded calls).

No GPU needed; the verdicts are the bench's own (``copy_rate.miss_reasons`` names the misses), this
only counts them.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from xlstm_kernels.benchmarks.copy_rate import COPY_TARGET_PCT, miss_reasons  # noqa: E402

DEFAULT = [os.path.join(os.path.dirname(HERE), "bench", "results", f"{f}-cuda-h100.csv")
           for f in ("norm", "rope", "attention")]


def _chain_view(extra: dict) -> tuple[float, float]:
    """(% of copy, ratio) of a marginal row's 20-call chain (kept, else chained), from the
    times the bench saved; NaN where the row has none or is not marginal."""
    nan = float("nan")
    if extra.get("steady") != "marginal":
        return nan, nan
    kind = next((k for k in ("kept", "chained") if extra.get(f"ours_{k}_ms")), None)
    if kind is None:
        return nan, nan
    ours, mlx = extra[f"ours_{kind}_ms"], extra.get(f"mlx_{kind}_ms")
    return extra["pct_copy"] * extra["ours_marginal_ms"] / ours, (mlx / ours if mlx else nan)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="*", default=DEFAULT)
    ap.add_argument("--parity", type=float, default=0.98, help="ratio from which a miss counts as parity")
    args = ap.parse_args()
    counts: collections.Counter = collections.Counter()
    print(f"{'op':26s} {'shape':22s} {'dtype':9s} {'timed':8s} {'% copy':>7s} {'copy@size':>9s} {'ratio':>6s} "
          f"{'chain %':>7s} {'chain x':>7s}  copy bar     ratio bar")
    for path in args.csv:
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                extra = json.loads(row.get("extra") or "{}")
                if "meets_copy" not in extra or extra["meets_copy"] is None:
                    continue
                copy, ratio = miss_reasons(extra, args.parity)
                counts[(copy, ratio)] += 1
                chain_pct, chain_x = _chain_view(extra)
                print(f"{row['op'][:26]:26s} {row['shape'][:22]:22s} {row['dtype']:9s} {extra.get('steady', '-')[:8]:8s} "
                      f"{extra['pct_copy']:7.1f} {extra.get('copy_same_bytes_pct', float('nan')):9.1f} "
                      f"{extra['ratio_steady']:6.2f} {chain_pct:7.1f} {chain_x:7.2f}  {copy:12s} {ratio}")
    total = sum(counts.values())
    print(f"\n{total} target rows (copy bar >= {COPY_TARGET_PCT:.0f}% of copy, ratio bar >= 1.0x; parity from "
          f"{args.parity:.2f}x):")
    for (copy, ratio), n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d}  copy {copy:12s} ratio {ratio}")
    both = counts[("met", "met")]
    print(f"  both bars met: {both}; copy bar unreachable at the row's size: "
          f"{sum(n for (c, _), n in counts.items() if c == 'unreachable')}; cached: "
          f"{sum(n for (c, _), n in counts.items() if c == 'cached')}; copy bar below: "
          f"{sum(n for (c, _), n in counts.items() if c == 'below')}; "
          f"ratio below parity: {sum(n for (_, r), n in counts.items() if r == 'below')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
