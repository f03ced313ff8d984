"""Kernel knobs (xlstm_kernels.tiles.knobs): registry, strict preset sections, precedence
argument > env > user files > shipped > built-in, malformed variables, shape-fit skips, and
every knob value changing the launch while the results stay right (float64 references,
through the test backend's kernels)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from launch_spies import spy_prepared_launches

from xlstm_kernels.ops import attention as att
from xlstm_kernels.ops import mlstm as ml
from xlstm_kernels.ops import norm as nm
from xlstm_kernels.ops import slstm as sl
from xlstm_kernels.tiles import (
    KNOB_OPS,
    TileConfigError,
    explain_knobs,
    knob_env_var,
    knob_shape_class,
    reload_presets,
    resolve_knobs,
)
from xlstm_kernels.tiles import knobs as knobs_mod
from xlstm_kernels.tiles import presets as presets_mod
from xlstm_kernels.tiles import resolve as resolve_mod

SHIPPED = Path(presets_mod.shipped_presets_path())


def _reset():
    presets_mod._reset_caches()
    resolve_mod._reset()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No XLSTM_* tile or knob variables, an empty config home, the cpu family, fresh caches."""
    for var in list(os.environ):
        if var.startswith("XLSTM_") and var not in ("XLSTM_TEST_BACKEND", "XLSTM_EMULATE_WORKERS",
                                                    "XLSTM_EMULATE_STACK_KB", "XLSTM_KERNELS_EMULATE_CACHE"):
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config-home"))
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "cpu")
    _reset()
    yield
    _reset()


def seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def _presets(monkeypatch, path: Path, text: str) -> Path:
    """Write a user preset file named by XLSTM_KERNELS_PRESETS."""
    path.write_text(text)
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(path))
    return path


def _expect(match_all, fn, *args, exc=TileConfigError, **kwargs) -> str:
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for part in match_all:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


class Spy:
    """Records the launches of one ops module (and still runs them)."""

    def __init__(self, monkeypatch, module):
        self.calls: list[tuple[str, dict]] = []
        real = module.launch

        def spy(spec, **kwargs):
            self.calls.append((spec.kernel, kwargs))
            return real(spec, **kwargs)

        monkeypatch.setattr(module, "launch", spy)
        if hasattr(module, "prepare_launch"):  # memoised ops: prepared once, run per call
            spy_prepared_launches(monkeypatch, module, lambda spec, kw: self.calls.append((spec.kernel, kw)))

    def take(self) -> list[tuple[str, dict]]:
        out, self.calls = self.calls, []
        return out


def needs_kernels(backend):
    if backend == "reference":
        pytest.skip("the reference backend launches no kernels")


def f64(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32), dtype=np.float64)


def rel_err(out: mx.array, ref: np.ndarray) -> float:
    return float(np.max(np.abs(f64(out) - ref)) / max(np.max(np.abs(ref)), 1e-30))


# ---------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------


def test_registry_names_and_classes():
    assert KNOB_OPS == {
        "rms_norm": ("n_reads", "simd_rows", "looped_threads"),
        "layer_norm": ("n_reads", "simd_rows", "looped_threads"),
        "attention": ("block_q", "block_k", "split_kv_block_size", "split_kv_min_keys", "split_kv_mma",
                      "split_kv_cluster", "split_kv_stream", "prefill_mma"),
        "mlstm": ("chunk_size",),
        "slstm": ("threads_per_unit", "r_in_registers"),
        "fused": ("single_kernel",),
    }
    assert knob_env_var("rms_norm", "n_reads") == "XLSTM_RMS_NORM_N_READS"
    assert knob_env_var("fused", "single_kernel") == "XLSTM_FUSED_SINGLE_KERNEL"
    assert knob_env_var("attention", "block_k") == "XLSTM_ATTENTION_BLOCK_K"
    assert knob_env_var("mlstm", "chunk_size") == "XLSTM_MLSTM_CHUNK_SIZE"
    assert knob_env_var("slstm", "r_in_registers") == "XLSTM_SLSTM_R_IN_REGISTERS"
    _expect(["knob 'n_read'", "n_reads"], knob_env_var, "rms_norm", "n_read")
    _expect(["op 'gru'", "rms_norm"], resolve_knobs, "gru", "float32", 8)
    _expect(["dtype", "float32"], resolve_knobs, "mlstm", mx.int32, 8)
    bounds = {"rms_norm": [(128, "small"), (129, "medium"), (4096, "medium"), (4097, "large")],
              "attention": [(1023, "small"), (1024, "medium"), (8191, "medium"), (8192, "large")],
              "mlstm": [(255, "small"), (256, "medium"), (4095, "medium"), (4096, "large")],
              "slstm": [(32, "small"), (33, "medium"), (128, "medium"), (129, "large")]}
    for op, cases in bounds.items():
        for size, cls in cases:
            assert knob_shape_class(op, size) == cls, (op, size)
            assert resolve_knobs(op, "float16", size).shape_class == cls


