"""Probe (session 33): how much the bench's copy@size moves between measurements.

copy@size is the share of the 1 GiB copy bandwidth that a chained copy of a row's own
bytes reaches (``benchmarks.copy_rate.measure_copy_at``, as ``annotate_same_bytes`` calls it
for a marginal row); ``scripts/targets_report.py`` labels a row below the copy bar
'unreachable' where it is under 80%. This measures it several times per size in one fresh
process, with and without every output kept, so that a bench's single reading can be set
beside its spread:

    python3 scripts/probe_copy_at_size.py [MiB ...]     # on the GPU; default 16 32 48 64 96

Sizes are the buffer copied (read once, written once): a row that moves 64 MiB, such as a
one-sequence decode reading 64 MiB of K and V, is compared with a copy of 32 MiB.

H100 80GB HBM3 (bench/results/probe-copy-at-size-cuda-h100-session33.txt): 32 MiB 74.6-90.0%
(88.0-90.4% kept), where the attention bench of the same session read 57.7% and, a minute
later, 72.8 / 86.3%; 16 MiB 114-126% (the chain runs from L2); 64-96 MiB 92-96%.
"""

from __future__ import annotations

import sys

from xlstm_kernels import runtime
from xlstm_kernels.benchmarks.copy_rate import measure_copy_at, measure_copy_rate

MEASUREMENTS = 8


def main(argv: list[str]) -> int:
    backend = runtime.current_backend()
    rate = measure_copy_rate(backend)
    if rate is None:
        print("probe_copy_at_size: needs a GPU backend (cuda or metal)", file=sys.stderr)
        return 2
    print(f"copy bandwidth {rate['gbps']:.0f} GB/s", flush=True)
    for mib in [int(a) for a in argv] or [16, 32, 48, 64, 96]:
        for kept in (False, True):
            pct = sorted(100 * measure_copy_at(backend, mib * 2**20, keep=kept, marginal=True) / rate["gbps"]
                         for _ in range(MEASUREMENTS))
            print(f"copy@size {mib:4d} MiB kept={kept!s:5}: " + " ".join(f"{p:5.1f}" for p in pct), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
