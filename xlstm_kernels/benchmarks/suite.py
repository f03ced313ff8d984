"""The benchmark suite: our kernels vs the MLX built-in (or an mx-ops composite), same run.

Families (``--ops``): ``gemm`` (built here: gemm_av, gemm_at_b, gemm_a_bt vs ``mx.matmul``,
linear vs ``gelu(addmm) + residual``) and ``norm``, ``rope``, ``attention``, ``mlstm``,
``slstm``, each from a module ``xlstm_kernels.benchmarks.ops_<family>`` exposing::

    run(backend: str, dtypes: list[mx.Dtype], quick: bool) -> list[dict]

(rows with op, shape, dtype, ours_ms, mlx_ms, ratio, gbps or tflops, pct_roofline,
max_rel_err, and on the emulator emulated_s). A family whose module is not there yet is
skipped with a note. Rows of every family are normalised to one schema
(:data:`xlstm_kernels.benchmarks.report.ROW_FIELDS`, docs/BENCH_SCHEMA.md).

On Metal (and the ``reference`` backend) rows carry wall-clock times after warm-up
(median of repeats, each synchronised with ``mx.eval``). On the emulator nothing times a
GPU: rows carry correctness (max relative error vs float64) and the emulated rate only;
``ours_ms``/``baseline_ms``/``ratio``/``pct_roofline`` are null there.
"""

from __future__ import annotations

import importlib
import inspect
import math
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from .. import runtime
from .. import tiles as tiles_mod
from ..tiles.gemm import dtype_size
from .args import BenchArgumentError, dtype_of, parse_dtypes, parse_names, parse_positive_int, parse_shapes, shape_text
from .kind import bench_kind
from .timing import measure, throughput

__all__ = [
    "BenchResult",
    "FAMILIES",
    "GEMM_OPS",
    "TOLERANCE",
    "default_gemm_shapes",
    "family_module",
    "gemm_rows",
    "normalize_row",
    "parse_ops",
    "relative_error",
    "run_bench",
    "timing_plan",
]

FAMILIES = ("gemm", "norm", "rope", "attention", "mlstm", "slstm")
GEMM_OPS = ("gemm_av", "gemm_at_b", "gemm_a_bt", "linear")
FAMILY_PACKAGE = "xlstm_kernels.benchmarks"

# Max |out - ref| / max |ref| allowed per dtype (as `xlstm-kernels check`).
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 2e-2}

# Default GEMM shapes, MxNxK (output M x N, reduction K; the tiles / explain notation).
_GEMM_SHAPES = {
    ("gpu", False): ((1, 4096, 4096), (512, 1024, 4096), (2048, 2048, 2048), (4096, 4096, 1024)),
    ("gpu", True): ((1, 1024, 1024), (256, 256, 256), (512, 512, 512)),
    ("emulate", False): ((1, 192, 256), (33, 31, 29), (64, 80, 96), (128, 128, 128)),
    ("emulate", True): ((1, 64, 96), (33, 31, 29), (64, 64, 64)),
    ("cpu", False): ((1, 1024, 1024), (256, 256, 256), (512, 512, 512)),
    ("cpu", True): ((1, 128, 128), (33, 31, 29), (64, 64, 64)),
}


def default_gemm_shapes(backend: str, quick: bool) -> list[tuple[int, int, int]]:
    """The GEMM shapes bench uses without --shapes (tiny on the emulator)."""
    return list(_GEMM_SHAPES[(bench_kind(backend), bool(quick))])


def timing_plan(backend: str, quick: bool) -> tuple[int, int]:
    """(warm-up runs, timed runs) by default: the emulator is timed once (its time is not a GPU's)."""
    if backend == "emulate":
        return (1, 1) if quick else (1, 3)
    return (2, 5) if quick else (3, 20)