def test_nothing_set_is_the_builtin_choice():
    for op, names in KNOB_OPS.items():
        res = resolve_knobs(op, mx.bfloat16, 100)
        assert res.values == {k: None for k in names} and res.skipped == [] and res.family == "cpu"
        assert all(s.startswith("built-in") for s in res.sources.values())
    assert sl.plan(64) == sl.SLSTMConfig(8, True)
    assert att.knob_values(40, 48, 32, 32, mx.float32) == {"block_q": 32, "block_k": 32, "split_kv_block_size": 256,
                                                           "split_kv_min_keys": 1024, "split_kv_mma": False,
                                                           "split_kv_cluster": 0, "split_kv_stream": None,
                                                           "prefill_mma": False}
    from xlstm_kernels.runtime import current_backend

    assert att.knob_values(1, 48, 32, 32, mx.float16)["split_kv_mma"] is (current_backend() != "metal")
    assert att.knob_values(40, 48, 32, 32, mx.float16)["prefill_mma"] is (current_backend() != "metal")
    assert ml.knob_values(70, mx.float16) == {"chunk_size": 64}
    assert nm.knob_values("rms_norm", 200, mx.float32) == {"n_reads": 4, "simd_rows": 8, "looped_threads": 1024}


# ---------------------------------------------------------------------------------------
# Preset schema
# ---------------------------------------------------------------------------------------

_K = "families:\n  cpu:\n    kernels:\n"


@pytest.mark.parametrize("text, expect", [
    (_K + "      rms_norm:\n        float32: {n_read: 4}\n",
     ["families.cpu.kernels.rms_norm.float32.n_read", "unknown key 'n_read'", "n_reads"]),
    (_K + "      rms_norm:\n        float32: {n_reads: 3}\n",
     ["families.cpu.kernels.rms_norm.float32.n_reads", "one of 1, 2, 4, 8", "got 3"]),
    (_K + "      layer_norm:\n        default: {n_reads: '4'}\n",
     ["families.cpu.kernels.layer_norm.default.n_reads", "integer", "'4'"]),
    (_K + "      rms_norm:\n        default: {looped_threads: 100}\n",
     ["families.cpu.kernels.rms_norm.default.looped_threads", "multiple of 32"]),
    (_K + "      attention:\n        float16: {block_k: 136}\n",
     ["families.cpu.kernels.attention.float16.block_k", "from 8 to 128"]),
    (_K + "      attention:\n        float16: {split_kv_block_size: 12}\n",
     ["families.cpu.kernels.attention.float16.split_kv_block_size", "multiple of 8"]),
    (_K + "      mlstm:\n        default: {chunk_size: 0}\n",
     ["families.cpu.kernels.mlstm.default.chunk_size", "from 1 to 128"]),
    (_K + "      mlstm:\n        default: {chunk_size: true}\n",
     ["families.cpu.kernels.mlstm.default.chunk_size", "integer"]),
    (_K + "      slstm:\n        float32: {r_in_registers: 1}\n",
     ["families.cpu.kernels.slstm.float32.r_in_registers", "boolean"]),
    (_K + "      slstm:\n        float32: {threads_per_unit: 64}\n",
     ["families.cpu.kernels.slstm.float32.threads_per_unit", "one of 1, 2, 4, 8, 16, 32"]),
    (_K + "      mlstm:\n        int8: {chunk_size: 8}\n", ["families.cpu.kernels.mlstm.int8", "unknown key 'int8'"]),
    (_K + "      gru:\n        default: {}\n", ["families.cpu.kernels.gru", "unknown key 'gru'", "rms_norm"]),
    (_K + "      gemm_av:\n        default: {}\n", ["families.cpu.kernels.gemm_av", "GEMM tiles go under gemm"]),
    (_K + "      medium:\n        rms_norm: {}\n",
     ["families.cpu.kernels.medium", "shape classes go under kernel_shapes"]),
    (_K + "      slstm:\n        float32: {chunk_size: 8}\n",
     ["families.cpu.kernels.slstm.float32.chunk_size", "unknown key"]),
    ("families:\n  cpu:\n    kernel_shapes:\n      rms_norm:\n        float32: {n_reads: 2}\n",
     ["families.cpu.kernel_shapes.rms_norm", "small, medium, large", "the class comes first"]),
    ("families:\n  cpu:\n    kernel_shapes:\n      huge: {}\n", ["families.cpu.kernel_shapes.huge", "unknown key"]),
    ("families:\n  cpu:\n    kernel_shapes:\n      small:\n        mlstm:\n          float16: {chunk_size: 200}\n",
     ["families.cpu.kernel_shapes.small.mlstm.float16.chunk_size", "from 1 to 128"]),
    ("families:\n  cpu:\n    kernels: [1, 2]\n", ["families.cpu.kernels", "expected a mapping"]),
    ("families:\n  cpu:\n    kernel: {}\n", ["families.cpu.kernel", "unknown key", "kernel_shapes"]),
])
def test_bad_knob_presets_name_file_and_key(monkeypatch, tmp_path, text, expect):
    path = _presets(monkeypatch, tmp_path / "bad.yaml", text)
    _expect([str(path), *expect], resolve_knobs, "rms_norm", "float32", 64)
    _expect([str(path)], presets_mod.load_preset_file, str(path))


# ---------------------------------------------------------------------------------------
# Precedence
# ---------------------------------------------------------------------------------------


def _shipped_with(monkeypatch, tmp_path, extra: str) -> Path:
    """A copy of the shipped presets whose cpu family has `extra` (indented YAML) appended."""
    text = SHIPPED.read_text()
    marker = "  cpu:\n"
    assert marker in text
    head, tail = text.split(marker, 1)
    copy = tmp_path / "shipped.yaml"
    copy.write_text(head + marker + extra + tail)
    monkeypatch.setattr(presets_mod, "_SHIPPED_PATH", str(copy))
    _reset()
    return copy


