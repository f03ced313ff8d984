"""``xlstm-kernels tune``: sweep the kernels' tunables, rank them, write the winners.

Ops (``TUNABLE_OPS``): the GEMM layouts gemm_av, gemm_at_b, gemm_a_bt (this module), and
the kernel knobs of rms_norm, layer_norm, attention, mlstm and slstm
(:mod:`xlstm_kernels.benchmarks.tune_knobs`: same steps, knob candidates, winners under
``kernel_shapes``). For a GEMM op, one dtype and a few shapes (M x N output, reduction K):

1. enumerate candidate configs from the :class:`~xlstm_kernels.tiles.GemmConfig` fields
   (scalar path: TM, TN, TK, RM, RN, PAD, double buffering, VEC4, ALIGN_EXECW; simd path:
   BM, BN, BK, WM, WN and SPLIT_K where the split-K rule fires; M == 1: the gemv kernel's
   threads), and drop the invalid ones with ``GemmConfig.validate`` — the very check a
   launch runs (<= 1024 threads, <= 32 KiB threadgroup memory, divisibility);
2. time each (warm-up, then the median of repeats, each ``mx.eval``-synchronised), in
   this process through ``tiles=`` or, with ``env=True``, each in a subprocess with the
   ``XLSTM_GEMM_*`` variables set (the sweep users script by hand), checking its result
   against float64; a progress bar runs on stderr;
3. rank them per shape (leaderboard) and per shape class (small / medium / large, the
   preset file's classes): the class winner has the best geometric-mean time over the
   class's shapes among the candidates correct on all of them;
4. optionally write the winners to the user preset YAML the runtime loads
   (``$XLSTM_KERNELS_PRESETS`` if set, else ``~/.config/xlstm_kernels/presets.yaml``) under
   ``families.<detected family>.shapes.<class>.<op>.<dtype>`` (the strict loader's layout),
   merged with what the file already holds and validated by that loader before it
   replaces the file.

The first candidate is always the config the runtime picks now ("current"), so the
leaderboard shows the speed-up over it. On the emulator times are CPU-emulator times:
they rank configs for the emulator (the ``cpu`` family), not for a GPU; shapes must be
tiny there and the quick grid is used.

"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .. import runtime
from .. import tiles as tiles_mod
from ..tiles import env as env_mod
from ..tiles import presets as presets_mod
from ..tiles.errors import TileConfigError
from ..tiles.gemm import SCALAR_FIELDS, SIMD_FIELDS, GemmConfig, dtype_name
from ..tiles.knobs import KNOB_OPS
from .args import BenchArgumentError, dtype_of, parse_dtypes, parse_names, parse_positive_int, parse_shapes, shape_text

__all__ = [
    "EMULATOR_MAX_MNK",
    "GEMM_TUNE_OPS",
    "TUNABLE_OPS",
    "CandidateResult",
    "TuneError",
    "TuneResult",
    "candidate_grid",
    "config_env",
    "config_label",
    "enumerate_candidates",
    "format_leaderboard",
    "preset_entry",
    "presets_target",
    "tune",
    "write_heatmap",
    "write_presets",
]

GEMM_TUNE_OPS = ("gemm_av", "gemm_at_b", "gemm_a_bt")
TUNABLE_OPS = GEMM_TUNE_OPS + tuple(KNOB_OPS)
PATHS = ("scalar", "simd")
SCHEMA = "xlstm-kernels/tune"
SCHEMA_VERSION = 1
EMULATOR_MAX_MNK = 256**3  # the emulator runs every GPU thread on the CPU: tiny shapes only
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 2e-2}
RESULT_TAG = "XK_TUNE_RESULT "

# The value grids per field. The full grid is every combination (then validated); the
# quick grid is a few sensible points for CI and the emulator.
FULL_GRID = {
    "scalar": {
        "tm": (8, 16, 32, 64, 128), "tn": (8, 16, 32, 64, 128), "tk": (8, 16, 32),
        "rm": (1, 2, 4, 8), "rn": (1, 2, 4, 8), "pad": (0, 1),
        "double_buffer": (False, True), "vec4": (False, True), "align_execw": (False, True),
    },
    "simd": {"bm": (16, 32, 64, 128), "bn": (16, 32, 64, 128), "bk": (16, 32), "wm": (1, 2, 4), "wn": (1, 2, 4)},
    "split_k": (1, 2, 4, 8),
    "gemv_threads": (32, 64, 128, 256, 512, 1024),
}
QUICK_GRID = {
    "scalar": {
        "tm": (16, 32, 64), "tn": (16, 32, 64), "tk": (16,), "rm": (4,), "rn": (4,), "pad": (1,),
        "double_buffer": (False,), "vec4": (True,), "align_execw": (False,),
    },
    "simd": {"bm": (32, 64), "bn": (32, 64), "bk": (16,), "wm": (2,), "wn": (2,)},
    "split_k": (1, 4),
    "gemv_threads": (64, 128, 256),
}


class TuneError(RuntimeError):
    """The tuner cannot go on (no kernel backend, nothing to write, an unreadable preset file)."""


# ---------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------


def candidate_grid(quick: bool) -> dict:
    return QUICK_GRID if quick else FULL_GRID


def _product(grid: dict[str, Sequence]) -> Iterable[dict[str, Any]]:
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        yield dict(zip(keys, values))


def enumerate_candidates(
    op: str, dtype: Any, shape: Sequence[int], *, quick: bool = False, paths: Sequence[str] = PATHS,
) -> tuple[list[GemmConfig], list[tuple[GemmConfig, str]]]:
    """(valid, rejected) candidate configs for `op` at `shape` = (M, N, K).

    M == 1 gives gemv candidates (the runtime's shape rule picks that kernel); otherwise
    the scalar and/or simd grids, SPLIT_K > 1 only where the split-K rule fires (capped
    at K // (2*BK), as the rule caps it). Every candidate is checked by
    ``GemmConfig.validate(dtype)``; rejected ones come back with the validator's message.
    """
    m, n, k = (int(d) for d in shape)
    dt = dtype_name(dtype)
    grid = candidate_grid(quick)
    seen: set = set()
    valid: list[GemmConfig] = []
    rejected: list[tuple[GemmConfig, str]] = []

    def consider(cfg: GemmConfig) -> None:
        key = tuple(sorted(cfg.to_dict().items()))
        if key in seen:
            return
        seen.add(key)
        try:
            cfg.validate(dt, source="candidate")
        except TileConfigError as e:
            rejected.append((cfg, str(e)))
            return
        valid.append(cfg)

    if m == 1:
        for t in grid["gemv_threads"]:
            consider(GemmConfig(path="gemv", gemv_threads=t))
        return valid, rejected
    if "scalar" in paths:
        for fields in _product(grid["scalar"]):
            consider(GemmConfig(path="scalar", **fields))
    if "simd" in paths:
        rule = tiles_mod.split_k_rule(m, n, k)
        for fields in _product(grid["simd"]):
            splits = [s for s in grid["split_k"] if s == 1 or s <= k // (2 * fields["bk"])] if rule else [1]
            for s in splits:
                consider(GemmConfig(path="simd", split_k=s, **fields))
    return valid, rejected


def _shuffle_key(cfg: GemmConfig, seed: int) -> tuple[str, int]:
    """A seeded pseudo-random order that is the same for every shape: a config's place
    depends only on its preset entry (split-K variants stay together), so --limit picks
    the same configs at every shape of a class and they can be compared across shapes."""
    entry = json.dumps(preset_entry(cfg), sort_keys=True)
    return hashlib.sha256(f"{seed}:{entry}".encode()).hexdigest(), cfg.split_k


def config_label(cfg: GemmConfig | dict) -> str:
    """A short human description, e.g. 'scalar 32x32x16 r4x4 pad1 db vec4' (knobs:
    'n_reads=4 simd_rows=8')."""
    c = cfg.to_dict() if isinstance(cfg, GemmConfig) else dict(cfg)
    if "path" not in c:  # a kernel-knob candidate
        from .tune_knobs import knob_label

        return knob_label(c)
    if c["path"] == "gemv":
        return f"gemv threads={c['gemv_threads']}"
    if c["path"] == "simd":
        s = f"simd {c['bm']}x{c['bn']}x{c['bk']} w{c['wm']}x{c['wn']}"
        return s + (f" splitk{c['split_k']}" if c.get("split_k", 1) != 1 else "")
    flags = [f"pad{c['pad']}" if c["pad"] else "", "db" if c["double_buffer"] else "", "vec4" if c["vec4"] else "",
             "execw" if c["align_execw"] else ""]
    return " ".join([f"scalar {c['tm']}x{c['tn']}x{c['tk']} r{c['rm']}x{c['rn']}", *[f for f in flags if f]])


def preset_entry(cfg: GemmConfig | dict) -> dict[str, Any]:
    """The preset-file fields that make the runtime pick `cfg`'s path and values (gemv:
    only gemv_threads, the M == 1 rule picks the kernel; split_k is added by the caller)."""
    c = cfg.to_dict() if isinstance(cfg, GemmConfig) else dict(cfg)
    if c["path"] == "gemv":
        return {"gemv_threads": c["gemv_threads"]}
    names = SCALAR_FIELDS if c["path"] == "scalar" else SIMD_FIELDS
    return {"path": c["path"], **{f: c[f] for f in names}}


def config_env(op: str, cfg: GemmConfig | dict) -> dict[str, str]:
    """The ``XLSTM_GEMM_*`` variables that make the runtime pick `cfg` for `op` (knob ops:
    the ``XLSTM_<OP>_<KNOB>`` variables of the knob dict `cfg`)."""
    if op in KNOB_OPS:
        from .tune_knobs import knob_config_env

        return knob_config_env(op, dict(cfg))
    if op not in env_mod.ENV_TILE:
        raise BenchArgumentError(f"op: {op!r} has no environment variables; expected one of {', '.join(TUNABLE_OPS)}")
    c = cfg.to_dict() if isinstance(cfg, GemmConfig) else dict(cfg)
    tile = env_mod.ENV_TILE[op]
    b = lambda v: "1" if v else "0"  # noqa: E731
    if c["path"] == "gemv":
        return {env_mod.ENV_GEMV_THREADS: str(c["gemv_threads"])}
    if c["path"] == "simd":
        return {env_mod.ENV_PATH: "simd", tile: f"{c['bm']}x{c['bn']}x{c['bk']}", env_mod.ENV_WARPS: f"{c['wm']}x{c['wn']}",
                env_mod.ENV_SPLIT_K: str(c["split_k"]), env_mod.ENV_STAGES: str(c.get("stages", 0))}
    return {env_mod.ENV_PATH: "scalar", tile: f"{c['tm']}x{c['tn']}x{c['tk']}", env_mod.ENV_MICRO: f"{c['rm']}x{c['rn']}",
            env_mod.ENV_PAD: str(c["pad"]), env_mod.ENV_DB: b(c["double_buffer"]), env_mod.ENV_VEC4: b(c["vec4"]),
            env_mod.ENV_ALIGN_EXECW: b(c["align_execw"])}


def _relevant(c: dict) -> dict:
    """The fields `c`'s path reads (what must match for two configs to launch the same kernel)."""
    if c["path"] == "gemv":
        return {"path": "gemv", "gemv_threads": c["gemv_threads"]}
    names = SCALAR_FIELDS if c["path"] == "scalar" else (*SIMD_FIELDS, "split_k")
    return {"path": c["path"], **{f: c[f] for f in names}}


# ---------------------------------------------------------------------------------------
# Running one candidate
# ---------------------------------------------------------------------------------------


def _operands(op: str, m: int, n: int, k: int, dt: str, seed: int):
    """(call(tiles) -> output, float64 reference, inputs) with the op's own operand layout."""
    import xlstm_kernels as xk

    from .suite import gemm_case

    _, _, _, ref, _, inputs = gemm_case(op, m, n, k, dtype_of(dt), np.random.default_rng(seed))
    fn = getattr(xk, op)
    a, b = inputs
    return (lambda tiles: fn(a, b, tiles=tiles)), ref, inputs


def _run_one(call, ref, tiles, dt: str, warmup: int, repeats: int, max_seconds: float | None) -> dict:
    """Time one config in this process; a dict with median_s, min_s, max_s, repeats, max_rel_err, ok, error."""
    from .suite import relative_error
    from .timing import measure

    try:
        t = measure(lambda: call(tiles), warmup=warmup, repeats=repeats, max_seconds=max_seconds)
        err = relative_error(t.output, ref)
        ok = err <= TOLERANCE[dt]
        return {"median_s": t.median_s, "min_s": t.min_s, "max_s": t.max_s, "repeats": len(t.times_s),
                "max_rel_err": err, "ok": ok,
                "error": "" if ok else f"error {err:.2e} above the {dt} bound {TOLERANCE[dt]:.0e}"}
    except Exception as e:  # noqa: BLE001  a failing candidate is a result, not a crash
        msg = str(e).splitlines()[0] if str(e) else ""
        return {"median_s": None, "min_s": None, "max_s": None, "repeats": 0, "max_rel_err": None, "ok": False,
                "error": f"{type(e).__name__}: {msg}"[:400]}


def _child_env(op: str, cfg: GemmConfig, backend: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLSTM_GEMM_")}
    env.update(config_env(op, cfg))
    env[runtime.ENV_VAR] = backend
    return env


#: A candidate's result when it could not be timed (an "error" is added).
FAILED_RESULT = {"median_s": None, "min_s": None, "max_s": None, "repeats": 0, "max_rel_err": None, "ok": False}


def run_child(entry: str, spec: dict, env: dict[str, str], timeout: float) -> dict:
    """Time one candidate in a fresh interpreter with environment `env`: runs ``entry``
    ("module:function", a child entry point that prints RESULT_TAG + its result as JSON) on
    ``json.dumps(spec)`` and returns that result, else FAILED_RESULT with the error (a
    timeout, or no result line: the exit status and the child's last line of stderr)."""
    module, func = entry.split(":")
    code = f"import sys; from {module} import {func}; sys.exit({func}(sys.argv[1]))"
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**FAILED_RESULT, "error": f"subprocess timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {**FAILED_RESULT, "error": f"subprocess exited with {proc.returncode}: {tail}"[:400]}


def error_result(e: Exception) -> dict:
    """FAILED_RESULT naming the exception (its type and first line)."""
    return {**FAILED_RESULT, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]}


def print_child_result(out: dict) -> int:
    """A child's last step: its result on one RESULT_TAG line (non-finite floats as null); 0."""
    out = {key: (v if not (isinstance(v, float) and not math.isfinite(v)) else None) for key, v in out.items()}
    print(RESULT_TAG + json.dumps(out), flush=True)
    return 0


def _run_subprocess(op: str, shape, dt: str, cfg: GemmConfig, backend: str, warmup: int, repeats: int,
                    seed: int, max_seconds: float | None, timeout: float) -> dict:
    """Time one config in a fresh interpreter configured only through XLSTM_GEMM_* variables."""
    spec = {"op": op, "shape": list(shape), "dtype": dt, "warmup": warmup, "repeats": repeats, "seed": seed,
            "max_seconds": max_seconds, "expect": _relevant(cfg.to_dict())}
    return run_child("xlstm_kernels.benchmarks.tuner:_child_main", spec, _child_env(op, cfg, backend), timeout)


def _child_main(spec_text: str) -> int:
    """Entry point of an --env subprocess: the config comes from the environment only."""
    spec = json.loads(spec_text)
    op, (m, n, k), dt = spec["op"], spec["shape"], spec["dtype"]
    try:
        got = _relevant(tiles_mod.explain(op, (m, n, k), dt)["config"])
    except Exception as e:  # noqa: BLE001
        return print_child_result(error_result(e))
    if got != spec["expect"]:
        diff = {f: got.get(f) for f in spec["expect"] if got.get(f) != spec["expect"][f]}
        return print_child_result({**FAILED_RESULT,
                                   "error": f"the XLSTM_GEMM_* variables resolved to a different config: {diff}"})
    call, ref, _ = _operands(op, m, n, k, dt, spec["seed"])
    return print_child_result(_run_one(call, ref, None, dt, spec["warmup"], spec["repeats"], spec["max_seconds"]))


# ---------------------------------------------------------------------------------------
# Progress bar (stderr)
# ---------------------------------------------------------------------------------------


class Progress:
    """A one-line bar on a terminal; on a pipe / CI log a line every ~10%."""

    def __init__(self, total: int, stream=None, enabled: bool = True, width: int = 28):
        self.total, self.width, self.enabled = max(1, total), width, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self._last_step = -1
        self.t0 = time.perf_counter()

    def update(self, text: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        filled = int(round(frac * self.width))
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s {text}"
        if self.tty:
            self.stream.write("\r" + line[:160].ljust(160))
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            step = int(frac * 10)
            if step != self._last_step or self.done >= self.total:
                self._last_step = step
                self.stream.write(line + "\n")
        self.stream.flush()


# ---------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------


@dataclass
class CandidateResult:
    shape: tuple[int, ...]  # GEMM (M, N, K); knob ops: the op's notation
    config: dict  # every GemmConfig field; knob ops: {knob: value} of the swept knobs
    current: bool  # the config the runtime picks now
    median_s: float | None
    min_s: float | None
    max_rel_err: float | None
    ok: bool
    error: str = ""
    repeats: int = 0

    @property
    def label(self) -> str:
        return config_label(self.config)

    def to_dict(self, op: str) -> dict:
        if op in KNOB_OPS:
            from ..tiles.knobs import knob_shape_class, shape_size

            cls, config = knob_shape_class(op, shape_size(op, self.shape)), dict(self.config)
        else:
            cls, config = tiles_mod.shape_class(*self.shape), _relevant(self.config)
        return {"shape": shape_text(self.shape), "dims": list(self.shape), "shape_class": cls,
                "label": self.label, "current": self.current, "median_ms": _ms(self.median_s), "min_ms": _ms(self.min_s),
                "max_rel_err": _finite(self.max_rel_err), "ok": self.ok, "error": self.error, "repeats": self.repeats,
                "config": config, "env": config_env(op, self.config)}


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def _finite(v: float | None) -> float | None:
    return v if v is None or math.isfinite(v) else None


@dataclass
class TuneResult:
    op: str
    dtype: str
    backend: str
    device: dict  # name, architecture, family
    shapes: list[tuple[int, ...]]
    mode: str  # "in-process" | "env"
    quick: bool
    limit: int | None
    counts: dict  # shape text -> {"enumerated", "valid", "rejected", "run"}
    results: list[CandidateResult]
    winners: dict = field(default_factory=dict)  # class -> {"entry", "label", "shapes", "ms", "speedup_vs_current"}
    seconds: float = 0.0
    created: str = ""
    files: dict = field(default_factory=dict)
    presets_path: str | None = None  # set by write_presets
    rejected_examples: list[str] = field(default_factory=list)

    @property
    def emulated(self) -> bool:
        return self.backend == "emulate"

    @property
    def knob_op(self) -> bool:
        """A kernel-knob op (not a GEMM layout)."""
        return self.op in KNOB_OPS

    def shape_class_of(self, shape) -> str:
        if self.knob_op:
            from ..tiles.knobs import knob_shape_class, shape_size

            return knob_shape_class(self.op, shape_size(self.op, shape))
        return tiles_mod.shape_class(*shape)

    def for_shape(self, shape) -> list[CandidateResult]:
        """This shape's results, fastest correct first, then the failures."""
        rs = [r for r in self.results if r.shape == tuple(shape)]
        return sorted(rs, key=lambda r: (not r.ok, r.median_s if r.median_s is not None else math.inf))

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "created": self.created, "op": self.op,
            "dtype": self.dtype, "backend": self.backend, "emulated": self.emulated, "device": self.device,
            "mode": self.mode, "quick": self.quick, "limit": self.limit,
            "shapes": [shape_text(s) for s in self.shapes], "counts": self.counts,
            "seconds": round(self.seconds, 3), "winners": self.winners, "presets_path": self.presets_path,
            "files": self.files, "rejected_examples": self.rejected_examples,
            "results": [r.to_dict(self.op) for r in self.results],
        }


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _key(entry: dict) -> tuple:
    return tuple(sorted(entry.items()))


def _class_winners(result: TuneResult) -> dict:
    """Per shape class: the entry with the best geometric-mean time over the class's shapes
    (among entries correct on every one of them); gemv (M == 1) shapes give gemv_threads."""
    winners: dict[str, dict] = {}
    by_class: dict[str, list[tuple[int, int, int]]] = {}
    for s in result.shapes:
        by_class.setdefault(tiles_mod.shape_class(*s), []).append(s)
    for cls, shapes in by_class.items():
        entry: dict[str, Any] = {}
        info: dict[str, Any] = {"shapes": [shape_text(s) for s in shapes], "labels": [], "ms": {}, "speedup_vs_current": {}}
        for group in ([s for s in shapes if s[0] > 1], [s for s in shapes if s[0] == 1]):
            if not group:
                continue
            best: dict[tuple, dict] = {}  # entry key -> shape -> (median_s, split_k, result)
            entries: dict[tuple, dict] = {}  # entry key -> the entry (field order kept)
            current: dict[tuple, float] = {}
            for s in group:
                for r in result.results:
                    if r.shape != s or not r.ok or r.median_s is None:
                        continue
                    if r.current:
                        current[s] = r.median_s
                    e = preset_entry(r.config)
                    k = _key(e)
                    entries.setdefault(k, e)
                    prev = best.setdefault(k, {}).get(s)
                    if prev is None or r.median_s < prev[0]:
                        best[k][s] = (r.median_s, r.config.get("split_k", 1), r)
            complete = {k: v for k, v in best.items() if all(s in v for s in group)}
            if not complete:
                continue
            win_key = min(complete, key=lambda k: (_geomean([complete[k][s][0] for s in group]), k))
            per_shape = complete[win_key]
            e = dict(entries[win_key])
            if e.get("path") == "simd":
                splits = [per_shape[s][1] for s in group if tiles_mod.split_k_rule(*s)]
                if splits:
                    e["split_k"] = max(set(splits), key=splits.count)
            entry.update(e)
            info["labels"].append(config_label(per_shape[group[0]][2].config))
            for s in group:
                info["ms"][shape_text(s)] = per_shape[s][0] * 1e3
                if s in current:
                    info["speedup_vs_current"][shape_text(s)] = current[s] / per_shape[s][0]
        if entry:
            info["entry"] = entry
            info["label"] = " + ".join(info.pop("labels"))
            winners[cls] = info
    return winners


# ---------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------


def parse_tune_op(value: Any, name: str = "--op") -> str:
    text = str(value).strip().lower() if value is not None else ""
    if text not in TUNABLE_OPS:
        raise BenchArgumentError(f"{name}: {value!r} is not a tunable op; expected one of {', '.join(TUNABLE_OPS)}")
    return text


def tune(
    op: str,
    dtype: Any = "float16",
    shapes: Any = None,
    *,
    env: bool = False,
    quick: bool = False,
    limit: int | None = None,
    paths: Any = None,
    backend: str | None = None,
    warmup: int | None = None,
    repeats: int | None = None,
    seed: int = 0,
    max_seconds: float | None = None,
    timeout: float = 600.0,
    progress: bool = True,
    stream=None,
    on_result: Callable[[CandidateResult], None] | None = None,
) -> TuneResult:
    """Sweep `op`'s valid configs (or knob values) at `shapes` and find the fastest correct ones.

    Args:
        op: gemm_av | gemm_at_b | gemm_a_bt, or a knob op: rms_norm | layer_norm |
            attention | mlstm | slstm (see :mod:`xlstm_kernels.benchmarks.tune_knobs`).
        dtype: float32 | float16 | bfloat16.
        shapes: GEMM: "MxNxK" (output M x N, reduction K), comma string or list (default:
            one shape per class on Metal, 64x64x64 on the emulator). Knob ops: their own
            notation: norms "ROWSxN", attention "BxHxLqxLkxD", mlstm "BxHxSxD", slstm
            "BxHxSxDH" (defaults: tiny on the emulator, about one per class on a GPU).
        env: run each candidate in a subprocess configured by XLSTM_GEMM_* variables
            (knob ops: XLSTM_<OP>_<KNOB>).
        quick: the small grid (implied on the emulator).
        limit: run at most this many candidates per shape (the current config first, then a
            seeded pseudo-random order that is the same at every shape).
        paths: restrict to "scalar" and/or "simd" (M == 1 shapes always sweep gemv threads);
            GEMM ops only.
        backend: metal | emulate (default: the active backend if it runs kernels, else
            metal where available, else emulate). The reference backend runs no kernels.
        warmup, repeats: per candidate (default: 1 and 5 on the emulator, 2 and 10 on Metal);
            max_seconds caps the timed runs of one candidate (default 2 s on Metal).
        progress, stream: the progress bar (stderr by default).

    Raises:
        BenchArgumentError: a malformed argument; TuneError: the tuner cannot run here.
    """
    t_start = time.perf_counter()
    op = parse_tune_op(op, "op")
    dt = parse_dtypes(dtype, "dtype")
    if len(dt) != 1:
        raise BenchArgumentError(f"dtype: tune takes one dtype, got {dtype!r}")
    dt = dt[0]
    limit = parse_positive_int(limit, "limit") if limit is not None else None
    backend = backend or _default_backend()
    if backend == "reference":
        raise TuneError("tune needs a kernel backend (metal or emulate); the reference backend runs plain MLX ops")
    if backend not in runtime.BACKENDS:
        raise BenchArgumentError(f"backend: unknown backend {backend!r}; expected metal or emulate")
    ok, why = runtime.available(backend)
    if not ok:
        raise TuneError(f"backend '{backend}' is not available: {why}")
    emulated = backend == "emulate"
    knob_op = op in KNOB_OPS
    if knob_op:
        from . import tune_knobs as tk

        if paths is not None:
            raise BenchArgumentError(f"paths: applies to the GEMM ops only ({', '.join(GEMM_TUNE_OPS)}); "
                                     f"{op} sweeps its knobs {', '.join(KNOB_OPS[op])}")
        if shapes is None:
            shape_list = list((tk.EMULATOR_SHAPES if emulated else tk.DEFAULT_SHAPES)[op])
        else:
            shape_list = tk.parse_knob_shapes(op, shapes, "shapes")
        if emulated:
            tk.check_emulator_shapes(op, shape_list, "shapes")
            quick = True
    else:
        path_sel = parse_names(paths, "paths", PATHS, what="path") if paths is not None else list(PATHS)
        if shapes is None:
            shape_list = [(64, 64, 64)] if emulated else [(64, 128, 128), (512, 512, 512), (2048, 2048, 2048)]
        else:
            shape_list = parse_shapes(shapes, "shapes")
        if emulated:
            big = [s for s in shape_list if s[0] * s[1] * s[2] > EMULATOR_MAX_MNK]
            if big:
                raise BenchArgumentError(
                    f"shapes: {shape_text(big[0])} is too large for the emulator (M*N*K must be <= 256**3 = "
                    f"{EMULATOR_MAX_MNK}; every GPU thread runs on the CPU); use tiny shapes such as 64x64x64"
                )
            quick = True
    if warmup is None:
        warmup = 1 if emulated else 2
    if repeats is None:
        repeats = 5 if emulated else 10
    repeats = parse_positive_int(repeats, "repeats")
    if max_seconds is None:
        max_seconds = None if emulated else 2.0

    device = tiles_mod.detect_device()
    plan: list[tuple[tuple[int, ...], Any, bool]] = []
    counts: dict[str, dict] = {}
    rejected_examples: list[str] = []
    valid_by_shape: dict = {}
    for s in shape_list:
        if knob_op:
            with runtime.use_backend(backend):
                current = tk.current_knobs(op, dt, s)
            chosen, counts[shape_text(s)], examples, valid_by_shape[s] = tk.plan_shape(
                op, dt, s, current, quick=quick, seed=seed, limit=limit)
            rejected_examples += examples[: max(0, 4 - len(rejected_examples))]
            plan += [(s, c, cur) for c, cur in chosen]
            continue
        valid, rejected = enumerate_candidates(op, dt, s, quick=quick, paths=path_sel)
        for _, msg in rejected[:2]:
            if len(rejected_examples) < 4:
                rejected_examples.append(msg)
        with runtime.use_backend(backend):
            current = tiles_mod.resolve_gemm_config(op, *s, dt).config
        rest = [c for c in valid if _relevant(c.to_dict()) != _relevant(current.to_dict())]
        rest.sort(key=lambda c: _shuffle_key(c, seed))
        chosen = [(current, True)] + [(c, False) for c in rest]
        if limit is not None:
            chosen = chosen[:limit]
        counts[shape_text(s)] = {"enumerated": len(valid) + len(rejected), "valid": len(valid),
                                 "rejected": len(rejected), "run": len(chosen)}
        plan += [(s, c, cur) for c, cur in chosen]

    result = TuneResult(op=op, dtype=dt, backend=backend,
                        device={"name": device.name, "architecture": device.architecture, "family": device.family_key},
                        shapes=shape_list, mode="env" if env else "in-process", quick=bool(quick), limit=limit,
                        counts=counts, results=[], created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        rejected_examples=rejected_examples)
    bar = Progress(len(plan), stream=stream, enabled=progress)
    operands: dict = {}
    best: dict = {}
    for s, cfg, cur in plan:
        if env and knob_op:
            out = tk.run_subprocess(op, s, dt, cfg, backend, warmup, repeats, seed, max_seconds, timeout)
        elif env:
            out = _run_subprocess(op, s, dt, cfg, backend, warmup, repeats, seed, max_seconds, timeout)
        else:
            if s not in operands:
                operands.clear()  # one shape's inputs at a time
                with runtime.use_backend(backend):
                    operands[s] = tk.operands(op, s, dt, seed) if knob_op else _operands(op, *s, dt, seed)[:2]
            call, ref = operands[s]
            with runtime.use_backend(backend):
                out = _run_one(call, ref, cfg, dt, warmup, repeats, max_seconds)
        config = dict(cfg) if knob_op else cfg.to_dict()
        r = CandidateResult(shape=s, config=config, current=cur, median_s=out["median_s"], min_s=out["min_s"],
                            max_rel_err=out["max_rel_err"], ok=bool(out["ok"]), error=out.get("error", ""),
                            repeats=out.get("repeats", 0))
        result.results.append(r)
        if r.ok and (s not in best or r.median_s < best[s]):
            best[s] = r.median_s
        if on_result:
            on_result(r)
        shown = f"best {best[s] * 1e3:.3f} ms" if s in best else "no correct config yet"
        bar.update(f"{shape_text(s)} {r.label} -> {'%.3f ms' % (r.median_s * 1e3) if r.ok else 'FAIL'}; {shown}")
    result.winners = tk.class_winners(result, valid_by_shape) if knob_op else _class_winners(result)
    result.seconds = time.perf_counter() - t_start
    return result


def _default_backend() -> str:
    cur = runtime.current_backend()
    if cur != "reference":
        return cur
    return "metal" if runtime.available("metal")[0] else "emulate"


# ---------------------------------------------------------------------------------------
# Leaderboard, heatmap, JSON
# ---------------------------------------------------------------------------------------


def format_leaderboard(result: TuneResult, top: int = 10) -> str:
    """Per shape: the `top` fastest correct configs (and the current one), then the class winners."""
    lines = []
    timing = ("emulated time (CPU emulator: ranks configs for the emulator, not for a GPU)" if result.emulated
              else "median wall time")
    lines.append(f"tune {result.op} {result.dtype} on {result.device['name']} (family {result.device['family']}), "
                 f"backend {result.backend}, {result.mode}; times: {timing}")
    for s in result.shapes:
        rs = result.for_shape(s)
        c = result.counts[shape_text(s)]
        good = [r for r in rs if r.ok]
        cur = next((r for r in rs if r.current), None)
        lines.append("")
        if result.knob_op:
            checks = "rejected by the runtime's knob checks"
            same = f", {c.get('same_launch', 0)} launching the same kernel as another"
        else:
            checks, same = "rejected by GemmConfig.validate", ""
        lines.append(f"shape {shape_text(s)} (class {result.shape_class_of(s)}): {c['enumerated']} enumerated, "
                     f"{c['valid']} valid, {c['rejected']} {checks}{same}, {c['run']} run, {len(good)} correct")
        lines.append(f"  {'rank':>4} {'ms':>10} {'vs current':>10} {'rel.err':>9}  config")
        shown = good[:top]
        if cur is not None and cur not in shown:
            shown.append(cur)
        for r in shown:
            rank = str(good.index(r) + 1) if r in good else "-"
            ms = f"{r.median_s * 1e3:.3f}" if r.median_s is not None else "-"
            vs = (f"{cur.median_s / r.median_s:.2f}x" if cur is not None and cur.ok and r.median_s else "-")
            err = f"{r.max_rel_err:.1e}" if r.max_rel_err is not None and math.isfinite(r.max_rel_err) else "-"
            tag = "  (current)" if r.current else ""
            fail = "" if r.ok else f"  FAIL: {r.error}"
            lines.append(f"  {rank:>4} {ms:>10} {vs:>10} {err:>9}  {r.label}{tag}{fail}")
        failed = [r for r in rs if not r.ok and r not in shown]
        if failed:
            lines.append(f"  ({len(failed)} more failed, e.g. {failed[0].label}: {failed[0].error})")
    lines.append("")
    if result.winners:
        for cls, w in result.winners.items():
            sp = ", ".join(f"{k} {v:.2f}x" for k, v in w["speedup_vs_current"].items()) or "-"
            lines.append(f"winner {cls}: {w['label']}  (shapes {', '.join(w['shapes'])}; vs current: {sp})")
            lines.append(f"  preset entry: {json.dumps(w['entry'])}")
    else:
        lines.append("no winner: no candidate was correct on every shape of a class")
    return "\n".join(lines)


def write_heatmap(result: TuneResult, path: str) -> str:
    """Best time per (TM, TN) (scalar) and (BM, BN) (simd) for each shape; gemv shapes: time
    per thread count. One PNG, Agg canvas. Knob ops: a bar chart of every candidate's time."""
    if result.knob_op:
        from .tune_knobs import write_bars

        return write_bars(result, path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = []
    for s in result.shapes:
        rs = [r for r in result.results if r.shape == s and r.ok and r.median_s is not None]
        if s[0] == 1:
            panels.append((s, "gemv", rs))
            continue
        for p in PATHS:
            prs = [r for r in rs if r.config["path"] == p]
            if prs:
                panels.append((s, p, prs))
        if not rs:
            panels.append((s, None, []))
    ncol = min(2, max(1, len(panels)))
    nrow = max(1, -(-len(panels) // ncol))
    fig = Figure(figsize=(5.2 * ncol, 4.2 * nrow), dpi=100)
    FigureCanvasAgg(fig)
    unit = "emulated ms" if result.emulated else "ms"
    for i, (s, p, rs) in enumerate(panels or [((0, 0, 0), None, [])]):
        ax = fig.add_subplot(nrow, ncol, i + 1)
        title = f"{result.op} {result.dtype} {shape_text(s)}"
        if not rs:
            ax.text(0.5, 0.5, "no correct candidate", ha="center", va="center")
            ax.set_axis_off()
            ax.set_title(title, fontsize=9)
            continue
        if p == "gemv":
            xs = sorted({r.config["gemv_threads"] for r in rs})
            ys = [min(r.median_s for r in rs if r.config["gemv_threads"] == x) * 1e3 for x in xs]
            ax.bar([str(x) for x in xs], ys, color="#4c72b0")
            ax.set_xlabel("gemv threads per threadgroup")
            ax.set_ylabel(f"best {unit}")
            ax.set_title(title + " (gemv)", fontsize=9)
            continue
        fm, fn = ("tm", "tn") if p == "scalar" else ("bm", "bn")
        ms_ = sorted({r.config[fm] for r in rs})
        ns_ = sorted({r.config[fn] for r in rs})
        grid = np.full((len(ms_), len(ns_)), np.nan)
        for r in rs:
            i_, j_ = ms_.index(r.config[fm]), ns_.index(r.config[fn])
            v = r.median_s * 1e3
            if np.isnan(grid[i_, j_]) or v < grid[i_, j_]:
                grid[i_, j_] = v
        im = ax.imshow(grid, cmap="viridis_r", aspect="auto", origin="lower")
        ax.set_xticks(range(len(ns_)))
        ax.set_xticklabels([str(v) for v in ns_])
        ax.set_yticks(range(len(ms_)))
        ax.set_yticklabels([str(v) for v in ms_])
        ax.set_xlabel(fn.upper())
        ax.set_ylabel(fm.upper())
        lo, hi = np.nanmin(grid), np.nanmax(grid)
        for (i_, j_), v in np.ndenumerate(grid):
            if not np.isnan(v):
                dark = hi > lo and (v - lo) / (hi - lo) > 0.5  # viridis_r: slow cells are dark
                ax.text(j_, i_, f"{v:.3g}", ha="center", va="center", fontsize=7, color="white" if dark else "black")
        fig.colorbar(im, ax=ax, label=f"best {unit}")
        ax.set_title(f"{title} ({p}: best over the other fields)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def save_tune(result: TuneResult, out_dir: str) -> dict:
    """tune-<op>-<dtype>-<backend>.json (every candidate) and .png (heatmap; knob ops: bar
    chart) in `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"tune-{result.op}-{result.dtype}-{result.backend}")
    files = {"json": stem + ".json", "png": stem + ".png"}
    write_heatmap(result, files["png"])
    result.files = dict(files)
    with open(files["json"], "w", encoding="utf-8") as fh:
        json.dump(result.to_dict(), fh, indent=2, allow_nan=False)
        fh.write("\n")
    return files


# ---------------------------------------------------------------------------------------
# Writing the preset file
# ---------------------------------------------------------------------------------------


def presets_target() -> str:
    """The user preset file the runtime loads: $XLSTM_KERNELS_PRESETS, else the default user path."""
    env_file = os.environ.get(env_mod.ENV_PRESETS, "").strip()
    if env_file:
        return os.path.abspath(os.path.expanduser(env_file))
    return presets_mod.user_presets_path()


def write_presets(result: TuneResult, path: str | None = None, *, family: str | None = None) -> str:
    """Merge `result`'s class winners into the user preset YAML and return its path.

    Writes ``families.<family>.shapes.<class>.<op>.<dtype>`` (knob ops:
    ``families.<family>.kernel_shapes.<class>.<op>.<dtype>``; family: the detected one at
    tune time), keeping everything else in the file. The new text is checked by the
    runtime's strict loader before it replaces the file (atomically); the previous file
    is kept as ``<path>.bak``. YAML comments of an existing file are not preserved.
    """
    import yaml

    if not result.winners:
        raise TuneError("nothing to write: no candidate was correct on every shape of a class")
    path = os.path.abspath(os.path.expanduser(path)) if path else presets_target()
    family = family or result.device["family"]
    doc: dict = {}
    old_text = None
    if os.path.exists(path):
        presets_mod.load_preset_file(path)  # an invalid file is reported, never overwritten
        with open(path, encoding="utf-8") as fh:
            old_text = fh.read()
        doc = yaml.safe_load(old_text) or {}
    doc.setdefault("version", 1)
    fams = doc.get("families")
    if not isinstance(fams, dict):
        fams = doc["families"] = {}
    fam = fams.get(family)
    if not isinstance(fam, dict):
        fam = fams[family] = {}
    section = "kernel_shapes" if result.op in KNOB_OPS else "shapes"
    shapes = fam.get(section)
    if not isinstance(shapes, dict):
        shapes = fam[section] = {}
    for cls, w in result.winners.items():
        per_op = shapes.get(cls)
        if not isinstance(per_op, dict):
            per_op = shapes[cls] = {}
        per_dtype = per_op.get(result.op)
        if not isinstance(per_dtype, dict):
            per_dtype = per_op[result.op] = {}
        entry = per_dtype.get(result.dtype)
        entry = dict(entry) if isinstance(entry, dict) else {}
        entry.update(w["entry"])
        per_dtype[result.dtype] = entry
    header = (f"# xlstm-kernels user presets (schema: the shipped tuning/presets.yaml).\n"
              f"# Last written by `xlstm-kernels tune` on {result.created} ({result.op} {result.dtype}, "
              f"backend {result.backend}, family {family}).\n")
    text = header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".presets-", suffix=".yaml", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        presets_mod.load_preset_file(tmp, display=path)  # the runtime's own strict check
        if old_text is not None:
            with open(path + ".bak", "w", encoding="utf-8") as fh:
                fh.write(old_text)
        os.replace(tmp, path)
        presets_mod.reload_presets()
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    result.presets_path = path
    return path


def ensure_presets_file(path: str) -> bool:
    """Create an empty valid preset file at `path` if it does not exist (so that
    XLSTM_KERNELS_PRESETS naming a new file can be tuned into); True if created."""
    if os.path.exists(path):
        return False
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("# xlstm-kernels user presets (created by `xlstm-kernels tune --write`)\nversion: 1\nfamilies: {}\n")
    presets_mod.reload_presets()
    return True