def parse_ops(value: Any, name: str = "--ops") -> list[str]:
    """Families (gemm, norm, rope, attention, mlstm, slstm; 'all') and single GEMM ops
    (gemm_av, gemm_at_b, gemm_a_bt, linear) -> the list of selections, in order."""
    extra = tuple(f for f in available_family_modules() if f not in FAMILIES)
    return parse_names(value, name, (*FAMILIES, *extra, *GEMM_OPS), aliases={"all": (*FAMILIES, *extra)}, what="op")


def available_family_modules() -> list[str]:
    """Families with an ``ops_<family>`` module in this package (importable or not)."""
    import pkgutil

    from . import __path__ as pkg_path

    return sorted(m.name[4:] for m in pkgutil.iter_modules(pkg_path) if m.name.startswith("ops_"))


def family_module(family: str):
    """The ``xlstm_kernels.benchmarks.ops_<family>`` module, or None if it does not exist.
    Errors raised while importing an existing module propagate."""
    name = f"{FAMILY_PACKAGE}.ops_{family}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            return None
        raise


# ---------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------


def to_f64(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32)).astype(np.float64)


def relative_error(out: mx.array, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref| (a non-finite output gives inf)."""
    o = to_f64(out).reshape(ref.shape)
    if not np.all(np.isfinite(o)):
        return math.inf
    if not ref.size:
        return 0.0
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    return float(np.max(np.abs(o - ref))) / scale


# ---------------------------------------------------------------------------------------
# GEMM rows
# ---------------------------------------------------------------------------------------


def _normal(rng: np.random.Generator, shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def gemm_case(op: str, m: int, n: int, k: int, dtype: mx.Dtype, rng: np.random.Generator, tiles: Any = None):
    """(ours, baseline, baseline name, reference f64, tiles op, inputs) for one GEMM op with
    an M x N output and reduction K, operands in the op's own layout; `tiles` goes to our op."""
    import xlstm_kernels as xk

    if op == "gemm_av":  # a (M, K) . v (K, N)
        a, b = _normal(rng, (m, k), dtype), _normal(rng, (k, n), dtype)
        ref = to_f64(a) @ to_f64(b)
        return (lambda: xk.gemm_av(a, b, tiles=tiles)), (lambda: mx.matmul(a, b)), "mx.matmul(a, v)", ref, op, (a, b)
    if op == "gemm_at_b":  # a (K, M)^T . b (K, N)
        a, b = _normal(rng, (k, m), dtype), _normal(rng, (k, n), dtype)
        ref = to_f64(a).T @ to_f64(b)
        return (lambda: xk.gemm_at_b(a, b, tiles=tiles)), (lambda: mx.matmul(a.T, b)), "mx.matmul(a.T, b)", ref, op, (a, b)
    if op == "gemm_a_bt":  # a (M, K) . b (N, K)^T
        a, b = _normal(rng, (m, k), dtype), _normal(rng, (n, k), dtype)
        ref = to_f64(a) @ to_f64(b).T
        return (lambda: xk.gemm_a_bt(a, b, tiles=tiles)), (lambda: mx.matmul(a, b.T)), "mx.matmul(a, b.T)", ref, op, (a, b)
    if op == "linear":  # gelu(x (M, K) . w (N, K)^T + bias) + residual
        import mlx.nn as nn

        x, w = _normal(rng, (m, k), dtype), _normal(rng, (n, k), dtype)
        bias, res = _normal(rng, (n,), dtype), _normal(rng, (m, n), dtype)
        z = to_f64(x) @ to_f64(w).T + to_f64(bias)
        from math import erf

        ref = 0.5 * z * (1.0 + np.frompyfunc(erf, 1, 1)(z / math.sqrt(2.0)).astype(np.float64)) + to_f64(res)
        ours = lambda: xk.linear(x, w, bias, activation="gelu", residual=res, tiles=tiles)  # noqa: E731
        base = lambda: nn.gelu(mx.addmm(bias, x, w.T)) + res  # noqa: E731
        return ours, base, "nn.gelu(mx.addmm(bias, x, w.T)) + residual", ref, "gemm_a_bt", (x, w, bias, res)
    raise BenchArgumentError(f"ops: unknown GEMM op {op!r}; expected one of {', '.join(GEMM_OPS)}")


def _empty_row() -> dict[str, Any]:
    from .report import ROW_FIELDS

    row = {k: None for k in ROW_FIELDS}
    row.update(note="", extra={})
    return row


def gemm_rows(
    ops: Sequence[str],
    shapes: Sequence[tuple[int, int, int]],
    dtypes: Sequence[str],
    backend: str,
    *,
    warmup: int,
    repeats: int,
    seed: int = 0,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """One row per (shape, dtype, op): our kernel vs its MLX baseline on `backend`."""
    emulated = backend == "emulate"
    device = tiles_mod.detect_device()
    roof = tiles_mod.roofline(device.family_key, device.name)
    rng = np.random.default_rng(seed)
    rows = []
    for m, n, k in shapes:
        for dt in dtypes:
            dtype = dtype_of(dt)
            for op in ops:
                row = _gemm_row(op, m, n, k, dt, dtype, backend, emulated, roof, rng, warmup, repeats)
                rows.append(row)
                if on_row:
                    on_row(row)
    return rows


def _gemm_row(op, m, n, k, dt, dtype, backend, emulated, roof, rng, warmup, repeats) -> dict:
    row = _empty_row()
    row.update(family="gemm", op=op, shape=shape_text((m, n, k)), dims=[m, n, k], dtype=dt, backend=backend,
               emulated=emulated, tolerance=TOLERANCE[dt], extra={})
    flops = 2.0 * m * n * k
    size = dtype_size(dt)
    nbytes = float(size * (m * k + k * n + m * n) + (size * (n + m * n) if op == "linear" else 0))
    try:
        ours, base, base_name, ref, tiles_op, inputs = gemm_case(op, m, n, k, dtype, rng)
        row["baseline"] = base_name
        mx.eval(*inputs)
        with runtime.use_backend(backend):
            info = tiles_mod.explain(tiles_op, (m, n, k), dt)
            row["path"] = info["path"] if backend != "reference" else "reference"
            row["extra"]["config"] = _path_fields(info["config"])
            t = measure(ours, warmup=warmup, repeats=repeats)
        row["max_rel_err"] = relative_error(t.output, ref)
        row["repeats"] = len(t.times_s)
        if emulated:
            row["emulated_s"] = t.median_s
            threads = int(np.prod(info["grid"]))
            row["emulated_threads_per_s"] = threads / t.median_s if t.median_s > 0 else None
            out = base()
            mx.eval(out)
            row["baseline_rel_err"] = relative_error(out, ref)
            row["note"] = "emulator: correctness and emulated rate only (no GPU timing)"
        else:
            tb = measure(base, warmup=warmup, repeats=repeats)
            row["baseline_rel_err"] = relative_error(tb.output, ref)
            row["ours_ms"], row["baseline_ms"] = t.median_s * 1e3, tb.median_s * 1e3
            row["ratio"] = tb.median_s / t.median_s if t.median_s > 0 else None
            _rates(row, flops, nbytes, t.median_s, roof, dt)
            # queued (20 calls per evaluation) and pipelined (async evaluation): a model's
            # steady state; the synchronised times above include the host's per-call cost
            with runtime.use_backend(backend):
                tp = throughput(ours, base, repeats=repeats)
            row["extra"].update(tp, gflops_queued=flops / tp["ours_queued_ms"] / 1e6,
                                gflops_pipelined=flops / tp["ours_pipelined_ms"] / 1e6)
        row["ok"] = row["max_rel_err"] <= row["tolerance"]
        if not row["ok"]:
            row["note"] = f"error {row['max_rel_err']:.2e} above the {dt} bound {row['tolerance']:.0e}"
    except Exception as e:  # noqa: BLE001  reported in the row; the exit status fails
        row["ok"] = False
        row["max_rel_err"] = row["max_rel_err"] if row["max_rel_err"] is not None else math.inf
        row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        row["extra"]["traceback"] = traceback.format_exc(limit=6)
    return row


def _path_fields(cfg: dict) -> dict:
    """The fields of a config dict its path reads."""
    from ..tiles.gemm import SCALAR_FIELDS, SIMD_FIELDS

    path = cfg.get("path")
    keep = {"scalar": SCALAR_FIELDS, "simd": (*SIMD_FIELDS, "split_k"), "gemv": ("gemv_threads",)}.get(path, ())
    return {"path": path, **{f: cfg[f] for f in keep}}


def _rates(row: dict, flops: float, nbytes: float, seconds: float, roof: dict, dt: str) -> None:
    peak = roof[{"float32": "fp32_tflops", "float16": "fp16_tflops", "bfloat16": "bf16_tflops"}[dt]] * 1e12
    bw = roof["bandwidth_gbs"] * 1e9
    t_compute, t_memory = flops / peak, nbytes / bw
    row["gflops"] = flops / seconds / 1e9
    row["gbps"] = nbytes / seconds / 1e9
    row["bound"] = "compute" if t_compute >= t_memory else "memory"
    row["metric"] = "GFLOP/s" if row["bound"] == "compute" else "GB/s"
    row["pct_roofline"] = 100.0 * max(t_compute, t_memory) / seconds


# ---------------------------------------------------------------------------------------
# Rows from family modules
# ---------------------------------------------------------------------------------------

_KNOWN_FAMILY_KEYS = {"op", "shape", "dtype", "ours_ms", "mlx_ms", "baseline_ms", "ratio", "gbps", "tflops",
                      "gflops", "pct_roofline", "max_rel_err", "emulated_s", "baseline", "baseline_rel_err",
                      "tolerance", "ok", "path", "note", "bound"}


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f


def normalize_row(raw: dict, family: str, backend: str) -> dict:
    """A family module's row in the bench schema (unknown keys go to ``extra``).

    ``ratio`` is recomputed as baseline time / our time (> 1: ours faster) when both
    times are given; ``tflops`` becomes ``gflops``; on the emulator the timing columns
    are cleared (a module's ``ours_ms`` becomes ``emulated_s`` if that is missing).
    """
    row = _empty_row()
    emulated = backend == "emulate"
    shape = raw.get("shape")
    if isinstance(shape, (list, tuple)):
        row["dims"] = [int(d) for d in shape]
        shape = shape_text(shape)
    dt = raw.get("dtype")
    dt = str(dt).split(".")[-1] if dt is not None else None
    row.update(family=family, op=str(raw.get("op", family)), shape=None if shape is None else str(shape), dtype=dt,
               backend=backend, emulated=emulated, baseline=raw.get("baseline", "mlx"), path=raw.get("path"),
               extra={k: v for k, v in raw.items() if k not in _KNOWN_FAMILY_KEYS})
    ours = _num(raw.get("ours_ms"))
    base = _num(raw.get("baseline_ms", raw.get("mlx_ms")))
    row["max_rel_err"] = _num(raw.get("max_rel_err"))
    row["baseline_rel_err"] = _num(raw.get("baseline_rel_err"))
    row["tolerance"] = _num(raw.get("tolerance")) or TOLERANCE.get(dt or "")
    if emulated:
        row["emulated_s"] = _num(raw.get("emulated_s"))
        if row["emulated_s"] is None and ours is not None:
            row["emulated_s"] = ours / 1e3
        row["note"] = raw.get("note") or "emulator: correctness and emulated rate only (no GPU timing)"
    else:
        row["ours_ms"], row["baseline_ms"] = ours, base
        row["ratio"] = base / ours if ours and base else _num(raw.get("ratio"))
        gflops = _num(raw.get("gflops"))
        if gflops is None and _num(raw.get("tflops")) is not None:
            gflops = _num(raw.get("tflops")) * 1e3
        row["gflops"], row["gbps"] = gflops, _num(raw.get("gbps"))
        row["metric"] = "GB/s" if row["gbps"] is not None and gflops is None else ("GFLOP/s" if gflops is not None else None)
        row["bound"] = raw.get("bound")
        row["pct_roofline"] = _num(raw.get("pct_roofline"))
        row["note"] = raw.get("note") or ""
    if "ok" in raw and isinstance(raw["ok"], bool):
        row["ok"] = raw["ok"]
    elif row["max_rel_err"] is not None and row["tolerance"] is not None:
        row["ok"] = row["max_rel_err"] <= row["tolerance"]
    elif row["max_rel_err"] is None:  # a timing-only row (e.g. a gradient pass): nothing to fail
        row["ok"] = True
        row["note"] = (row.get("note") or "") + ("; " if row.get("note") else "") + "timing only: no error check"
    else:
        row["ok"] = math.isfinite(row["max_rel_err"])
    return row


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------


@dataclass
class BenchResult:
    """Everything one bench run measured (``to_dict`` is the JSON document)."""

    backend: str
    rows: list[dict]
    options: dict
    device: dict
    roofline: dict
    skipped: list[dict] = field(default_factory=list)  # {"family", "reason"}
    errors: list[dict] = field(default_factory=list)  # {"family", "error"}: a module raised
    seconds: float = 0.0
    created: str = ""
    files: dict = field(default_factory=dict)  # "json" / "csv" / "png" -> path, once saved
    command: str = ""  # the command line, when run from the CLI
    copy: dict | None = None  # the measured copy bandwidth (copy_rate.measure_copy_rate), GPU runs

    @property
    def emulated(self) -> bool:
        return self.backend == "emulate"

    @property
    def ok(self) -> bool:
        return not self.errors and all(r.get("ok") for r in self.rows)

    def to_dict(self) -> dict:
        from .report import to_document

        return to_document(self)


def run_bench(
    ops: Any = None,
    dtypes: Any = None,
    shapes: Any = None,
    *,
    quick: bool = False,
    backend: str | None = None,
    warmup: int | None = None,
    repeats: int | None = None,
    seed: int = 0,
    out_dir: str | None = None,
    on_row: Callable[[dict], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> BenchResult:
    """Benchmark our kernels against MLX's in one run; see the module docstring.

    Args:
        ops: families / GEMM ops, a comma string or a list (default: all families).
        dtypes: float32, float16, bfloat16 (default: all three).
        shapes: GEMM shapes "MxNxK" (output M x N, reduction K), a comma string or a list of
            strings / int tuples (default: by backend and `quick`). Families choose their own
            shapes unless their ``run`` takes a ``shapes`` keyword.
        quick: small shapes and few repeats (the CI smoke test).
        backend: metal | emulate | reference (default: the active backend).
        warmup, repeats: untimed and timed runs per case (default: by backend, see timing_plan).
        seed: seed of the random inputs.
        out_dir: if given, save JSON, CSV and PNG there (see report.save_results).
        on_row: called with each row as it is measured; on_note: with each note (skips).

    Raises:
        BenchArgumentError: a malformed argument (the message names it).
    """
    t_start = time.perf_counter()
    selection = parse_ops(ops if ops is not None else "all", "ops")
    dts = parse_dtypes(dtypes if dtypes is not None else ",".join(("float32", "float16", "bfloat16")), "dtypes")
    backend = backend or runtime.current_backend()
    if backend not in runtime.BACKENDS:
        raise BenchArgumentError(f"backend: unknown backend {backend!r}; expected one of {', '.join(runtime.BACKENDS)}")
    ok, why = runtime.available(backend)
    if not ok:
        raise runtime.BackendUnavailableError(f"backend '{backend}' is not available: {why}")
    gemm_ops = [o for o in GEMM_OPS if "gemm" in selection or o in selection]
    gemm_shapes = parse_shapes(shapes, "shapes") if shapes is not None else default_gemm_shapes(backend, quick)
    w0, r0 = timing_plan(backend, quick)
    warmup = w0 if warmup is None else int(warmup)
    repeats = r0 if repeats is None else parse_positive_int(repeats, "repeats")
    note = on_note or (lambda s: None)

    # A malformed XLSTM_GEMM_* variable or preset file fails here, once, with its own message.
    from ..tiles import env as env_mod

    for op in {("gemm_a_bt" if o == "linear" else o) for o in gemm_ops}:
        env_mod.read_gemm_env(op)
    device = tiles_mod.detect_device()
    result = BenchResult(
        backend=backend, rows=[], device={"name": device.name, "architecture": device.architecture,
                                          "family": device.family_key},
        roofline=tiles_mod.roofline(device.family_key, device.name),
        options={"ops": selection, "dtypes": dts, "shapes": [shape_text(s) for s in gemm_shapes] if gemm_ops else [],
                 "quick": bool(quick), "warmup": warmup, "repeats": repeats, "seed": seed},
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    if backend == "emulate":
        note("emulator: kernels run on the CPU emulator; rows report correctness and the emulated rate only, "
             "not GPU time (no ratio or roofline)")
    elif backend == "reference":
        note("reference backend: 'ours' is the ops' plain-MLX reference path, not a custom kernel")

    def add(row: dict) -> None:
        result.rows.append(row)
        if on_row:
            on_row(row)

    if gemm_ops:
        gemm_rows(gemm_ops, gemm_shapes, dts, backend, warmup=warmup, repeats=repeats, seed=seed, on_row=add)
    families = [f for f in selection if f not in GEMM_OPS and f != "gemm"]
    for family in families:
        try:
            module = family_module(family)
        except Exception as e:  # noqa: BLE001  a broken module is an error, not a skip
            result.errors.append({"family": family, "error": f"import failed: {type(e).__name__}: {e}"})
            note(f"{family}: importing {FAMILY_PACKAGE}.ops_{family} failed: {type(e).__name__}: {e}")
            continue
        if module is None or not callable(getattr(module, "run", None)):
            reason = (f"no benchmark module {FAMILY_PACKAGE}.ops_{family} yet" if module is None
                      else f"{FAMILY_PACKAGE}.ops_{family} has no run(backend, dtypes, quick)")
            result.skipped.append({"family": family, "reason": reason})
            note(f"{family}: skipped ({reason})")
            continue
        kwargs = {}
        if shapes is not None and "shapes" in inspect.signature(module.run).parameters:
            kwargs["shapes"] = parse_shapes(shapes, "shapes", dims=None)
        try:
            with runtime.use_backend(backend):
                raw_rows = module.run(backend, [dtype_of(d) for d in dts], bool(quick), **kwargs)
        except Exception as e:  # noqa: BLE001
            result.errors.append({"family": family, "error": f"{type(e).__name__}: {e}"})
            note(f"{family}: run failed: {type(e).__name__}: {e}")
            continue
        for raw in raw_rows or []:
            add(normalize_row(dict(raw), family, backend))
    if any(r.get("metric") == "GB/s" for r in result.rows):
        # the bar of the memory-bound rows: the copy bandwidth, measured in this run
        from .copy_rate import annotate_rows, annotate_same_bytes, measure_copy_rate

        try:
            result.copy = measure_copy_rate(backend)
        except Exception as e:  # noqa: BLE001  reported; the rows stand without it
            result.errors.append({"family": "copy", "error": f"copy bandwidth: {type(e).__name__}: {e}"})
            note(f"copy bandwidth: {type(e).__name__}: {e}")
        annotate_rows(result.rows, result.copy["gbps"] if result.copy else None)
        try:
            annotate_same_bytes(result.rows, result.copy["gbps"] if result.copy else None, backend)
        except Exception as e:  # noqa: BLE001  information only: reported, the rows stand
            result.errors.append({"family": "copy", "error": f"copy at the rows' sizes: {type(e).__name__}: {e}"})
            note(f"copy at the rows' sizes: {type(e).__name__}: {e}")
    result.seconds = time.perf_counter() - t_start
    if out_dir is not None:
        from .report import save_results

        save_results(result, out_dir)
    return result


def environment() -> dict:
    """Versions and machine, for the JSON document."""
    import xlstm_kernels

    return {"mlx_version": mx.__version__, "package_version": xlstm_kernels.__version__,
            "python": sys.version.split()[0], "machine": platform.platform()}