def test_precedence_argument_env_user_files_shipped_builtin(monkeypatch, tmp_path, backend):
    _shipped_with(monkeypatch, tmp_path, "    kernels:\n      rms_norm:\n        default:"
                                         " {n_reads: 2, simd_rows: 2, looped_threads: 64}\n")
    shape = (2, 200)  # medium
    info = explain_knobs("rms_norm", "float32", shape)
    assert info["values"] == {"n_reads": 2, "simd_rows": 2, "looped_threads": 64}
    assert info["sources"]["n_reads"] == "presets.yaml: families.cpu.kernels.rms_norm.default.n_reads"

    # the default user file (XDG_CONFIG_HOME): most specific entry first within the file
    home = Path(os.environ["XDG_CONFIG_HOME"]) / "xlstm_kernels" / "presets.yaml"
    home.parent.mkdir(parents=True)
    home.write_text("families:\n  cpu:\n    kernels:\n      rms_norm:\n        float32: {n_reads: 1, simd_rows: 4}\n"
                    "    kernel_shapes:\n      medium:\n        rms_norm:\n          float32: {n_reads: 8}\n")
    info = explain_knobs("rms_norm", "float32", shape)
    assert info["values"] == {"n_reads": 8, "simd_rows": 4, "looped_threads": 64}
    assert info["sources"]["n_reads"] == f"{home}: families.cpu.kernel_shapes.medium.rms_norm.float32.n_reads"
    assert info["sources"]["simd_rows"] == f"{home}: families.cpu.kernels.rms_norm.float32.simd_rows"
    assert info["sources"]["looped_threads"].startswith("presets.yaml: ")
    # another class / dtype / op does not see the float32 / medium entries
    assert explain_knobs("rms_norm", "float32", (2, 100))["values"]["n_reads"] == 1  # small: kernels.* entry
    assert explain_knobs("rms_norm", "float16", shape)["values"]["n_reads"] == 2  # shipped default
    assert explain_knobs("layer_norm", "float32", shape)["values"]["n_reads"] is None

    # $XLSTM_KERNELS_PRESETS beats the default user file, even with a less specific key
    user = _presets(monkeypatch, tmp_path / "user.yaml",
                    "families:\n  cpu:\n    kernels:\n      rms_norm:\n        default: {n_reads: 4}\n")
    info = explain_knobs("rms_norm", "float32", shape)
    assert info["values"]["n_reads"] == 4 and info["sources"]["n_reads"] == \
        f"{user}: families.cpu.kernels.rms_norm.default.n_reads"
    assert info["sources"]["simd_rows"].startswith(str(home))

    # the environment beats every file; the argument beats the environment
    monkeypatch.setenv("XLSTM_RMS_NORM_N_READS", "2")
    monkeypatch.setenv("XLSTM_RMS_NORM_LOOPED_THREADS", "128")
    info = explain_knobs("rms_norm", "float32", shape)
    assert info["values"] == {"n_reads": 2, "simd_rows": 4, "looped_threads": 128}
    assert info["sources"]["n_reads"] == "XLSTM_RMS_NORM_N_READS"
    info = explain_knobs("rms_norm", "float32", shape, args={"n_reads": 8, "simd_rows": None})
    assert info["values"]["n_reads"] == 8 and info["sources"]["n_reads"] == "argument"
    assert info["sources"]["simd_rows"].startswith(str(home))

    # ... and the op launches exactly that
    x = mx.array(np.random.default_rng(seed_of("prec")).standard_normal(shape).astype(np.float32))
    spec, kw = nm._plan("rms", x, None, None, 1e-5)
    assert spec.kernel == "rms_norm" and dict(kw["template"])["N_READS"] == 2 and kw["threadgroup"] == (128, 1, 1)
    spec, kw = nm._plan("rms", x, None, None, 1e-5, 1, {"n_reads": 8})
    assert dict(kw["template"])["N_READS"] == 8 and kw["threadgroup"] == (32, 2, 1)  # one simdgroup, 2 rows
    if backend != "reference":
        from xlstm_kernels import runtime

        with runtime.use_backend(backend):
            assert rel_err(nm.rms_norm(x, None, 1e-5, knobs={"n_reads": 8}), _np_rms(f64(x), None)) < 1e-5

    # unset everything above the shipped file: back to it, then to the built-in defaults
    for var in ("XLSTM_RMS_NORM_N_READS", "XLSTM_RMS_NORM_LOOPED_THREADS", "XLSTM_KERNELS_PRESETS"):
        monkeypatch.delenv(var)
    home.unlink()
    assert explain_knobs("rms_norm", "float32", shape)["values"]["simd_rows"] == 2
    monkeypatch.setattr(presets_mod, "_SHIPPED_PATH", str(SHIPPED))
    _reset()
    assert explain_knobs("rms_norm", "float32", shape)["sources"]["n_reads"] == "built-in default: by row length and dtype (ops.norm._forward_layout)"


