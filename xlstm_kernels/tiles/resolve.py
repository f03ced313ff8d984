"""Resolving the GEMM config of one call: argument > env > user presets > shipped > default.

Levels, highest first; each field is taken from the highest level that sets it and
``ResolvedGemmConfig.sources`` says which one that was:

    0  tiles= argument        a GemmConfig (every field), a dict of fields, or "TMxTN[xTK]"
    1  set_gemm_tiles(...)    process-wide defaults, same forms
    2  environment            XLSTM_GEMM_* (see :mod:`xlstm_kernels.tiles.env`)
    3  $XLSTM_KERNELS_PRESETS user file, then ~/.config/xlstm_kernels/presets.yaml
    4  shipped presets.yaml   for the detected device family
    5  built-in default       GemmConfig() (and split_k 4 when the split-K rule fires)

A tile size implies its path: "TMxTN[xTK]" strings, XLSTM_GEMM_TILE_* and dict keys
tm/tn/tk select the scalar path (a string or XLSTM_GEMM_TILE_* sets BMxBN[xBK] instead
when XLSTM_GEMM_PATH=simd); dict keys bm/bn/bk select simd.

Shape rules (M x N output, K reduction), applied unless levels 0-2 set the field:
    path     M == 1 -> "gemv"
    split_k  simd path, M*N*batch <= 64*64*4 and K >= max(8*max(M, N), 256): the preset's
             split_k (default 4), at most K // (2*BK); otherwise 1. A split_k from levels
             0-2 is used for every shape on the simd path.
             Waves rule, where the family sets compute_units (threadgroups one wave of
             the GPU runs: SMs; the CUDA families): when the split-K rule does not fire
             and the output has at most compute_units / 2 BMxBN tiles (times batch), K
             is split into min(the preset's split_k, compute_units // tiles,
             K // 512) parts when that is >= 2 (an under-filled GPU, e.g.
             512x1024x4096 with 128x128 tiles: 32 tiles for 132 SMs -> 4 splits).
             Before that, a preset's warpgroup tile (BM, BN, WM not set at levels 0-2)
             steps down WARPGROUP_LADDER (128x256 -> 128x128 -> 128x64 -> 64x64) while
             the output has at most compute_units / 2 of its tiles (1024^3 on an H100:
             32 tiles of 128x256 -> 128 of 128x64).
    vec4     a preset's vec4 is dropped when the final TK or TN is not a multiple of 4.
    warpgroup a preset's warpgroup is dropped when the final simd tile cannot take warpgroup
             products (WN = 1, BM = 16*WM, WM a multiple of 4, BK = 64, BN 64/128/256).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from dataclasses import fields as dc_fields
from typing import Any

from . import env as env_mod
from . import presets as presets_mod
from .errors import TileConfigError
from .gemm import OPS, GemmConfig, check_field, dtype_name, dtype_size, parse_tile
from .presets import DeviceInfo

__all__ = [
    "ResolvedGemmConfig",
    "explain",
    "get_gemm_tiles",
    "resolve_gemm_config",
    "set_gemm_tiles",
    "split_k_rule",
    "waves_split_k",
    "WARPGROUP_LADDER",
]

ARGUMENT = "tiles= argument"
BUILTIN = "built-in default"
SPLIT_K_MAX_MN = 64 * 64 * 4
SPLIT_K_K_RATIO = 8
SPLIT_K_MIN_K = 256
SPLIT_K_DEFAULT = 4
WAVES_MIN_K_PER_SPLIT = 512  # the waves rule keeps at least this much K per split

_DEFAULTS = {f.name: f.default for f in dc_fields(GemmConfig)}
_DEFAULTS["split_k"] = SPLIT_K_DEFAULT  # the count used when the split-K rule fires
_TILE_IMPLIES = {"tm": "scalar", "tn": "scalar", "tk": "scalar", "bm": "simd", "bn": "simd", "bk": "simd"}
_OP_KEYS = {"gemm_av": "av", "gemm_at_b": "atb", "gemm_a_bt": "abt"}


@dataclass(frozen=True)
class ResolvedGemmConfig:
    """The config one call dispatches, where each field came from, and the device."""

    config: GemmConfig
    sources: dict
    family: str
    device: DeviceInfo
    shape_class: str


def split_k_rule(m: int, n: int, k: int, batch: int = 1) -> bool:
    """True when an M x N output is too small to fill the GPU and K is long."""
    return m * n * batch <= SPLIT_K_MAX_MN and k >= max(SPLIT_K_K_RATIO * max(m, n), SPLIT_K_MIN_K)


# Warpgroup tiles a preset's tile steps down to when the output has at most half a wave of
# tiles, (BM, BN, WM) largest first (H100, session 10, queued vs mx.matmul over gemm_av /
# gemm_a_bt / gemm_at_b / linear: 1024^3 128x256 0.47-0.87x -> 128x64 0.61-1.57x;
# 2048x1024x1024 0.48-0.57x -> 128x128 0.64-1.16x; 1024x1024x4096 0.69-0.80x -> 128x64 0.81-1.10x).
WARPGROUP_LADDER = ((128, 256, 8), (128, 128, 8), (128, 64, 8), (64, 64, 4))


def _warpgroup_ladder(m: int, n: int, batch: int, cfg: GemmConfig, units: int) -> GemmConfig:
    """`cfg` with the first tile of WARPGROUP_LADDER (from its own down) whose output tiles
    (times batch) fill more than half of `units`, or the last; `cfg` itself when its tile
    is not on the ladder or already fills that much."""
    here = (cfg.bm, cfg.bn, cfg.wm)
    if here not in WARPGROUP_LADDER or cfg.wn != 1:
        return cfg
    out = cfg
    for bm, bn, wm in WARPGROUP_LADDER[WARPGROUP_LADDER.index(here):]:
        out = cfg if (bm, bn, wm) == here else cfg.replace(bm=bm, bn=bn, wm=wm)
        if 2 * (-(-m // bm) * -(-n // bn) * batch) > units:
            break
    return out


def waves_split_k(m: int, n: int, k: int, batch: int, bm: int, bn: int, most: int, units: int) -> int:
    """Splits of K for an output of few BM x BN tiles on a GPU running `units` threadgroups
    per wave: 1 unless the tiles (times batch) fill at most half a wave; then
    min(most, units // tiles, K // WAVES_MIN_K_PER_SPLIT), at least 1."""
    tiles = -(-m // bm) * -(-n // bn) * batch
    if tiles == 0 or 2 * tiles > units:
        return 1
    return max(1, min(most, units // tiles, k // WAVES_MIN_K_PER_SPLIT))


# ---------------------------------------------------------------------------------------
# Argument-level values (tiles= and set_gemm_tiles)
# ---------------------------------------------------------------------------------------


def _parse_tiles(tiles: Any, label: str, env_path: str | None) -> dict[str, Any]:
    """Fields set by a tiles value (GemmConfig, dict or tile string); raises naming `label`."""
    if tiles is None:
        return {}
    if isinstance(tiles, GemmConfig):
        return tiles.to_dict()
    if isinstance(tiles, str):
        sizes = parse_tile(tiles, f"{label} {tiles!r}")
        names = ("bm", "bn", "bk") if env_path == "simd" else ("tm", "tn", "tk")
        out: dict[str, Any] = dict(zip(names, sizes))
        if env_path != "simd":
            out["path"] = "scalar"
        return out
    if isinstance(tiles, dict):
        out = {}
        for key, value in tiles.items():
            msg = check_field(key, value) if isinstance(key, str) else f"field names are strings, got {key!r}"
            if msg:
                raise TileConfigError(f"{label}: {msg}")
            out[key] = value
        if "path" not in out:
            implied = {_TILE_IMPLIES[k] for k in out if k in _TILE_IMPLIES}
            if len(implied) == 1:
                out["path"] = implied.pop()
        return out
    raise TileConfigError(
        f"{label}: expected a GemmConfig, a dict of its fields or a 'TMxTN[xTK]' string, "
        f"got {type(tiles).__name__} {tiles!r}"
    )


_PROCESS_TILES: dict[str, Any] = {"av": None, "atb": None, "abt": None}
_PROCESS_VERSION = [0]


def set_gemm_tiles(av: Any = None, atb: Any = None, abt: Any = None) -> None:
    """Process-wide tiles for gemm_av / gemm_at_b / gemm_a_bt, below a call's ``tiles=``
    and above the environment. Each value is a GemmConfig, a dict of fields or a
    "TMxTN[xTK]" string; each call replaces all three (None = no default for that op)."""
    new = {"av": av, "atb": atb, "abt": abt}
    for key, value in new.items():
        _parse_tiles(value, f"set_gemm_tiles({key}=...)", None)  # format errors fail here
        if isinstance(value, dict):
            new[key] = dict(value)
    _PROCESS_TILES.update(new)
    _PROCESS_VERSION[0] += 1


def get_gemm_tiles() -> dict[str, Any]:
    """The values last given to :func:`set_gemm_tiles` ({"av", "atb", "abt"})."""
    return dict(_PROCESS_TILES)


# ---------------------------------------------------------------------------------------
# Resolve
# ---------------------------------------------------------------------------------------

_CACHE: dict[tuple, ResolvedGemmConfig] = {}
_CACHE_MAX = 4096


def _tiles_key(tiles: Any) -> Any:
    if tiles is None or isinstance(tiles, (str, GemmConfig)):
        return tiles
    if isinstance(tiles, dict):
        try:
            key = ("dict", tuple(sorted(tiles.items())))
            hash(key)
            return key
        except TypeError:
            return _UNCACHEABLE
    return _UNCACHEABLE


_UNCACHEABLE = object()


def resolve_gemm_config(
    op: str,
    m: int,
    n: int,
    k: int,
    dtype: Any,
    tiles: Any = None,
    *,
    batch: int = 1,
    family: str | None = None,
    backend: str | None = None,
) -> ResolvedGemmConfig:
    """The validated config for one call of `op` with an M x N output and reduction K.

    Args:
        op: "gemm_av", "gemm_at_b" or "gemm_a_bt".
        m, n, k: output rows, output columns, reduction length (the kernels' M, N, K,
            whatever the op's operand layout).
        dtype: float32, float16 or bfloat16 (mx dtype, numpy dtype or name).
        tiles: a GemmConfig, a dict of GemmConfig fields or "TMxTN[xTK]" (the
            highest-precedence level); None to use the lower levels.
        batch: number of independent products (only the split-K rule looks at it).
        family: use this preset family instead of the detected device's.
        backend: the kernel backend that will run the config: adds its limits (an explicit
            simd ``stages`` count against its threadgroup memory); None skips them.

    Raises:
        TileConfigError: a malformed setting or a config beyond the GPU's limits; the
            message names the variable / file key / argument it came from.
    """
    if op not in OPS:
        raise TileConfigError(f"op {op!r}: expected one of {', '.join(OPS)}")
    dt = dtype_name(dtype)
    snap = env_mod.snapshot()
    stamps = presets_mod.stack_stamps(snap)
    tkey = _tiles_key(tiles)
    key = None
    if tkey is not _UNCACHEABLE:
        key = (op, m, n, k, batch, dt, tkey, family, backend, _PROCESS_VERSION[0], snap, stamps)
        hit = _CACHE.get(key)
        if hit is not None:
            return ResolvedGemmConfig(hit.config, dict(hit.sources), hit.family, hit.device, hit.shape_class)
    res = _resolve(op, m, n, k, dt, tiles, batch, family, stamps, backend)
    if key is not None:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = res
        res = ResolvedGemmConfig(res.config, dict(res.sources), res.family, res.device, res.shape_class)
    return res


def _resolve(op, m, n, k, dt, tiles, batch, family, stamps, backend=None) -> ResolvedGemmConfig:
    for name, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TileConfigError(f"resolve_gemm_config: {name} must be a non-negative integer, got {v!r}")
    stack = presets_mod.current_stack(stamps)
    if family is None:
        device = presets_mod.select_family(stack, stamps, stacklevel=3)  # -> resolve_gemm_config's caller
    else:
        if not stack.has_family(family):
            raise TileConfigError(f"family {family!r}: no such preset family; known: {', '.join(stack.family_keys())}")
        device = DeviceInfo(f"family={family}", "", family)
    fam = device.family_key
    cls = presets_mod.shape_class(m, n, k)

    env_path, _ = env_mod.env_path()
    env_layer = env_mod.read_gemm_env(op)
    opk = _OP_KEYS[op]
    set_label = f"set_gemm_tiles({opk}=...)"

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    rank: dict[str, int] = {}

    def take(fields: dict[str, Any], src: Any, level: int) -> None:
        for f, v in fields.items():
            if f not in values:
                values[f] = v
                sources[f] = src(f) if callable(src) else src
                rank[f] = level

    take(_parse_tiles(tiles, ARGUMENT, env_path), ARGUMENT, 0)
    take(_parse_tiles(_PROCESS_TILES[opk], set_label, env_path), set_label, 1)
    take(env_layer.fields, env_layer.sources.__getitem__, 2)
    for prefix, entry in stack.layers(fam, op, dt, cls):
        level = 4 if prefix.startswith(presets_mod.SHIPPED_DISPLAY + ":") else 3
        take(entry, lambda f, p=prefix: f"{p}.{f}", level)
    take(_DEFAULTS, BUILTIN, 5)

    def explicit(f: str) -> bool:  # set by the argument, set_gemm_tiles or the environment
        return rank[f] <= 2

    # path: M == 1 -> gemv unless chosen at levels 0-2
    if m == 1 and not explicit("path"):
        values["path"] = "gemv"
        sources["path"] = "shape rule: M == 1 selects the gemv kernel"
    if values["path"] == "gemv" and m != 1:
        values["path"] = "simd"
        sources["path"] = f"{sources['path']} (gemv needs M == 1: the simd path runs)"
    path = values["path"]

    cfg = GemmConfig(**values)
    if cfg.tn != values["tn"]:
        sources["tn"] = f"align_execw ({sources['align_execw']}): TN = 32*RN"
        rank["tn"] = rank["align_execw"]

    # warpgroup from a preset is only a preference: dropped when the tile fields given
    # explicitly (argument, set_gemm_tiles, environment) do not make warpgroup tiles
    if cfg.warpgroup is True and not explicit("warpgroup") and cfg._warpgroup_problems("", None):
        cfg = cfg.replace(warpgroup=False)
        sources["warpgroup"] = f"{sources['warpgroup']} (dropped: the tile given does not make warpgroup tiles)"

    # vec4 from a preset is only a preference
    if cfg.vec4 and not explicit("vec4") and (cfg.tk % 4 or cfg.tn % 4):
        cfg = cfg.replace(vec4=False)
        sources["vec4"] = f"{sources['vec4']} (dropped: TK={cfg.tk}, TN={cfg.tn} not multiples of 4)"

    # waves rule, part 1: a preset's warpgroup tile steps down its ladder while the output
    # has at most half a wave of tiles (then part 2, split-K, sees the final tile)
    if path == "simd" and cfg.uses_warpgroup(dt) and not any(explicit(f) for f in ("bm", "bn", "wm", "wn")):
        units = stack.compute_units(fam)
        stepped = _warpgroup_ladder(m, n, batch, cfg, units) if units else cfg
        if stepped is not cfg:
            tiles = -(-m // cfg.bm) * -(-n // cfg.bn) * batch
            note = (f" (waves rule: {tiles} output tiles of {cfg.bm}x{cfg.bn} for {units} compute units -> "
                    f"{stepped.bm}x{stepped.bn} warpgroup tiles, {stepped.wm} warps)")
            for f in ("bm", "bn", "wm"):
                if getattr(stepped, f) != getattr(cfg, f):
                    sources[f] = sources[f] + note
            cfg = stepped

    # split-K
    if explicit("split_k"):
        if path != "simd" and cfg.split_k != 1:
            sources["split_k"] = f"{sources['split_k']} (ignored: split-K runs on the simd path only)"
            cfg = cfg.replace(split_k=1)
    else:
        fires = path == "simd" and split_k_rule(m, n, k, batch)
        units = stack.compute_units(fam) if path == "simd" else None
        ints = all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                   for v in (cfg.split_k, cfg.bk, cfg.bm, cfg.bn))
        waves = waves_split_k(m, n, k, batch, cfg.bm, cfg.bn, cfg.split_k, units) if units and ints else 1
        if fires and ints:
            split = max(1, min(cfg.split_k, k // (2 * cfg.bk)))
            sources["split_k"] = f"{sources['split_k']} (split-K rule: M*N={m * n}, K={k})"
        elif waves > 1:
            split = waves
            tiles = -(-m // cfg.bm) * -(-n // cfg.bn) * batch
            sources["split_k"] = (f"{sources['split_k']} (waves rule: {tiles} output tiles of {cfg.bm}x{cfg.bn} "
                                  f"for {units} compute units, K={k})")
        else:
            split = 1
            sources["split_k"] = "shape rule: no split-K for this shape"
            rank["split_k"] = 5
        cfg = cfg.replace(split_k=split)

    # limits: the backend that will run it; without one, a CUDA family's (its tiles may use
    # CUDA's threadgroup memory), else the base limits (an explicit stage count unchecked)
    if backend is None and stack.backend(fam) == "cuda":
        backend = "cuda"
    probs = cfg.problems(dt, backend)
    if probs:
        raise TileConfigError("; ".join(f"{_name_sources(fs, sources, rank)}: {msg}" for fs, msg in probs))
    return ResolvedGemmConfig(cfg, sources, fam, device, cls)


def _name_sources(fields: tuple[str, ...], sources: dict[str, str], rank: dict[str, int]) -> str:
    """The sources behind `fields`, highest precedence first (built-in defaults last)."""
    ordered = sorted((rank[f], i, sources[f]) for i, f in enumerate(fields) if f in sources)
    named = [s for _, _, s in ordered if s != BUILTIN]
    return " + ".join(dict.fromkeys(named)) or BUILTIN


# ---------------------------------------------------------------------------------------
# Explain
# ---------------------------------------------------------------------------------------


def _mnk(op: str, shapes: Any) -> tuple[int, int, int, int]:
    """(M, N, K, batch) from (M, N, K) ints or the op's two operand shapes."""
    if op not in OPS:
        raise TileConfigError(f"op {op!r}: expected one of {', '.join(OPS)}")
    shapes = tuple(shapes)
    if len(shapes) == 3 and all(isinstance(s, int) for s in shapes):
        m, n, k = shapes
        return m, n, k, 1
    if len(shapes) != 2 or not all(isinstance(s, (tuple, list)) and len(s) >= 2 for s in shapes):
        raise TileConfigError(
            f"explain: shapes must be (M, N, K) ints or the two operand shapes of {op}, got {shapes!r}"
        )
    a, b = (tuple(int(d) for d in s) for s in shapes)
    if op == "gemm_av":  # a (m, n), v (n, k) -> (m, k)
        m, ka, kb, n = a[-2], a[-1], b[-2], b[-1]
    elif op == "gemm_at_b":  # a (m, n), b (m, k) -> (n, k)
        ka, m, kb, n = a[-2], a[-1], b[-2], b[-1]
    else:  # a (m, k), b (n, k) -> (m, n)
        m, ka, n, kb = a[-2], a[-1], b[-2], b[-1]
    if ka != kb:
        raise TileConfigError(f"explain: {op} operand shapes {a} and {b} disagree on the reduction length")
    lead_a, lead_b = a[:-2], b[:-2]
    width = max(len(lead_a), len(lead_b))
    lead_a, lead_b = (1,) * (width - len(lead_a)) + lead_a, (1,) * (width - len(lead_b)) + lead_b
    batch = 1
    for x, y in zip(lead_a, lead_b):
        if x != y and 1 not in (x, y):
            raise TileConfigError(f"explain: batch dimensions of {a} and {b} do not broadcast")
        batch *= max(x, y)
    return m, n, ka, batch


def explain(op: str, shapes: Any, dtype: Any, tiles: Any = None, *, family: str | None = None) -> dict[str, Any]:
    """Everything about the config one call would use, for people tuning kernels.

    Args:
        op: "gemm_av", "gemm_at_b" or "gemm_a_bt".
        shapes: the op's operand shapes in its own layout, leading batch dims allowed:
            gemm_av ((m, n), (n, k)), gemm_at_b ((m, n), (m, k)), gemm_a_bt ((m, k), (n, k));
            or three ints (M, N, K) = output rows, output columns, reduction length.
        dtype: float32, float16 or bfloat16.
        tiles, family: as for :func:`resolve_gemm_config`.

    Returns a dict: op, device, architecture, family, dtype, mnk (M, N, K), batch,
    shape_class, path, config (all fields), sources (field -> origin), threads,
    threadgroup_bytes, grid (in threads), template, roofline (the family's peaks plus
    this call's flops, bytes and lower-bound time in microseconds).
    """
    presets_mod.reload_presets()  # diagnostics always read the files as they are now
    m, n, k, batch = _mnk(op, shapes)
    res = resolve_gemm_config(op, m, n, k, dtype, tiles, batch=batch, family=family)
    cfg, dt = res.config, dtype_name(dtype)
    trans_b = op == "gemm_a_bt"  # B read as (N, K) rows (the gemv kernel's layout choice)
    roof = dict(presets_mod.roofline(res.family))
    peak = roof[{"float32": "fp32_tflops", "float16": "fp16_tflops", "bfloat16": "bf16_tflops"}[dt]]
    flops = 2.0 * m * n * k * batch
    nbytes = float(dtype_size(dt) * (m * k + k * n + m * n) * batch)
    t_compute = flops / (peak * 1e12) * 1e6
    t_memory = nbytes / (roof["bandwidth_gbs"] * 1e9) * 1e6
    roof.update(
        flops=flops,
        bytes=nbytes,
        compute_us=t_compute,
        memory_us=t_memory,
        bound_us=max(t_compute, t_memory),
        bound="compute" if t_compute >= t_memory else "memory",
        arithmetic_intensity=flops / nbytes if nbytes else math.inf,
    )
    return {
        "op": op,
        "device": res.device.name,
        "architecture": res.device.architecture,
        "family": res.family,
        "dtype": dt,
        "mnk": (m, n, k),
        "batch": batch,
        "shape_class": res.shape_class,
        "path": cfg.path,
        "config": cfg.to_dict(),
        "sources": res.sources,
        "threads": cfg.threads(),
        "threadgroup_bytes": cfg.threadgroup_bytes(dt),
        "grid": cfg.grid(m, n, batch, dtype=dt, trans_b=trans_b),
        "template": cfg.template_args(dt) + ([("COLS", cfg.gemv_cols(n, dt, trans_b))] if cfg.path == "gemv" else []),
        "roofline": roof,
    }


def _reset() -> None:
    """Clear the resolve cache and set_gemm_tiles (for tests)."""
    _CACHE.clear()
    _PROCESS_TILES.update(av=None, atb=None, abt=None)
    _PROCESS_VERSION[0] += 1
