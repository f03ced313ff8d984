"""Shared driver of the marginal-chain probes (scripts/probe_norm_marginal.py,
scripts/probe_rope_marginal.py): one op's variants in the bench's steady state
(``timing.measure_marginal``), interleaved with MLX's op and a plain copy of the same bytes.

A probe gives its cases (strings), a ``make_case(spec) -> (x, ours, mlx, moved_bytes)`` and
a ``configure(settings)`` that applies one variant's settings (and resets the others'); the
variants are ``name:SETTING,SETTING`` words ``|``-separated (:func:`parse_variants`).
Each case prints one line: per side the fastest quarter / median over `repeats` rounds of the
marginal time a call (us), the fastest quarter as % of the copy bandwidth measured at the
start (``copy``: copy_words of x, its 2 x bytes; the others: `moved_bytes`), and for MLX and
our variants the host's microseconds a call to build 50 chained calls (nothing evaluated).

The chains do not keep their outputs unless ``PROBE_KEEP=1``: then every call's output stays
referenced until the chain is evaluated, as the norm bench's marginal rows do. Without it, an
MLX op that writes over a donatable input (MLX's CUDA norms) keeps one buffer where ours
alternate two; on rows of 32 MiB that made MLX's norms 1.1-1.4x faster (session 48,
scripts/probe_donation.py). Our variants compare alike either way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import mlx.core as mx

from xlstm_kernels.benchmarks import timing
from xlstm_kernels.benchmarks.copy_rate import copy_words, measure_copy_rate

Variant = tuple[str, list[str]]
KEEP = os.environ.get("PROBE_KEEP", "0") == "1"  # keep every output (no donation), as the bench


def parse_variants(text: str) -> list[Variant]:
    """``"auto|n8:A=8,B=1"`` -> [("auto", []), ("n8", ["A=8", "B=1"])]."""
    return [(p.split(":", 1)[0], [s for s in (p.split(":", 1) + [""])[1].split(",") if s]) for p in text.split("|") if p]


def host_us(step: Callable[[Any], Any], x: mx.array, calls: int = 50) -> float:
    """Microseconds a call to build `calls` chained calls' graph (nothing evaluated)."""
    step(x)
    t0 = time.perf_counter()
    y = x
    for _ in range(calls):
        y = step(y)
    dt = (time.perf_counter() - t0) / calls
    mx.eval(y)
    return dt * 1e6


def run_probe(name: str, cases: Sequence[str], make_case: Callable, configure: Callable[[list[str]], None],
              variants: Sequence[Variant], repeats: int, argv: Sequence[str] | None = None) -> int:
    """Time every case's sides and print / save them (``--out FILE``: JSON). Needs CUDA."""
    if not mx.cuda.is_available():
        print(f"{name}: needs MLX's CUDA backend", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(prog=name)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    copy = measure_copy_rate()
    gbps = copy["gbps"]
    print(f"device {mx.device_info().get('device_name', '?')}; copy {gbps:,.0f} GB/s; outputs "
          f"{'kept' if KEEP else 'not kept'}; variants "
          + " | ".join(f"{n}: {','.join(s) or 'shipped'}" for n, s in variants), flush=True)
    rows = []
    for spec in cases:
        x, ours, mlx, moved = make_case(spec)
        sides = [("copy", lambda: (configure([]), copy_words)[1]), ("mlx", lambda: (configure([]), mlx)[1])]
        sides += [(n, (lambda s: lambda: (configure(s), ours)[1])(settings)) for n, settings in variants]
        configure([])
        t = timing.measure_chained_variants(sides, x, repeats=repeats, marginal=True, keep=KEEP)
        line = {}
        for side, s in t.items():
            q, med = timing.fastest_quarter(s), statistics.median(s)
            nbytes = 2 * x.nbytes if side == "copy" else moved
            line[side] = {"q25_us": q * 1e6, "median_us": med * 1e6, "pct_copy_q25": 100 * nbytes / q / 1e9 / gbps}
        for side, prepare in sides[1:]:
            line[side]["host_us"] = host_us(prepare(), x)
        rows.append({"case": spec, "sides": line})
        print(f"{spec:30s} " + "  ".join(f"{n} {v['q25_us']:.2f}/{v['median_us']:.2f} ({v['pct_copy_q25']:.0f}%"
                                         + (f", host {v['host_us']:.1f})" if "host_us" in v else ")")
                                         for n, v in line.items()), flush=True)
    configure([])
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"copy": copy, "keep": KEEP, "variants": list(variants), "rows": rows, "seconds": time.perf_counter() - t0},
                      fh, indent=1)
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0