def test_env_and_file_changes_take_effect(monkeypatch, tmp_path):
    """Env changes apply at once; an in-place file edit after reload_presets() (or STAMP_TTL_S)."""
    assert resolve_knobs("mlstm", "float32", 70).values["chunk_size"] is None
    monkeypatch.setenv("XLSTM_MLSTM_CHUNK_SIZE", "16")
    assert ml.knob_values(70, "float32") == {"chunk_size": 16}
    monkeypatch.setenv("XLSTM_MLSTM_CHUNK_SIZE", "  ")  # empty counts as unset
    assert ml.knob_values(70, "float32") == {"chunk_size": 64}
    path = _presets(monkeypatch, tmp_path / "p.yaml", "families:\n  cpu:\n    kernels:\n      mlstm:\n"
                                                      "        default: {chunk_size: 8}\n")
    assert ml.knob_values(70, "float32") == {"chunk_size": 8}
    path.write_text("families:\n  cpu:\n    kernels:\n      mlstm:\n        default: {chunk_size: 32}\n")
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    reload_presets()
    assert ml.knob_values(70, "float32") == {"chunk_size": 32}
    assert ml.knob_values(70, "float32", 5) == {"chunk_size": 5}  # an explicit argument wins
    # another family's entries do not apply
    path.write_text("families:\n  m3:\n    kernels:\n      mlstm:\n        default: {chunk_size: 32}\n")
    os.utime(path, ns=(time.time_ns() + 2 * 10**9, time.time_ns() + 2 * 10**9))
    monkeypatch.setattr(presets_mod, "STAMP_TTL_S", 0.0)  # as if STAMP_TTL_S had passed
    assert ml.knob_values(70, "float32") == {"chunk_size": 64}
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "m3")
    assert resolve_knobs("mlstm", "float32", 70).family == "m3"
    assert ml.knob_values(70, "float32") == {"chunk_size": 32}


def test_resolve_is_cheap():
    """The layered lookup is cached: a call costs microseconds (generous bound for slow CI)."""
    resolve_knobs("rms_norm", mx.float16, 4096)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        resolve_knobs("rms_norm", mx.float16, 4096)
    assert (time.perf_counter() - t0) / n < 200e-6


# ---------------------------------------------------------------------------------------
# Malformed settings and shape fits
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("var, value, op, expect", [
    ("XLSTM_RMS_NORM_N_READS", "3", "rms_norm", "one of 1, 2, 4, 8"),
    ("XLSTM_RMS_NORM_N_READS", "four", "rms_norm", "one of 1, 2, 4, 8"),
    ("XLSTM_LAYER_NORM_SIMD_ROWS", "0", "layer_norm", "from 1 to 32"),
    ("XLSTM_LAYER_NORM_LOOPED_THREADS", "100", "layer_norm", "multiple of 32"),
    ("XLSTM_ATTENTION_BLOCK_Q", "12", "attention", "multiple of 8"),
    ("XLSTM_ATTENTION_BLOCK_K", "256", "attention", "from 8 to 128"),
    ("XLSTM_ATTENTION_SPLIT_KV_BLOCK_SIZE", "4", "attention", ">= 8"),
    ("XLSTM_ATTENTION_SPLIT_KV_MIN_KEYS", "-1", "attention", ">= 0"),
    ("XLSTM_KERNELS_ATTN_SPLIT_MIN_KEYS", "many", "attention", ">= 0"),
    ("XLSTM_MLSTM_CHUNK_SIZE", "129", "mlstm", "from 1 to 128"),
    ("XLSTM_MLSTM_CHUNK_SIZE", "1.5", "mlstm", "from 1 to 128"),
    ("XLSTM_SLSTM_THREADS_PER_UNIT", "3", "slstm", "one of 1, 2, 4, 8, 16, 32"),
    ("XLSTM_SLSTM_R_IN_REGISTERS", "maybe", "slstm", "true, false"),
])
def test_malformed_env_names_the_variable(monkeypatch, var, value, op, expect):
    monkeypatch.setenv(var, value)
    _expect([f"{var}={value!r}", expect], resolve_knobs, op, "float32", 64)
    other = {"rms_norm": "mlstm"}.get(op, "rms_norm")
    resolve_knobs(other, "float32", 64)  # another op's variable does not matter


def test_malformed_env_fails_the_op_call(monkeypatch, kernel_backend):
    needs_kernels(kernel_backend)
    monkeypatch.setenv("XLSTM_SLSTM_R_IN_REGISTERS", "sometimes")
    wx, r, b = _slstm_inputs(seed_of("bad env"), 1, 2, 1, 8)
    _expect(["XLSTM_SLSTM_R_IN_REGISTERS='sometimes'"], sl.slstm, wx, r, b)
    monkeypatch.setenv("XLSTM_RMS_NORM_N_READS", "12")
    _expect(["XLSTM_RMS_NORM_N_READS='12'", "one of 1, 2, 4, 8, 16, 32, 64"], nm.rms_norm, mx.ones((2, 8)), None)


def test_argument_errors_name_the_argument():
    _expect(["argument n_reads=3", "rms_norm", "one of 1, 2, 4, 8, 16, 32, 64"], resolve_knobs, "rms_norm", "float32", 8,
            args={"n_reads": 3})
    _expect(["argument", "n_read", "has the knobs"], nm.rms_norm, mx.ones((2, 8)), None, knobs={"n_read": 2})
    _expect(["knobs must be a dict"], nm.layer_norm, mx.ones((2, 8)), None, None, knobs=[2], exc=TypeError)
    _expect(["argument block_k=256", "needs", "32 KiB"], resolve_knobs, "attention", "float32", 64,
            args={"block_k": 256}, fits=knobs_mod.attention_fits(64, 64, "float32"))
    _expect(["block_q"], att.attention_prefill, mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 4, 8)),
            scale=1.0, block_q=12, exc=ValueError)
    _expect(["chunk_size must be a positive int"], ml.knob_values, 8, "float32", 0, exc=ValueError)


