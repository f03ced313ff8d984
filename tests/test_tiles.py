"""Tile configuration layer: precedence, validation, presets, device matching (no kernels run)."""

from __future__ import annotations

import os
import time
import warnings

import mlx.core as mx
import pytest

from xlstm_kernels import tiles
from xlstm_kernels.tiles import (
    GemmConfig,
    TileConfigError,
    detect_device,
    explain,
    get_gemm_tiles,
    reload_presets,
    resolve_gemm_config,
    roofline,
    set_gemm_tiles,
)
from xlstm_kernels.tiles import env as env_mod
from xlstm_kernels.tiles import presets as presets_mod
from xlstm_kernels.tiles import resolve as resolve_mod

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
OPS = ("gemm_av", "gemm_at_b", "gemm_a_bt")
SHIPPED = "presets.yaml: families."


def _reset():
    presets_mod._reset_caches()
    resolve_mod._reset()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No XLSTM_* variables, an empty config home, the cpu family, fresh caches."""
    for var in env_mod.GEMM_ENV_VARS:
        if var.startswith("XLSTM_"):
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config-home"))
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "cpu")
    _reset()
    yield
    _reset()


def _write(path, text):
    path.write_text(text)
    return path


def _expect_error(match_all, fn, *args, **kwargs):
    with pytest.raises(TileConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for part in match_all:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


# ---------------------------------------------------------------------------------------
# Precedence
# ---------------------------------------------------------------------------------------


def test_precedence_argument_env_user_shipped_default(monkeypatch, tmp_path):
    shape = (256, 256, 256)
    info = explain("gemm_av", shape, mx.float32)
    assert info["family"] == "cpu"
    assert info["sources"]["tm"] == SHIPPED + "cpu.gemm.default.default.tm"
    assert info["config"]["tm"] == 32

    # default user file (~/.config/xlstm_kernels/presets.yaml via XDG_CONFIG_HOME)
    home_file = tmp_path / "config-home" / "xlstm_kernels" / "presets.yaml"
    home_file.parent.mkdir(parents=True)
    _write(home_file, "families:\n  cpu:\n    gemm:\n      gemm_av:\n        float32: {tm: 16, tk: 8}\n")
    info = explain("gemm_av", shape, mx.float32)
    assert info["config"]["tm"] == 16
    assert info["sources"]["tm"] == f"{home_file}: families.cpu.gemm.gemm_av.float32.tm"
    assert info["sources"]["tn"].startswith(SHIPPED)

    # XLSTM_KERNELS_PRESETS file beats the default user file
    user = _write(tmp_path / "user.yaml", "version: 1\nfamilies:\n  cpu:\n    gemm:\n      default:\n        float32: {tm: 64, rm: 8}\n")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(user))
    info = explain("gemm_av", shape, mx.float32)
    assert info["config"]["tm"] == 64
    assert info["sources"]["tm"] == f"{user}: families.cpu.gemm.default.float32.tm"
    assert info["sources"]["tk"] == f"{home_file}: families.cpu.gemm.gemm_av.float32.tk"
    assert info["config"]["tk"] == 8

    # env beats user presets
    monkeypatch.setenv("XLSTM_GEMM_TILE_AV", "8x16")
    info = explain("gemm_av", shape, mx.float32)
    assert (info["config"]["tm"], info["config"]["tn"]) == (8, 16)
    assert info["sources"]["tm"] == "XLSTM_GEMM_TILE_AV"
    assert info["sources"]["rm"] == f"{user}: families.cpu.gemm.default.float32.rm"
    assert info["path"] == "scalar"

    # set_gemm_tiles beats env; the tiles= argument beats both
    set_gemm_tiles(av="16x32")
    info = explain("gemm_av", shape, mx.float32)
    assert (info["config"]["tm"], info["config"]["tn"]) == (16, 32)
    assert info["sources"]["tm"] == "set_gemm_tiles(av=...)"
    info = explain("gemm_av", shape, mx.float32, tiles={"tm": 32, "tn": 8})
    assert (info["config"]["tm"], info["config"]["tn"]) == (32, 8)
    assert info["sources"]["tm"] == "tiles= argument"
    assert info["sources"]["tk"] == f"{home_file}: families.cpu.gemm.gemm_av.float32.tk"
    # other ops are untouched by the gemm_av settings
    assert explain("gemm_a_bt", shape, mx.float32)["sources"]["tm"] == f"{user}: families.cpu.gemm.default.float32.tm"


def test_builtin_defaults_for_a_family_without_entries(monkeypatch, tmp_path):
    user = _write(tmp_path / "u.yaml", "families:\n  bare:\n    roofline: {fp32_tflops: 1, fp16_tflops: 1, bf16_tflops: 1, bandwidth_gbs: 10}\n")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(user))
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "bare")
    info = explain("gemm_av", (128, 128, 128), mx.float16)
    assert info["family"] == "bare"
    assert info["config"] == GemmConfig().to_dict()
    assert all(s == "built-in default" for f, s in info["sources"].items() if f != "split_k")
    assert info["roofline"]["fp32_tflops"] == 1.0


def test_gemm_config_argument_is_used_as_given():
    cfg = GemmConfig(path="scalar", tm=16, tn=64, tk=8, rm=2, rn=8, pad=2, double_buffer=True, vec4=True)
    res = resolve_gemm_config("gemm_a_bt", 1, 100, 100, mx.float16, cfg)
    assert res.config == cfg  # M == 1 does not override an explicit path
    assert set(res.sources.values()) == {"tiles= argument"}


def test_env_changes_take_effect_without_reload(monkeypatch):
    base = resolve_gemm_config("gemm_at_b", 128, 128, 128, mx.float32).config
    monkeypatch.setenv("XLSTM_GEMM_TILE_ATB", "16x16x8")
    cfg = resolve_gemm_config("gemm_at_b", 128, 128, 128, mx.float32).config
    assert (cfg.tm, cfg.tn, cfg.tk) == (16, 16, 8)
    monkeypatch.setenv("XLSTM_GEMM_TILE_ATB", "8x8")
    assert resolve_gemm_config("gemm_at_b", 128, 128, 128, mx.float32).config.tm == 8
    monkeypatch.delenv("XLSTM_GEMM_TILE_ATB")
    assert resolve_gemm_config("gemm_at_b", 128, 128, 128, mx.float32).config == base


def test_user_file_edits_are_picked_up(monkeypatch, tmp_path):
    user = _write(tmp_path / "u.yaml", "families:\n  cpu:\n    gemm:\n      default:\n        default: {tm: 16}\n")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(user))
    assert resolve_gemm_config("gemm_av", 64, 64, 64, "float32").config.tm == 16
    _write(user, "families:\n  cpu:\n    gemm:\n      default:\n        default: {tm: 64, rm: 8}\n")
    os.utime(user, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    # within STAMP_TTL_S of the last look the file is not stat()ed again ...
    monkeypatch.setattr(presets_mod, "STAMP_TTL_S", 3600.0)
    assert resolve_gemm_config("gemm_av", 64, 64, 64, "float32").config.tm == 16
    reload_presets()  # ... unless asked to
    assert resolve_gemm_config("gemm_av", 64, 64, 64, "float32").config.tm == 64
    _write(user, "families:\n  cpu:\n    gemm:\n      default:\n        default: {tm: 32}\n")
    os.utime(user, ns=(time.time_ns() + 2 * 10**9, time.time_ns() + 2 * 10**9))
    monkeypatch.setattr(presets_mod, "STAMP_TTL_S", 0.0)  # or once STAMP_TTL_S has passed
    assert resolve_gemm_config("gemm_av", 64, 64, 64, "float32").config.tm == 32


def test_missing_user_file_named(monkeypatch, tmp_path):
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(tmp_path / "nope.yaml"))
    _expect_error(["XLSTM_KERNELS_PRESETS", "nope.yaml"], resolve_gemm_config, "gemm_av", 8, 8, 8, "float32")


def test_set_gemm_tiles_roundtrip():
    assert get_gemm_tiles() == {"av": None, "atb": None, "abt": None}
    cfg = GemmConfig(path="simd", bm=64, bn=32)
    set_gemm_tiles(av="32x8", abt=cfg)
    assert get_gemm_tiles() == {"av": "32x8", "atb": None, "abt": cfg}
    assert resolve_gemm_config("gemm_av", 64, 64, 64, "float16").config.tn == 8
    assert resolve_gemm_config("gemm_a_bt", 64, 64, 64, "float16").config.bn == 32
    set_gemm_tiles()
    assert get_gemm_tiles() == {"av": None, "atb": None, "abt": None}
    assert resolve_gemm_config("gemm_av", 64, 64, 64, "float16").sources["tn"].startswith(SHIPPED)
    _expect_error(["set_gemm_tiles(atb=...)", "TMxTN"], set_gemm_tiles, atb="big")
    _expect_error(["set_gemm_tiles(av=...)", "bogus"], set_gemm_tiles, av={"bogus": 1})


# ---------------------------------------------------------------------------------------
# Shipped presets
# ---------------------------------------------------------------------------------------


def test_every_shipped_preset_validates():
    stack = presets_mod.current_stack()
    families = stack.family_keys()
    expected = {
        "m1", "m1_pro", "m1_max", "m1_ultra", "m2", "m2_pro", "m2_max", "m2_ultra", "m3", "m3_pro",
        "m3_max", "m3_ultra", "m4", "m4_pro", "m4_max", "m5", "generic_apple", "cpu",
    }
    assert expected <= set(families)
    shapes = [(1, 4096, 4096), (16, 16, 8192), (128, 128, 128), (4096, 4096, 4096), (33, 17, 5)]
    for fam in families:
        roof = roofline(fam)
        assert set(roof) == {"fp32_tflops", "fp16_tflops", "bf16_tflops", "bandwidth_gbs"}
        assert all(v > 0 for v in roof.values())
        if fam not in ("cpu", "generic_apple"):
            assert stack.match(fam)["architecture"], fam
        for op in OPS:
            for dt in DTYPES:
                for m, n, k in shapes:
                    res = resolve_gemm_config(op, m, n, k, dt, family=fam)
                    cfg = res.config
                    backend = stack.backend(fam)  # a CUDA family's tiles may use CUDA's shared memory
                    cfg.validate(dt, source=f"{fam}/{op}", backend=backend)
                    assert res.family == fam
                    assert all(not s.startswith("built-in") for f, s in res.sources.items()), (fam, res.sources)
                    assert not cfg.problems(dt, backend)
                    if backend != "cuda":
                        assert cfg.threadgroup_bytes(dt) <= 32768
                    x, y, z = cfg.threads()
                    assert x * y * z <= 1024
                    # the scalar and simd configs of every entry are valid too, whatever the shape picks
                    for path in ("scalar", "simd"):
                        cfg.replace(path=path).validate(dt, backend=backend)


def test_shipped_defaults_follow_device_class():
    big = resolve_gemm_config("gemm_av", 2048, 2048, 2048, mx.float16, family="m3_max").config
    assert (big.path, big.bm, big.bn, big.bk, big.wm, big.wn) == ("simd", 64, 64, 16, 2, 2)
    base = resolve_gemm_config("gemm_av", 2048, 2048, 2048, mx.float16, family="m3").config
    assert (base.path, base.bm, base.bn, base.bk, base.wm, base.wn) == ("simd", 32, 32, 16, 2, 2)
    ultra = resolve_gemm_config("gemm_a_bt", 2048, 2048, 2048, mx.float32, family="m2_ultra").config
    assert (ultra.bm, ultra.bn, ultra.bk, ultra.wm, ultra.wn) == (32, 64, 16, 1, 2)
    assert roofline("m1") == {"fp32_tflops": 2.6, "fp16_tflops": 2.6, "bf16_tflops": 1.3, "bandwidth_gbs": 68.0}
    assert roofline("m4_max")["bandwidth_gbs"] == 546.0
    _expect_error(["unknown family", "m99"], roofline, "m99")


def test_device_rooflines_replace_figures_for_the_devices_they_name(monkeypatch, tmp_path):
    # shipped: an H200 shares the H100's family (tiles, SMs) but not its bandwidth
    h100 = roofline("nvidia_hopper", "NVIDIA H100 80GB HBM3")
    h200 = roofline("nvidia_hopper", "NVIDIA H200")
    assert h100 == roofline("nvidia_hopper") and h100["bandwidth_gbs"] == 3350.0
    assert h200 == {**h100, "bandwidth_gbs": 4800.0}
    # a user file: the longest matching name wins, a tie goes to the higher-precedence file,
    # and the family's own figures fill the rest
    user = _write(tmp_path / "u.yaml", "families:\n  bare:\n"
                  "    roofline: {fp32_tflops: 1, fp16_tflops: 2, bf16_tflops: 3, bandwidth_gbs: 10}\n"
                  "    device_rooflines:\n      X1: {bandwidth_gbs: 20}\n      X1 Max: {bandwidth_gbs: 40, fp32_tflops: 4}\n")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(user))
    assert roofline("bare", "Acme X1 Max") == {"fp32_tflops": 4.0, "fp16_tflops": 2.0, "bf16_tflops": 3.0,
                                               "bandwidth_gbs": 40.0}
    assert roofline("bare", "acme x1")["bandwidth_gbs"] == 20.0  # case-insensitive
    assert roofline("bare", "Acme X2")["bandwidth_gbs"] == 10.0
    assert roofline("bare")["bandwidth_gbs"] == 10.0  # a named family without a device: its own figures
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "bare")  # this device: named by the override, no match
    assert roofline()["bandwidth_gbs"] == 10.0
    # the same name in a higher-precedence file than the shipped one: the user's figures
    user2 = _write(tmp_path / "u2.yaml", "families:\n  nvidia_hopper:\n    device_rooflines: {h200: {bandwidth_gbs: 4000}}\n")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(user2))
    assert roofline("nvidia_hopper", "NVIDIA H200")["bandwidth_gbs"] == 4000.0
    assert roofline("nvidia_hopper", "NVIDIA H100")["bandwidth_gbs"] == 3350.0


# ---------------------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tile, tm, tn, threads", [("32x8", 32, 8, (2, 8, 1)), ("8x32", 8, 32, (8, 2, 1))])
def test_rectangular_tiles_stay_rectangular(monkeypatch, tile, tm, tn, threads):
    for how in ("argument", "env"):
        if how == "env":
            monkeypatch.setenv("XLSTM_GEMM_TILE_AV", tile)
            info = explain("gemm_av", ((100, 64), (64, 50)), mx.float32)
        else:
            info = explain("gemm_av", ((100, 64), (64, 50)), mx.float32, tiles=tile)
        cfg = info["config"]
        assert (info["path"], cfg["tm"], cfg["tn"], cfg["rm"], cfg["rn"]) == ("scalar", tm, tn, 4, 4)
        assert info["threads"] == threads
        # grid in threads: ceil(N/TN)*TN/RN x ceil(M/TM)*TM/RM
        assert info["grid"] == (-(-50 // tn) * (tn // 4), -(-100 // tm) * (tm // 4), 1)
        assert dict(info["template"])["TM"] == tm and dict(info["template"])["TN"] == tn


def test_align_execw_adjusts_tile_and_threads(monkeypatch):
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "m3")  # TK 16, no double buffering
    monkeypatch.setenv("XLSTM_GEMM_TILE_AV", "32x8")
    monkeypatch.setenv("XLSTM_GEMM_ALIGN_EXECW", "true")
    info = explain("gemm_av", (256, 256, 64), mx.float16)
    cfg = GemmConfig(**info["config"])
    assert cfg.align_execw and cfg.tn == 32 * cfg.rn == 128
    assert info["threads"] == cfg.threads() == (32, 8, 1)  # one row of threads = one simdgroup
    assert info["grid"] == (2 * 32, 8 * 8, 1)
    assert dict(info["template"])["TN"] == 128
    assert "align_execw" in info["sources"]["tn"] and "XLSTM_GEMM_ALIGN_EXECW" in info["sources"]["tn"]
    monkeypatch.setenv("XLSTM_GEMM_MICRO", "4x2")
    info = explain("gemm_av", (256, 256, 64), mx.float16)
    assert info["config"]["tn"] == 64 and info["threads"] == (32, 8, 1)
    # the constructor applies the rule too, so a config can never be inconsistent
    assert GemmConfig(align_execw=True, rn=1).tn == 32
    assert GemmConfig(align_execw=True, rn=1).replace(rn=2).tn == 64


def test_threadgroup_bytes_threads_and_template():
    s = GemmConfig(path="scalar", tm=32, tn=32, tk=16, rm=4, rn=4, pad=1, double_buffer=True, vec4=True)
    assert s.threadgroup_bytes(mx.float16) == 4 * (16 * 33 + 16 * 33) * 2
    assert s.threads() == (8, 8, 1)
    assert s.template_args(mx.float32) == [
        ("TM", 32), ("TN", 32), ("TK", 16), ("RM", 4), ("RN", 4), ("PAD", 1), ("DB", True), ("VEC4", True)
    ]
    d = GemmConfig(path="simd", bm=64, bn=64, bk=16, wm=2, wn=2)
    assert d.threadgroup_bytes(mx.float16) == 2 * (64 * 24 + 16 * 72)
    assert d.threadgroup_bytes(mx.float32) == 4 * (64 * 20 + 16 * 68)
    assert d.threads() == (64, 2, 1)
    assert d.grid(100, 130, 3) == (64 * 3, 2 * 2, 3)
    assert d.template_args(mx.bfloat16) == [("BM", 64), ("BN", 64), ("BK", 16), ("WM", 2), ("WN", 2)]
    g = GemmConfig(path="gemv", gemv_threads=256)
    assert g.threads() == (32, 8, 1) and g.threadgroup_bytes(mx.float32) == 0
    assert g.grid(1, 100) == (32, 8 * 13, 1)


def test_validate_names_source_and_limit():
    big = GemmConfig(path="scalar", tm=128, tn=128, tk=32, double_buffer=True)
    _expect_error(["my source", "65536 bytes", "32 KiB"], big.validate, mx.float32, source="my source")
    _expect_error(["argument", "not a multiple of RM"], GemmConfig(tm=30).validate, mx.float32)
    _expect_error(["4096 threads", "1024"], GemmConfig(tm=64, tn=64, rm=1, rn=1).validate, "float32")
    _expect_error(["BN=24", "8*WN=16"], GemmConfig(bn=24).validate, "float16")
    _expect_error(["35328 bytes", "float32"], GemmConfig(bm=128, bn=128, bk=32, wm=4, wn=4).validate, "float32")
    GemmConfig(bm=128, bn=128, bk=32, wm=4, wn=4).validate("float16")  # 2-byte tiles fit
    _expect_error(["VEC4", "multiples of 4"], GemmConfig(tn=6, rn=2, vec4=True).validate, "float32")
    _expect_error(["gemv_threads", "multiple of 32"], GemmConfig(gemv_threads=100).validate, "float32")


# ---------------------------------------------------------------------------------------
# Environment errors
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "var, value, expect",
    [
        ("XLSTM_GEMM_TILE_AV", "abc", "TMxTN"),
        ("XLSTM_GEMM_TILE_AV", "0x16", "TMxTN"),
        ("XLSTM_GEMM_TILE_AV", "32x", "TMxTN"),
        ("XLSTM_GEMM_TILE_AV", "8x8x8x8", "TMxTN"),
        ("XLSTM_GEMM_TILE_AV", "-8x8", "TMxTN"),
        ("XLSTM_GEMM_TILE_AV", "30x32", "not a multiple of RM"),
        ("XLSTM_GEMM_TILE_AV", "256x256", "threads per threadgroup"),
        ("XLSTM_GEMM_PAD", "maybe", "pad width"),
        ("XLSTM_GEMM_PAD", "-1", "pad width"),
        ("XLSTM_GEMM_DB", "2", "true, false"),
        ("XLSTM_GEMM_VEC4", "sure", "true, false"),
        ("XLSTM_GEMM_ALIGN_EXECW", "y", "true, false"),
        ("XLSTM_GEMM_PATH", "gpu", "'simd' or 'scalar'"),
        ("XLSTM_GEMM_SPLIT_K", "0", "integer >= 1"),
        ("XLSTM_GEMM_SPLIT_K", "two", "integer >= 1"),
        ("XLSTM_GEMM_MICRO", "4", "RMxRN"),
        ("XLSTM_GEMM_WARPS", "0x2", "WMxWN"),
        ("XLSTM_GEMM_GEMV_THREADS", "100", "multiple of 32"),
    ],
)
def test_malformed_env_values_name_the_variable(monkeypatch, var, value, expect):
    monkeypatch.setenv(var, value)
    _expect_error([var, expect], resolve_gemm_config, "gemm_av", 64, 64, 64, mx.float32)


def test_env_tile_beyond_32k_names_all_sources(monkeypatch):
    monkeypatch.setenv("XLSTM_GEMM_TILE_AV", "128x128x32")
    monkeypatch.setenv("XLSTM_GEMM_MICRO", "8x8")
    monkeypatch.setenv("XLSTM_GEMM_DB", "1")
    msg = _expect_error(
        ["XLSTM_GEMM_TILE_AV", "XLSTM_GEMM_DB", "needs", "bytes of threadgroup memory", "32 KiB"],
        resolve_gemm_config, "gemm_av", 512, 512, 512, mx.float16,
    )
    assert msg.index("XLSTM_GEMM_TILE_AV") < msg.index("XLSTM_GEMM_DB")
    monkeypatch.setenv("XLSTM_GEMM_DB", "0")
    monkeypatch.setenv("XLSTM_GEMM_PAD", "0")
    assert resolve_gemm_config("gemm_av", 512, 512, 512, mx.float16).config.scalar_bytes() == 32768  # exactly fits
    # the tile of another op's variable does not leak into gemm_av
    monkeypatch.setenv("XLSTM_GEMM_TILE_ABT", "nonsense")
    resolve_gemm_config("gemm_av", 512, 512, 512, mx.float16)
    _expect_error(["XLSTM_GEMM_TILE_ABT"], resolve_gemm_config, "gemm_a_bt", 512, 512, 512, mx.float16)


def test_env_tile_with_simd_path_sets_block(monkeypatch):
    monkeypatch.setenv("XLSTM_GEMM_PATH", "simd")
    monkeypatch.setenv("XLSTM_GEMM_TILE_AV", "64x32x32")
    monkeypatch.setenv("XLSTM_GEMM_WARPS", "2x1")
    info = explain("gemm_av", (256, 256, 256), "float16")
    c = info["config"]
    assert (info["path"], c["bm"], c["bn"], c["bk"], c["wm"], c["wn"]) == ("simd", 64, 32, 32, 2, 1)
    assert info["sources"]["path"] == "XLSTM_GEMM_PATH" and info["sources"]["bm"] == "XLSTM_GEMM_TILE_AV"
    assert info["threads"] == (32, 2, 1)
    assert info["grid"] == (32 * 8, 2 * 4, 1)
    # the tiles= string follows XLSTM_GEMM_PATH too
    assert resolve_gemm_config("gemm_av", 256, 256, 256, "float16", "32x64").config.bn == 64


def test_pad_and_bool_words(monkeypatch):
    for text, pad in (("0", 0), ("1", 1), ("true", 1), ("No", 0), ("4", 4)):
        monkeypatch.setenv("XLSTM_GEMM_PAD", text)
        assert resolve_gemm_config("gemm_av", 64, 64, 64, "float32").config.pad == pad
    monkeypatch.setenv("XLSTM_GEMM_DB", "off")
    monkeypatch.setenv("XLSTM_GEMM_VEC4", "YES")
    cfg = resolve_gemm_config("gemm_av", 64, 64, 64, "float32").config
    assert cfg.double_buffer is False and cfg.vec4 is True
    monkeypatch.setenv("XLSTM_GEMM_DB", "   ")  # empty counts as unset
    assert resolve_gemm_config("gemm_av", 64, 64, 64, "float32").config.double_buffer is True  # cpu preset


def test_preset_vec4_yields_to_an_unaligned_tile_but_explicit_vec4_errors(monkeypatch):
    monkeypatch.setenv("XLSTM_GEMM_TILE_AV", "32x6")
    monkeypatch.setenv("XLSTM_GEMM_MICRO", "4x2")
    res = resolve_gemm_config("gemm_av", 64, 64, 64, "float32")
    assert res.config.vec4 is False and "dropped" in res.sources["vec4"]
    monkeypatch.setenv("XLSTM_GEMM_VEC4", "1")
    _expect_error(["XLSTM_GEMM_VEC4", "VEC4"], resolve_gemm_config, "gemm_av", 64, 64, 64, "float32")


def test_argument_errors_name_the_argument():
    _expect_error(["tiles= argument", "TMxTN"], resolve_gemm_config, "gemm_av", 8, 8, 8, "float32", "abc")
    _expect_error(["tiles= argument", "unknown field 'tmm'"], resolve_gemm_config, "gemm_av", 8, 8, 8, "float32", {"tmm": 8})
    _expect_error(["tiles= argument", "positive integer"], resolve_gemm_config, "gemm_av", 8, 8, 8, "float32", {"tm": "8"})
    _expect_error(["tiles= argument", "65536 bytes"], resolve_gemm_config, "gemm_av", 8, 8, 8, "float32",
                  {"tm": 128, "tn": 128, "tk": 32, "rm": 8, "rn": 8, "pad": 0, "double_buffer": True})
    _expect_error(["tiles= argument"], resolve_gemm_config, "gemm_av", 8, 8, 8, "float32", 42)
    _expect_error(["op", "gemm_av"], resolve_gemm_config, "gemm", 8, 8, 8, "float32")
    _expect_error(["dtype", "float32"], resolve_gemm_config, "gemm_av", 8, 8, 8, mx.int32)


# ---------------------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------------------

_ENTRY = "families:\n  cpu:\n    gemm:\n      gemm_av:\n        float32:\n          {body}\n"


@pytest.mark.parametrize(
    "text, expect",
    [
        (_ENTRY.format(body="tmm: 16"), ["families.cpu.gemm.gemm_av.float32.tmm", "unknown key"]),
        (_ENTRY.format(body="tm: abc"), ["families.cpu.gemm.gemm_av.float32.tm", "positive integer"]),
        (_ENTRY.format(body="tm: 16.0"), ["families.cpu.gemm.gemm_av.float32.tm", "positive integer"]),
        (_ENTRY.format(body="vec4: 1"), ["families.cpu.gemm.gemm_av.float32.vec4", "true or false"]),
        (_ENTRY.format(body="path: gemv"), ["families.cpu.gemm.gemm_av.float32.path", "'simd' or 'scalar'"]),
        (_ENTRY.format(body="{tm: 30, rm: 4}"), ["families.cpu.gemm.gemm_av.float32.tm", "not a multiple of RM"]),
        (
            _ENTRY.format(body="{tm: 128, tn: 128, tk: 32, rm: 8, rn: 8, double_buffer: true}"),
            ["families.cpu.gemm.gemm_av.float32.tm", "65536 bytes", "32 KiB"],
        ),
        (_ENTRY.format(body="{bm: 128, bn: 128, bk: 32, wm: 4, wn: 4}"), ["families.cpu.gemm.gemm_av.float32.bm", "35328 bytes"]),
        ("families:\n  cpu:\n    gemm:\n      gemm_xx: {}\n", ["families.cpu.gemm.gemm_xx", "unknown key"]),
        ("families:\n  cpu:\n    gemm:\n      gemm_av:\n        int8: {}\n", ["families.cpu.gemm.gemm_av.int8", "unknown key"]),
        ("families:\n  cpu:\n    tiles: {}\n", ["families.cpu.tiles", "unknown key"]),
        ("families:\n  cpu:\n    gemm: [1, 2]\n", ["families.cpu.gemm", "expected a mapping"]),
        ("families:\n  cpu:\n    roofline: {fp32_tflops: -1}\n", ["families.cpu.roofline.fp32_tflops", "positive number"]),
        ("families:\n  cpu:\n    device_rooflines: {X1: {bandwidth_gbs: 0}}\n",
         ["families.cpu.device_rooflines.X1.bandwidth_gbs", "positive number"]),
        ("families:\n  cpu:\n    device_rooflines: {X1: {speed: 2}}\n", ["families.cpu.device_rooflines.X1.speed", "unknown key"]),
        ("families:\n  cpu:\n    device_rooflines: [X1]\n", ["families.cpu.device_rooflines", "expected a mapping"]),
        ("families:\n  cpu:\n    device_rooflines: {' ': {bandwidth_gbs: 1}}\n", ["families.cpu.device_rooflines", "empty"]),
        ("families:\n  cpu:\n    match: {architecture: 5}\n", ["families.cpu.match.architecture", "list of"]),
        ("families:\n  cpu:\n    shapes:\n      huge: {}\n", ["families.cpu.shapes.huge", "unknown key"]),
        ("families:\n  bad-key: {}\n", ["families.bad-key", "letters, digits"]),
        ("version: 2\n", ["version", "only version 1"]),
        ("famlies: {}\n", ["famlies", "unknown key"]),
        ("families: [\n", ["not valid YAML"]),
    ],
)
def test_bad_yaml_names_file_and_key(monkeypatch, tmp_path, text, expect):
    user = _write(tmp_path / "bad.yaml", text)
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(user))
    _expect_error([str(user), *expect], resolve_gemm_config, "gemm_av", 64, 64, 64, mx.float32)


def test_partial_user_file_is_checked_only_on_what_it_sets(monkeypatch, tmp_path):
    # tm: 128 alone is fine: rm/rn come from lower levels and make it valid there
    user = _write(tmp_path / "u.yaml", _ENTRY.format(body="{tm: 64, rm: 8}"))
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(user))
    assert resolve_gemm_config("gemm_av", 64, 64, 64, mx.float32).config.tm == 64
    # a merged combination that breaks a limit names the file's key and the other source
    user2 = _write(tmp_path / "u2.yaml", _ENTRY.format(body="{tm: 128, tn: 128}"))
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(user2))
    monkeypatch.setenv("XLSTM_GEMM_MICRO", "1x1")
    _expect_error([f"{user2}: families.cpu.gemm.gemm_av.float32.tm", "XLSTM_GEMM_MICRO", "threads"],
                  resolve_gemm_config, "gemm_av", 64, 64, 64, mx.float32)


def test_user_shapes_section(monkeypatch, tmp_path):
    text = (
        "families:\n  cpu:\n    shapes:\n      large:\n        default:\n          default: {tm: 64, rm: 8}\n"
        "      small:\n        gemm_av:\n          float16: {tm: 8}\n"
    )
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(_write(tmp_path / "s.yaml", text)))
    assert tiles.shape_class(127, 128, 128) == "small" and tiles.shape_class(1024, 1024, 1024) == "large"
    res = resolve_gemm_config("gemm_av", 2048, 2048, 2048, mx.float32)
    assert res.shape_class == "large" and res.config.tm == 64
    assert res.sources["tm"].endswith("families.cpu.shapes.large.default.default.tm")
    assert resolve_gemm_config("gemm_av", 16, 16, 16, mx.float16).config.tm == 8
    assert resolve_gemm_config("gemm_av", 16, 16, 16, mx.float32).config.tm == 32  # shipped
    assert resolve_gemm_config("gemm_av", 256, 256, 256, mx.float16).config.tm == 32  # medium: shipped


# ---------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, arch, family",
    [
        ("Apple M1", "applegpu_g13g", "m1"),
        ("Apple M1 Ultra", "applegpu_g13d", "m1_ultra"),
        ("Apple M2 Max", "applegpu_g14c", "m2_max"),
        ("Apple M3 Pro", "applegpu_g15s", "m3_pro"),
        ("Apple M4", "applegpu_g16g", "m4"),
        ("Apple M4 Max", "applegpu_g16c", "m4_max"),
        ("Apple M5", "applegpu_g17g", "m5"),
        ("Apple M4 Pro", "", "m4_pro"),  # no architecture: longest device-name match
    ],
)
def test_device_matching(monkeypatch, name, arch, family):
    monkeypatch.delenv("XLSTM_KERNELS_DEVICE")
    monkeypatch.setattr(presets_mod, "_hardware", lambda: (name, arch))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        info = detect_device()
    assert info == tiles.DeviceInfo(name, arch, family)
    assert explain("gemm_av", (64, 64, 64), "float16")["family"] == family


def test_cpu_without_metal(monkeypatch):
    monkeypatch.delenv("XLSTM_KERNELS_DEVICE")
    monkeypatch.setattr(presets_mod, "_hardware", lambda: None)
    assert detect_device().family_key == "cpu"
    assert roofline() == roofline("cpu")


def test_unknown_device_warns_once_and_uses_generic(monkeypatch):
    monkeypatch.delenv("XLSTM_KERNELS_DEVICE")
    monkeypatch.setattr(presets_mod, "_hardware", lambda: ("Apple M9 Hyper", "applegpu_g99x"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for shape in ((64, 64, 64), (128, 128, 128), (64, 64, 64)):
            res = resolve_gemm_config("gemm_av", *shape, mx.float16)
            assert res.family == "generic_apple"
        assert detect_device().family_key == "generic_apple"
        assert roofline() == roofline("generic_apple")
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "generic_apple" in msgs[0] and "applegpu_g99x" in msgs[0]


def test_device_override_env(monkeypatch):
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "m2_pro")
    assert detect_device().family_key == "m2_pro"
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "applegpu_g15c")  # an architecture string matches too
    assert detect_device().family_key == "m3_max"
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "no_such_chip")
    with pytest.warns(UserWarning, match="generic_apple"):
        assert detect_device().family_key == "generic_apple"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_gemm_config("gemm_av", 8, 8, 8, "float32").family == "generic_apple"


# ---------------------------------------------------------------------------------------
# Shape rules
# ---------------------------------------------------------------------------------------


def test_m1_picks_gemv_unless_a_path_is_forced(monkeypatch):
    for fam in ("cpu", "m3_max"):
        res = resolve_gemm_config("gemm_a_bt", 1, 4096, 4096, mx.float16, family=fam)
        assert res.config.path == "gemv" and "M == 1" in res.sources["path"]
        assert res.config.threads()[0] == 32 and res.config.threadgroup_bytes(mx.float16) == 0
    assert resolve_gemm_config("gemm_a_bt", 2, 4096, 4096, mx.float16, family="m3_max").config.path == "simd"
    assert resolve_gemm_config("gemm_av", 1, 64, 64, "float32", {"path": "simd"}).config.path == "simd"
    assert resolve_gemm_config("gemm_av", 1, 64, 64, "float32", "32x8").config.path == "scalar"
    monkeypatch.setenv("XLSTM_GEMM_PATH", "scalar")
    assert resolve_gemm_config("gemm_av", 1, 64, 64, "float32").config.path == "scalar"
    monkeypatch.setenv("XLSTM_GEMM_PATH", "simd")
    assert resolve_gemm_config("gemm_av", 1, 64, 64, "float32").config.path == "simd"
    monkeypatch.delenv("XLSTM_GEMM_PATH")
    monkeypatch.setenv("XLSTM_GEMM_GEMV_THREADS", "64")
    info = explain("gemm_av", ((1, 300), (300, 100)), "float32")
    # a row-major B: column blocks of COLS = 2 threads x 4 float32 (13 blocks of 8 columns)
    assert info["path"] == "gemv" and info["threads"] == (32, 2, 1) and info["grid"] == (32, 2 * 13, 1)
    assert dict(info["template"])["COLS"] == 2
    info = explain("gemm_a_bt", ((1, 300), (100, 300)), "float32")  # (N, K) rows: a column a simdgroup here
    assert info["grid"] == (32, 100, 1) and dict(info["template"])["COLS"] == 1


def test_split_k_rule(monkeypatch):
    res = resolve_gemm_config("gemm_av", 16, 16, 8192, mx.float16, family="m3_max")
    assert res.config.path == "simd" and res.config.split_k == 4
    assert "split-K rule" in res.sources["split_k"]
    assert explain("gemm_av", (16, 16, 8192), mx.float16)["config"]["split_k"] == 1  # cpu: scalar path
    for shape in ((512, 512, 8192), (64, 64, 128), (128, 128, 512)):
        r = resolve_gemm_config("gemm_av", *shape, mx.float16, family="m3_max")
        assert r.config.split_k == 1, shape
    assert resolve_gemm_config("gemm_av", 64, 64, 512, mx.float16, family="m3_max").config.split_k == 4
    # the batch counts: many small products already fill the GPU
    assert resolve_gemm_config("gemm_av", 16, 16, 8192, mx.float16, batch=256, family="m3_max").config.split_k == 1
    # a short K caps the split so each part keeps 2*BK of K
    assert resolve_gemm_config("gemm_av", 4, 4, 256, "float32", family="m3_max").config.split_k == 4
    assert tiles.split_k_rule(16, 16, 8192) and not tiles.split_k_rule(16, 16, 64)
    # forced from the env for every shape on the simd path; ignored (and said so) on the scalar path
    monkeypatch.setenv("XLSTM_GEMM_SPLIT_K", "2")
    r = resolve_gemm_config("gemm_av", 512, 512, 512, mx.float16, family="m3_max")
    assert r.config.split_k == 2 and r.sources["split_k"] == "XLSTM_GEMM_SPLIT_K"
    r = resolve_gemm_config("gemm_av", 512, 512, 512, mx.float16, family="cpu")
    assert r.config.split_k == 1 and "ignored" in r.sources["split_k"]
    info = explain("gemm_av", (16, 16, 8192), mx.float16, tiles={"path": "simd", "split_k": 8})
    assert info["grid"][2] == 8


# ---------------------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------------------


def test_explain_operand_layouts_and_batch():
    assert explain("gemm_av", ((5, 7), (7, 9)), "float32")["mnk"] == (5, 9, 7)
    assert explain("gemm_at_b", ((7, 5), (7, 9)), "float32")["mnk"] == (5, 9, 7)
    assert explain("gemm_a_bt", ((5, 7), (9, 7)), "float32")["mnk"] == (5, 9, 7)
    assert explain("gemm_a_bt", (5, 9, 7), "float32")["mnk"] == (5, 9, 7)  # ints: output M, N, reduction K
    assert explain("gemm_av", (64, 64, 64), "float16", family="m4_pro")["family"] == "m4_pro"
    info = explain("gemm_a_bt", ((3, 1, 64, 32), (4, 48, 32)), "float16")
    assert info["batch"] == 12 and info["grid"][2] == 12
    for key in ("op", "device", "family", "dtype", "path", "config", "sources", "threads",
                "threadgroup_bytes", "grid", "roofline"):
        assert key in info
    roof = info["roofline"]
    assert roof["flops"] == 2 * 64 * 48 * 32 * 12 and roof["bound_us"] > 0
    _expect_error(["disagree"], explain, "gemm_av", ((5, 7), (8, 9)), "float32")
    _expect_error(["shapes"], explain, "gemm_av", (5, 7), "float32")


# ---------------------------------------------------------------------------------------
# simd stages and the per-backend threadgroup memory limit
# ---------------------------------------------------------------------------------------


def test_simd_stage_bytes_and_stage_counts():
    c = GemmConfig(path="simd", bm=128, bn=256, bk=32, wm=2, wn=4)
    # one stage per layout: A (128 x 40 | 32 x 136 transposed), B (32 x 264 | 256 x 40 transposed)
    assert c.simd_stage_bytes(mx.float16, False, False) == 2 * (128 * 40 + 32 * 264) == 27136
    assert c.simd_stage_bytes(mx.float16, True, False) == 2 * (32 * 136 + 32 * 264)
    assert c.simd_stage_bytes(mx.float16, False, True) == 2 * (128 * 40 + 256 * 40)
    assert c.simd_stage_bytes(mx.float16, False, False) == c.simd_bytes(mx.float16)  # gemm_av's, as before
    # auto (stages=0): Apple 32 KiB / 3, cuda 48 KiB / 4, at least one
    assert [c.simd_stages(mx.float16, False, False, be) for be in ("metal", "emulate", None, "cuda")] == [1, 1, 1, 1]
    small = GemmConfig(path="simd", bm=64, bn=32, bk=16, wm=2, wn=1)
    assert small.simd_stages(mx.float16, False, False, "emulate") == 3
    assert small.simd_stages(mx.float16, False, False, "cuda") == 4
    # an explicit count is used as given, everywhere
    s3 = c.replace(stages=3)
    assert [s3.simd_stages(mx.bfloat16, ta, tb, be) for ta, tb in ((0, 0), (1, 0), (0, 1)) for be in ("metal", "cuda")] \
        == [3] * 6
    assert s3.simd_threadgroup_bytes(mx.float16, False, False, "cuda") == 3 * 27136
    odd = GemmConfig(path="simd", bm=24, bn=16, bk=8, wm=1, wn=2, stages=3)  # 16-byte words, rounded up
    assert odd.simd_threadgroup_bytes(mx.float32, False, False) == -(-3 * odd.simd_stage_bytes(mx.float32, 0, 0) // 16) * 16


def test_simd_stage_limits_per_backend():
    big = GemmConfig(path="simd", bm=128, bn=256, bk=32, wm=2, wn=4, stages=3)  # 3 x 30 KiB (a_bt)
    assert big.problems(mx.float16) == [] and big.problems(mx.float16, "cuda") == []
    for backend in ("metal", "emulate"):
        msg = _expect_error(["STAGES=3", "92160 bytes", "32 KiB", f"backend '{backend}'", "stages <= 1", "stages=0"],
                            big.validate, mx.float16, backend=backend)
        assert "227 KiB" not in msg
    big.replace(stages=1).validate(mx.float16, backend="emulate")
    big.replace(stages=0).validate(mx.float16, backend="emulate")
    # one stage beyond 32 KiB: Apple (and no backend: the portable rule) refuse it, cuda takes it
    deep = GemmConfig(path="simd", bm=128, bn=256, bk=64, wm=2, wn=4, stages=3)
    _expect_error(["BK=64", "52224 bytes", "32 KiB"], deep.validate, mx.float16)
    _expect_error(["52224 bytes", "32 KiB"], deep.validate, mx.float16, backend="metal")
    deep.validate(mx.float16, backend="cuda")  # 3 x 54 KiB (a_bt) in 227 KiB
    _expect_error(["STAGES=5", "276480 bytes", "227 KiB", "stages <= 4"], deep.replace(stages=5).validate,
                  mx.float16, backend="cuda")
    huge = GemmConfig(path="simd", bm=512, bn=512, bk=128, wm=4, wn=8)
    _expect_error(["227 KiB", "smaller BMxBNxBK"], huge.validate, mx.float16, backend="cuda")
    # the field itself
    for bad in (-1, 9, True, 2.0):
        _expect_error(["stages", "from 0 (as many as fit) to 8"], GemmConfig(stages=bad).validate, mx.float16)


def test_stages_from_argument_env_and_backend_checked_resolve(monkeypatch):
    tiles = dict(path="simd", bm=128, bn=256, bk=32, wm=2, wn=4, stages=3)
    assert resolve_gemm_config("gemm_av", 512, 512, 512, mx.float16, tiles).config.stages == 3
    assert resolve_gemm_config("gemm_av", 512, 512, 512, mx.float16, tiles, backend="cuda").config.stages == 3
    _expect_error(["argument", "STAGES=3", "backend 'emulate'"], resolve_gemm_config, "gemm_av", 512, 512, 512,
                  mx.float16, tiles, backend="emulate")
    monkeypatch.setenv("XLSTM_GEMM_STAGES", "2")
    res = resolve_gemm_config("gemm_av", 512, 512, 512, mx.float16, dict(path="simd", bm=64, bn=64, bk=16))
    assert res.config.stages == 2 and res.sources["stages"] == "XLSTM_GEMM_STAGES"
    for bad in ("9", "-1", "two"):
        monkeypatch.setenv("XLSTM_GEMM_STAGES", bad)
        _expect_error(["XLSTM_GEMM_STAGES", "from 0 (as many as fit) to 8"], resolve_gemm_config, "gemm_av", 64, 64,
                      64, mx.float16)


def test_presets_check_stages_against_the_family_backend(monkeypatch, tmp_path):
    entry = "{path: simd, bm: 128, bn: 256, bk: 64, wm: 2, wn: 4, stages: 3}"
    cuda = ("families:\n  big_gpu:\n    match: {architecture: [sm_90]}\n"
            "    roofline: {fp32_tflops: 1, fp16_tflops: 1, bf16_tflops: 1, bandwidth_gbs: 10}\n"
            f"    gemm:\n      gemm_av:\n        float16: {entry}\n")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(_write(tmp_path / "cuda.yaml", cuda)))
    res = resolve_gemm_config("gemm_av", 4096, 4096, 4096, mx.float16, family="big_gpu", backend="cuda")
    assert (res.config.bk, res.config.stages) == (64, 3)
    assert res.sources["stages"].endswith("families.big_gpu.gemm.gemm_av.float16.stages")
    _reset()
    apple = cuda.replace("sm_90", "applegpu_g15s")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(_write(tmp_path / "apple.yaml", apple)))
    _expect_error(["families.big_gpu.gemm.gemm_av.float16", "52224 bytes", "32 KiB"], resolve_gemm_config,
                  "gemm_av", 64, 64, 64, mx.float16)
