"""``xlstm-kernels tune`` for the kernel knobs: rms_norm, layer_norm, attention, mlstm, slstm, fused.

The knobs are those of :mod:`xlstm_kernels.tiles.knobs`. Per op and dtype, for a few shapes
in the op's notation (``KNOB_SHAPE_FORMS``)::

    rms_norm, layer_norm   ROWSxN          n_reads x simd_rows x looped_threads
    attention              BxHxLqxLkxD     Lq > 8: block_q x block_k (attention_prefill, causal);
                                           Lq <= 8: split_kv_block_size (attention_decode_split_kv)
    mlstm                  BxHxSxD         chunk_size
    slstm                  BxHxSxDH        threads_per_unit x r_in_registers
    fused                  MxNxK           single_kernel (fused_norm_linear: the fused kernel
                                           or the unfused sequence rms_norm + linear; the knob
                                           also decides fused_norm_qkv_rope, whose GEMM has
                                           the same plan: not timed here, see bench --ops fused)

1. candidates: the product of each swept knob's grid (:attr:`Knob.quick` / :attr:`Knob.grid`),
   checked with the runtime's own checks (:meth:`Knob.problem` and the op's shape fit,
   :func:`~xlstm_kernels.tiles.knobs.shape_fits`); candidates that launch exactly the same
   kernel at a shape (e.g. simd_rows where no row runs one simdgroup per row) run once;
   the knobs the runtime picks now come first ("current");
2. each is timed like a GEMM candidate (warm-up, median of repeats, ``mx.eval``), in process
   through the op's arguments (``knobs=``, ``block_q=``/``block_k=``, ``block_size=``,
   ``chunk_size=``, ``config=``) or, with ``env=True``, in a subprocess configured by the
   ``XLSTM_<OP>_<KNOB>`` variables only (the child checks that it resolved the intended
   knobs); every output is compared with the op's reference function
   (``rms_norm_reference``, ``layer_norm_reference``, ``attention_reference``,
   ``mlstm_chunkwise_mx`` in float64 on the CPU, ``slstm_reference``, RMSNorm + product
   in float64 NumPy for fused);
3. class winners (the op's shape classes): best geometric-mean time over the class's
   shapes; the written entry keeps only the knobs that change the launch at those shapes;
4. ``write_presets`` merges them into ``families.<family>.kernel_shapes.<class>.<op>.<dtype>``.

``split_kv_min_keys`` (the split-KV/prefill switch) is a policy threshold, not swept.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from .. import runtime
from ..tiles import knobs as knobs_mod
from .args import BenchArgumentError, dtype_of, parse_shapes, shape_text

__all__ = [
    "DEFAULT_SHAPES",
    "EMULATOR_SHAPES",
    "EMULATOR_MAX_WORK",
    "KNOB_TUNE_OPS",
    "class_winners",
    "current_knobs",
    "effective_knobs",
    "enumerate_knob_candidates",
    "knob_config_env",
    "knob_label",
    "launch_key",
    "parse_knob_shapes",
    "swept_knobs",
    "write_bars",
]

KNOB_TUNE_OPS = tuple(knobs_mod.KNOB_OPS)
EPS = 1e-5

#: Default shapes on the emulator (tiny: every GPU thread runs on the CPU) ...
EMULATOR_SHAPES = {
    "rms_norm": [(64, 200)],
    "layer_norm": [(64, 200)],
    "attention": [(1, 2, 40, 48, 32), (1, 2, 1, 300, 32)],
    "mlstm": [(1, 2, 70, 16)],
    "slstm": [(1, 2, 12, 16)],
    "fused": [(33, 31, 29)],
}
#: ... and on a GPU: about one per shape class.
DEFAULT_SHAPES = {
    "rms_norm": [(16384, 128), (4096, 4096), (1024, 16384)],
    "layer_norm": [(16384, 128), (4096, 4096), (1024, 16384)],
    "attention": [(1, 32, 512, 512, 64), (1, 32, 1, 512, 128), (1, 32, 1024, 2048, 128), (1, 32, 1, 4096, 128),
                  (1, 32, 8, 16384, 128)],
    "mlstm": [(4, 8, 128, 64), (1, 8, 1024, 128), (1, 8, 4096, 128)],
    "slstm": [(8, 4, 256, 32), (8, 4, 256, 64), (8, 4, 256, 128), (4, 4, 128, 256)],
    "fused": [(1, 4096, 4096), (8, 4096, 4096), (512, 4096, 4096), (4096, 4096, 4096)],
}
#: Largest emulated work per shape (elements x inner length), to keep runs to seconds.
EMULATOR_MAX_WORK = 1 << 22


def _work(op: str, shape: tuple[int, ...]) -> int:
    if op in ("rms_norm", "layer_norm"):
        return shape[0] * shape[1]
    if op == "attention":
        b, h, lq, lk, d = shape
        return b * h * lq * lk * d
    if op == "mlstm":
        b, h, s, d = shape
        return b * h * s * d * d
    if op == "fused":
        m, n, k = shape
        return m * n * k
    b, h, s, dh = shape
    return b * h * s * dh * dh


def parse_knob_shapes(op: str, value: Any, name: str = "shapes") -> list[tuple[int, ...]]:
    """Shapes in `op`'s notation ("64x200" for norms, "1x2x40x48x32" for attention, ...)."""
    form, _, words = knobs_mod.KNOB_SHAPE_FORMS[op]
    dims = form.count("x") + 1
    return parse_shapes(value, name, dims=dims, form=f"{form} ({words})")


