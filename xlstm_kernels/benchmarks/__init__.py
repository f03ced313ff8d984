"""Library behind ``xlstm-kernels bench``, ``tune`` and ``info`` (the commands are thin wrappers).

    from xlstm_kernels import benchmarks as xb

    res = xb.run_bench(ops="gemm", dtypes="float16", quick=True, backend="emulate", out_dir="out")
    print(xb.format_table(res.rows)); res.to_dict()          # JSON document (docs/BENCH_SCHEMA.md)

    tr = xb.tune("gemm_av", "float16", shapes="64x64x64", quick=True, limit=4)
    print(xb.format_leaderboard(tr)); xb.write_presets(tr)   # winners -> user preset YAML
    tr = xb.tune("rms_norm", "float16", shapes="64x200")     # kernel knobs: kernel_shapes.<class>.rms_norm

    print(xb.format_info(xb.collect_info()))

Modules: ``args`` (argument parsing, BenchArgumentError), ``timing`` (warm-up + median with
mx.eval), ``suite`` (op registry, rows), ``report`` (table, JSON, CSV, PNG), ``tuner``
(candidates, sweep, leaderboard, heatmap, preset writing), ``tune_knobs`` (the same for the
norm, attention, mLSTM and sLSTM knobs), ``info``. Benchmark modules of
the other kernel families live here as ``ops_<family>.py`` with
``run(backend, dtypes, quick) -> list[dict]``.
"""

from .args import BenchArgumentError, parse_dtypes, parse_positive_int, parse_shapes
from .info import collect_info, format_info
from .report import ROW_FIELDS, SCHEMA, SCHEMA_VERSION, format_table, save_results
from .suite import FAMILIES, GEMM_OPS, BenchResult, parse_ops, run_bench
from .timing import Timing, measure
from .tuner import (
    TUNABLE_OPS,
    TuneResult,
    config_env,
    enumerate_candidates,
    format_leaderboard,
    tune,
    write_presets,
)

__all__ = [
    "BenchArgumentError",
    "BenchResult",
    "FAMILIES",
    "GEMM_OPS",
    "ROW_FIELDS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "TUNABLE_OPS",
    "Timing",
    "TuneResult",
    "collect_info",
    "config_env",
    "enumerate_candidates",
    "format_info",
    "format_leaderboard",
    "format_table",
    "measure",
    "parse_dtypes",
    "parse_ops",
    "parse_positive_int",
    "parse_shapes",
    "run_bench",
    "save_results",
    "tune",
    "write_presets",
]
