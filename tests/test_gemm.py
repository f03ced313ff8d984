"""GEMM family (metal_src/gemm.metal + xlstm_kernels.ops.gemm) against float64 NumPy.

Every numerical check compares with a float64 reference computed from the inputs as
rounded to the tested dtype; the error measure is max|out - ref| / max|ref| (bounded by
1e-5 for float32, 1e-2 for float16/bfloat16, 2e-2 for bfloat16 with K >= 256). Configs
are chosen with ``tiles=`` (or the environment) and what actually ran is checked with
explain() and by recording the op's kernel launches.

Notation (the kernels'): the output has M rows and N columns, the reduction runs over K,
whatever the operand layout of the op. ``python -m pytest tests/test_gemm.py --backend
metal`` runs the same tests on a Mac; the emulator_only tests call the CPU emulator's
kernel objects directly (check_schedules, check_bounds).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import xlstm_kernels
from xlstm_kernels import explain, gemm_a_bt, gemm_at_b, gemm_av, linear, set_gemm_tiles
from xlstm_kernels.ops import gemm as gemm_mod
from xlstm_kernels.ops.gemm import gemm_reference
from xlstm_kernels.runtime import get_kernel, use_backend
from xlstm_kernels.tiles import GemmConfig, TileConfigError, resolve_gemm_config
from xlstm_kernels.tiles import env as env_mod
from xlstm_kernels.tiles import presets as presets_mod
from xlstm_kernels.tiles import resolve as resolve_mod

from gemm_helpers import (
    ACT_CODE,
    ACTIVATIONS,
    DTYPES,
    OP_FN,
    OPS,
    LaunchSpy,
    assert_close,
    f64,
    np_activation,
    np_product,
    np_reference,
    operand_shapes,
    operands,
    rand,
    raw_calls,
    rel_err,
    same_launch,
    seed_of,
    spanning_shape,
    tile_dims,
    tolerance,
)

DTYPE_NAMES = tuple(DTYPES)


def _reset_tiles():
    presets_mod._reset_caches()
    resolve_mod._reset()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No XLSTM_GEMM_* / preset / device variables, an empty config home, fresh caches."""
    for var in env_mod.GEMM_ENV_VARS:
        if var.startswith("XLSTM_"):
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config-home"))
    _reset_tiles()
    yield
    _reset_tiles()


@pytest.fixture
def spy(monkeypatch):
    return LaunchSpy(monkeypatch)


def _runs_kernels(backend: str) -> bool:
    return backend != "reference"


def _run_op(op, a, b, **kw):
    out = OP_FN[op](a, b, **kw)
    mx.eval(out)
    return out


def _check_op(op, a, b, dtype, k, what="", **kw):
    out = _run_op(op, a, b, **kw)
    return assert_close(out, np_reference(op, a, b), dtype, k, what or op)


# =======================================================================================
# Layouts x dtypes x shapes on the default config
# =======================================================================================

SHAPES = {"2x3x5": (2, 3, 5), "33x29x31": (33, 29, 31), "64x128x32": (64, 128, 32), "128x96x80": (128, 96, 80)}


