"""Bench output: the table, the JSON document, the CSV and the PNG bar chart.

The JSON schema (``SCHEMA`` / ``SCHEMA_VERSION``, documented in docs/BENCH_SCHEMA.md) is
stable: fields are only ever added; a rename or a change of meaning bumps the version.
Plots use matplotlib's object API with the Agg canvas, so saving a chart never changes
the pyplot backend of a notebook.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Sequence

__all__ = [
    "ROW_FIELDS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "format_row",
    "format_table",
    "save_results",
    "table_header",
    "to_document",
    "write_chart",
    "write_csv",
    "write_json",
]

SCHEMA = "xlstm-kernels/bench"
SCHEMA_VERSION = 1

# Every row has exactly these keys (null where not applicable), in this order (CSV columns).
ROW_FIELDS = (
    "family",            # gemm | norm | rope | attention | mlstm | slstm | ...
    "op",                # e.g. gemm_av, linear, rms_norm
    "shape",             # text, e.g. "64x64x64" (GEMM: MxNxK = output M x N, reduction K)
    "dims",              # the shape as a list of ints, or null
    "dtype",             # float32 | float16 | bfloat16
    "backend",           # metal | emulate | reference
    "path",              # kernel path that ran (GEMM: scalar | simd | gemv | reference), or null
    "baseline",          # what we compare with, e.g. "mx.matmul(a, v)"
    "ours_ms",           # median ms of our op (null on the emulator)
    "baseline_ms",       # median ms of the baseline (null on the emulator)
    "ratio",             # baseline_ms / ours_ms: > 1 means ours is faster (null on the emulator)
    "gflops",            # our GFLOP/s (null on the emulator / where not meaningful)
    "gbps",              # our GB/s of compulsory traffic (null likewise)
    "metric",            # "GFLOP/s" or "GB/s": the rate that matters for this row (its roofline bound)
    "bound",             # "compute" | "memory" (from the preset roofline), or null
    "pct_roofline",      # 100 * roofline lower-bound time / our time (null on the emulator)
    "max_rel_err",       # max |ours - ref64| / max |ref64|; null if the output was not finite
    "baseline_rel_err",  # the same for the baseline
    "tolerance",         # the bound max_rel_err is checked against
    "ok",                # max_rel_err <= tolerance and no error
    "emulated",          # true on the emulator
    "emulated_s",        # emulator wall time of one run (emulator only)
    "emulated_threads_per_s",  # emulated GPU threads per second (emulator, GEMM)
    "repeats",           # timed runs behind the medians
    "note",              # why a row failed, or what its numbers mean; "" if nothing to say
    "extra",             # mapping: family-specific values (GEMM: config; failures: traceback)
)


def _clean(v: Any) -> Any:
    """JSON-safe: non-finite floats -> None, tuples -> lists, mx dtypes -> names."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if hasattr(v, "item") and callable(v.item):  # numpy scalars
        try:
            return _clean(v.item())
        except Exception:  # noqa: BLE001
            pass
    return str(v)


def to_document(result) -> dict:
    """The JSON document of a BenchResult (see docs/BENCH_SCHEMA.md)."""
    from .suite import environment

    rows = [{k: _clean(r.get(k)) for k in ROW_FIELDS} for r in result.rows]
    failed = [r for r in result.rows if not r.get("ok")]
    timing = ("emulator: kernels ran on the CPU Metal emulator; rows give correctness and the emulated rate only, "
              "no GPU time (ours_ms, baseline_ms, ratio, pct_roofline are null)") if result.emulated else (
              f"wall clock: median of {result.options.get('repeats')} runs after {result.options.get('warmup')} "
              "warm-up runs, each synchronised with mx.eval")
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": result.created,
        "command": getattr(result, "command", "") or "",
        "backend": result.backend,
        "emulated": result.emulated,
        "timing": timing,
        "device": _clean(result.device),
        "roofline": _clean(result.roofline),
        "copy": _clean(getattr(result, "copy", None)),
        "environment": environment(),
        "options": _clean(result.options),
        "summary": {"rows": len(rows), "ok": len(rows) - len(failed), "failed": len(failed),
                    "skipped": len(result.skipped), "errors": len(result.errors),
                    "seconds": round(result.seconds, 3), "passed": result.ok},
        "skipped": _clean(result.skipped),
        "errors": _clean(result.errors),
        "rows": rows,
        "files": _clean(result.files),
    }


# ---------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------


def _f(v: Any, fmt: str, width: int) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        text = "-" if v is None else str(v)
    else:
        text = format(v, fmt)
    return f"{text:>{width}}"


def table_header(emulated: bool) -> str:
    if emulated:
        return (f"{'op':<10} {'shape':<16} {'dtype':<9} {'path':<9} {'emu ms':>9} {'emu rate':>14} "
                f"{'rel.err':>9} {'mlx err':>9}  result")
    return (f"{'op':<10} {'shape':<16} {'dtype':<9} {'path':<9} {'ours ms':>9} {'mlx ms':>9} {'ratio':>6} "
            f"{'rate':>16} {'%roof':>6} {'rel.err':>9}  result")