def check_emulator_shapes(op: str, shapes: Sequence[tuple[int, ...]], name: str = "shapes") -> None:
    for s in shapes:
        if _work(op, s) > EMULATOR_MAX_WORK:
            tiny = shape_text(EMULATOR_SHAPES[op][0])
            raise BenchArgumentError(
                f"{name}: {shape_text(s)} is too large for the emulator (work {_work(op, s)} > {EMULATOR_MAX_WORK}; "
                f"every GPU thread runs on the CPU); use tiny shapes such as {tiny}")


def swept_knobs(op: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    """The knobs the tuner sweeps at `shape`."""
    if op == "attention":
        return ("block_q", "block_k") if shape[2] > 8 else ("split_kv_block_size",)
    return tuple(k for k in knobs_mod.KNOB_OPS[op] if k != "split_kv_min_keys")


def _kind(op: str, shape: tuple[int, ...]) -> str:
    """Groups whose winners are found separately (attention: prefill and decode shapes)."""
    if op == "attention":
        return "prefill" if shape[2] > 8 else "decode"
    return "all"


# ---------------------------------------------------------------------------------------
# What the runtime does with a candidate
# ---------------------------------------------------------------------------------------


def current_knobs(op: str, dtype: Any, shape: tuple[int, ...]) -> dict[str, Any]:
    """The swept knobs' values the runtime picks now for `shape` (env, presets, defaults,
    heuristics), read through the ops' own helpers."""
    vals = effective_knobs(op, dtype, shape)
    return {k: vals[k] for k in swept_knobs(op, shape)}


def effective_knobs(op: str, dtype: Any, shape: tuple[int, ...]) -> dict[str, Any]:
    """Every knob's value a call of `op` at `shape` (the op's notation) uses now, defaults
    and heuristics filled in, through the ops' own helpers."""
    from ..ops import attention as att
    from ..ops import fused as fu
    from ..ops import mlstm as ml
    from ..ops import norm as nm
    from ..ops import slstm as sl

    if op in ("rms_norm", "layer_norm"):
        vals = nm.knob_values(op, shape[1], dtype)
    elif op == "fused":
        vals = fu.knob_values(shape[0], dtype)
    elif op == "attention":
        b, h, lq, lk, d = shape
        vals = att.knob_values(lq, lk, d, d, dtype)
    elif op == "mlstm":
        vals = ml.knob_values(shape[2], dtype)
    else:
        cfg = sl.plan(shape[3], dtype)
        vals = {"threads_per_unit": cfg.threads_per_unit, "r_in_registers": cfg.r_in_registers}
    return vals


def launch_key(op: str, shape: tuple[int, ...], cand: dict[str, Any]) -> tuple:
    """What the kernel launch depends on: candidates with equal keys launch the same kernel."""
    if op in ("rms_norm", "layer_norm"):
        from ..ops.norm import _layout

        lay = _layout(shape[1], shape[0], cand["n_reads"], cand["simd_rows"], cand["looped_threads"])
        return (cand["n_reads"], lay.looped, lay.one_simd, lay.tpr, lay.rows_per_tg)
    if op == "attention":
        return tuple(cand[k] for k in swept_knobs(op, shape))
    if op == "mlstm":
        return (min(cand["chunk_size"], shape[2]),)
    if op == "fused":
        return (cand["single_kernel"],)
    return (cand["threads_per_unit"], cand["r_in_registers"])


def _grid(op: str, knob: str, quick: bool) -> tuple:
    k = knobs_mod.KNOBS[op][knob]
    return k.quick if quick else k.grid


def enumerate_knob_candidates(op: str, dtype: Any, shape: tuple[int, ...], *, quick: bool = False
                              ) -> tuple[list[dict], list[tuple[dict, str]]]:
    """(valid, rejected) candidate knob dicts at `shape`: the product of the swept knobs'
    grids, checked with the runtime's checks (value range and the op's shape fit)."""
    names = swept_knobs(op, shape)
    spec = knobs_mod.KNOBS[op]
    fits = knobs_mod.shape_fits(op, dtype, shape)
    valid, rejected = [], []
    for values in itertools.product(*(_grid(op, n, quick) for n in names)):
        cand = dict(zip(names, values))
        msg = _problem(spec, cand, fits)
        if msg:
            rejected.append((cand, msg))
        else:
            valid.append(cand)
    return valid, rejected


def _problem(spec, cand: dict, fits) -> str | None:
    for name, value in cand.items():
        msg = spec[name].problem(value)
        if msg is None and fits is not None:
            msg = fits(name, value)
        if msg:
            return f"{name}={value!r}: {msg}"
    return None


def _order_key(cand: dict, seed: int) -> str:
    """A seeded order that is the same at every shape (as the GEMM tuner's)."""
    return hashlib.sha256(f"{seed}:{json.dumps(cand, sort_keys=True)}".encode()).hexdigest()


def plan_shape(op: str, dtype: Any, shape: tuple[int, ...], current: dict, *, quick: bool, seed: int,
               limit: int | None) -> tuple[list[tuple[dict, bool]], dict, list[str], dict]:
    """(chosen [(candidate, is_current)], counts, rejected examples, launch key -> candidate
    list) for one shape: current first, then one candidate per new launch in seeded order."""
    valid, rejected = enumerate_knob_candidates(op, dtype, shape, quick=quick)
    rest = sorted(valid, key=lambda c: _order_key(c, seed))
    chosen: list[tuple[dict, bool]] = [(dict(current), True)]
    seen = {launch_key(op, shape, current)}
    same = 0
    for c in rest:
        key = launch_key(op, shape, c)
        if key in seen:
            same += 1
            continue
        seen.add(key)
        chosen.append((c, False))
    if limit is not None:
        chosen = chosen[:limit]
    counts = {"enumerated": len(valid) + len(rejected), "valid": len(valid), "rejected": len(rejected),
              "same_launch": same, "run": len(chosen)}
    return chosen, counts, [m for _, m in rejected[:2]], valid


def knob_label(cfg: dict) -> str:
    """e.g. 'n_reads=4 simd_rows=8 looped_threads=1024'."""
    return " ".join(f"{k}={'true' if v is True else 'false' if v is False else v}" for k, v in cfg.items())


def knob_config_env(op: str, cfg: dict) -> dict[str, str]:
    """The XLSTM_<OP>_<KNOB> variables that make the runtime pick `cfg`."""
    out = {}
    for k, v in cfg.items():
        out[knobs_mod.knob_env_var(op, k)] = ("1" if v else "0") if isinstance(v, bool) else str(v)
    return out


# ---------------------------------------------------------------------------------------
# Operands, the call and its reference
# ---------------------------------------------------------------------------------------


def _normal(rng, shape, dtype, scale: float = 1.0, shift: float = 0.0) -> mx.array:
    return mx.array((rng.standard_normal(shape) * scale + shift).astype(np.float32)).astype(dtype)


def _f64(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32)).astype(np.float64)