@pytest.mark.parametrize("shape_id", [*SHAPES, "2tiles"])
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_layouts_dtypes_shapes_default_config(kernel_backend, spy, op, dtype_name, shape_id):
    dtype = DTYPES[dtype_name]
    if shape_id == "2tiles":
        cfg = resolve_gemm_config(op, 64, 64, 64, dtype).config
        m, n, k = spanning_shape(cfg)
        assert tile_dims(resolve_gemm_config(op, m, n, k, dtype).config) == tile_dims(cfg)
        tm, tn, tk = tile_dims(cfg)
        assert -(-m // tm) >= 2 and -(-n // tn) >= 2 and -(-k // tk) >= 2
    else:
        m, n, k = SHAPES[shape_id]
    a, b = operands(op, m, n, k, dtype, seed_of(op, dtype_name, shape_id))
    _check_op(op, a, b, dtype, k)
    if _runs_kernels(kernel_backend):
        info = explain(op, (a.shape, b.shape), dtype)
        launched = spy.calls[0]
        assert launched.kernel == {"scalar": "gemm_scalar", "simd": "gemm_simd", "gemv": "gemv"}[info["path"]]
        assert launched.threadgroup == tuple(info["threads"])


# Every layout on every path (explicit configs), every dtype.
PATH_CONFIGS = {
    "scalar": ({"path": "scalar", "tm": 16, "tn": 32, "tk": 8, "rm": 2, "rn": 4, "pad": 0,
                "double_buffer": False, "vec4": False, "align_execw": False}, (37, 70, 27)),
    "simd": ({"path": "simd", "bm": 32, "bn": 32, "bk": 16, "wm": 2, "wn": 2, "split_k": 1}, (70, 67, 37)),
    "split_k": ({"path": "simd", "bm": 32, "bn": 32, "bk": 16, "wm": 2, "wn": 2, "split_k": 3}, (37, 35, 101)),
    "gemv": ({"path": "gemv", "gemv_threads": 128}, (1, 71, 101)),
}
PATH_KERNELS = {"scalar": ["gemm_scalar"], "simd": ["gemm_simd"], "split_k": ["gemm_simd", "gemm_split_k_reduce"],
                "gemv": ["gemv"]}


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("path", PATH_CONFIGS)
@pytest.mark.parametrize("op", OPS)
def test_every_layout_on_every_path(kernel_backend, spy, op, path, dtype_name):
    dtype = DTYPES[dtype_name]
    tiles, (m, n, k) = PATH_CONFIGS[path]
    a, b = operands(op, m, n, k, dtype, seed_of("paths", op, path, dtype_name))
    _check_op(op, a, b, dtype, k, f"{op}/{path}", tiles=tiles)
    if _runs_kernels(kernel_backend):
        assert spy.kernels() == PATH_KERNELS[path]
        t = spy.calls[0].template
        if path != "gemv":  # the gemv kernel has no TRANS_A: op(A) is one contiguous row in every layout
            assert t["TRANS_A"] == (op == "gemm_at_b")
        assert t["TRANS_B"] == (op == "gemm_a_bt")
        if path == "split_k":
            assert t["SPLIT"] == 3 and spy.calls[0].grid[2] == 3


# =======================================================================================
# Every option in every dtype (gemm_av: both operands row-major, so VEC4 loads both)
# =======================================================================================

_SCALAR = {"path": "scalar", "tm": 32, "tn": 32, "tk": 16, "rm": 4, "rn": 4, "pad": 0,
           "double_buffer": False, "vec4": False, "align_execw": False}
_SIMD = {"path": "simd", "bm": 32, "bn": 32, "bk": 16, "wm": 2, "wn": 2, "split_k": 1}
ALIGNED = (70, 68, 52)  # K % 4 == N % 4 == 0: VEC4 takes its vector loads (and partial tiles)
UNALIGNED = (70, 67, 37)  # VEC4 falls back to scalar loads

OPTIONS = {
    "plain": ({**_SCALAR}, ALIGNED),
    "pad1": ({**_SCALAR, "pad": 1}, UNALIGNED),
    "pad3": ({**_SCALAR, "pad": 3}, ALIGNED),
    "db": ({**_SCALAR, "double_buffer": True}, UNALIGNED),
    "db_pad1": ({**_SCALAR, "double_buffer": True, "pad": 1}, ALIGNED),
    "vec4_aligned": ({**_SCALAR, "vec4": True}, ALIGNED),
    "vec4_unaligned": ({**_SCALAR, "vec4": True}, UNALIGNED),
    "vec4_db_pad": ({**_SCALAR, "vec4": True, "double_buffer": True, "pad": 1, "tk": 8}, ALIGNED),
    "align_execw_rn1": ({**_SCALAR, "align_execw": True, "tm": 16, "rm": 2, "rn": 1}, UNALIGNED),
    "align_execw_rn2": ({**_SCALAR, "align_execw": True, "tm": 16, "rm": 4, "rn": 2, "vec4": True}, (37, 136, 52)),
    "micro_1x1": ({**_SCALAR, "tm": 16, "tn": 16, "tk": 8, "rm": 1, "rn": 1}, (37, 35, 29)),
    "micro_2x8": ({**_SCALAR, "tm": 16, "tn": 64, "rm": 2, "rn": 8}, (37, 131, 37)),
    "simd": ({**_SIMD}, UNALIGNED),
    "simd_1x2": ({**_SIMD, "wm": 1, "wn": 2, "bn": 64}, (70, 131, 37)),
    "simd_64x32x32": ({**_SIMD, "bm": 64, "bn": 32, "bk": 32, "wm": 2, "wn": 1}, (131, 67, 69)),
    "split_k2": ({**_SIMD, "split_k": 2}, (37, 35, 100)),
    "split_k3_uneven": ({**_SIMD, "split_k": 3}, (37, 35, 101)),
    "split_k4_empty_split": ({**_SIMD, "split_k": 4}, (37, 35, 9)),  # K per split 3: the last split is empty
    "gemv32": ({"path": "gemv", "gemv_threads": 32}, (1, 37, 70)),
    "gemv128": ({"path": "gemv", "gemv_threads": 128}, (1, 70, 101)),
    "gemv1024": ({"path": "gemv", "gemv_threads": 1024}, (1, 67, 33)),
    # M > 1: the simd path runs (its tile pinned: the device family must not matter)
    "gemv_on_m_gt_1": ({"path": "gemv", "gemv_threads": 128, "bm": 32, "bn": 32, "bk": 16}, (37, 70, 40)),
}


def _expected_kernels(tiles, m):
    if tiles["path"] == "gemv":
        return ["gemv"] if m == 1 else ["gemm_simd"]
    if tiles["path"] == "simd":
        return ["gemm_simd"] + (["gemm_split_k_reduce"] if tiles.get("split_k", 1) > 1 else [])
    return ["gemm_scalar"]


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("option", OPTIONS)
def test_every_option_in_every_dtype(kernel_backend, spy, option, dtype_name):
    dtype = DTYPES[dtype_name]
    tiles, (m, n, k) = OPTIONS[option]
    cfg = resolve_gemm_config("gemm_av", m, n, k, dtype, tiles).config
    for f, v in tiles.items():
        if option == "gemv_on_m_gt_1" and f == "path":
            assert cfg.path == "simd"  # gemv covers M == 1 only; the resolver says so and picks simd
        elif not (f == "tn" and cfg.align_execw):
            assert getattr(cfg, f) == v, (f, getattr(cfg, f), v)
    if cfg.path in ("scalar", "simd"):
        tm, tn, tk = tile_dims(cfg)
        assert -(-m // tm) >= 2 and -(-n // tn) >= 2, "shape spans < 2 tiles"
        assert -(-k // tk) >= 2 or option == "split_k4_empty_split", "K spans < 2 tiles"
    a, b = operands("gemm_av", m, n, k, dtype, seed_of("option", option, dtype_name))
    _check_op("gemm_av", a, b, dtype, k, option, tiles=tiles)
    if not _runs_kernels(kernel_backend):
        return
    assert spy.kernels() == _expected_kernels(tiles, m)
    t, launched = spy.calls[0].template, spy.calls[0]
    if cfg.path == "scalar":
        assert [(name, t[name]) for name, _ in cfg.template_args(dtype)] == cfg.template_args(dtype)
        assert launched.threadgroup == (cfg.tn // cfg.rn, cfg.tm // cfg.rm, 1) == cfg.threads()
        if cfg.align_execw:
            assert t["TN"] == 32 * cfg.rn and launched.threadgroup[0] == 32
    elif cfg.path == "simd":
        assert (t["BM"], t["BN"], t["BK"], t["WM"], t["WN"], t["SPLIT"]) == (
            cfg.bm, cfg.bn, cfg.bk, cfg.wm, cfg.wn, cfg.split_k)
        assert launched.grid[2] == cfg.split_k
    elif m == 1:
        assert t["ROWS"] == cfg.gemv_threads // 32 and launched.threadgroup == (32, cfg.gemv_threads // 32, 1)


# =======================================================================================
# Every shipped preset config (deduplicated), each once on a shape spanning >= 2 tiles
# =======================================================================================

SHIPPED = presets_mod.load_preset_file(presets_mod.shipped_presets_path(), presets_mod.SHIPPED_DISPLAY)
FAMILIES = tuple(SHIPPED.families)


def _config_key(op, dtype, cfg: GemmConfig):
    return (op, str(dtype), cfg.path, tuple(cfg.template_args(dtype)), cfg.split_k if cfg.path == "simd" else 1)


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_every_shipped_preset_config(kernel_backend, spy, monkeypatch, op, dtype_name):
    """Per family: the config its preset gives a >=2-tile shape (run through
    XLSTM_KERNELS_DEVICE, the op resolving it itself), the same entry on the other path
    (tiles=GemmConfig), its split-K config (split-K rule shape) and its gemv config
    (M == 1). Identical configs run once."""
    assert {"m1", "m3_max", "m2_ultra", "generic_apple", "cpu"} <= set(FAMILIES)
    dtype = DTYPES[dtype_name]
    done: dict = {}
    for fam in FAMILIES:
        base = resolve_gemm_config(op, 64, 64, 64, dtype, family=fam).config
        other = base.replace(path="simd" if base.path == "scalar" else "scalar")
        split = resolve_gemm_config(op, 72, 70, 584, dtype, family=fam).config
        gemv = resolve_gemm_config(op, 1, 70, 101, dtype, family=fam).config
        assert gemv.path == "gemv"
        plan = [("preset", base, spanning_shape(base)), ("other_path", other, spanning_shape(other)),
                ("gemv", gemv, (1, 2 * (gemv.gemv_threads // 32) + 3, 101))]
        if split.path == "simd" and split.split_k > 1:
            plan.append(("split_k", split, (72, 70, 584)))
        for variant, cfg, (m, n, k) in plan:
            key = _config_key(op, dtype, cfg)
            if key in done:
                continue
            done[key] = (fam, variant)
            a, b = operands(op, m, n, k, dtype, seed_of("preset", fam, variant, op, dtype_name))
            spy.clear()
            if variant == "other_path":
                out = _run_op(op, a, b, tiles=cfg)
            else:
                monkeypatch.setenv("XLSTM_KERNELS_DEVICE", fam)
                info = explain(op, (a.shape, b.shape), dtype)
                assert info["family"] == fam and GemmConfig(**info["config"]) == cfg, (fam, variant, info["config"])
                out = _run_op(op, a, b)
                monkeypatch.delenv("XLSTM_KERNELS_DEVICE")
            assert_close(out, np_reference(op, a, b), dtype, k, f"{fam}/{variant}/{op}/{dtype_name}")
            if _runs_kernels(kernel_backend):
                launched = spy.calls[0]
                assert launched.kernel == {"scalar": "gemm_scalar", "simd": "gemm_simd", "gemv": "gemv"}[cfg.path]
                assert launched.threadgroup == cfg.threads()
                assert [(f, launched.template[f]) for f, _ in cfg.template_args(dtype)] == cfg.template_args(dtype)
                if variant == "split_k":
                    assert spy.kernels() == ["gemm_simd", "gemm_split_k_reduce"]
                    assert launched.template["SPLIT"] == cfg.split_k and cfg.split_k > 1
    paths = {key[2] for key in done}
    assert paths == {"scalar", "simd", "gemv"} and len(done) >= 7, done


# =======================================================================================
# Waves rule: families with compute_units split K when the output under-fills the GPU
# =======================================================================================

WAVES_CASES = [
    # m, n, k, batch, bm, bn, most, units -> splits
    (512, 1024, 4096, 1, 128, 128, 4, 132, 4),  # 32 tiles for 132 SMs
    (512, 1024, 1024, 1, 128, 128, 4, 132, 2),  # K // 512 caps it
    (512, 1024, 4096, 1, 128, 128, 8, 132, 4),  # units // tiles caps it
    (512, 512, 4096, 4, 128, 128, 4, 132, 2),   # batch counts: 64 tiles
    (2048, 2048, 2048, 1, 128, 128, 4, 132, 1),  # 256 tiles: a full wave and more
    (1152, 1024, 4096, 1, 128, 128, 4, 132, 1),  # 72 tiles: more than half a wave
    (512, 1024, 511, 1, 128, 128, 4, 132, 1),   # too little K
    (100, 70, 3000, 1, 32, 32, 4, 48, 4),       # partial tiles count: 4 x 3 = 12
    (0, 70, 3000, 1, 32, 32, 4, 48, 1),         # empty output
]


@pytest.mark.parametrize("case", WAVES_CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}b{c[3]}_u{c[7]}" for c in WAVES_CASES])
def test_waves_split_k_rule(case):
    *args, want = case
    assert resolve_mod.waves_split_k(*args) == want


def test_waves_rule_on_the_hopper_family():
    fam = "nvidia_hopper"
    assert presets_mod.current_stack().compute_units(fam) == 132
    assert presets_mod.current_stack().compute_units("generic_apple") is None
    for dt in ("float16", "bfloat16"):
        res = resolve_gemm_config("gemm_at_b", 96, 512, 4096, dt, family=fam)  # the default tile
        assert res.config.split_k == 4 and "waves rule: 4 output tiles of 128x128" in res.sources["split_k"]
        # the large (warpgroup) tile steps down to 64x64 first: still 64 tiles, so K splits
        res = resolve_gemm_config("gemm_av", 512, 512, 4096, dt, family=fam)
        c = res.config
        assert (c.bm, c.bn, c.wm, c.split_k) == (64, 64, 4, 2) and c.uses_warpgroup(dt)
        assert "waves rule: 64 output tiles of 64x64" in res.sources["split_k"]
        assert resolve_gemm_config("gemm_at_b", 512, 1024, 1024, dt, family=fam).config.split_k == 2
        assert resolve_gemm_config("gemm_av", 2048, 2048, 2048, dt, family=fam).config.split_k == 1
        assert resolve_gemm_config("gemm_av", 4096, 4096, 1024, dt, family=fam).config.split_k == 1
        # an explicit split_k wins; families without compute_units never use the rule
        assert resolve_gemm_config("gemm_av", 512, 1024, 4096, dt, {"split_k": 1}, family=fam).config.split_k == 1
        for other in ("generic_apple", "nvidia_generic", "m3_max"):
            assert resolve_gemm_config("gemm_av", 512, 1024, 4096, dt, family=other).config.split_k == 1
    # the split-K rule (tiny output, long K) still comes first
    res = resolve_gemm_config("gemm_av", 64, 64, 4096, "float16", family=fam)
    assert res.config.split_k == 4 and "split-K rule" in res.sources["split_k"]


WARPGROUP_LADDER_CASES = [
    # op, m, n, k -> bm, bn, wm, split_k of the hopper family's fp16 / bf16 large tile (128x256, 8 warps)
    ("gemm_av", 4096, 4096, 4096, 128, 256, 8, 1),   # 512 tiles: stays
    ("gemm_av", 2048, 2048, 2048, 128, 256, 8, 1),   # 128 tiles: more than half of 132
    ("gemm_av", 1024, 1024, 1024, 128, 64, 8, 1),    # 32 -> 64 -> 128 tiles
    ("gemm_a_bt", 2048, 1024, 1024, 128, 128, 8, 1),  # 64 -> 128 tiles
    ("gemm_at_b", 1024, 1024, 4096, 128, 64, 8, 1),
    ("gemm_at_b", 1024, 512, 4096, 64, 64, 4, 1),    # 16 -> 32 -> 64 -> 128 tiles
    ("gemm_av", 512, 512, 4096, 64, 64, 4, 2),       # the bottom rung (64 tiles), then split-K
    ("gemm_av", 1000, 1001, 1100, 128, 64, 8, 1),    # partial tiles count (8 x 16)
]


@pytest.mark.parametrize("case", WARPGROUP_LADDER_CASES, ids=[f"{c[0]}_{c[1]}x{c[2]}x{c[3]}" for c in WARPGROUP_LADDER_CASES])
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_waves_rule_steps_down_warpgroup_tiles(case, dt):
    """Under half a wave of output tiles, the preset's warpgroup tile steps down the ladder
    (the sources say so); float32 and tiles given explicitly keep theirs."""
    op, m, n, k, bm, bn, wm, split = case
    res = resolve_gemm_config(op, m, n, k, dt, family="nvidia_hopper")
    c = res.config
    assert (c.bm, c.bn, c.wm, c.wn, c.split_k, c.bk) == (bm, bn, wm, 1, split, 64) and c.uses_warpgroup(dt)
    c.validate(dt, backend="cuda")
    if (bm, bn) != (128, 256):
        assert "waves rule: " in res.sources["bn"] and f"-> {bm}x{bn} warpgroup tiles" in res.sources["bn"]
    else:
        assert "waves rule" not in res.sources["bn"]
    given = {"bm": 128, "bn": 256, "bk": 64, "wm": 8, "wn": 1, "warpgroup": True}
    assert (resolve_gemm_config(op, m, n, k, dt, given, family="nvidia_hopper").config.bn, c.bk) == (256, 64)
    f32 = resolve_gemm_config(op, m, n, k, "float32", family="nvidia_hopper").config
    assert not f32.uses_warpgroup("float32") and "waves rule" not in str(f32)


def test_warpgroup_ladder_tiles_are_valid_on_cuda():
    for bm, bn, wm in resolve_mod.WARPGROUP_LADDER:
        for stages in (3, 4):
            GemmConfig(path="simd", bm=bm, bn=bn, bk=64, wm=wm, wn=1, stages=stages, warpgroup=True).validate(
                "float16", backend="cuda")


def test_compute_units_must_be_a_positive_integer(monkeypatch, tmp_path):
    for bad in ("0", "-3", "1.5", "true", "many"):
        path = tmp_path / f"bad_{bad.replace('.', '_')}.yaml"
        path.write_text(f"version: 1\nfamilies:\n  cpu:\n    compute_units: {bad}\n")
        monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(path))
        _reset_tiles()
        with pytest.raises(TileConfigError, match=r"compute_units.*expected a positive integer"):
            resolve_gemm_config("gemm_av", 8, 8, 8, "float32")


@pytest.mark.parametrize("op", OPS)
def test_waves_rule_runs_split_k(kernel_backend, spy, monkeypatch, tmp_path, op):
    """A user family with compute_units: the op itself picks split-K for an output of few
    tiles (>= 2 tiles along M and N, odd sizes) and the result matches NumPy."""
    path = tmp_path / "waves.yaml"
    path.write_text("version: 1\nfamilies:\n  wavy:\n    compute_units: 16\n    gemm:\n      default:\n"
                    "        default: {path: simd, bm: 64, bn: 64, bk: 16, wm: 2, wn: 2, split_k: 3}\n")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(path))
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "wavy")
    _reset_tiles()
    # M*N > 16384 (no split-K rule); 3 x 2 tiles: min(3, 16 // 6, 1100 // 512) = 2 splits
    m, n, k = 130, 127, 1100
    dtype = DTYPES["float16"]
    info = explain(op, ((m, k) if op != "gemm_at_b" else (k, m), (k, n) if op != "gemm_a_bt" else (n, k)), dtype)
    assert info["family"] == "wavy" and info["config"]["split_k"] == 2, info
    a, b = operands(op, m, n, k, dtype, seed_of("waves", op))
    out = _run_op(op, a, b)
    assert_close(out, np_reference(op, a, b), dtype, k, f"waves/{op}")
    if _runs_kernels(kernel_backend):
        assert spy.kernels() == ["gemm_simd", "gemm_split_k_reduce"]
        assert spy.calls[0].template["SPLIT"] == 2


# =======================================================================================
# Rectangular tiles really run as rectangles
# =======================================================================================

RECT_CASES = [(t, op, "float32") for t in ("16x16", "32x8", "8x32") for op in OPS] + [
    (t, "gemm_av", d) for t in ("16x16", "32x8", "8x32") for d in ("float16", "bfloat16")
]


@pytest.mark.parametrize("tile, op, dtype_name", RECT_CASES)
def test_rectangular_tiles_run_as_rectangles(kernel_backend, spy, tile, op, dtype_name):
    dtype = DTYPES[dtype_name]
    tm, tn = (int(s) for s in tile.split("x"))
    cfg = resolve_gemm_config(op, 64, 64, 64, dtype, tile).config
    m, n, k = spanning_shape(cfg, extra=(3, 5, 7))
    a, b = operands(op, m, n, k, dtype, seed_of("rect", tile, op, dtype_name))
    info = explain(op, (a.shape, b.shape), dtype, tiles=tile)
    c = info["config"]
    assert (info["path"], c["tm"], c["tn"]) == ("scalar", tm, tn)
    assert info["threads"] == (tn // c["rn"], tm // c["rm"], 1)
    assert info["grid"] == (-(-n // tn) * (tn // c["rn"]), -(-m // tm) * (tm // c["rm"]), 1)
    _check_op(op, a, b, dtype, k, f"{op} tile {tile}", tiles=tile)
    if _runs_kernels(kernel_backend):
        launched = spy.only("gemm_scalar")
        assert (launched.template["TM"], launched.template["TN"]) == (tm, tn)
        assert launched.threadgroup == tuple(info["threads"]) and launched.grid == tuple(info["grid"])
        if tm != tn:
            assert launched.threadgroup[0] != launched.threadgroup[1]


# =======================================================================================
# Batched and broadcast operands
# =======================================================================================

BATCH_CASES = {
    "batched_a_2d_b": ((2, 3), ()),  # (2,3,m,n) x (n,k): folded into M (or B stride 0)
    "2d_a_batched_b": ((), (4,)),  # (m,n) x (4,n,k): A stride 0
    "broadcast_both": ((2, 1), (1, 3)),  # (2,1,m,n) x (1,3,n,k)
    "same_batch": ((3,), (3,)),
}
BATCH_PATHS = {
    "default": None,
    "simd": {**_SIMD},
    "split_k": {**_SIMD, "split_k": 2},
}


@pytest.mark.parametrize("path", BATCH_PATHS)
@pytest.mark.parametrize("case", BATCH_CASES)
@pytest.mark.parametrize("op", OPS)
def test_batched_and_broadcast(kernel_backend, op, case, path):
    lead_a, lead_b = BATCH_CASES[case]
    m, n, k = (33, 19, 70) if path == "split_k" else (33, 19, 40)
    dtype = mx.float32
    a, b = operands(op, m, n, k, dtype, seed_of("batch", op, case, path), lead_a, lead_b)
    out = _run_op(op, a, b, tiles=BATCH_PATHS[path])
    ref = np_product(op, f64(a), f64(b))  # NumPy matmul broadcasting
    assert ref.shape == (*np.broadcast_shapes(lead_a, lead_b), m, n)
    assert_close(out, ref, dtype, k, f"{op}/{case}/{path}")


@pytest.mark.parametrize("case", ["2d_a_batched_b", "broadcast_both", "same_batch"])
@pytest.mark.parametrize("op", OPS)
def test_batched_gemv(kernel_backend, spy, op, case):
    lead_a, lead_b = BATCH_CASES[case]
    a, b = operands(op, 1, 37, 70, mx.float16, seed_of("bgemv", op, case), lead_a, lead_b)
    out = _run_op(op, a, b)
    assert_close(out, np_product(op, f64(a), f64(b)), mx.float16, 70, f"{op}/{case}")
    if _runs_kernels(kernel_backend):
        launched = spy.only("gemv")
        assert launched.grid[2] == int(np.prod(np.broadcast_shapes(lead_a, lead_b)))


# =======================================================================================
# linear: bias, activations, residual (the fused epilogue on every path)
# =======================================================================================


def _linear_case(dtype, seed, lead=(2, 20), fin=40, fout=36, bias=True, residual="full"):
    rng = np.random.default_rng(seed)
    x = rand(rng, (*lead, fin), dtype)
    w = rand(rng, (fout, fin), dtype, scale=1.0 / math.sqrt(fin))
    b = rand(rng, (fout,), dtype) if bias else None
    r = None
    if residual == "full":
        r = rand(rng, (*lead, fout), dtype)
    elif residual == "row":
        r = rand(rng, (fout,), dtype)
    return x, w, b, r


def _linear_reference(x, w, b, act, r):
    out = f64(x) @ f64(w).T
    if b is not None:
        out = out + f64(b)
    out = np_activation(out, act)
    if r is not None:
        out = out + f64(r)
    return out


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_linear_bias_activation_residual(kernel_backend, spy, act, dtype_name):
    dtype = DTYPES[dtype_name]
    x, w, b, r = _linear_case(dtype, seed_of("linear", act, dtype_name))
    out = linear(x, w, b, act, r)
    mx.eval(out)
    assert_close(out, _linear_reference(x, w, b, act, r), dtype, 40, f"linear/{act}")
    if _runs_kernels(kernel_backend):
        t = spy.calls[-1].template
        assert (t["HAS_BIAS"], t["ACT"], t["HAS_RES"]) == (True, ACT_CODE[act], True)


@pytest.mark.parametrize("path", ["scalar", "simd", "split_k", "gemv"])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_linear_epilogue_on_every_path(kernel_backend, spy, act, path):
    tiles, _ = PATH_CONFIGS[path]
    lead = () if path == "gemv" else (3, 13)
    fin = 101 if path in ("split_k", "gemv") else 40
    x, w, b, r = _linear_case(mx.float32, seed_of("linpath", act, path), lead=lead, fin=fin)
    out = linear(x, w, b, act, r, tiles=tiles)
    mx.eval(out)
    assert_close(out, _linear_reference(x, w, b, act, r), mx.float32, fin, f"linear/{act}/{path}")
    if _runs_kernels(kernel_backend):
        assert spy.kernels() == PATH_KERNELS[path]
        t = spy.calls[-1].template  # the reduce pass runs the epilogue with split-K
        assert (t["HAS_BIAS"], t["ACT"], t["HAS_RES"]) == (True, ACT_CODE[act], True)
        if path == "split_k":
            first = spy.calls[0].template
            assert (first["HAS_BIAS"], first["ACT"], first["HAS_RES"]) == (True, ACT_CODE[act], True)


@pytest.mark.parametrize(
    "bias, residual, lead",
    [(True, None, (3, 13)), (False, "full", (3, 13)), (False, None, (3, 13)), (True, "row", (3, 13)),
     (True, "row", ()), (False, "full", (2, 1, 7))],
)
def test_linear_bias_residual_combinations(kernel_backend, bias, residual, lead):
    x, w, b, r = _linear_case(mx.float32, seed_of("lincomb", bias, residual, lead), lead=lead, bias=bias,
                              residual=residual)
    out = linear(x, w, b, "gelu", r)
    mx.eval(out)
    assert_close(out, _linear_reference(x, w, b, "gelu", r), mx.float32, 40, f"linear {bias} {residual} {lead}")


# =======================================================================================
# VJPs against mx.grad of the mx.matmul reference
# =======================================================================================


def _grads_close(got, want, dtype, k, what):
    for i, (g, r) in enumerate(zip(got, want)):
        assert g.shape == r.shape, f"{what} grad {i}: shape {g.shape} != {r.shape}"
        assert_close(g, f64(r), dtype, k, f"{what} grad {i}")


def _ref_vjp(fn, primals, cotangent):
    """vjp of the mx reference in float32 from the (dtype-rounded) primals and cotangent."""
    p32 = [p.astype(mx.float32) for p in primals]
    _, grads = mx.vjp(fn, p32, [cotangent.astype(mx.float32)])
    return grads


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_vjp_each_op(kernel_backend, op, dtype_name):
    dtype = DTYPES[dtype_name]
    m, n, k = 37, 29, 45
    a, b = operands(op, m, n, k, dtype, seed_of("vjp", op, dtype_name))
    cot = rand(np.random.default_rng(seed_of("cot", op, dtype_name)), (m, n), dtype)
    out, grads = mx.vjp(lambda x, y: OP_FN[op](x, y), [a, b], [cot])
    mx.eval(out, grads)
    want = _ref_vjp(lambda x, y: gemm_reference(op, x, y), [a, b], cot)
    _grads_close(grads, want, dtype, max(m, n, k), f"vjp {op}")
    # mx.grad of a scalar loss agrees too
    g = mx.grad(lambda x, y: (OP_FN[op](x, y).astype(mx.float32) * cot.astype(mx.float32)).sum(), argnums=(0, 1))(a, b)
    _grads_close(g, want, dtype, max(m, n, k), f"grad {op}")


@pytest.mark.parametrize("tiles", [None, {**_SIMD, "split_k": 2}], ids=["default", "split_k"])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_vjp_linear_bias_activation_residual(kernel_backend, act, tiles):
    x, w, b, r = _linear_case(mx.float32, seed_of("vjplin", act, str(tiles)), lead=(3, 11), fin=40)
    cot = rand(np.random.default_rng(seed_of("vjplin-cot", act)), (3, 11, 36), mx.float32)

    def loss(fn):
        return lambda x, w, b, r: (fn(x, w, b, r) * cot).sum()

    kernel = mx.grad(loss(lambda x, w, b, r: linear(x, w, b, act, r, tiles=tiles)), argnums=(0, 1, 2, 3))(x, w, b, r)
    ref = mx.grad(loss(lambda x, w, b, r: gemm_reference("gemm_a_bt", x, w, b, act, r)), argnums=(0, 1, 2, 3))(
        x, w, b, r)
    mx.eval(kernel, ref)
    _grads_close(kernel, ref, mx.float32, 40, f"linear vjp {act}")


@pytest.mark.parametrize("case", ["broadcast_both", "2d_a_batched_b", "batched_a_2d_b"])
@pytest.mark.parametrize("op", OPS)
def test_vjp_broadcast_batched(kernel_backend, op, case):
    lead_a, lead_b = BATCH_CASES[case]
    m, n, k = 17, 13, 21
    a, b = operands(op, m, n, k, mx.float32, seed_of("vjpb", op, case), lead_a, lead_b)
    out_shape = (*np.broadcast_shapes(lead_a, lead_b), m, n)
    cot = rand(np.random.default_rng(seed_of("vjpb-cot", op, case)), out_shape, mx.float32)
    (out,), grads = mx.vjp(lambda x, y: OP_FN[op](x, y), [a, b], [cot])
    assert out.shape == out_shape
    want = _ref_vjp(lambda x, y: gemm_reference(op, x, y), [a, b], cot)
    assert grads[0].shape == a.shape and grads[1].shape == b.shape
    _grads_close(grads, want, mx.float32, 100, f"vjp {op}/{case}")


# =======================================================================================
# The emulator's race and bounds checks on the raw kernels, with the op's arguments
# =======================================================================================

SCHEDULE_CASES = {
    "scalar_db_pad_vec4": ("gemm_av", "float32", GemmConfig(
        path="scalar", tm=16, tn=16, tk=8, rm=2, rn=2, pad=1, double_buffer=True, vec4=True), (37, 36, 40), None),
    "scalar_db_pad_trans_a": ("gemm_at_b", "float16", GemmConfig(
        path="scalar", tm=16, tn=8, tk=8, rm=2, rn=2, pad=2, double_buffer=True), (37, 19, 35), None),
    "scalar_single_stage": ("gemm_a_bt", "bfloat16", GemmConfig(
        path="scalar", tm=8, tn=16, tk=8, rm=2, rn=2, pad=1), (19, 37, 35), None),
    "simd": ("gemm_a_bt", "bfloat16", GemmConfig(path="simd", bm=32, bn=32, bk=16, wm=2, wn=2), (40, 37, 40), None),
    "split_k": ("gemm_av", "float16", GemmConfig(path="simd", bm=16, bn=16, bk=8, wm=1, wn=2, split_k=3),
                (20, 35, 100), "silu"),
    "gemv": ("gemm_a_bt", "float32", GemmConfig(path="gemv", gemv_threads=128), (1, 37, 100), "gelu"),
    # row-major B: column blocks (COLS), whole runs (N % 8 == 0, 13 threadgroups) and ragged
    "gemv_cols": ("gemm_av", "bfloat16", GemmConfig(path="gemv", gemv_threads=128), (1, 200, 100), "gelu"),
    "gemv_cols_ragged": ("gemm_at_b", "float32", GemmConfig(path="gemv", gemv_threads=64), (1, 37, 70), None),
}


def _raw_case(name, spy):
    op, dtype_name, cfg, (m, n, k), act = SCHEDULE_CASES[name]
    dtype = DTYPES[dtype_name]
    a, b = operands(op, m, n, k, dtype, seed_of("raw", name))
    rng = np.random.default_rng(seed_of("raw-epi", name))
    bias = rand(rng, (n,), dtype) if act else None
    res = rand(rng, (m, n), dtype) if act else None
    calls = raw_calls(op, a, b, cfg, bias, ACT_CODE[act], res)
    # the reproduction is what the op launches
    if act:
        op_out = gemm_mod._run(op, a, b, bias, act, res, tiles=cfg)
    else:
        op_out = OP_FN[op](a, b, tiles=cfg)
    mx.eval(op_out)
    assert len(spy.calls) == len(calls)
    for rec, (spec, kwargs) in zip(spy.calls, calls):
        same_launch(rec, spec, kwargs)
    ref = np_reference(op, a, b, bias, act, res)
    return dtype, k, calls, ref, op_out


@pytest.mark.emulator_only
@pytest.mark.parametrize("name", SCHEDULE_CASES)
def test_check_schedules_raw_kernels(name, spy):
    from xlstm_kernels.emulate import check_schedules

    with use_backend("emulate"):
        dtype, k, calls, ref, op_out = _raw_case(name, spy)
    partial = None
    outs = None
    for spec, kwargs in calls:
        kernel = get_kernel(spec, "emulate")
        if kwargs["inputs"][0] is None:
            kwargs = {**kwargs, "inputs": [partial, *kwargs["inputs"][1:]]}
        outs = check_schedules(kernel, **kwargs)
        if spec is gemm_mod.SIMD and len(calls) > 1:
            partial = outs[1]
    c = outs[0].reshape(ref.shape)
    assert_close(c, ref, dtype, k, name)
    assert np.array_equal(f64(c), f64(op_out))


# The simd path's pipeline (gemm_simd's STAGES K tiles in flight: 3, 2, or 1 when one
# stage takes more than 16 KiB), its fragment pairs (xk_mma2_k16 when BK % 16 == 0, else
# xk_mma2; an odd last row block runs single products) and the 16-byte runs of its tile
# copies (edge runs element by element), in every operand layout, under several thread
# schedules (a missing barrier between a stage's copy and its readers changes the bits).
PIPELINE_CASES = {
    # name: (config, dtype, stages for (gemm_av, gemm_at_b, gemm_a_bt))
    "s3_k16_pairs": (GemmConfig(path="simd", bm=32, bn=16, bk=16, wm=2, wn=1), "float16", (3, 3, 3)),
    "s3_k8_odd_fm": (GemmConfig(path="simd", bm=24, bn=16, bk=8, wm=1, wn=2), "bfloat16", (3, 3, 3)),
    "s3_k16_odd_fm": (GemmConfig(path="simd", bm=40, bn=16, bk=16, wm=1, wn=1), "float16", (3, 3, 3)),
    "s2_half": (GemmConfig(path="simd", bm=64, bn=32, bk=64, wm=2, wn=1), "bfloat16", (2, 2, 2)),
    "s2_float": (GemmConfig(path="simd", bm=32, bn=64, bk=32, wm=1, wn=2), "float32", (2, 2, 2)),
    "s1_float": (GemmConfig(path="simd", bm=64, bn=64, bk=32, wm=2, wn=2), "float32", (1, 1, 1)),
}


@pytest.mark.emulator_only
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_simd_pipeline_stages_pairs_and_runs(name, op, spy):
    from xlstm_kernels.emulate import check_schedules

    cfg, dtype_name, stages = PIPELINE_CASES[name]
    dtype = DTYPES[dtype_name]
    assert gemm_mod.simd_stages(cfg, dtype, op == "gemm_at_b", op == "gemm_a_bt") == stages[OPS.index(op)]
    # >= 2 tiles along M and N, > 3 tiles of K (every stage reused), partial tiles, odd sizes
    m, n, k = 2 * cfg.bm + 5, 2 * cfg.bn + 3, 4 * cfg.bk - 3 if cfg.bk > 8 else 4 * cfg.bk + 3
    a, b = operands(op, m, n, k, dtype, seed_of("pipeline", name, op))
    rng = np.random.default_rng(seed_of("pipeline-epi", name, op))
    bias, res = rand(rng, (n,), dtype), rand(rng, (m, n), dtype)
    (spec, kwargs), = raw_calls(op, a, b, cfg, bias, ACT_CODE["gelu"], res)
    with use_backend("emulate"):
        out = check_schedules(get_kernel(spec, "emulate"), **kwargs, seeds=(1,))[0]
    assert_close(out.reshape(m, n), np_reference(op, a, b, bias, "gelu", res), dtype, k, f"{name}/{op}")


# The CUDA backend's automatic budget (stages = 0: 48 KiB, up to 4 stages;
# tiles.gemm.SIMD_AUTO_STAGES) against Apple's (32 KiB, 3): stages per (config, dtype, op).
CUDA_STAGE_CASES = [
    # config, dtype, op, stages on metal / emulate, stages on cuda
    (GemmConfig(path="simd", bm=128, bn=128, bk=16, wm=2, wn=4), "float16", "gemm_av", 3, 4),
    (GemmConfig(path="simd", bm=128, bn=128, bk=32, wm=2, wn=4), "float16", "gemm_av", 1, 2),
    (GemmConfig(path="simd", bm=128, bn=128, bk=32, wm=2, wn=4), "bfloat16", "gemm_at_b", 1, 2),
    (GemmConfig(path="simd", bm=128, bn=64, bk=32, wm=2, wn=2), "float16", "gemm_a_bt", 2, 3),
    (GemmConfig(path="simd", bm=128, bn=256, bk=16, wm=2, wn=4), "bfloat16", "gemm_av", 2, 3),
    (GemmConfig(path="simd", bm=32, bn=16, bk=16, wm=2, wn=1), "float16", "gemm_av", 3, 4),
    (GemmConfig(path="simd", bm=64, bn=64, bk=32, wm=2, wn=2), "float32", "gemm_av", 1, 2),
]


@pytest.mark.parametrize("case", range(len(CUDA_STAGE_CASES)))
def test_simd_stages_per_backend(case):
    cfg, dtype_name, op, apple, cuda = CUDA_STAGE_CASES[case]
    dtype = DTYPES[dtype_name]
    ta, tb = op == "gemm_at_b", op == "gemm_a_bt"
    assert gemm_mod.simd_stages(cfg, dtype, ta, tb) == apple
    assert gemm_mod.simd_stages(cfg, dtype, ta, tb, "emulate") == apple
    assert gemm_mod.simd_stages(cfg, dtype, ta, tb, "metal") == apple
    assert gemm_mod.simd_stages(cfg, dtype, ta, tb, "cuda") == cuda


def test_simd_auto_stage_budget():
    budget, most = gemm_mod.SIMD_STAGE_BUDGET["cuda"]
    assert (budget, most) == (48 * 1024, 4)  # CUDA's static shared memory: the presets' schedule
    assert "metal" not in gemm_mod.SIMD_STAGE_BUDGET and "emulate" not in gemm_mod.SIMD_STAGE_BUDGET  # 32 KiB, 3


# The 4 stages CUDA's automatic budget gives, run through the emulator on a tile small
# enough for 4 stages in 32 KiB (the config's explicit stages=4 picks the body's STAGES
# there): every stage reused over > 4 K tiles, all thread orders bit-identical, results as
# NumPy's.
FOUR_STAGE_CASES = {
    "k16_x4": (GemmConfig(path="simd", bm=64, bn=32, bk=16, wm=2, wn=1), "float16"),  # fast loop when aligned
    "k8_odd_fm": (GemmConfig(path="simd", bm=24, bn=16, bk=8, wm=1, wn=2), "bfloat16"),
}


@pytest.mark.emulator_only
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", FOUR_STAGE_CASES)
@pytest.mark.parametrize("aligned", [True, False])
def test_simd_four_stage_pipeline(name, op, aligned):
    from xlstm_kernels.emulate import check_schedules

    cfg, dtype_name = FOUR_STAGE_CASES[name]
    dtype = DTYPES[dtype_name]
    kernel = get_kernel(gemm_mod.SIMD, "emulate")
    # aligned: multiples of the tile (the unguarded fast loop); else partial tiles, odd sizes
    if aligned:
        m, n, k = 2 * cfg.bm, 3 * cfg.bn, 6 * cfg.bk
    else:
        m, n, k = 2 * cfg.bm + 5, 2 * cfg.bn + 3, 5 * cfg.bk + 3
    a, b = operands(op, m, n, k, dtype, seed_of("four-stage", name, op, aligned))
    ta, tb = op == "gemm_at_b", op == "gemm_a_bt"
    assert gemm_mod.simd_stages(cfg, dtype, ta, tb, "cuda") == 4
    assert gemm_mod.simd_stages(cfg, dtype, ta, tb, "emulate") == 3
    (_, kwargs), = raw_calls(op, a, b, cfg.replace(stages=4), None, 0, None)
    assert dict(kwargs["template"])["STAGES"] == 4
    # the kernel really holds 4 stages of tiles (what the 32 KiB budget alone allows: 3)
    size, p = dtype.size, 16 // dtype.size
    stage = size * ((cfg.bk * (cfg.bm + p) if ta else cfg.bm * (cfg.bk + p)) +
                    (cfg.bn * (cfg.bk + p) if tb else cfg.bk * (cfg.bn + p)))
    assert cfg.simd_stage_bytes(dtype, ta, tb) == stage
    assert cfg.replace(stages=4).simd_threadgroup_bytes(dtype, ta, tb, "emulate") == 4 * stage
    with pytest.MonkeyPatch.context() as mp:
        from xlstm_kernels.emulate import kernel as ek

        mp.setattr(ek, "MAX_THREADGROUP_MEMORY", 0)
        with pytest.raises(ek.EmulatorError, match=f"threadgroup memory of {4 * stage} bytes"):
            kernel(**{**kwargs, "shared_memory": 0})  # (as an Apple launch)
    with use_backend("emulate"):
        out = check_schedules(kernel, **kwargs, seeds=(1,))[0]
    assert_close(out.reshape(m, n), np_reference(op, a, b, None, None, None), dtype, k, f"{name}/{op}")


# The unguarded fast K loop runs STAGES tiles per trip (the stage is its unrolled
# counter): every stage count the budgets allow (1..4: the config's explicit stages) with
# K tile counts that end a trip early, fill it, and run one tile past
# it, all tiles interior (the fast path), with the fused epilogue stored in pairs; an odd N
# adds an edge tile and misaligned pair stores. "uneven": 64 threads and tiles whose 16-byte
# runs they do not divide evenly (A of gemm_av / gemm_a_bt: 96 runs, 2 per thread for
# rows < 16 only; B of gemm_av / gemm_a_bt: 32 runs): the fast copies' last-run guard.
FAST_LOOP_CONFIGS = {
    "even": GemmConfig(path="simd", bm=32, bn=32, bk=16, wm=2, wn=1),  # whole runs in every layout
    "uneven": GemmConfig(path="simd", bm=48, bn=16, bk=16, wm=2, wn=1),
}
FAST_LOOP_CASES = [("even", st, nt, odd) for st in (1, 2, 3, 4) for nt in (1, st + 1, 2 * st + 1)
                   for odd in (False, True) if not (odd and nt != st + 1)]
FAST_LOOP_CASES += [("uneven", st, st + 1, False) for st in (1, 3, 4)]


@pytest.mark.emulator_only
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("tile, stages, ntiles, odd_n", FAST_LOOP_CASES,
                         ids=[f"{c[0]}_st{c[1]}_t{c[2]}{'_oddn' if c[3] else ''}" for c in FAST_LOOP_CASES])
def test_simd_fast_loop_trips(op, tile, stages, ntiles, odd_n):
    from xlstm_kernels.emulate import check_schedules

    cfg, dtype = FAST_LOOP_CONFIGS[tile].replace(stages=stages), DTYPES["float16"]
    kernel = get_kernel(gemm_mod.SIMD, "emulate")
    m, n, k = 2 * cfg.bm, 2 * cfg.bn + (1 if odd_n else 0), ntiles * cfg.bk
    a, b = operands(op, m, n, k, dtype, seed_of("fast-loop-trips", op, tile, stages, ntiles, odd_n))
    rng = np.random.default_rng(seed_of("fast-loop-epi", op, tile, stages, ntiles, odd_n))
    bias, res = rand(rng, (n,), dtype), rand(rng, (m, n), dtype)
    (_, kwargs), = raw_calls(op, a, b, cfg, bias, ACT_CODE["silu"], res)
    with use_backend("emulate"):
        out = check_schedules(kernel, **kwargs, seeds=(1,))[0]
    assert_close(out.reshape(m, n), np_reference(op, a, b, bias, "silu", res), dtype, k,
                 f"{op} {tile} stages={stages} tiles={ntiles}")


# The large tiles for CUDA's tensor cores (scripts/probe_gemm.py's candidates: 64x64 or
# 32x64 simdgroup tiles, BK 32 / 64, explicit stages whose buffers need CUDA's dynamic
# shared memory) with the exact template the cuda backend launches (its STAGES), run
# through the emulator with its 32 KiB limit lifted: aligned multi-tile shapes (the
# unguarded fast loop, with K tile counts that end a trip early and run past one) and
# ragged odd shapes (the guarded path, partial tiles everywhere), every layout, 16-bit
# dtypes (float32 on the fp32 CUDA path for one), fused epilogue; all thread orders
# bit-identical.
CUDA_TILE_CASES = {
    # name: (config, dtype)
    "128x256x32_w2x4_s3": (GemmConfig(path="simd", bm=128, bn=256, bk=32, wm=2, wn=4, stages=3), "float16"),
    "128x256x32_w2x4_s4": (GemmConfig(path="simd", bm=128, bn=256, bk=32, wm=2, wn=4, stages=4), "bfloat16"),
    "256x128x32_w4x2_s3": (GemmConfig(path="simd", bm=256, bn=128, bk=32, wm=4, wn=2, stages=3), "bfloat16"),
    "128x256x64_w2x4_s3": (GemmConfig(path="simd", bm=128, bn=256, bk=64, wm=2, wn=4, stages=3), "float16"),
    "128x128x32_w2x4_s4": (GemmConfig(path="simd", bm=128, bn=128, bk=32, wm=2, wn=4, stages=4), "float16"),
    "128x128x32_w2x2_s4": (GemmConfig(path="simd", bm=128, bn=128, bk=32, wm=2, wn=2, stages=4), "bfloat16"),
    "128x256x32_w4x4_s4": (GemmConfig(path="simd", bm=128, bn=256, bk=32, wm=4, wn=4, stages=4), "float16"),
    "64x128x32_w2x2_s3_f32": (GemmConfig(path="simd", bm=64, bn=128, bk=32, wm=2, wn=2, stages=3), "float32"),
}


@pytest.mark.emulator_only
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", ["aligned", "ragged"])
@pytest.mark.parametrize("name", CUDA_TILE_CASES)
def test_simd_cuda_tiles_through_the_emulator(name, shape, op, monkeypatch):
    from xlstm_kernels.emulate import check_schedules
    from xlstm_kernels.emulate import kernel as ek

    cfg, dtype_name = CUDA_TILE_CASES[name]
    dtype = DTYPES[dtype_name]
    ta, tb = op == "gemm_at_b", op == "gemm_a_bt"
    cfg.validate(dtype, backend="cuda")
    need = cfg.simd_threadgroup_bytes(dtype, ta, tb, "cuda")
    if need > ek.MAX_THREADGROUP_MEMORY:
        with pytest.raises(TileConfigError, match=r"32 KiB.*backend 'emulate'"):
            cfg.validate(dtype, backend="emulate")
    monkeypatch.setattr(ek, "MAX_THREADGROUP_MEMORY", 1 << 20)
    if shape == "aligned":  # 2 x 2 tiles, K tiles = STAGES + 2: a full trip of the fast loop and a partial one
        m, n, k = 2 * cfg.bm, 2 * cfg.bn, (cfg.stages + 2) * cfg.bk
    else:  # 3 x 2 tiles with partial ones, odd K
        m, n, k = 2 * cfg.bm + 5, cfg.bn + 3, 3 * cfg.bk + 5
    a, b = operands(op, m, n, k, dtype, seed_of("cuda-tiles", name, shape, op))
    rng = np.random.default_rng(seed_of("cuda-tiles-epi", name, shape, op))
    bias, res = rand(rng, (n,), dtype), rand(rng, (m, n), dtype)
    (spec, kwargs), = raw_calls(op, a, b, cfg, bias, ACT_CODE["gelu_approx"], res, backend="cuda")
    assert dict(kwargs["template"])["STAGES"] == cfg.stages
    kernel = get_kernel(spec, "emulate")
    with pytest.MonkeyPatch.context() as mp:  # the kernel really holds the cuda schedule's buffer
        mp.setattr(ek, "MAX_THREADGROUP_MEMORY", 0)
        with pytest.raises(ek.EmulatorError, match=f"threadgroup memory of {need} bytes"):
            kernel(**{**kwargs, "shared_memory": 0})  # (as an Apple launch)
        with pytest.raises(ek.EmulatorError, match=f"exceeds the launch's shared_memory={need - 16}"):
            kernel(**{**kwargs, "shared_memory": need - 16})
    with use_backend("emulate"):
        out = check_schedules(kernel, **kwargs, schedules=("sequential", "random"), seeds=(1,))[0]
    assert_close(out.reshape(m, n), np_reference(op, a, b, bias, "gelu_approx", res), dtype, k,
                 f"{name} {shape} {op}")


# The same tiles through the public ops on the selected backend: on cuda with their stages
# (dynamic shared memory beyond 48 KiB; the GPU run of this file), elsewhere with as many
# stages as the backend's 32 KiB allow (skipped when one stage does not fit).
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", CUDA_TILE_CASES)
def test_simd_cuda_tiles_through_the_ops(kernel_backend, spy, name, op):
    cfg, dtype_name = CUDA_TILE_CASES[name]
    dtype = DTYPES[dtype_name]
    if not _runs_kernels(kernel_backend):
        pytest.skip("the reference backend runs no kernels")
    if kernel_backend != "cuda":
        cfg = cfg.replace(stages=0)
        if cfg.problems(dtype, kernel_backend):
            pytest.skip(f"one stage of {name} exceeds the 32 KiB of backend '{kernel_backend}'")
    m, n, k = 2 * cfg.bm + 5, cfg.bn + 3, 5 * cfg.bk + 7
    a, b = operands(op, m, n, k, dtype, seed_of("cuda-tiles-ops", name, op))
    _check_op(op, a, b, dtype, k, f"{name} {op}", tiles=cfg)
    (launched,) = spy.calls
    ta, tb = op == "gemm_at_b", op == "gemm_a_bt"
    assert launched.template["STAGES"] == cfg.simd_stages(dtype, ta, tb, kernel_backend)
    aligned = (2 * cfg.bm, 2 * cfg.bn, 4 * cfg.bk)
    a, b = operands(op, *aligned, dtype, seed_of("cuda-tiles-ops-aligned", name, op))
    _check_op(op, a, b, dtype, aligned[2], f"{name} {op} aligned", tiles=cfg)


# Warpgroup products (GemmConfig.warpgroup: gemm_simd's WG, CUDA's wgmma on sm_90a): every
# product width, 4 / 8 / 16 simdgroups, 3 and 4 stages, both 16-bit dtypes. Through the
# emulator as the CUDA launch each models (its shared_memory: 48-208 KiB): aligned 2 x 2
# tiles (the unguarded copies; K tiles = STAGES + 2, so the pipeline drains with products
# in flight) and ragged sizes (the guarded copies, partial tiles everywhere), every layout,
# the fused epilogue; all thread orders bit-identical. The portable products run
# asynchronously (recorded at xk_wg_mma, computed at xk_wg_wait), so a stage refilled
# before its products were waited for gives wrong results here as on the GPU.
WG_CASES = {
    "wg64x64_w4_s3": (GemmConfig(path="simd", bm=64, bn=64, bk=64, wm=4, wn=1, stages=3, warpgroup=True), "float16"),
    "wg128x128_w8_s4": (GemmConfig(path="simd", bm=128, bn=128, bk=64, wm=8, wn=1, stages=4, warpgroup=True),
                        "bfloat16"),
    "wg128x64_w8_s4": (GemmConfig(path="simd", bm=128, bn=64, bk=64, wm=8, wn=1, stages=4, warpgroup=True), "float16"),
    "wg128x256_w8_s3": (GemmConfig(path="simd", bm=128, bn=256, bk=64, wm=8, wn=1, stages=3, warpgroup=True),
                        "float16"),
    "wg256x128_w16_s3": (GemmConfig(path="simd", bm=256, bn=128, bk=64, wm=16, wn=1, stages=3, warpgroup=True),
                         "bfloat16"),
}


@pytest.mark.emulator_only
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", ["aligned", "ragged"])
@pytest.mark.parametrize("name", WG_CASES)
def test_warpgroup_tiles_through_the_emulator(name, shape, op):
    from xlstm_kernels.emulate import check_schedules

    cfg, dtype_name = WG_CASES[name]
    dtype = DTYPES[dtype_name]
    ta, tb = op == "gemm_at_b", op == "gemm_a_bt"
    cfg.validate(dtype, backend="emulate")
    cfg.validate(dtype, backend="cuda")
    if shape == "aligned":
        m, n, k = 2 * cfg.bm, 2 * cfg.bn, (cfg.stages + 2) * cfg.bk
    else:
        m, n, k = 2 * cfg.bm + 5, cfg.bn + 3, 3 * cfg.bk + 5
    a, b = operands(op, m, n, k, dtype, seed_of("wg-tiles", name, shape, op))
    rng = np.random.default_rng(seed_of("wg-tiles-epi", name, shape, op))
    bias, res = rand(rng, (n,), dtype), rand(rng, (m, n), dtype)
    (spec, kwargs), = raw_calls(op, a, b, cfg, bias, ACT_CODE["gelu_approx"], res)
    t = dict(kwargs["template"])
    assert t["WG"] is True and t["STAGES"] == cfg.stages
    assert kwargs["shared_memory"] == cfg.stages * 2 * (cfg.bm * cfg.bk + cfg.bk * cfg.bn)
    kernel = get_kernel(spec, "emulate")
    with use_backend("emulate"):
        out = check_schedules(kernel, **kwargs, schedules=("sequential", "random"), seeds=(1,))[0]
    assert_close(out.reshape(m, n), np_reference(op, a, b, bias, "gelu_approx", res), dtype, k,
                 f"{name} {shape} {op}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", WG_CASES)
def test_warpgroup_tiles_through_the_ops(kernel_backend, spy, name, op):
    """The public ops with warpgroup tiles (cuda: wgmma; emulate: the portable products),
    ragged and aligned, split-K too; float32 with the same tiles runs the simd path's own
    products (WG off)."""
    if kernel_backend not in ("cuda", "emulate"):
        pytest.skip(f"warpgroup tiles run on cuda and the emulator, not on {kernel_backend!r}")
    cfg, dtype_name = WG_CASES[name]
    dtype = DTYPES[dtype_name]
    m, n, k = 2 * cfg.bm + 7, cfg.bn + 9, 5 * cfg.bk + 3
    a, b = operands(op, m, n, k, dtype, seed_of("wg-ops", name, op))
    _check_op(op, a, b, dtype, k, f"{name} {op}", tiles=cfg)
    t = spy.only("gemm_simd").template
    assert t["WG"] is True and t["BN"] == cfg.bn
    spy.calls.clear()
    aligned = (2 * cfg.bm, cfg.bn, 4 * cfg.bk)
    a, b = operands(op, *aligned, dtype, seed_of("wg-ops-aligned", name, op))
    _check_op(op, a, b, dtype, aligned[2], f"{name} {op} aligned split-K", tiles=cfg.replace(split_k=2))
    assert [c.kernel for c in spy.calls] == ["gemm_simd", "gemm_split_k_reduce"]
    assert spy.calls[0].template["SPLIT"] == 2 and spy.calls[0].template["WG"] is True
    spy.calls.clear()
    if name == "wg64x64_w4_s3":  # float32: the same tiles without warpgroup products (padded float tiles)
        f32 = DTYPES["float32"]
        a, b = operands(op, 70, 67, 130, f32, seed_of("wg-ops-f32", op))
        if kernel_backend == "cuda":
            _check_op(op, a, b, f32, 130, f"{name} {op} float32", tiles=cfg)
            assert spy.only("gemm_simd").template["WG"] is False
        else:  # one stage of float tiles exceeds the emulator's 32 KiB: said so
            with pytest.raises(TileConfigError, match=r"needs 34816 bytes .* for float32"):
                _run_op(op, a, b, tiles=cfg)


@pytest.mark.parametrize("changes, fields", [
    ({"wn": 2, "bn": 128}, r"WN=1"),
    ({"wm": 6, "bm": 96}, r"WM to be a multiple of 4"),
    ({"bm": 128}, r"BM = 16\*WM = 64"),
    ({"bk": 32}, r"BK=64"),
    ({"bn": 192}, r"BN in \(64, 128, 256\)"),
    ({"stages": 2}, r"stages >= 3"),
])
def test_warpgroup_config_errors(changes, fields):
    good = GemmConfig(path="simd", bm=64, bn=64, bk=64, wm=4, wn=1, stages=3, warpgroup=True)
    good.validate(DTYPES["float16"], backend="cuda")
    with pytest.raises(TileConfigError, match=fields):
        good.replace(**changes).validate(DTYPES["float16"], backend="cuda")


def test_warpgroup_needs_cuda_shared_memory():
    cfg = GemmConfig(path="simd", bm=128, bn=256, bk=64, wm=8, wn=1, warpgroup=True)
    for backend in ("cuda", "emulate"):
        cfg.validate(DTYPES["bfloat16"], backend=backend)
    with pytest.raises(TileConfigError, match=r"backend 'metal' cannot run them"):
        cfg.validate(DTYPES["bfloat16"], backend="metal")
    # auto stages: as many as fit 227 KiB, at most 4, at least 3 (48 KiB per stage here)
    assert cfg.simd_stages(DTYPES["bfloat16"], False, False, "emulate") == 4
    assert cfg.replace(bm=256, wm=16).simd_stages(DTYPES["float16"], True, False, "cuda") == 3
    with pytest.raises(TileConfigError, match=r"STAGES=5 needs .* bytes"):
        cfg.replace(stages=5).validate(DTYPES["float16"], backend="cuda")


def test_preset_warpgroup_is_a_preference():
    """The nvidia_hopper preset's warpgroup tiles: a partial tiles= argument that does not
    make warpgroup tiles drops the preset's warpgroup (said in the sources); an explicit
    warpgroup=True with such tiles is an error naming the fields."""
    fam = "nvidia_hopper"
    small = {"path": "simd", "bm": 32, "bn": 32, "bk": 16, "wm": 2, "wn": 2}
    res = resolve_gemm_config("gemm_a_bt", 512, 2976, 1024, "float16", small, family=fam, backend="cuda")
    assert res.config.warpgroup is False and "dropped" in res.sources["warpgroup"]
    res = resolve_gemm_config("gemm_a_bt", 512, 2976, 1024, "float16", family=fam, backend="cuda")
    # (48 tiles of 128x256 are under half a wave: the waves rule steps down to 128x128)
    assert res.config.warpgroup is True and (res.config.bm, res.config.bn, res.config.wm) == (128, 128, 8)
    with pytest.raises(TileConfigError, match=r"warpgroup products needs WN=1"):
        resolve_gemm_config("gemm_a_bt", 512, 2976, 1024, "float16", {**small, "warpgroup": True}, family=fam,
                            backend="cuda")


def test_warpgroup_env_variable(monkeypatch):
    monkeypatch.setenv("XLSTM_GEMM_PATH", "simd")
    monkeypatch.setenv("XLSTM_GEMM_TILE_AV", "64x64x64")
    monkeypatch.setenv("XLSTM_GEMM_WARPS", "4x1")
    monkeypatch.setenv("XLSTM_GEMM_WARPGROUP", "1")
    cfg = resolve_gemm_config("gemm_av", 256, 256, 256, DTYPES["float16"], backend="emulate").config
    assert cfg.warpgroup is True and (cfg.bm, cfg.bn, cfg.bk, cfg.wm, cfg.wn) == (64, 64, 64, 4, 1)
    monkeypatch.setenv("XLSTM_GEMM_WARPGROUP", "maybe")
    with pytest.raises(TileConfigError, match="XLSTM_GEMM_WARPGROUP"):
        resolve_gemm_config("gemm_av", 256, 256, 256, DTYPES["float16"], backend="emulate")


# XK_GEMM_GROUP_M (threadgroups walk bands of G tile rows column by column): on a ragged
# 5 x 5 grid of tiles, bands that divide it, do not (a last band of fewer rows), and one
# band taller than the grid; split-K's grid z and the epilogue unchanged.
@pytest.mark.emulator_only
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("group", [2, 3, 8])
def test_simd_grouped_tile_order(op, group):
    from xlstm_kernels.emulate import metal_kernel

    cfg, dtype = GemmConfig(path="simd", bm=32, bn=16, bk=16, wm=2, wn=1, split_k=2), DTYPES["bfloat16"]
    spec = gemm_mod.SIMD
    kernel = metal_kernel(
        name=spec.kernel, input_names=list(spec.input_names), output_names=list(spec.output_names),
        source=spec.source(), header=f"#define XK_GEMM_GROUP_M {group}\n" + spec.full_header(),
        ensure_row_contiguous=spec.ensure_row_contiguous, atomic_outputs=spec.atomic_outputs,
    )
    m, n, k = 5 * cfg.bm - 3, 4 * cfg.bn + 5, 3 * cfg.bk + 5
    a, b = operands(op, m, n, k, dtype, seed_of("group-m", op, group))
    rng = np.random.default_rng(seed_of("group-m-epi", op, group))
    bias, res = rand(rng, (n,), dtype), rand(rng, (m, n), dtype)
    (main, main_kw), (red_spec, red_kw) = raw_calls(op, a, b, cfg, bias, ACT_CODE["relu"], res)
    with use_backend("emulate"):
        partial = kernel(**main_kw)[1]
        red_kw["inputs"][0] = partial
        out = get_kernel(red_spec, "emulate")(**red_kw)[0]
    assert_close(out.reshape(m, n), np_reference(op, a, b, bias, "relu", res), dtype, k, f"{op} G={group}")


# The large simd tiles scripts/probe_gemm.py compares on the H100 (16 warps of 32x64 or 64x32,
# 96-row tiles with uneven copy runs, 4 warps of 48x64): each through the emulator on 2 x 2
# tiles of aligned operands (the fast loop) and on ragged sizes (the guarded one), every layout.
LARGE_TILES = {
    "128x256x16_w4x4": GemmConfig(path="simd", bm=128, bn=256, bk=16, wm=4, wn=4),
    "256x128x16_w4x4": GemmConfig(path="simd", bm=256, bn=128, bk=16, wm=4, wn=4),
    "96x128x32_w2x4": GemmConfig(path="simd", bm=96, bn=128, bk=32, wm=2, wn=4),
    "96x128x32_w2x2": GemmConfig(path="simd", bm=96, bn=128, bk=32, wm=2, wn=2),
}


@pytest.mark.parametrize("ragged", [False, True], ids=["aligned", "ragged"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", LARGE_TILES)
def test_large_simd_tiles(kernel_backend, spy, name, op, ragged):
    cfg, dtype = LARGE_TILES[name], DTYPES["bfloat16" if ragged else "float16"]
    m, n, k = (2 * cfg.bm + 5, cfg.bn + 3, 3 * cfg.bk + 7) if ragged else (2 * cfg.bm, 2 * cfg.bn, 3 * cfg.bk)
    a, b = operands(op, m, n, k, dtype, seed_of("large-tiles", name, op, ragged))
    out = _run_op(op, a, b, tiles=cfg.to_dict())
    assert_close(out, np_reference(op, a, b), dtype, k, f"{name}/{op}")
    if _runs_kernels(kernel_backend):
        t = spy.only("gemm_simd").template
        assert [t[f] for f in ("BM", "BN", "BK", "WM", "WN", "SPLIT")] == [cfg.bm, cfg.bn, cfg.bk, cfg.wm, cfg.wn, 1]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_simd_operands_at_odd_offsets(kernel_backend, op, dtype_name):
    """Operands that start one element into their buffer (a sliced array reaches the kernel
    uncopied): the 16-byte copies of interior runs must not assume aligned rows."""
    dtype = DTYPES[dtype_name]
    cfg = GemmConfig(path="simd", bm=32, bn=32, bk=16, wm=2, wn=2)
    m, n, k = 67, 70, 72  # K, N multiples of 8: rows 16-byte aligned only when the base is
    sa, sb = operand_shapes(op, m, n, k)
    rng = np.random.default_rng(seed_of("offset", op, dtype_name))
    flat_a, flat_b = rand(rng, (math.prod(sa) + 1,), dtype), rand(rng, (math.prod(sb) + 3,), dtype)
    a, b = flat_a[1:].reshape(sa), flat_b[3:].reshape(sb)
    out = OP_FN[op](a, b, tiles=cfg)
    assert_close(out, np_reference(op, a, b), dtype, k, f"{op} at offsets")


@pytest.mark.parametrize("op", ["gemm_av", "gemm_at_b"])
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("threads", [32, 128, 1024])
@pytest.mark.parametrize("case", ["whole_runs", "ragged", "offset", "batched"])
def test_gemv_column_blocks(kernel_backend, spy, op, dtype_name, threads, case):
    """The M == 1 kernel on a row-major B (COLS > 0: column blocks of 16-byte runs, partial
    sums over a simdgroup's rows by xor shuffles, then over its simdgroups in threadgroup
    memory): whole runs (N a multiple of the run, several threadgroups, K not a multiple of
    the four rows in flight), a ragged N, operands one element into their buffers (element
    accesses), and a batch of B matrices (grid z), for 32 to 1024 threads, against float64."""
    dtype = DTYPES[dtype_name]
    cfg = GemmConfig(path="gemv", gemv_threads=threads)
    n, k = {"whole_runs": (264, 203), "ragged": (37, 70), "offset": (72, 70), "batched": (40, 33)}[case]
    lead_b = (3,) if case == "batched" else ()
    rng = np.random.default_rng(seed_of("gemv-cols", op, dtype_name, threads, case))
    if case == "offset":
        sa, sb = operand_shapes(op, 1, n, k)
        flat_a, flat_b = rand(rng, (math.prod(sa) + 1,), dtype), rand(rng, (math.prod(sb) + 3,), dtype)
        a, b = flat_a[1:].reshape(sa), flat_b[3:].reshape(sb)
    else:
        a, b = operands(op, 1, n, k, dtype, seed_of("gemv-cols-ab", op, dtype_name, threads, case), (), lead_b)
    out = OP_FN[op](a, b, tiles=cfg)
    assert_close(out, np_product(op, f64(a), f64(b)), dtype, k, f"{op}/{case}/{threads}")
    if _runs_kernels(kernel_backend):
        launched = spy.only("gemv")
        cols = cfg.gemv_cols(n, dtype, False)
        w = min(8, 16 // dtype.size)
        assert launched.template["COLS"] == cols >= 1 and launched.template["TRANS_B"] is False
        assert launched.grid == (32, threads // 32 * -(-n // (cols * w)), 3 if lead_b else 1)
        if case == "whole_runs":
            assert -(-n // (cols * w)) >= 2  # several threadgroups of column blocks


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("threads", [32, 256])
@pytest.mark.parametrize("k", [264, 1000, 70, "offset"])
@pytest.mark.parametrize("cps", [1, 4])
def test_gemv_transposed_b_runs(kernel_backend, spy, monkeypatch, dtype_name, threads, k, cps):
    """The M == 1 kernel on B as (N, K) rows (gemm_a_bt: a simdgroup per CPS columns, COLS):
    16-byte runs of a, each reused for the simdgroup's rows, for K a multiple of the run (one
    lane with two runs, many lanes with several), elements for K = 70 and for operands one
    element into their buffers; 1 or 4 columns a simdgroup (N = 37: the last simdgroup's
    columns partly past N); against float64."""
    from xlstm_kernels.tiles import gemm as tiles_gemm

    monkeypatch.setattr(tiles_gemm, "GEMV_ROW_TARGET_GROUPS", 1 if cps == 4 else 1 << 30)
    gemm_mod._LAUNCHERS.clear()
    gemm_mod._CALLS.clear()
    dtype = DTYPES[dtype_name]
    cfg = GemmConfig(path="gemv", gemv_threads=threads)
    n = 37
    rng = np.random.default_rng(seed_of("gemv-rows", dtype_name, threads, k))
    if k == "offset":
        k = 264
        sa, sb = operand_shapes("gemm_a_bt", 1, n, k)
        flat_a, flat_b = rand(rng, (math.prod(sa) + 1,), dtype), rand(rng, (math.prod(sb) + 3,), dtype)
        a, b = flat_a[1:].reshape(sa), flat_b[3:].reshape(sb)
    else:
        a, b = operands("gemm_a_bt", 1, n, k, dtype, seed_of("gemv-rows-ab", dtype_name, threads, k))
    out = gemm_a_bt(a, b, tiles=cfg)
    assert_close(out, np_product("gemm_a_bt", f64(a), f64(b)), dtype, k, f"gemm_a_bt/{k}/{threads}")
    if _runs_kernels(kernel_backend):
        launched = spy.only("gemv")
        assert launched.template["TRANS_B"] is True and launched.template["COLS"] == cps
        assert launched.grid == (32, threads // 32 * -(-n // (threads // 32 * cps)), 1)
    gemm_mod._LAUNCHERS.clear()
    gemm_mod._CALLS.clear()


def test_gemv_cols_choice():
    """COLS: at least 2 where the threadgroup holds two runs a row (whole 32-byte sectors),
    grown while GEMV_TARGET_GROUPS threadgroups remain, within a run per thread and
    GEMV_PART_BYTES of partial sums; on a transposed B the columns a simdgroup (1 to 4)."""
    from xlstm_kernels.tiles.gemm import GEMV_PART_BYTES, GEMV_TARGET_GROUPS

    g128, g32, g1024 = (GemmConfig(path="gemv", gemv_threads=t) for t in (128, 32, 1024))
    assert g128.gemv_cols(4096, mx.bfloat16, True) == 4  # 4096 / (4 x 4) = 256 groups >= 132
    assert g128.gemv_cols(1000, mx.bfloat16, True) == 1  # 250 groups; 2 would leave 125
    assert g32.gemv_cols(100, mx.float32, True) == 1
    assert g128.gemv_cols(4096, mx.bfloat16, False) == 2  # 4096 / 16 = 256 groups: no room to grow
    assert g128.gemv_cols(4096, mx.float32, False) == 2  # 512 groups; 4 would leave 256
    assert g128.gemv_cols(65536, mx.bfloat16, False) == 16  # a run per thread at most: 16 x 8 columns, 128 threads
    assert g32.gemv_cols(4096, mx.bfloat16, False) == 2  # 256 groups of 16 columns: 4 would leave 128
    assert g32.gemv_cols(1 << 20, mx.bfloat16, False) == 4  # 32 threads: at most 4 runs of 8 a row
    for cfg in (g128, g32, g1024):
        for n in (1, 37, 4096, 1 << 20):
            for dt in (mx.float32, mx.bfloat16):
                c = cfg.gemv_cols(n, dt, False)
                rows, w = cfg.gemv_threads // 32, 16 // dt.size
                assert c in (1, 2, 4, 8, 16, 32) and c * w <= cfg.gemv_threads and rows * c * w * 4 <= GEMV_PART_BYTES
                assert c <= 2 or -(-n // (c * w)) >= GEMV_TARGET_GROUPS


BOUNDS_CASES = [
    (op, path) for op in OPS for path in ("scalar_vec4_db", "scalar_pad", "simd", "split_k", "gemv")
]
BOUNDS_CONFIGS = {
    "scalar_vec4_db": (GemmConfig(path="scalar", tm=16, tn=16, tk=8, rm=2, rn=2, pad=0, double_buffer=True, vec4=True),
                       (21, 36, 28), "float16"),  # K, N multiples of 4: vector loads at the partial edges
    "scalar_pad": (GemmConfig(path="scalar", tm=32, tn=8, tk=16, rm=4, rn=2, pad=3), (35, 13, 37), "bfloat16"),
    "simd": (GemmConfig(path="simd", bm=32, bn=16, bk=8, wm=2, wn=1), (35, 21, 19), "float32"),
    "split_k": (GemmConfig(path="simd", bm=16, bn=16, bk=8, wm=1, wn=1, split_k=4), (19, 21, 43), "float16"),
    "gemv": (GemmConfig(path="gemv", gemv_threads=96), (1, 37, 45), "bfloat16"),
}


@pytest.mark.emulator_only
@pytest.mark.parametrize("op, path", BOUNDS_CASES)
def test_check_bounds_partial_tiles(op, path):
    cfg, (m, n, k), dtype_name = BOUNDS_CONFIGS[path]
    dtype = DTYPES[dtype_name]
    a, b = operands(op, m, n, k, dtype, seed_of("bounds", op, path))
    rng = np.random.default_rng(seed_of("bounds-epi", op, path))
    bias, res = rand(rng, (n,), dtype), rand(rng, (m, n), dtype)
    calls = raw_calls(op, a, b, cfg, bias, ACT_CODE["relu"], res)
    partial = None
    outs = None
    for spec, kwargs in calls:
        kernel = get_kernel(spec, "emulate")
        if kwargs["inputs"][0] is None:
            kwargs = {**kwargs, "inputs": [partial, *kwargs["inputs"][1:]]}
        if kwargs.get("init_value") is not None:
            kwargs = {**kwargs, "init_value": float("nan")}  # every used element must be written
        outs = kernel(**kwargs, check_bounds=True)
        if spec is gemm_mod.SIMD and len(calls) > 1:
            partial = outs[1]
            assert np.all(np.isfinite(np.asarray(partial))), "split-K partial sums left unwritten"
    c = outs[0].reshape(m, n)
    assert_close(c, np_reference(op, a, b, bias, "relu", res), dtype, k, f"{op}/{path} check_bounds")


# =======================================================================================
# Environment overrides change what runs
# =======================================================================================

ENV_CASES = {
    "tile_av": ("gemm_av", {"XLSTM_GEMM_TILE_AV": "16x8"}, (37, 19, 40),
                {"path": "scalar", "tm": 16, "tn": 8}, "gemm_scalar"),
    "tile_atb_micro": ("gemm_at_b", {"XLSTM_GEMM_TILE_ATB": "8x16x8", "XLSTM_GEMM_MICRO": "2x4"}, (19, 37, 21),
                       {"path": "scalar", "tm": 8, "tn": 16, "tk": 8, "rm": 2, "rn": 4}, "gemm_scalar"),
    "tile_abt_pad_db_vec4": ("gemm_a_bt", {"XLSTM_GEMM_TILE_ABT": "16x32", "XLSTM_GEMM_PAD": "3", "XLSTM_GEMM_DB": "on",
                                           "XLSTM_GEMM_VEC4": "false"}, (37, 70, 45),
                             {"path": "scalar", "tm": 16, "tn": 32, "pad": 3, "double_buffer": True, "vec4": False},
                             "gemm_scalar"),
    "pad_db_vec4_words": ("gemm_av", {"XLSTM_GEMM_PATH": "scalar", "XLSTM_GEMM_PAD": "yes", "XLSTM_GEMM_DB": "0",
                                      "XLSTM_GEMM_VEC4": "TRUE"}, (70, 68, 76),
                          {"path": "scalar", "pad": 1, "double_buffer": False, "vec4": True}, "gemm_scalar"),
    "align_execw": ("gemm_av", {"XLSTM_GEMM_TILE_AV": "16x16", "XLSTM_GEMM_MICRO": "2x1", "XLSTM_GEMM_ALIGN_EXECW": "1"},
                    (37, 70, 40), {"path": "scalar", "tm": 16, "tn": 32, "rm": 2, "rn": 1, "align_execw": True},
                    "gemm_scalar"),
    "path_simd_tile_warps": ("gemm_av", {"XLSTM_GEMM_PATH": "simd", "XLSTM_GEMM_TILE_AV": "16x32x8",
                                         "XLSTM_GEMM_WARPS": "1x2"}, (37, 70, 21),
                             {"path": "simd", "bm": 16, "bn": 32, "bk": 8, "wm": 1, "wn": 2, "split_k": 1}, "gemm_simd"),
    "split_k": ("gemm_at_b", {"XLSTM_GEMM_PATH": "simd", "XLSTM_GEMM_SPLIT_K": "3"}, (37, 35, 70),
                {"path": "simd", "split_k": 3}, "gemm_simd"),
    "gemv_threads": ("gemm_a_bt", {"XLSTM_GEMM_GEMV_THREADS": "64"}, (1, 37, 70),
                     {"path": "gemv", "gemv_threads": 64}, "gemv"),
    "path_scalar_for_m1": ("gemm_av", {"XLSTM_GEMM_PATH": "scalar"}, (1, 37, 70), {"path": "scalar"}, "gemm_scalar"),
    "device_m3": ("gemm_av", {"XLSTM_KERNELS_DEVICE": "m3"}, (37, 35, 40),
                  {"path": "simd", "bm": 32, "bn": 32, "bk": 16, "wm": 2, "wn": 2}, "gemm_simd"),
    "device_m2_ultra_f32": ("gemm_a_bt", {"XLSTM_KERNELS_DEVICE": "m2_ultra"}, (37, 70, 40),
                            {"path": "simd", "bm": 32, "bn": 64, "bk": 16, "wm": 1, "wn": 2}, "gemm_simd"),
    "user_presets_file": ("gemm_av", {"XLSTM_KERNELS_DEVICE": "cpu", "XLSTM_KERNELS_PRESETS": "{tmp}/user.yaml"},
                          (37, 19, 21), {"path": "scalar", "tm": 16, "tn": 8, "tk": 8, "rm": 2, "rn": 2},
                          "gemm_scalar"),
}
USER_PRESETS = ("families:\n  cpu:\n    gemm:\n      gemm_av:\n        default:\n"
                "          {path: scalar, tm: 16, tn: 8, tk: 8, rm: 2, rn: 2, double_buffer: false}\n")


@pytest.mark.parametrize("case", ENV_CASES)
def test_env_overrides_change_what_runs(kernel_backend, spy, monkeypatch, tmp_path, case):
    op, env, (m, n, k), expect, kernel = ENV_CASES[case]
    dtype = mx.float32
    a, b = operands(op, m, n, k, dtype, seed_of("env", case))
    before = explain(op, (a.shape, b.shape), dtype)
    (tmp_path / "user.yaml").write_text(USER_PRESETS)
    for var, value in env.items():
        monkeypatch.setenv(var, value.format(tmp=tmp_path))
    info = explain(op, (a.shape, b.shape), dtype)
    got = {f: info["config"][f] for f in expect}
    assert got == expect, (got, expect)
    if before["family"] != env.get("XLSTM_KERNELS_DEVICE"):  # (on a Mac that family may be the detected one)
        assert got != {f: before["config"][f] for f in expect}, "the environment changed nothing"
    env_vars = [v for v in env if v.startswith("XLSTM_GEMM_")]
    if env_vars:
        named = " ".join(info["sources"].values())
        assert all(v in named for v in env_vars), info["sources"]
    if case == "user_presets_file":
        assert info["sources"]["tm"].startswith(str(tmp_path / "user.yaml"))
    if case.startswith("device_"):
        assert info["family"] == env["XLSTM_KERNELS_DEVICE"]
    _check_op(op, a, b, dtype, k, case)
    if _runs_kernels(kernel_backend):
        launched = spy.calls[0]
        assert launched.kernel == kernel
        assert launched.threadgroup == tuple(info["threads"]) and launched.grid == tuple(info["grid"])
        cfg = GemmConfig(**info["config"])
        assert [(f, launched.template[f]) for f, _ in cfg.template_args(dtype)] == cfg.template_args(dtype)


def test_set_gemm_tiles_changes_what_runs(kernel_backend, spy):
    a, b = operands("gemm_at_b", 37, 19, 21, mx.float32, seed_of("set_gemm_tiles"))
    set_gemm_tiles(atb="16x8x8")
    _check_op("gemm_at_b", a, b, mx.float32, 21)
    if _runs_kernels(kernel_backend):
        t = spy.only("gemm_scalar").template
        assert (t["TM"], t["TN"], t["TK"]) == (16, 8, 8)


MALFORMED_ENV = [
    ("gemm_av", {"XLSTM_GEMM_TILE_AV": "abc"}, "XLSTM_GEMM_TILE_AV", "TMxTN"),
    ("gemm_av", {"XLSTM_GEMM_TILE_AV": "0x16"}, "XLSTM_GEMM_TILE_AV", "zero size"),
    ("gemm_av", {"XLSTM_GEMM_TILE_AV": "128x128x32", "XLSTM_GEMM_DB": "1"}, "XLSTM_GEMM_TILE_AV", "32 KiB"),
    ("gemm_av", {"XLSTM_GEMM_PAD": "maybe"}, "XLSTM_GEMM_PAD", "pad width"),
    ("gemm_av", {"XLSTM_GEMM_DB": "2"}, "XLSTM_GEMM_DB", "true, false"),
    ("gemm_av", {"XLSTM_GEMM_VEC4": "sure"}, "XLSTM_GEMM_VEC4", "true, false"),
    ("gemm_av", {"XLSTM_GEMM_ALIGN_EXECW": "y"}, "XLSTM_GEMM_ALIGN_EXECW", "true, false"),
    ("gemm_av", {"XLSTM_GEMM_PATH": "gpu"}, "XLSTM_GEMM_PATH", "'simd' or 'scalar'"),
    ("gemm_av", {"XLSTM_GEMM_SPLIT_K": "0"}, "XLSTM_GEMM_SPLIT_K", "integer >= 1"),
    ("gemm_av", {"XLSTM_GEMM_MICRO": "4"}, "XLSTM_GEMM_MICRO", "RMxRN"),
    ("gemm_av", {"XLSTM_GEMM_WARPS": "0x2"}, "XLSTM_GEMM_WARPS", "WMxWN"),
    ("gemm_av", {"XLSTM_GEMM_GEMV_THREADS": "100"}, "XLSTM_GEMM_GEMV_THREADS", "multiple of 32"),
    ("gemm_at_b", {"XLSTM_GEMM_TILE_ATB": "8x8x8x8"}, "XLSTM_GEMM_TILE_ATB", "TMxTN"),
    ("linear", {"XLSTM_GEMM_TILE_ABT": "30x32"}, "XLSTM_GEMM_TILE_ABT", "not a multiple of RM"),
    ("gemm_a_bt", {"XLSTM_KERNELS_PRESETS": "/nonexistent/presets.yaml"}, "XLSTM_KERNELS_PRESETS", "no such"),
]


@pytest.mark.parametrize("op, env, var, expect", MALFORMED_ENV, ids=[f"{v}={list(e.values())[0]}" for _, e, v, _ in
                                                                       MALFORMED_ENV])
def test_malformed_env_raises_naming_the_variable(kernel_backend, spy, monkeypatch, op, env, var, expect):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    x = mx.ones((8, 8))  # the values do not matter: nothing may run
    with pytest.raises(TileConfigError) as info:
        if op == "linear":
            linear(x, x)
        else:
            OP_FN[op](x, x)
    assert isinstance(info.value, ValueError)
    assert var in str(info.value) and expect in str(info.value), str(info.value)
    assert spy.calls == []


# =======================================================================================
# Bad inputs, dtype promotion, zero sizes
# =======================================================================================

F = mx.float32


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: gemm_av(mx.ones((4, 5)), mx.ones((6, 3))), ValueError, ["gemm_av", "disagree on n", "(4, 5)", "(6, 3)"]),
        (lambda: gemm_at_b(mx.ones((4, 5)), mx.ones((6, 3))), ValueError, ["gemm_at_b", "disagree on m"]),
        (lambda: gemm_a_bt(mx.ones((4, 5)), mx.ones((3, 6))), ValueError, ["gemm_a_bt", "disagree on k"]),
        (lambda: linear(mx.ones((4, 5)), mx.ones((3, 6))), ValueError, ["in_features"]),
        (lambda: gemm_av(mx.ones((5,)), mx.ones((5, 3))), ValueError, ["a", "at least 2"]),
        (lambda: gemm_at_b(mx.ones((5, 3)), mx.ones((5,))), ValueError, ["b", "at least 2"]),
        (lambda: gemm_av(mx.ones((4, 5)), mx.ones((5,))), ValueError, ["v", "at least 2"]),
        (lambda: linear(mx.ones((4, 5)), mx.ones((2, 3, 5))), ValueError, ["weight", "2 dimensions"]),
        (lambda: linear(mx.ones(()), mx.ones((3, 5))), ValueError, ["x", "at least 1"]),
        (lambda: gemm_av(mx.ones((4, 5), dtype=mx.int32), mx.ones((5, 3))), TypeError, ["a", "int32"]),
        (lambda: gemm_a_bt(mx.ones((4, 5)), mx.ones((3, 5), dtype=mx.int8)), TypeError, ["b", "int8"]),
        (lambda: linear(mx.ones((4, 5)), mx.ones((3, 5)), mx.ones((3,), dtype=mx.int32)), TypeError, ["bias", "int32"]),
        (lambda: gemm_av(np.ones((4, 5), np.float32), mx.ones((5, 3))), TypeError, ["a", "mx.array"]),
        (lambda: linear(mx.ones((4, 5)), mx.ones((3, 5)), mx.ones((4,))), ValueError, ["bias", "(3,)", "(4,)"]),
        (lambda: linear(mx.ones((4, 5)), mx.ones((3, 5)), mx.ones((1, 3))), ValueError, ["bias", "1 dimensions"]),
        (lambda: gemm_av(mx.ones((2, 4, 5)), mx.ones((3, 5, 3))), ValueError, ["batch dimensions", "broadcast"]),
        (lambda: linear(mx.ones((4, 5)), mx.ones((3, 5)), activation="tanh"), ValueError, ["activation", "tanh"]),
        (lambda: gemm_av(mx.ones((4, 5)), mx.ones((5, 3)), tiles="big"), TileConfigError, ["tiles= argument"]),
        (lambda: gemm_av(mx.ones((4, 5)), mx.ones((5, 3)), tiles={"tm": 30}), TileConfigError,
         ["tiles= argument", "RM"]),
    ],
)
def test_bad_inputs_raise_clear_errors(kernel_backend, spy, call, exc, words):
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    assert all(w in msg for w in words), msg
    assert spy.calls == []


def test_linear_bad_residual_names_residual(kernel_backend):
    with pytest.raises(ValueError, match="residual"):
        linear(mx.ones((4, 5)), mx.ones((3, 5)), residual=mx.ones((3, 7)))


def test_gemm_bad_residual_names_residual(kernel_backend):
    with pytest.raises(ValueError, match="residual"):
        gemm_mod._run("gemm_a_bt", mx.ones((4, 5)), mx.ones((3, 5)), residual=mx.ones((3, 7)))


MIXED = [(mx.float16, mx.float32), (mx.float32, mx.bfloat16), (mx.bfloat16, mx.float16), (mx.float16, mx.float16)]


@pytest.mark.parametrize("dta, dtb", MIXED, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op", OPS)
def test_mixed_dtypes_promote_like_matmul(kernel_backend, op, dta, dtb):
    m, n, k = 21, 19, 37
    rng = np.random.default_rng(seed_of("mixed", op, str(dta), str(dtb)))
    sa, sb = operand_shapes(op, m, n, k)
    a, b = rand(rng, sa, dta), rand(rng, sb, dtb)
    expected = mx.matmul(a.swapaxes(-1, -2) if op == "gemm_at_b" else a,
                         b.swapaxes(-1, -2) if op == "gemm_a_bt" else b).dtype
    out = _run_op(op, a, b)
    assert out.dtype == expected
    assert_close(out, np_product(op, f64(a), f64(b)), expected, k, f"{op} {dta} x {dtb}")


LINEAR_ZERO = [((0, 5), (6, 5)), ((2, 0, 5), (6, 5)), ((3, 5), (0, 5))]


@pytest.mark.parametrize("xs, ws", LINEAR_ZERO, ids=["rows0", "lead0", "out0"])
def test_zero_size_linear(kernel_backend, xs, ws):
    rng = np.random.default_rng(seed_of("zero-linear", xs, ws))
    x, w, b = rand(rng, xs, F), rand(rng, ws, F), rand(rng, (ws[0],), F)
    out = linear(x, w, b, "relu")
    assert out.shape == (*xs[:-1], ws[0]) and out.dtype == F and out.size == 0


ZERO_CASES = {
    "m0": ((0, 5, 7), (), ()),
    "n0": ((4, 0, 7), (), ()),
    "k0": ((4, 5, 0), (), ()),
    "batch0": ((4, 5, 7), (0,), ()),
    "batch0_bcast": ((4, 5, 7), (2, 0), (1,)),
    "m1_k0": ((1, 5, 0), (), ()),
}


@pytest.mark.parametrize("case", ZERO_CASES)
@pytest.mark.parametrize("op", OPS)
def test_zero_size_dims(kernel_backend, op, case):
    (m, n, k), lead_a, lead_b = ZERO_CASES[case]
    dtype = mx.float16
    sa, sb = operand_shapes(op, m, n, k, lead_a, lead_b)
    rng = np.random.default_rng(seed_of("zero", op, case))
    a, b = rand(rng, sa, dtype), rand(rng, sb, dtype)
    out = _run_op(op, a, b)
    want = (*np.broadcast_shapes(lead_a, lead_b), m, n)
    assert tuple(out.shape) == want and out.dtype == dtype
    assert np.array_equal(f64(out), np.zeros(want))


def test_zero_k_linear_is_the_epilogue_of_zero(kernel_backend):
    rng = np.random.default_rng(seed_of("zero-linear"))
    x, w, b, r = rand(rng, (3, 0), F), rand(rng, (6, 0), F), rand(rng, (6,), F), rand(rng, (3, 6), F)
    out = linear(x, w, b, "silu", r)
    assert out.shape == (3, 6)
    assert_close(out, np_activation(np.broadcast_to(f64(b), (3, 6)), "silu") + f64(r), F, 0)


# =======================================================================================
# The reference backend gives the same answers
# =======================================================================================


@pytest.mark.parametrize("op", [*OPS, "linear"])
def test_reference_backend_same_answers(kernel_backend, op):
    dtype = mx.bfloat16
    if op == "linear":
        x, w, b, r = _linear_case(dtype, seed_of("refbackend", op))
        run = lambda: linear(x, w, b, "gelu_approx", r)  # noqa: E731
        ref = _linear_reference(x, w, b, "gelu_approx", r)
        k = 40
    else:
        m, n, k = 33, 29, 31
        a, b = operands(op, m, n, k, dtype, seed_of("refbackend", op), (2,), ())
        run = lambda: OP_FN[op](a, b)  # noqa: E731
        ref = np_product(op, f64(a), f64(b))
    out_kernel = run()
    with use_backend("reference"):
        assert xlstm_kernels.current_backend() == "reference"
        out_ref = run()
    mx.eval(out_kernel, out_ref)
    assert_close(out_kernel, ref, dtype, k, f"{op} on {kernel_backend}")
    assert_close(out_ref, ref, dtype, k, f"{op} on reference")
    assert rel_err(f64(out_kernel), f64(out_ref)) <= tolerance(dtype, k)


# =======================================================================================
# explain() describes the launch the op makes
# =======================================================================================


class _Abort(Exception):
    pass


def _first_launch(monkeypatch, fn):
    """The op's first kernel launch, recorded and then aborted (nothing runs)."""
    seen = []

    def record(spec, **kwargs):
        seen.append((spec.kernel, tuple(kwargs["grid"]), tuple(kwargs["threadgroup"]), dict(kwargs["template"])))
        raise _Abort

    monkeypatch.setattr(gemm_mod, "prepare_launch", record)  # the op prepares its launch first
    gemm_mod._CALLS.clear()
    gemm_mod._LAUNCHERS.clear()
    with pytest.raises(_Abort):
        fn()
    return seen[0]


EXPLAIN_CASES = [
    pytest.param("m3", (3,), (3,), (40, 37, 64), None, id="batched_simd"),
    pytest.param(None, (2, 1), (1, 3), (40, 37, 64), "16x8", id="broadcast_scalar"),
    pytest.param("m3", (), (), (16, 16, 512), None, id="split_k_rule_2d"),
    pytest.param(None, (), (4,), (1, 37, 64), None, id="batched_gemv"),
    pytest.param("m3", (17,), (17,), (32, 32, 256), None, id="batched_split_k_rule"),
    pytest.param("m3", (), (), (5, 37, 40), {"path": "gemv", "bm": 16, "bn": 16, "wm": 1, "wn": 1},
                 id="gemv_path_with_m_gt_1"),
]


@pytest.mark.parametrize("device, lead_a, lead_b, mnk, tiles", EXPLAIN_CASES)
def test_explain_matches_the_launch(kernel_backend, monkeypatch, device, lead_a, lead_b, mnk, tiles):
    if not _runs_kernels(kernel_backend):
        pytest.skip("the reference backend launches no kernels")
    if device:
        monkeypatch.setenv("XLSTM_KERNELS_DEVICE", device)
    op = "gemm_av"
    a, b = operands(op, *mnk, mx.float32, seed_of("explain", mnk), lead_a, lead_b)
    info = explain(op, (a.shape, b.shape), mx.float32, tiles=tiles)
    kernel, grid, threads, template = _first_launch(monkeypatch, lambda: gemm_av(a, b, tiles=tiles))
    assert kernel == {"scalar": "gemm_scalar", "simd": "gemm_simd", "gemv": "gemv"}[info["path"]]
    assert threads == tuple(info["threads"])
    assert grid == tuple(info["grid"])
    if info["path"] == "simd":
        assert template["SPLIT"] == info["config"]["split_k"]


def test_bench_gemm_rows_report_queued_throughput():
    """GEMM bench rows on a timing backend carry the queued (20 calls per evaluation) and
    pipelined (async evaluation) measurements of ours and of the MLX baseline in `extra`,
    next to the synchronised one."""
    from xlstm_kernels.benchmarks import suite

    row, = suite.gemm_rows(["gemm_av"], [(40, 24, 16)], ["float32"], "reference", warmup=1, repeats=4)
    ex = row["extra"]
    assert row["ok"] and row["ratio"] is not None
    assert ex["ours_queued_ms"] > 0 and ex["mlx_queued_ms"] > 0
    assert ex["ratio_queued"] == pytest.approx(ex["mlx_queued_ms"] / ex["ours_queued_ms"])
    assert ex["gflops_queued"] == pytest.approx(2 * 40 * 24 * 16 / (ex["ours_queued_ms"] * 1e-3) / 1e9)
    assert ex["ours_pipelined_ms"] > 0 and ex["mlx_pipelined_ms"] > 0  # async evaluation, overlapped
    assert ex["ratio_pipelined"] == pytest.approx(ex["mlx_pipelined_ms"] / ex["ours_pipelined_ms"])


def test_measure_pipelined_counts_every_call_and_checks_its_arguments():
    """Each batch's calls are built once and evaluated (asynchronously, then waited for);
    the time is per call."""
    from xlstm_kernels.benchmarks.timing import measure_pipelined

    built = []
    x = mx.array(np.random.default_rng(3).standard_normal(64).astype(np.float32))

    def fn():
        built.append(1)
        return x * 2.0 + 1.0

    t = measure_pipelined(fn, calls=5, batches=3, repeats=2)
    assert t > 0 and len(built) == 5 + 2 * 3 * 5  # a warm-up batch, then repeats x batches x calls
    for bad in ({"calls": 0}, {"batches": 0}, {"repeats": 0}):
        with pytest.raises(ValueError, match="measure_pipelined"):
            measure_pipelined(fn, **bad)


def test_measure_step_loop_builds_each_step_once_and_evaluates_it():
    """Steps 0 .. n-1 are built in order, each evaluated (its values right), and the two
    per-step times are positive with the building part within the whole."""
    from xlstm_kernels.benchmarks.timing import measure_step_loop

    x = mx.array(np.random.default_rng(4).standard_normal(32).astype(np.float32))
    seen, outs = [], []

    def step(i):
        seen.append(i)
        out = x * float(i) + 1.0
        outs.append(out)
        return out

    whole, host = measure_step_loop(step, 5)
    assert seen == list(range(5)) and 0 < host <= whole
    for i, out in enumerate(outs):
        np.testing.assert_allclose(np.asarray(out), np.asarray(x) * i + 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="measure_step_loop"):
        measure_step_loop(step, 0)


def test_measure_pipelined_pair_interleaves_the_two_sides():
    """One run of each side per repeat, the side that goes first alternating; each run is
    measure_pipelined's (a warm-up batch, then the batches)."""
    from xlstm_kernels.benchmarks.timing import measure_pipelined_pair

    order = []
    x = mx.array(np.random.default_rng(4).standard_normal(64).astype(np.float32))

    def side(name):
        def fn():
            order.append(name)
            return x * 2.0 + 1.0
        return fn

    a, b = measure_pipelined_pair(side("a"), side("b"), calls=2, batches=3, repeats=3)
    assert a > 0 and b > 0
    runs = [order[i] for i in range(0, len(order), 2 * 4)]  # one run = (1 + 3 batches) x 2 calls
    assert runs == ["a", "b", "b", "a", "a", "b"] and len(order) == 3 * 2 * 4 * 2
    with pytest.raises(ValueError, match="measure_pipelined_pair"):
        measure_pipelined_pair(side("a"), side("b"), repeats=0)


def test_measure_chained_feeds_each_call_the_last_output():
    """Every call of a repeat takes the previous call's output (the first takes x0); the
    time is per call."""
    from xlstm_kernels.benchmarks.timing import measure_chained

    x0 = mx.array(np.random.default_rng(4).standard_normal(64).astype(np.float32))
    seen = []

    def step(x):
        seen.append(x)
        return x * 0.5 + 1.0

    t = measure_chained(step, x0, calls=4, repeats=3)
    assert t > 0 and len(seen) == 1 + 3 * 4  # a warm-up call, then repeats x calls
    for r in range(3):
        chain = seen[1 + 4 * r: 5 + 4 * r]
        assert chain[0] is x0
        for prev, cur in zip(chain, chain[1:]):
            np.testing.assert_allclose(np.asarray(cur), np.asarray(prev) * 0.5 + 1.0, rtol=1e-6)
    for bad in ({"calls": 0}, {"repeats": 0}):
        with pytest.raises(ValueError, match="measure_chained"):
            measure_chained(step, x0, **bad)


def test_measure_chained_pair_interleaves_the_two_chains():
    """One chain of each side per repeat, the side that goes first alternating; each chain
    feeds every call the last call's output; the result is (ours, theirs) per call."""
    from xlstm_kernels.benchmarks.timing import chained_repeats, measure_chained_pair

    x0 = mx.array(np.random.default_rng(6).standard_normal(32).astype(np.float32))
    order = []

    def make(tag, a):
        def step(x):
            order.append(tag)
            return x * a + 1.0
        return step

    ours, theirs = measure_chained_pair(make("o", 0.5), make("t", 0.25), x0, calls=3, repeats=4)
    assert ours > 0 and theirs > 0
    runs = "".join(order[2:])  # after one warm-up call of each
    assert runs == "ooo" "ttt" "ttt" "ooo" "ooo" "ttt" "ttt" "ooo", runs
    for bad in ({"calls": 0}, {"repeats": 0}):
        with pytest.raises(ValueError, match="measure_chained_pair"):
            measure_chained_pair(make("o", 0.5), make("t", 0.25), x0, **bad)
    assert [chained_repeats(r) for r in (1, 10, 14, 20)] == [5, 5, 7, 11]


def test_measure_chained_variants_rotates_the_order():
    """One chain of every variant per repeat, the order rotated by one place per repeat;
    each variant's prepare() runs before its chain (then one untimed call and an untimed
    two-call chain); fastest_quarter is the first quartile."""
    from xlstm_kernels.benchmarks.timing import fastest_quarter, measure_chained_variants

    x0 = mx.array(np.random.default_rng(7).standard_normal(16).astype(np.float32))
    order, prepared = [], []

    def variant(tag, a):
        def prepare():
            prepared.append(tag)

            def step(x):
                order.append(tag)
                return x * a + 1.0
            return step
        return tag, prepare

    times = measure_chained_variants([variant("a", 0.5), variant("b", 0.25), variant("c", 2.0)], x0, calls=2,
                                     repeats=4)
    assert sorted(times) == ["a", "b", "c"] and all(len(t) == 4 and min(t) > 0 for t in times.values())
    assert "".join(prepared) == "abc" "bca" "cab" "abc"
    # per chain: 1 warm-up call, a 2-call warm-up chain, then the 2 timed calls
    assert "".join(order) == "".join(tag * 5 for tag in "abcbcacababc")
    assert fastest_quarter([5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 7.0, 8.0]) == 3.0
    for bad in ({"calls": 0}, {"repeats": 0}):
        with pytest.raises(ValueError, match="measure_chained_variants"):
            measure_chained_variants([variant("a", 0.5)], x0, **bad)
    with pytest.raises(ValueError, match="measure_chained_variants"):
        measure_chained_variants([], x0)
    with pytest.raises(ValueError, match="fastest_quarter"):
        fastest_quarter([])


def test_measure_chained_keep_holds_every_output():
    """keep=True: every output of a repeat is still referenced when the chain is evaluated
    (no buffer can be donated along it); the chain is the same."""
    import gc
    import weakref

    from xlstm_kernels.benchmarks.timing import measure_chained

    x0 = mx.array(np.random.default_rng(5).standard_normal(64).astype(np.float32))
    refs, alive_at_eval = [], []
    real_eval = mx.eval

    def step(x):
        y = x * 0.5 + 1.0
        refs.append(weakref.ref(y))
        return y

    def eval_counting(*args):
        gc.collect()
        alive_at_eval.append(sum(r() is not None for r in refs))
        return real_eval(*args)

    mx.eval = eval_counting
    try:
        measure_chained(step, x0, calls=4, repeats=2, keep=True)
    finally:
        mx.eval = real_eval
    # the warm-up evaluates one call; then each repeat's 4 outputs are all alive at its eval
    assert alive_at_eval[1] >= 4 and alive_at_eval[2] >= 4
