"""Tile configurations for the kernels: preset YAML -> environment -> explicit argument.

    gemm      GemmConfig: fields, limits (1024 threads, 32 KiB), threads / grid / template args
    env       XLSTM_GEMM_* variables, parsed on every resolve
    presets   YAML preset files (strict schema), device families, rooflines
    resolve   resolve_gemm_config (precedence + shape rules), set_gemm_tiles, explain
    knobs     the other kernels' tunables (norms, attention, mLSTM, sLSTM): KNOB_OPS,
              XLSTM_<OP>_<KNOB> variables, presets' kernels / kernel_shapes sections,
              resolve_knobs, explain_knobs

Typical use (the ops do this per call)::

    cfg = resolve_gemm_config("gemm_av", m, n, k, mx.float16).config
    cfg.threads(), cfg.grid(m, n, batch), cfg.template_args(mx.float16)
"""

from .errors import TileConfigError
from .gemm import DTYPES, OPS, GemmConfig
from .knobs import KNOB_OPS, ResolvedKnobs, explain_knobs, knob_env_var, knob_shape_class, resolve_knobs
from .presets import DeviceInfo, detect_device, reload_presets, roofline, shape_class
from .resolve import (
    ResolvedGemmConfig,
    explain,
    get_gemm_tiles,
    resolve_gemm_config,
    set_gemm_tiles,
    split_k_rule,
)

__all__ = [
    "DTYPES",
    "KNOB_OPS",
    "OPS",
    "DeviceInfo",
    "GemmConfig",
    "ResolvedGemmConfig",
    "ResolvedKnobs",
    "TileConfigError",
    "detect_device",
    "explain",
    "explain_knobs",
    "get_gemm_tiles",
    "knob_env_var",
    "knob_shape_class",
    "reload_presets",
    "resolve_gemm_config",
    "resolve_knobs",
    "roofline",
    "set_gemm_tiles",
    "shape_class",
    "split_k_rule",
]