def _slstm_preset(monkeypatch, tmp_path, k: int, lower_k: int | None = None) -> Path:
    text = f"families:\n  cpu:\n    kernels:\n      slstm:\n        default: {{threads_per_unit: {k}}}\n"
    if lower_k is not None:  # a second layer in a lower file
        home = Path(os.environ["XDG_CONFIG_HOME"]) / "xlstm_kernels" / "presets.yaml"
        home.parent.mkdir(parents=True, exist_ok=True)
        home.write_text(f"families:\n  cpu:\n    kernels:\n      slstm:\n        float32: {{threads_per_unit: {lower_k}}}\n")
    return _presets(monkeypatch, tmp_path / "k.yaml", text)


def test_preset_misfit_is_skipped_but_argument_and_env_misfits_raise(monkeypatch, tmp_path, backend):
    path = _slstm_preset(monkeypatch, tmp_path, 32)
    src = f"{path}: families.cpu.kernels.slstm.default.threads_per_unit"
    # DH = 16: 512 threads, fits
    info = explain_knobs("slstm", "float32", 16)
    assert info["values"]["threads_per_unit"] == 32 and info["sources"]["threads_per_unit"] == src
    assert sl.plan(16) == sl.SLSTMConfig(32, sl.plan(16, config={"threads_per_unit": 32}).r_in_registers)
    # DH = 64: 2048 threads: the preset is skipped for this call and says why
    info = explain_knobs("slstm", "float32", 64)
    assert info["values"]["threads_per_unit"] is None and info["sources"]["threads_per_unit"].startswith("built-in")
    (skip,) = info["skipped"]
    assert skip["knob"] == "threads_per_unit" and skip["value"] == 32 and skip["source"] == src
    assert "DH*K = 2048" in skip["reason"] and "skipped" in skip["reason"]
    assert sl.plan(64) == sl.SLSTMConfig(8, True)
    # with a lower layer that fits, that one is used
    _slstm_preset(monkeypatch, tmp_path, 32, lower_k=4)
    info = explain_knobs("slstm", "float32", 64)
    assert info["values"]["threads_per_unit"] == 4 and "families.cpu.kernels.slstm.float32" in \
        info["sources"]["threads_per_unit"] and len(info["skipped"]) == 1
    assert explain_knobs("slstm", "float16", 64)["values"]["threads_per_unit"] is None  # lower entry is float32-only
    # the same value from an argument or a variable is an error naming it
    _expect(["DH*K = 2048"], sl.plan, 64, mx.float32, {"threads_per_unit": 32}, exc=ValueError)
    monkeypatch.setenv("XLSTM_SLSTM_THREADS_PER_UNIT", "32")
    _expect(["XLSTM_SLSTM_THREADS_PER_UNIT=32", "DH*K = 2048", "unset it"], sl.plan, 64)
    assert sl.plan(16).threads_per_unit == 32
    monkeypatch.delenv("XLSTM_SLSTM_THREADS_PER_UNIT")

    # the op runs (and is right) at the shape the preset does not fit
    if backend != "reference":
        from xlstm_kernels import runtime

        spy = Spy(monkeypatch, sl)
        wx, r, b = _slstm_inputs(seed_of("misfit"), 1, 3, 1, 64)
        with runtime.use_backend(backend):
            y = sl.slstm(wx, r, b)
        (kernel, kw), = spy.take()
        assert dict(kw["template"])["K"] == 4 and kw["threadgroup"] == (256, 1, 1)
        assert rel_err(y, _np_slstm(wx, r, b)) < 2e-5


def test_attention_block_k_misfit(monkeypatch, tmp_path, backend):
    path = _presets(monkeypatch, tmp_path / "a.yaml", "families:\n  cpu:\n    kernels:\n      attention:\n"
                                                       "        float32: {block_k: 128, block_q: 16}\n")
    info = explain_knobs("attention", "float32", (1, 2, 40, 48, 64))  # 128 * 68 * 4 > 32 KiB even shared
    assert info["values"] == {"block_q": 16, "block_k": None, "split_kv_block_size": None, "split_kv_min_keys": None,
                              "split_kv_mma": None, "split_kv_cluster": None, "split_kv_stream": None,
                              "prefill_mma": None}
    assert info["skipped"][0]["knob"] == "block_k" and "32 KiB" in info["skipped"][0]["reason"]
    assert info["skipped"][0]["source"] == f"{path}: families.cpu.kernels.attention.float32.block_k"
    fits = explain_knobs("attention", "float32", (1, 2, 40, 48, 16))
    assert fits["values"]["block_k"] == 128 and fits["skipped"] == []
    assert att.knob_values(40, 48, 64, 64, "float32")["block_k"] == 32  # heuristic
    assert att.knob_values(40, 48, 16, 16, "float32")["block_k"] == 128
    monkeypatch.setenv("XLSTM_ATTENTION_BLOCK_K", "128")
    _expect(["XLSTM_ATTENTION_BLOCK_K=128", "32 KiB"], att.knob_values, 40, 48, 64, 64, "float32")
    if backend != "reference":
        from xlstm_kernels import runtime

        q, k, v = _qkv(seed_of("bk misfit"), 1, 1, 9, 12, 64, mx.float32)
        with runtime.use_backend(backend):
            _expect(["XLSTM_ATTENTION_BLOCK_K=128", "32 KiB"], att.scaled_dot_product_attention, q, k, v, scale=0.125)
            monkeypatch.delenv("XLSTM_ATTENTION_BLOCK_K")
            spy = Spy(monkeypatch, att)
            out = att.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
            (kernel, kw), = spy.take()
            assert kernel == "attention_prefill" and dict(kw["template"])["BK"] == 32 and dict(kw["template"])["BQ"] == 16
            assert rel_err(out, _np_attention(q, k, v, 0.125)) < 1e-5


