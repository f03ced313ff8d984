"""Probe: is the float32 norm backward's gap to the copy bar a fixed cost a call, or a rate?
(session 26)

    python3 scripts/probe_vjp_scaling.py chain      # chained us a call over a sweep of rows
    python3 scripts/probe_vjp_scaling.py kernels    # one call of each, for ncu's kernel durations
    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
        python3 scripts/probe_vjp_scaling.py kernels

Session 25's target report left the float32 backward rows of 4096 x 4096 and 2048 x 8192 at
75-79% of copy, while the bench's 16384 x 4096 rows read 93-96%. ``chain`` times, for rows
of n = 4096 (and 8192) at several row counts, 20 compiled VJPs chained through dx (every
output kept, first quartile of interleaved repeats, as ``probe_vjp_chain.py``) next to the
``add`` floor (MLX's ``x + g``: the same reads and writes) and a chained copy of the same bytes,
then fits t = t0 + bytes / rate per variant: t0 is the fixed cost a call (ramp, tail, launch
gap), rate the streaming rate. Row counts that are multiples of 132 (an H100's SMs: every
persistent unit the same number of rows) sit next to those that are not.
``kernels`` launches each case's kernels a few times with a sync after each, so that
``ncu --metrics gpu__time_duration.sum`` gives each kernel's own duration (no launch gaps).

PROBE_VS_CASES: "kind:rows:n" words (kind rms or ln), default the sweep below;
PROBE_VS_VARIANTS: of add copy base (ours as shipped) and probe_vjp_chain.py's patches.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe_vjp_chain as pvc  # noqa: E402

from xlstm_kernels.benchmarks.copy_rate import measure_copy_rate  # noqa: E402
from xlstm_kernels.benchmarks.timing import fastest_quarter  # noqa: E402
from xlstm_kernels.ops import norm as norm_mod  # noqa: E402

SWEEP = ("ln:1056:4096 ln:2112:4096 ln:3960:4096 ln:4096:4096 ln:8184:4096 ln:16384:4096 "
         "rms:1056:4096 rms:2112:4096 rms:3960:4096 rms:4096:4096 rms:8184:4096 rms:16384:4096 "
         "ln:1980:8192 ln:2048:8192 ln:4096:8192")


def _cases():
    out = []
    for word in os.environ.get("PROBE_VS_CASES", SWEEP).split():
        kind, rows, n = word.split(":")
        out.append((kind, int(rows), int(n)))
    return out


def _inputs(rows, n):
    x, w, b, g = (mx.random.normal(s) for s in ((rows, n), (n,), (n,), (rows, n)))
    mx.eval(x, w, b, g)
    return x, w, b, g


def _fit(points):
    """Least squares t = t0 + bytes / rate over (bytes, seconds) points: (t0 us, rate GB/s)."""
    k = len(points)
    sx = sum(p[0] for p in points)
    sy = sum(p[1] for p in points)
    sxx = sum(p[0] * p[0] for p in points)
    sxy = sum(p[0] * p[1] for p in points)
    slope = (k * sxy - sx * sy) / (k * sxx - sx * sx)
    return (sy - slope * sx) / k * 1e6, 1e-9 / slope


def chain() -> None:
    chosen = os.environ.get("PROBE_VS_VARIANTS", "add copy base").split()
    repeats = int(os.environ.get("PROBE_VS_REPEATS", "7"))
    saved = {k: getattr(norm_mod, k) for p in pvc.PATCHES.values() for k in p}
    copy = measure_copy_rate("cuda")
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s", flush=True)
    pts: dict = {}
    for kind, rows, n in _cases():
        x, w, b, g = _inputs(rows, n)
        nbytes = 3 * x.nbytes
        half = mx.random.uniform(shape=(nbytes // 8,))
        mx.eval(half)

        times = pvc.time_variants(kind, 1, x, w, b, g, half, chosen, repeats, saved)
        for name in chosen:
            t = fastest_quarter(times[name])
            pts.setdefault((kind, n, name), []).append((nbytes, t))
            print(f"{kind:4s} {rows:6d}x{n:<5d} {name:6s} {t * 1e6:8.1f} us  {100 * nbytes / t / 1e9 / copy['gbps']:5.1f}% of copy"
                  f"  (median {sorted(times[name])[len(times[name]) // 2] * 1e6:8.1f})", flush=True)
    print("\nfit t = t0 + bytes / rate (first quartiles):")
    for (kind, n, name), p in pts.items():
        if len(p) >= 3:
            t0, rate = _fit(p)
            print(f"{kind:4s} n={n:<5d} {name:6s} t0 {t0:6.1f} us  rate {rate:6.0f} GB/s ({100 * rate / copy['gbps']:5.1f}% of copy)")


def kernels() -> None:
    """Each case: ours (the compiled VJP, dx only) three times, then MLX's x + g three times,
    a sync after each (ncu times every kernel on its own)."""
    for kind, rows, n in _cases():
        x, w, b, g = _inputs(rows, n)
        norm_mod._CALLS.clear()
        step = pvc._vjp_step(kind, 1, x, w, b, ours=True)
        for _ in range(3):
            mx.eval(step(g))
        for _ in range(3):
            mx.eval(x + g)
        print(f"{kind} {rows}x{n}: 3 x ours, 3 x add", flush=True)


def ncu() -> None:
    """``kernels`` under ncu (gpu__time_duration and DRAM bytes of every kernel), as a table:
    each kernel's own duration and its DRAM bytes over that duration."""
    import csv
    import io
    import subprocess

    metrics = "gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum"
    cmd = ["ncu", "--metrics", metrics, "--csv", "--print-units", "base", "--clock-control", "none",
           sys.executable, os.path.abspath(__file__), "kernels"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=int(os.environ.get("PROBE_VS_NCU_TIMEOUT", "400")))
    text = res.stdout
    start = text.find('"ID"')
    if start < 0:
        print(text[-3000:], res.stderr[-3000:])
        return
    rows: dict = {}
    for r in csv.DictReader(io.StringIO(text[start:])):
        rows.setdefault((int(r["ID"]), r["Kernel Name"][:60]), {})[r["Metric Name"]] = float(r["Metric Value"].replace(",", ""))
    labels = [c for c in text[:start].splitlines() if "x ours" in c]
    print(f"{'id':>4s} {'kernel':60s} {'us':>8s} {'MB read':>8s} {'MB written':>10s} {'GB/s':>7s}")
    for (i, name), m in sorted(rows.items()):
        t = m.get("gpu__time_duration.sum", 0.0) * 1e-9
        by = m.get("dram__bytes_read.sum", 0.0) + m.get("dram__bytes_write.sum", 0.0)
        print(f"{i:4d} {name:60s} {t * 1e6:8.1f} {m.get('dram__bytes_read.sum', 0.0) / 1e6:8.1f} "
              f"{m.get('dram__bytes_write.sum', 0.0) / 1e6:10.1f} {by / t / 1e9 if t else 0:7.0f}")
    print("cases in order:", "; ".join(labels))


if __name__ == "__main__":
    {"chain": chain, "kernels": kernels, "ncu": ncu}[sys.argv[1] if len(sys.argv) > 1 else "chain"]()