def operands(op: str, shape: tuple[int, ...], dt: str, seed: int) -> tuple[Callable[[dict | None], mx.array], np.ndarray]:
    """(call(knobs or None) -> output, reference as float64 NumPy) on fresh random inputs.
    call(None) passes no knob arguments (the --env children)."""
    from ..ops import attention as att
    from ..ops import fused as fu
    from ..ops import mlstm as ml
    from ..ops import norm as nm
    from ..ops import slstm as sl

    rng = np.random.default_rng(seed)
    dtype = dtype_of(dt)
    if op in ("rms_norm", "layer_norm"):
        rows, n = shape
        x, w, b = _normal(rng, (rows, n), dtype), _normal(rng, (n,), dtype), _normal(rng, (n,), dtype)
        if op == "rms_norm":
            ref = nm.rms_norm_reference(x, w, EPS)
            return (lambda k: nm.rms_norm(x, w, EPS, knobs=k)), _f64(ref)
        ref = nm.layer_norm_reference(x, w, b, EPS)
        return (lambda k: nm.layer_norm(x, w, b, EPS, knobs=k)), _f64(ref)
    if op == "attention":
        bsz, h, lq, lk, d = shape
        q, k, v = (_normal(rng, (bsz, h, ln, d), dtype) for ln in (lq, lk, lk))
        scale = d ** -0.5
        ref = _f64(att.attention_reference(q, k, v, scale=scale, mask="causal"))
        if lq > 8:
            return (lambda kn: att.attention_prefill(q, k, v, scale=scale, mask="causal", **(kn or {}))), ref

        def decode(kn):
            return att.attention_decode_split_kv(q, k, v, scale=scale, mask="causal",
                                                 block_size=(kn or {}).get("split_kv_block_size"))

        return decode, ref
    if op == "mlstm":
        bsz, h, s, d = shape
        q, k, v = (_normal(rng, (bsz, h, s, d), dtype) for _ in range(3))
        i_pre, f_pre = _normal(rng, (bsz, h, s), mx.float32), _normal(rng, (bsz, h, s), mx.float32, shift=3.0)
        with mx.stream(mx.cpu):
            ref = ml.mlstm_chunkwise_mx(*[a.astype(mx.float32).astype(mx.float64) for a in (q, k, v, i_pre, f_pre)])
            ref = np.asarray(ref)
        return (lambda kn: ml.mlstm(q, k, v, i_pre, f_pre, chunk_size=(kn or {}).get("chunk_size"))), ref
    if op == "fused":
        m, n, k = shape
        x, g, w = _normal(rng, (m, k), dtype), _normal(rng, (k,), dtype), _normal(rng, (n, k), dtype, scale=k ** -0.5)
        x64, g64 = _f64(x), _f64(g)
        ref = (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS) * g64) @ _f64(w).T
        return (lambda kn: fu.fused_norm_linear(x, g, w, None, EPS, knobs=kn)), ref
    bsz, h, s, dh = shape
    wx = _normal(rng, (bsz, s, 4, h, dh), dtype)
    r = _normal(rng, (h, dh, 4, dh), dtype, scale=dh ** -0.5)
    b = _normal(rng, (4, h, dh), mx.float32, scale=0.5)
    ref = _f64(sl.slstm_reference(wx, r, b))
    return (lambda kn: sl.slstm(wx, r, b, config=kn)), ref