def format_row(r: dict) -> str:
    status = "ok" if r.get("ok") else "FAIL"
    note = r.get("note") or ""
    if note and (not r.get("ok") or not r.get("emulated")) and not note.startswith("emulator:"):
        status += f" ({note})"
    head = f"{str(r.get('op')):<10} {str(r.get('shape')):<16} {str(r.get('dtype')):<9} {str(r.get('path') or '-'):<9}"
    if r.get("emulated"):
        es = r.get("emulated_s")
        tps = r.get("emulated_threads_per_s")
        rate = f"{tps / 1e6:.2f}M thr/s" if tps else "-"
        return (f"{head} {_f(None if es is None else es * 1e3, '.2f', 9)} {rate:>14} "
                f"{_f(r.get('max_rel_err'), '.1e', 9)} {_f(r.get('baseline_rel_err'), '.1e', 9)}  {status}")
    metric = r.get("metric")
    value = r.get("gbps") if metric == "GB/s" else r.get("gflops")
    rate = f"{value:,.1f} {metric}" if value is not None and metric else "-"
    return (f"{head} {_f(r.get('ours_ms'), '.3f', 9)} {_f(r.get('baseline_ms'), '.3f', 9)} {_f(r.get('ratio'), '.2f', 6)} "
            f"{rate:>16} {_f(r.get('pct_roofline'), '.1f', 6)} {_f(r.get('max_rel_err'), '.1e', 9)}  {status}")


def format_table(rows: Sequence[dict], emulated: bool | None = None) -> str:
    if emulated is None:
        emulated = bool(rows) and all(r.get("emulated") for r in rows)
    return "\n".join([table_header(emulated), *(format_row(r) for r in rows)])


# ---------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------


def write_json(result, path: str) -> str:
    doc = to_document(result)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2, allow_nan=False)
        fh.write("\n")
    return path


def write_csv(rows: Sequence[dict], path: str) -> str:
    """One line per row, the columns of ROW_FIELDS (dims and extra as JSON text)."""
    with open(path, "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(ROW_FIELDS)
        for r in rows:
            cells = []
            for k in ROW_FIELDS:
                v = _clean(r.get(k))
                if isinstance(v, (dict, list)):
                    v = json.dumps(v, sort_keys=True, allow_nan=False)
                cells.append("" if v is None else v)
            w.writerow(cells)
    return path


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def write_chart(rows: Sequence[dict], path: str, title: str = "") -> str:
    """Horizontal bars, one per row: the ratio to the MLX baseline (> 1: ours faster);
    on the emulator (no ratios) the emulated time in ms instead, titled as such."""
    labelled = [r for r in rows if r.get("ratio") is not None]
    emulated = not labelled
    if emulated:
        labelled = [r for r in rows if r.get("emulated_s") is not None]
    values = [r["ratio"] if not emulated else r["emulated_s"] * 1e3 for r in labelled]
    labels = [f"{r.get('op')} {r.get('shape')} {r.get('dtype')}" for r in labelled]
    keys = [(r.get("op"), r.get("shape"), r.get("dtype")) for r in labelled]
    if len(set(keys)) < len(keys):  # several baselines per case (the fused family): name them
        labels = [f"{lab} vs {str(r.get('baseline', '')).split(':')[0]}" for lab, r in zip(labels, labelled)]
    fig = _figure(9.0, max(2.5, 0.28 * len(values) + 1.4))
    ax = fig.add_subplot(1, 1, 1)
    if values:
        colors = ["#4c72b0" if r.get("ok") else "#c44e52" for r in labelled]
        y = list(range(len(values)))
        ax.barh(y, values, color=colors)
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        if emulated:
            ax.set_xlabel("emulated time per run (ms, CPU emulator: not GPU time)")
        else:
            ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_xlabel("speed ratio vs MLX (baseline time / our time; > 1 = ours faster)")
            positive = [v for v in values if v > 0]
            if positive and max(positive) / min(positive) > 30:  # a wide spread: ratios on a log axis
                ax.set_xscale("log")
                ax.set_xlabel("speed ratio vs the baseline, log scale (baseline time / our time; > 1 = ours faster)")
    else:
        ax.text(0.5, 0.5, "no rows", ha="center", va="center")
        ax.set_axis_off()
    ax.set_title(title or ("emulated time (no GPU timing)" if emulated else "ours vs MLX"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def save_results(result, out_dir: str, stem: str | None = None) -> dict:
    """Write <stem>.json, <stem>.csv and <stem>.png (default stem: bench-<backend>) into
    `out_dir` (created if needed); returns {"json", "csv", "png"} -> path, also kept in
    ``result.files``."""
    os.makedirs(out_dir, exist_ok=True)
    stem = stem or f"bench-{result.backend}"
    files = {
        "json": os.path.join(out_dir, stem + ".json"),
        "csv": os.path.join(out_dir, stem + ".csv"),
        "png": os.path.join(out_dir, stem + ".png"),
    }
    result.files = dict(files)
    write_csv(result.rows, files["csv"])
    where = f"{result.device.get('name')} ({result.device.get('family')})"
    write_chart(result.rows, files["png"], title=f"xlstm-kernels bench, backend {result.backend}, {where}")
    write_json(result, files["json"])
    return files