def test_split_min_keys_alias(monkeypatch, kernel_backend):
    needs_kernels(kernel_backend)
    spy = Spy(monkeypatch, att)
    q, k, v = _qkv(seed_of("alias"), 1, 2, 1, 40, 32, mx.float32)
    ref = _np_attention(q, k, v, 0.2)
    assert rel_err(att.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal"), ref) < 1e-5
    assert [c for c, _ in spy.take()] == ["attention_prefill"]
    monkeypatch.setenv("XLSTM_KERNELS_ATTN_SPLIT_MIN_KEYS", "40")
    info = explain_knobs("attention", "float32", 40)
    assert info["values"]["split_kv_min_keys"] == 40
    assert info["sources"]["split_kv_min_keys"].startswith("XLSTM_KERNELS_ATTN_SPLIT_MIN_KEYS (alias of "
                                                           "XLSTM_ATTENTION_SPLIT_KV_MIN_KEYS)")
    assert rel_err(att.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal"), ref) < 1e-5
    assert [c for c, _ in spy.take()] == ["attention_partial", "attention_reduce"]
    monkeypatch.setenv("XLSTM_ATTENTION_SPLIT_KV_MIN_KEYS", "41")  # the generic name wins
    att.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    assert [c for c, _ in spy.take()] == ["attention_prefill"]
    att.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal", split_kv_min_keys=8)  # the argument wins
    assert [c for c, _ in spy.take()] == ["attention_partial", "attention_reduce"]


# ---------------------------------------------------------------------------------------
# Every knob value changes the launch; results stay right (float64 references)
# ---------------------------------------------------------------------------------------


def _np_rms(x, w, eps=1e-5):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def _np_ln(x, w, b, eps=1e-5):
    xc = x - x.mean(axis=-1, keepdims=True)
    return xc / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps) * w + b


def _norm_layout(n: int, n_reads: int) -> str:
    if n <= 32 * n_reads:
        return "one_simd"
    return "cached" if n <= 1024 * n_reads else "looped"


@pytest.mark.parametrize("n_reads", [1, 2, 4, 8])
def test_norm_n_reads(monkeypatch, kernel_backend, n_reads):
    """n_reads 1/2/4/8 over one-simdgroup, cached and looped row lengths, odd sizes too."""
    needs_kernels(kernel_backend)
    spy = Spy(monkeypatch, nm)
    rng = np.random.default_rng(seed_of("n_reads", n_reads))
    for n in (33, 129, 300, 4100):
        rows = 3 if n < 4000 else 2
        x = mx.array(rng.standard_normal((rows, n)).astype(np.float32))
        w, b = (mx.array(rng.standard_normal(n).astype(np.float32)) for _ in range(2))
        xd, wd, bd = f64(x), f64(w), f64(b)
        y = nm.rms_norm(x, w, 1e-5, knobs={"n_reads": n_reads})
        assert rel_err(y, _np_rms(xd, wd)) < 1e-5, (n_reads, n)
        monkeypatch.setenv("XLSTM_LAYER_NORM_N_READS", str(n_reads))
        y = nm.layer_norm(x, w, b, 1e-5)
        monkeypatch.delenv("XLSTM_LAYER_NORM_N_READS")
        assert rel_err(y, _np_ln(xd, wd, bd)) < 1e-5, (n_reads, n)
        layout = _norm_layout(n, n_reads)
        for kernel, kw in spy.take():
            tmpl = dict(kw["template"])
            assert tmpl["N_READS"] == n_reads
            assert kernel.endswith("_looped") == (layout == "looped"), (kernel, n, n_reads)
            if layout != "looped":
                assert tmpl["ONE_SIMD"] == (layout == "one_simd")
                assert kw["threadgroup"][0] == (32 if layout == "one_simd" else -(-(-(-n // n_reads)) // 32) * 32)


def test_norm_simd_rows_and_looped_threads(monkeypatch, kernel_backend, tmp_path):
    """Every simd_rows and looped_threads value of the tuner's grid, through env, preset and
    argument; multihead_layer_norm follows layer_norm's knobs."""
    needs_kernels(kernel_backend)
    spy = Spy(monkeypatch, nm)
    rng = np.random.default_rng(seed_of("rows/threads"))
    x = mx.array(rng.standard_normal((37, 40)).astype(np.float32))  # 40 <= 32 * 2: one simdgroup per row
    xd = f64(x)
    for rows in knobs_mod.KNOBS["rms_norm"]["simd_rows"].grid:
        monkeypatch.setenv("XLSTM_RMS_NORM_SIMD_ROWS", str(rows))
        y = nm.rms_norm(x, None, 1e-5, knobs={"n_reads": 2})
        (kernel, kw), = spy.take()
        assert kw["threadgroup"] == (32, rows, 1) and kw["grid"][1] == rows * -(-37 // rows)
        assert rel_err(y, _np_rms(xd, None)) < 1e-5, rows
    monkeypatch.delenv("XLSTM_RMS_NORM_SIMD_ROWS")
    x = mx.array(rng.standard_normal((2, 1100)).astype(np.float32))  # > 1024 * 1: looped with n_reads 1
    w, b = (mx.array(rng.standard_normal(1100).astype(np.float32)) for _ in range(2))
    for threads in knobs_mod.KNOBS["layer_norm"]["looped_threads"].grid:
        _presets(monkeypatch, tmp_path / f"lt{threads}.yaml", "families:\n  cpu:\n    kernel_shapes:\n      medium:\n"
                 f"        layer_norm:\n          float32: {{n_reads: 1, looped_threads: {threads}}}\n")
        y = nm.layer_norm(x, w, b, 1e-5)
        (kernel, kw), = spy.take()
        assert kernel == "layer_norm_looped" and kw["threadgroup"] == (threads, 1, 1)
        assert rel_err(y, _np_ln(f64(x), f64(w), f64(b))) < 1e-5, threads
    # multi-head LayerNorm: layer_norm's knobs, keyed on the head length (4 heads of 275: medium)
    y = nm.multihead_layer_norm(x, w, b, 4, 1e-5)
    (kernel, kw), = spy.take()
    assert kernel == "layer_norm" and dict(kw["template"])["N_READS"] == 1 and kw["threadgroup"] == (288, 1, 1)
    xh = f64(x).reshape(2, 4, 275)
    ref = ((xh - xh.mean(-1, keepdims=True)) / np.sqrt(xh.var(-1, keepdims=True) + 1e-5)).reshape(2, 1100)
    assert rel_err(y, ref * f64(w) + f64(b)) < 1e-5


def _qkv(seed, b, h, lq, lk, d, dtype):
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((b, h, ln, d)).astype(np.float32)).astype(dtype)
                 for ln in (lq, lk, lk))


def _np_attention(q, k, v, scale):
    qd, kd, vd = f64(q), f64(k), f64(v)
    lq, lk = qd.shape[2], kd.shape[2]
    s = qd @ kd.swapaxes(-1, -2) * scale
    visible = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq)
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ vd


@pytest.mark.parametrize("block_q, block_k, how", [
    (8, 128, "argument"), (16, 8, "env"), (32, 16, "preset"), (64, 32, "knobs"), (16, 64, "env"),
])
def test_attention_prefill_tiles(monkeypatch, kernel_backend, tmp_path, block_q, block_k, how):
    """Every block_q and block_k value of the grid on a multi-tile odd shape (D = 20)."""
    needs_kernels(kernel_backend)
    q, k, v = _qkv(seed_of("tiles", block_q, block_k), 1, 2, 37, 45, 20, mx.float32)
    scale = 20**-0.5
    spy = Spy(monkeypatch, att)
    if how == "argument":
        out = att.attention_prefill(q, k, v, scale=scale, mask="causal", block_q=block_q, block_k=block_k)
    elif how == "knobs":
        out = att.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal",
                                               knobs={"block_q": block_q, "block_k": block_k})
    else:
        if how == "env":
            monkeypatch.setenv("XLSTM_ATTENTION_BLOCK_Q", str(block_q))
            monkeypatch.setenv("XLSTM_ATTENTION_BLOCK_K", str(block_k))
        else:
            _presets(monkeypatch, tmp_path / "t.yaml", "families:\n  cpu:\n    kernel_shapes:\n      small:\n"
                     f"        attention:\n          float32: {{block_q: {block_q}, block_k: {block_k}}}\n")
        assert att.knob_values(37, 45, 20, 20, "float32")["block_q"] == block_q
        out = att.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    (kernel, kw), = spy.take()
    tmpl = dict(kw["template"])
    assert kernel == "attention_prefill" and (tmpl["BQ"], tmpl["BK"]) == (block_q, block_k)
    assert kw["threadgroup"] == (32 * block_q // 8, 1, 1) and kw["grid"][0] == 32 * block_q // 8 * -(-37 // block_q)
    assert rel_err(out, _np_attention(q, k, v, scale)) < 1e-5


def test_attention_split_kv_block_sizes(monkeypatch, kernel_backend):
    needs_kernels(kernel_backend)
    q, k, v = _qkv(seed_of("split sizes"), 1, 2, 2, 300, 24, mx.float32)
    ref = _np_attention(q, k, v, 0.3)
    spy = Spy(monkeypatch, att)
    monkeypatch.setenv("XLSTM_ATTENTION_SPLIT_KV_MIN_KEYS", "0")
    for bs in knobs_mod.KNOBS["attention"]["split_kv_block_size"].grid:
        monkeypatch.setenv("XLSTM_ATTENTION_SPLIT_KV_BLOCK_SIZE", str(bs))
        out = att.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
        (k1, kw1), (k2, kw2) = spy.take()
        assert (k1, k2) == ("attention_partial", "attention_reduce")
        # LSE per key block, declared (B * Hq * Lq rows, blocks) by the op's prepared launches
        assert kw1["output_shapes"][1] == (1 * 2 * 2, -(-300 // bs))
        assert rel_err(out, ref) < 1e-5, bs
    out = att.attention_decode_split_kv(q, k, v, scale=0.3, mask="causal", block_size=24)  # the argument wins
    assert spy.take()[0][1]["output_shapes"][1] == (4, 13) and rel_err(out, ref) < 1e-5


def _np_mlstm(q, k, v, i_pre, f_pre, eps=1e-6):
    q, k, v, i_pre, f_pre = (f64(x) for x in (q, k, v, i_pre, f_pre))
    b, nh, s, dk = q.shape
    c, n, m = np.zeros((b, nh, dk, v.shape[-1])), np.zeros((b, nh, dk)), np.zeros((b, nh))
    h = np.zeros((b, nh, s, v.shape[-1]))
    for t in range(s):
        lf = np.minimum(f_pre[:, :, t], 0) - np.log1p(np.exp(-np.abs(f_pre[:, :, t])))
        m1 = np.maximum(lf + m, i_pre[:, :, t])
        fa, ia = np.exp(lf + m - m1), np.exp(i_pre[:, :, t] - m1)
        c = fa[..., None, None] * c + ia[..., None, None] * k[:, :, t, :, None] * v[:, :, t, None, :]
        n = fa[..., None] * n + ia[..., None] * k[:, :, t]
        m = m1
        qs = q[:, :, t] * dk**-0.5
        den = np.maximum(np.abs(np.einsum("bhd,bhd->bh", qs, n)), np.exp(-m)) + eps
        h[:, :, t] = np.einsum("bhd,bhde->bhe", qs, c) / den[..., None]
    return h


@pytest.mark.parametrize("chunk, how", [(1, "env"), (16, "preset"), (128, "argument")])
def test_mlstm_chunk_sizes(monkeypatch, kernel_backend, tmp_path, chunk, how):
    needs_kernels(kernel_backend)
    rng = np.random.default_rng(seed_of("mlstm chunk", chunk))
    q, k, v = (mx.array(rng.standard_normal((1, 2, 70, 16)).astype(np.float32)) for _ in range(3))
    i_pre = mx.array(rng.standard_normal((1, 2, 70)).astype(np.float32))
    f_pre = mx.array((rng.standard_normal((1, 2, 70)) + 2.0).astype(np.float32))
    spy = Spy(monkeypatch, ml)
    if how == "env":
        monkeypatch.setenv("XLSTM_MLSTM_CHUNK_SIZE", str(chunk))
    elif how == "preset":
        _presets(monkeypatch, tmp_path / "c.yaml",
                 f"families:\n  cpu:\n    kernel_shapes:\n      small:\n        mlstm:\n          default: {{chunk_size: {chunk}}}\n")
    h = ml.mlstm(q, k, v, i_pre, f_pre, chunk_size=chunk if how == "argument" else None)
    (k1, kw1), (k2, _) = spy.take()
    assert (k1, k2) == ("mlstm_chunk_states", "mlstm_chunk_outputs")
    s, L, nc = np.asarray(kw1["inputs"][-1])[:3].tolist()
    assert (s, L, nc) == (70, min(chunk, 70), -(-70 // min(chunk, 70)))
    assert rel_err(h, _np_mlstm(q, k, v, i_pre, f_pre)) < 1e-4, chunk


def _slstm_inputs(seed, bsz, s, nh, dh):
    rng = np.random.default_rng(seed)
    wx = mx.array(rng.standard_normal((bsz, s, 4, nh, dh)).astype(np.float32))
    r = mx.array((rng.standard_normal((nh, dh, 4, dh)) / np.sqrt(dh)).astype(np.float32))
    b = mx.array((0.5 * rng.standard_normal((4, nh, dh))).astype(np.float32))
    return wx, r, b


def _np_slstm(wx, r, b):
    wx, r, b = f64(wx), f64(r), f64(b)
    bsz, s, _, nh, dh = wx.shape
    y, c, n, m = (np.zeros((bsz, nh, dh)) for _ in range(4))
    ys = []
    for t in range(s):
        raw = wx[:, t] + np.einsum("bhi,higj->bghj", y, r) + b
        ir, fr, zr, orr = raw[:, 0], raw[:, 1], raw[:, 2], raw[:, 3]
        empty = n == 0
        lfm = m - np.logaddexp(0.0, -fr)
        mt = np.where(empty, ir, np.maximum(ir, lfm))
        fg = np.where(empty, 0.0, np.exp(np.where(empty, 0.0, lfm - mt)))
        ig = np.exp(ir - mt)
        c = fg * c + ig * np.tanh(zr)
        n = fg * n + ig
        m = mt
        y = c / n / (1.0 + np.exp(-orr))
        ys.append(y)
    return np.stack(ys, axis=1)


@pytest.mark.parametrize("k, rreg, how", [
    (1, True, "env"), (2, False, "preset"), (4, True, "config"), (8, False, "env"), (16, True, "preset"),
    (32, False, "config"),
])
def test_slstm_threads_and_registers(monkeypatch, kernel_backend, tmp_path, k, rreg, how):
    """Every threads_per_unit value and both r_in_registers values; DH = 12 (not a multiple of K >= 8)."""
    needs_kernels(kernel_backend)
    wx, r, b = _slstm_inputs(seed_of("slstm knobs", k, rreg), 1, 4, 2, 12)
    config = None
    if how == "env":
        monkeypatch.setenv("XLSTM_SLSTM_THREADS_PER_UNIT", str(k))
        monkeypatch.setenv("XLSTM_SLSTM_R_IN_REGISTERS", "yes" if rreg else "off")
    elif how == "preset":
        _presets(monkeypatch, tmp_path / "s.yaml", "families:\n  cpu:\n    kernels:\n      slstm:\n        float32: "
                 f"{{threads_per_unit: {k}, r_in_registers: {str(rreg).lower()}}}\n")
    else:
        config = {"threads_per_unit": k, "r_in_registers": rreg}
    assert sl.plan(12, mx.float32, config) == sl.SLSTMConfig(k, rreg)
    spy = Spy(monkeypatch, sl)
    y = sl.slstm(wx, r, b, config=config)
    (kernel, kw), = spy.take()
    tmpl = dict(kw["template"])
    assert kernel == "slstm_fwd" and (tmpl["K"], tmpl["RREG"]) == (k, rreg) and kw["threadgroup"] == (12 * k, 1, 1)
    assert rel_err(y, _np_slstm(wx, r, b)) < 2e-5