# ---------------------------------------------------------------------------------------
# --env children
# ---------------------------------------------------------------------------------------


def child_env(op: str, cfg: dict, backend: str) -> dict[str, str]:
    """This process's environment without any knob variable of `op`, plus `cfg`'s."""
    drop = set(knobs_mod.knob_env_vars(op))
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(knob_config_env(op, cfg))
    env[runtime.ENV_VAR] = backend
    return env


def run_subprocess(op: str, shape, dt: str, cfg: dict, backend: str, warmup: int, repeats: int, seed: int,
                   max_seconds: float | None, timeout: float) -> dict:
    """Time one knob candidate in a fresh interpreter configured only by XLSTM_<OP>_<KNOB>."""
    from .tuner import run_child

    spec = {"op": op, "shape": list(shape), "dtype": dt, "warmup": warmup, "repeats": repeats, "seed": seed,
            "max_seconds": max_seconds, "expect": cfg}
    return run_child("xlstm_kernels.benchmarks.tune_knobs:child_main", spec, child_env(op, cfg, backend), timeout)


def child_main(spec_text: str) -> int:
    """Entry point of an --env subprocess: the knobs come from the environment only."""
    from .tuner import FAILED_RESULT, _run_one, error_result, print_child_result

    spec = json.loads(spec_text)
    op, shape, dt = spec["op"], tuple(spec["shape"]), spec["dtype"]
    try:
        got = current_knobs(op, dt, shape)
    except Exception as e:  # noqa: BLE001
        return print_child_result(error_result(e))
    if got != spec["expect"]:
        diff = {k: got.get(k) for k in spec["expect"] if got.get(k) != spec["expect"][k]}
        return print_child_result({**FAILED_RESULT,
                                   "error": f"the XLSTM_{op.upper()}_* variables resolved to different knobs: {diff}"})
    call, ref = operands(op, shape, dt, spec["seed"])
    return print_child_result(_run_one(call, ref, None, dt, spec["warmup"], spec["repeats"], spec["max_seconds"]))


# ---------------------------------------------------------------------------------------
# Class winners
# ---------------------------------------------------------------------------------------


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def class_winners(result, valid_by_shape: dict) -> dict:
    """Per shape class (and attention's prefill / decode groups, merged into one entry):
    the candidate with the best geometric-mean time over the class's shapes, counting a
    candidate that was not run at a shape with the run candidate of the same launch; the
    entry keeps the knobs that change the launch at one of those shapes at least."""
    op = result.op
    by_class: dict[str, list[tuple[int, ...]]] = {}
    for s in result.shapes:
        by_class.setdefault(knobs_mod.knob_shape_class(op, knobs_mod.shape_size(op, s)), []).append(s)
    winners: dict[str, dict] = {}
    for cls, shapes in by_class.items():
        entry: dict[str, Any] = {}
        info: dict[str, Any] = {"shapes": [shape_text(s) for s in shapes], "labels": [], "ms": {},
                                "speedup_vs_current": {}}
        kinds: dict[str, list] = {}
        for s in shapes:
            kinds.setdefault(_kind(op, s), []).append(s)
        for group in kinds.values():
            timed: dict[tuple, dict[tuple, float]] = {}  # shape -> launch key -> median
            current: dict[tuple, float] = {}
            for s in group:
                timed[s] = {}
                for r in result.results:
                    if r.shape == s and r.ok and r.median_s is not None:
                        timed[s][launch_key(op, s, r.config)] = r.median_s
                        if r.current:
                            current[s] = r.median_s
            cands: dict[str, dict] = {}
            for s in group:
                for r in result.results:
                    if r.shape == s and r.ok:
                        cands.setdefault(json.dumps(r.config, sort_keys=True), r.config)
                for c in valid_by_shape.get(s, []):
                    cands.setdefault(json.dumps(c, sort_keys=True), c)
            best = None
            for key, c in cands.items():
                times = []
                for s in group:
                    if set(c) != set(swept_knobs(op, s)):
                        break
                    t = timed[s].get(launch_key(op, s, c))
                    if t is None:
                        break
                    times.append(t)
                else:
                    cur = any(r.current and r.config == c for r in result.results if r.shape in group)
                    score = (_geomean(times), not cur, key)
                    if best is None or score < best[0]:
                        best = (score, c, times)
            if best is None:
                continue
            _, c, times = best
            relevant = _relevant_knobs(op, group, c) or list(c)  # (nothing matters here: keep them all)
            entry.update({k: c[k] for k in relevant})
            info["labels"].append(knob_label({k: c[k] for k in relevant}))
            for s, t in zip(group, times):
                info["ms"][shape_text(s)] = t * 1e3
                if s in current:
                    info["speedup_vs_current"][shape_text(s)] = current[s] / t
        if entry:
            info["entry"] = entry
            info["label"] = " + ".join(info.pop("labels"))
            winners[cls] = info
    return winners


def _relevant_knobs(op: str, shapes: Sequence[tuple[int, ...]], cand: dict) -> list[str]:
    """The knobs of `cand` whose other grid values change the launch at one of `shapes`."""
    out = []
    for k, v in cand.items():
        spec = knobs_mod.KNOBS[op][k]
        others = [x for x in (*spec.grid, *spec.quick) if x != v]
        if any(launch_key(op, s, {**cand, k: x}) != launch_key(op, s, cand) for s in shapes for x in others):
            out.append(k)
    return out


# ---------------------------------------------------------------------------------------
# The chart
# ---------------------------------------------------------------------------------------


def write_bars(result, path: str) -> str:
    """A horizontal bar chart of the time of every correct candidate, one panel per shape."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shapes = list(result.shapes) or [()]
    heights = [max(2.0, 0.28 * max(1, len(result.for_shape(s))) + 1.0) for s in shapes]
    fig = Figure(figsize=(8.0, sum(heights)), dpi=100)
    FigureCanvasAgg(fig)
    unit = "emulated ms" if result.emulated else "ms"
    gs = fig.add_gridspec(len(shapes), 1, height_ratios=heights)
    for i, s in enumerate(shapes):
        ax = fig.add_subplot(gs[i])
        rs = [r for r in result.for_shape(s) if r.ok and r.median_s is not None] if s else []
        title = f"{result.op} {result.dtype} {shape_text(s) if s else ''}"
        if not rs:
            ax.text(0.5, 0.5, "no correct candidate", ha="center", va="center")
            ax.set_axis_off()
            ax.set_title(title, fontsize=9)
            continue
        labels = [r.label + ("  (current)" if r.current else "") for r in rs]
        ys = [r.median_s * 1e3 for r in rs]
        colors = ["#dd8452" if r.current else "#4c72b0" for r in rs]
        ax.barh(range(len(rs)), ys, color=colors)
        ax.set_yticks(range(len(rs)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.set_title(title + " (fastest first; orange: current)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path
