"""Tunables ("knobs") of the non-GEMM kernels: registry, environment, presets, per-call resolution.

Ops and their knobs (the names are public API: env variables, preset keys, ``knobs=``)::

    rms_norm, layer_norm   n_reads         1 | 2 | ... | 64: elements per thread per step (the
    (multihead_layer_norm                  kernels' N_READS); rows up to 32*n_reads run one
     uses layer_norm's)                    simdgroup per row, rows up to 1024*n_reads are
                                           cached in registers, longer rows run the looped kernel
                           simd_rows       1..32: rows (simdgroups) per threadgroup in the
                                           simdgroup-per-row layout
                           looped_threads  32..1024, a multiple of 32: threads of the looped kernel
    attention              block_q         8..256, a multiple of 8: prefill queries per threadgroup
                           block_k         8..128, a multiple of 8: prefill keys per tile (must fit
                                           32 KiB of threadgroup memory for the head dims: a shape fit)
                           split_kv_block_size  >= 8, a multiple of 8: keys per split-KV block
                           split_kv_min_keys    >= 0: decode (Lq <= 8) uses split-KV from this many keys
                           split_kv_mma    true | false: split-KV pass 1 as simdgroup-matrix tiles
                                           (attention_partial_mma; default on for 2-byte dtypes on
                                           cuda / the emulator) or
                                           the lane walk (attention_partial)
                           split_kv_cluster 0..8: key blocks of the tile pass 1 merged in one
                                           threadgroup cluster (0 / 1, the default: none; a cluster
                                           holding every block makes a decode step one launch). Only
                                           the emulator and cuda on sm_90 with MLX_USE_CUDA_GRAPHS=0
                                           run clusters (ops.attention._cluster_support says why)
                           split_kv_stream true | false: decode in one launch, one threadgroup per
                                           (batch, kv head) streaming all its keys through bulk
                                           copies (attention_decode_stream), no split and no pass 2;
                                           unset: automatic (cuda on sm_90, 32-64 such pairs of one
                                           query row, head dims 128, 2-byte dtypes, no mask array)
                           prefill_mma     true | false: prefill as 16 x 16 simdgroup-matrix tiles
                                           (attention_prefill_mma; default on for 2-byte dtypes on
                                           cuda / the emulator) or attention_prefill (the one
                                           block_q / block_k describe; an argument block_q= /
                                           block_k= selects it)
    mlstm                  chunk_size      1..128: steps per chunk of the chunkwise kernels
    slstm                  threads_per_unit  1 | 2 | 4 | 8 | 16 | 32: lanes per unit K (DH*K <= 1024
                                             threads per threadgroup: a shape fit)
                           r_in_registers  true | false: keep R in registers over the sequence
    fused                  single_kernel   true | false: fused_norm_linear / fused_norm_qkv_rope as
    (fused_norm_linear,                    their one fused kernel, or as the unfused sequence of
     fused_norm_qkv_rope)                  this package's kernels (rms_norm, linear, rope). Built-in:
                                           the fused kernel; the NVIDIA presets choose the sequence

Resolution per call, each knob on its own, highest first:

    argument      the op's keyword: ``knobs={...}`` (norms, scaled_dot_product_attention),
                  ``block_q=`` / ``block_k=`` / ``block_size=`` / ``split_kv_min_keys=``
                  (attention), ``chunk_size=`` (mlstm), ``config=`` (slstm), ``knobs={...}`` (fused)
    environment   ``XLSTM_<OP>_<KNOB>`` upper-case, e.g. XLSTM_RMS_NORM_N_READS,
                  XLSTM_ATTENTION_BLOCK_K, XLSTM_MLSTM_CHUNK_SIZE, XLSTM_SLSTM_R_IN_REGISTERS,
                  XLSTM_FUSED_SINGLE_KERNEL
                  (booleans: 1/0, true/false, yes/no, on/off). XLSTM_KERNELS_ATTN_SPLIT_MIN_KEYS is
                  an alias of XLSTM_ATTENTION_SPLIT_KV_MIN_KEYS (the generic name wins if both are set)
    preset files  the GEMM stack ($XLSTM_KERNELS_PRESETS, ~/.config/xlstm_kernels/presets.yaml,
                  the shipped tuning/presets.yaml), for the detected family, most specific first:
                  kernel_shapes.<class>.<op>.<dtype>, kernel_shapes.<class>.<op>.default,
                  kernels.<op>.<dtype>, kernels.<op>.default; a higher file wins
    built-in      the op's own default or heuristic: the value is None in :class:`ResolvedKnobs`

Shape fit: a value that is valid in general may not fit one call (attention block_k whose
K/V tiles exceed 32 KiB for the head dims; slstm DH*K > 1024). From an argument or an
environment variable that is an error (:class:`TileConfigError` naming the source); from a
preset, that layer is skipped for this call, the next lower one is used and
``ResolvedKnobs.skipped`` / :func:`explain_knobs` say why. So a preset never makes a shape
fail.

Shape classes (for presets and the tuner), by the size each op is keyed on:

    rms_norm, layer_norm   row length n      small <= 128 < medium <= 4096 < large
    attention              key length Lk     small < 1024 <= medium < 8192 <= large
    mlstm                  sequence length S small < 256 <= medium < 4096 <= large
    slstm                  head dim DH       small <= 32 < medium <= 128 < large
    fused                  rows M (B*L)      small <= 8 < medium <= 512 < large

The layered lookup (environment + preset layers) is cached per (op, dtype, shape class,
family, environment snapshot, preset file stamps), so a call costs a few microseconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from . import env as env_mod
from . import presets as presets_mod
from .errors import TileConfigError
from .gemm import dtype_name
from .presets import DeviceInfo

__all__ = [
    "ATTENTION_TG_MEMORY",
    "KNOB_OPS",
    "KNOB_SHAPE_FORMS",
    "KNOBS",
    "Knob",
    "ResolvedKnobs",
    "attention_block_k_bytes",
    "attention_fits",
    "explain_knobs",
    "format_knobs",
    "knob_env_var",
    "knob_env_vars",
    "knob_shape_class",
    "parse_knob_env",
    "read_knob_env",
    "resolve_knobs",
    "shape_fits",
    "shape_size",
    "slstm_fits",
]

ARGUMENT = "argument"
BUILTIN = "built-in"
ATTENTION_TG_MEMORY = 32 * 1024
ALIAS_SPLIT_MIN_KEYS = "XLSTM_KERNELS_ATTN_SPLIT_MIN_KEYS"


# ---------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _IntRule:
    """Accepted integers: lo..hi (hi None: no upper bound), a multiple of `multiple`, or
    one of `choices`."""

    lo: int = 0
    hi: int | None = None
    multiple: int = 1
    choices: tuple[int, ...] | None = None

    def ok(self, v: int) -> bool:
        if self.choices is not None:
            return v in self.choices
        return v >= self.lo and (self.hi is None or v <= self.hi) and v % self.multiple == 0

    def form(self) -> str:
        if self.choices is not None:
            return "an integer, one of " + ", ".join(str(c) for c in self.choices)
        mult = f", a multiple of {self.multiple}" if self.multiple > 1 else ""
        if self.hi is None:
            return f"an integer >= {self.lo}{mult}"
        return f"an integer from {self.lo} to {self.hi}{mult}"


@dataclass(frozen=True)
class Knob:
    """One tunable of one op.

    Attributes:
        name: the knob's name (preset key, ``knobs=`` key, env suffix).
        kind: "int" or "bool".
        rule: accepted integers for env / preset / ``knobs=`` values (None for bools).
        arg_rule: accepted integers for the op's legacy keyword argument, where that is
            wider (e.g. ``attention_decode_split_kv(block_size=4)``); None: `rule`.
        builtin: what the op does when nothing sets the knob (shown as the source).
        grid, quick: the tuner's full and quick value grids.
        meaning: one line for ``xlstm-kernels info``.
    """

    name: str
    kind: str
    rule: _IntRule | None
    builtin: str
    grid: tuple
    quick: tuple
    meaning: str
    arg_rule: _IntRule | None = None

    def form(self, for_arg: bool = False) -> str:
        if self.kind == "bool":
            return "a boolean (true or false; in variables 1/0, true/false, yes/no, on/off)"
        rule = self.arg_rule if for_arg and self.arg_rule is not None else self.rule
        return rule.form()

    def problem(self, value: Any, for_arg: bool = False) -> str | None:
        """None if `value` is acceptable in general, else what is expected."""
        if self.kind == "bool":
            return None if isinstance(value, bool) else f"expected {self.form(for_arg)}"
        rule = self.arg_rule if for_arg and self.arg_rule is not None else self.rule
        if isinstance(value, bool) or not isinstance(value, int) or not rule.ok(value):
            return f"expected {self.form(for_arg)}"
        return None


_NORM_KNOBS = (
    Knob("n_reads", "int", _IntRule(choices=(1, 2, 4, 8, 16, 32, 64)),
         "built-in default: by row length and dtype (ops.norm._forward_layout)", (1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8),
         "elements per thread per step; one simdgroup per row up to 32*n_reads, cached up to 1024*n_reads"),
    Knob("simd_rows", "int", _IntRule(1, 32),
         "built-in default: 8 (ops.norm.SIMD_ROWS)", (1, 2, 4, 8, 16, 32), (4, 8, 16),
         "rows per threadgroup in the simdgroup-per-row layout"),
    Knob("looped_threads", "int", _IntRule(32, 1024, 32),
         "built-in default: 1024 (ops.norm.LOOPED_THREADS)", (128, 256, 512, 1024), (256, 1024),
         "threads of the looped (long-row) kernel"),
)

KNOBS: dict[str, dict[str, Knob]] = {
    "rms_norm": {k.name: k for k in _NORM_KNOBS},
    "layer_norm": {k.name: k for k in _NORM_KNOBS},
    "attention": {k.name: k for k in (
        Knob("block_q", "int", _IntRule(8, 256, 8),
             "built-in heuristic: 8 for Lq <= 8, 16 for Lq <= 16, else 32", (8, 16, 32, 64), (8, 16, 32),
             "prefill queries per threadgroup (BQ)"),
        Knob("block_k", "int", _IntRule(8, 128, 8),
             "built-in heuristic: 32, or 16 from head dim 128", (8, 16, 32, 64, 128), (16, 32, 64),
             "prefill keys per tile (BK); must fit 32 KiB of threadgroup memory",
             arg_rule=_IntRule(8, None, 8)),
        Knob("split_kv_block_size", "int", _IntRule(8, None, 8),
             "built-in default: 256 (ops.attention.SPLIT_KV_BLOCK_SIZE)", (64, 128, 256, 512, 1024), (64, 128, 256),
             "keys per block of the split-KV decode pass 1",
             arg_rule=_IntRule(1)),
        Knob("split_kv_min_keys", "int", _IntRule(0),
             "built-in default: 1024 (ops.attention.SPLIT_KV_MIN_KEYS)", (), (),
             "decode (Lq <= 8) runs split-KV from this many keys"),
        Knob("split_kv_mma", "bool", None,
             "built-in default: on for float16 / bfloat16 on cuda and the emulator, off for float32 and on "
             "Apple GPUs (ops.attention._mma_default)", (False, True),
             (False, True), "split-KV pass 1 as simdgroup-matrix tiles (tensor cores on CUDA) instead of the lane walk"),
        Knob("split_kv_cluster", "int", _IntRule(0, 8),
             "built-in default: none (opt-in: the emulator, cuda on sm_90 with MLX_USE_CUDA_GRAPHS=0; "
             "ops.attention._cluster_support)", (), (),
             "key blocks of the split-KV tile pass 1 merged in one threadgroup cluster (0 / 1: none)"),
        Knob("split_kv_stream", "bool", None,
             "built-in default: automatic (ops.attention._use_stream: cuda on sm_90, 32 to 64 (batch, kv head) "
             "pairs of one query row, head dims 128, 2-byte dtypes, no mask array)", (), (),
             "decode (split-KV calls) in one launch, a threadgroup per (batch, kv head) streaming its keys "
             "through bulk copies (attention_decode_stream), instead of the split-KV pass pair"),
        Knob("prefill_mma", "bool", None,
             "built-in default: on for float16 / bfloat16 on cuda and the emulator, off for float32 and on "
             "Apple GPUs (ops.attention._prefill_mma_default)", (False, True),
             (False, True), "prefill as 16 x 16 simdgroup-matrix tiles (attention_prefill_mma; tensor cores on CUDA) "
             "instead of attention_prefill; block_q / block_k apply to attention_prefill only"),
    )},
    "mlstm": {k.name: k for k in (
        Knob("chunk_size", "int", _IntRule(1, 128),
             "built-in default: 64", (8, 16, 32, 64, 128), (16, 32, 64),
             "steps per chunk of the chunkwise kernels",
             arg_rule=_IntRule(1)),
    )},
    "slstm": {k.name: k for k in (
        Knob("threads_per_unit", "int", _IntRule(choices=(1, 2, 4, 8, 16, 32)),
             "built-in heuristic: the power of two nearest DH/8 with DH*K <= 512", (1, 2, 4, 8, 16, 32),
             (1, 2, 4, 8), "lanes per unit K (DH*K threads per threadgroup, <= 1024)"),
        Knob("r_in_registers", "bool", None,
             "built-in heuristic: when the 4*ceil(DH/K) values of R per lane fit in 128 bytes", (False, True),
             (False, True), "keep R in registers for the whole sequence"),
    )},
    "fused": {k.name: k for k in (
        Knob("single_kernel", "bool", None,
             "built-in default: on (the one fused kernel; ops.fused.knob_values)", (False, True), (False, True),
             "fused_norm_linear / fused_norm_qkv_rope as one fused kernel (on) or as the unfused sequence of "
             "this package's kernels: rms_norm, linear, rope (off)"),
    )},
}

#: op -> its knob names, in order.
KNOB_OPS: dict[str, tuple[str, ...]] = {op: tuple(ks) for op, ks in KNOBS.items()}

#: The tuner's shape notation per op, and which entry is the size the shape class uses.
KNOB_SHAPE_FORMS: dict[str, tuple[str, int, str]] = {
    "rms_norm": ("ROWSxN", 1, "rows x row length n, e.g. 64x200"),
    "layer_norm": ("ROWSxN", 1, "rows x row length n, e.g. 64x200"),
    "attention": ("BxHxLqxLkxD", 3, "batch x heads x query length x key length x head dim, e.g. 1x2x40x48x32"),
    "mlstm": ("BxHxSxD", 2, "batch x heads x sequence length x head dim, e.g. 1x2x70x16"),
    "slstm": ("BxHxSxDH", 3, "batch x heads x sequence length x head dim, e.g. 1x2x12x16"),
    "fused": ("MxNxK", 0, "rows x outputs x reduction of fused_norm_linear, e.g. 33x31x29"),
}

# (upper bound of small, upper bound of medium, inclusive?) per op
_CLASS_BOUNDS = {
    "rms_norm": (128, 4096, True),
    "layer_norm": (128, 4096, True),
    "attention": (1024, 8192, False),
    "mlstm": (256, 4096, False),
    "slstm": (32, 128, True),
    "fused": (8, 512, True),
}


def _check_op(op: Any) -> dict[str, Knob]:
    spec = KNOBS.get(op) if isinstance(op, str) else None
    if spec is None:
        raise TileConfigError(f"op {op!r}: expected one of {', '.join(KNOBS)} (the ops with kernel knobs)")
    return spec


def knob_shape_class(op: str, size: int) -> str:
    """'small' | 'medium' | 'large' of `op` for its class size (see the module docstring)."""
    small, medium, inclusive = _CLASS_BOUNDS[op]
    if inclusive:
        return "small" if size <= small else "medium" if size <= medium else "large"
    return "small" if size < small else "medium" if size < medium else "large"


def shape_size(op: str, shape: tuple[int, ...]) -> int:
    """The class size of a tuner-notation shape (norms: n; attention: Lk; mlstm: S; slstm: DH;
    fused: M)."""
    _check_op(op)
    form, index, _ = KNOB_SHAPE_FORMS[op]
    dims = form.count("x") + 1
    if len(shape) != dims:
        raise TileConfigError(f"{op} shape {tuple(shape)}: expected {dims} sizes {form}")
    return int(shape[index])


def knob_env_var(op: str, knob: str) -> str:
    """The environment variable of one knob: ``XLSTM_<OP>_<KNOB>`` upper-case."""
    if knob not in _check_op(op):
        raise TileConfigError(f"knob {knob!r}: {op} has the knobs {', '.join(KNOB_OPS[op])}")
    return f"XLSTM_{op.upper()}_{knob.upper()}"


def knob_env_vars(op: str | None = None) -> list[str]:
    """Every knob variable (of `op`, or of all ops), the attention alias included."""
    ops = [op] if op is not None else list(KNOBS)
    out = [knob_env_var(o, k) for o in ops for k in KNOB_OPS[o]]
    if "attention" in ops:
        out.append(ALIAS_SPLIT_MIN_KEYS)
    return out


# ---------------------------------------------------------------------------------------
# Shape fits (shared with the ops)
# ---------------------------------------------------------------------------------------


def _round8(n: int) -> int:
    return -(-n // 8) * 8


def attention_block_k_bytes(block_k: int, d: int, dv: int, itemsize: int) -> int:
    """Threadgroup bytes of the prefill kernel's K/V tiles (one shared buffer when both do
    not fit in 32 KiB), as ``metal_src/attention.metal`` declares them."""
    pad = 16 // itemsize
    ldk, ldv = _round8(d) + pad, _round8(dv) + pad
    if block_k * (ldk + ldv) * itemsize > ATTENTION_TG_MEMORY:
        return block_k * max(ldk, ldv) * itemsize
    return block_k * (ldk + ldv) * itemsize


def _itemsize(dtype: Any) -> int:
    return 4 if dtype_name(dtype) == "float32" else 2


def attention_fits(d: int, dv: int, dtype: Any) -> Callable[[str, Any], str | None]:
    """`fits` for attention calls with head dims (d, dv): block_k's tiles must fit 32 KiB."""
    itemsize = _itemsize(dtype)
    dt = dtype_name(dtype)

    def fits(knob: str, value: Any) -> str | None:
        if knob == "block_k":
            need = attention_block_k_bytes(value, d, dv, itemsize)
            if need > ATTENTION_TG_MEMORY:
                return (f"block_k={value} with head dims ({d}, {dv}) in {dt} needs {need} bytes of "
                        f"threadgroup memory (> 32 KiB)")
        return None

    return fits


def slstm_fits(dh: int) -> Callable[[str, Any], str | None]:
    """`fits` for slstm calls with DH units per head: DH*K <= 1024 threads."""

    def fits(knob: str, value: Any) -> str | None:
        if knob == "threads_per_unit" and dh * value > 1024:
            return f"threads_per_unit={value} gives DH*K = {dh * value} threads per threadgroup (max 1024)"
        return None

    return fits


def shape_fits(op: str, dtype: Any, shape: Any) -> Callable[[str, Any], str | None] | None:
    """The `fits` the op applies for a tuner-notation shape (a tuple), or for a class size
    (an int: only slstm's DH says enough); None where nothing can misfit / is known."""
    if isinstance(shape, int):
        return slstm_fits(shape) if op == "slstm" else None
    if op == "attention":
        return attention_fits(int(shape[4]), int(shape[4]), dtype)
    if op == "slstm":
        return slstm_fits(int(shape[3]))
    return None


# ---------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------

_ALL_VARS = tuple(knob_env_vars())
_snapshot = env_mod.make_snapshot(_ALL_VARS)


def parse_knob_env(op: str, knob: Knob, var: str, text: str) -> Any:
    """The value of variable `var` = `text` for `knob` of `op`; TileConfigError naming `var`."""
    if knob.kind == "bool":
        return env_mod.parse_bool(var, text)
    word = text.strip()
    if word.isdigit() and knob.rule.ok(int(word)):
        return int(word)
    raise TileConfigError(f"{var}={text!r}: expected {knob.form()} ({op} {knob.name})")


def read_knob_env(op: str) -> dict[str, tuple[Any, str]]:
    """knob -> (value, variable) set by the environment for `op`; raises
    :class:`TileConfigError` naming the variable for a malformed value. Empty = unset."""
    spec = _check_op(op)
    out: dict[str, tuple[Any, str]] = {}
    for name, knob in spec.items():
        var = knob_env_var(op, name)
        text = os.environ.get(var, "")
        if text.strip():
            out[name] = (parse_knob_env(op, knob, var, text), var)
        elif op == "attention" and name == "split_kv_min_keys":
            text = os.environ.get(ALIAS_SPLIT_MIN_KEYS, "")
            if text.strip():
                label = f"{ALIAS_SPLIT_MIN_KEYS} (alias of {var})"
                out[name] = (parse_knob_env(op, knob, ALIAS_SPLIT_MIN_KEYS, text), label)
    return out


# ---------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------


class ResolvedKnobs(NamedTuple):
    """The knobs of one call (a named tuple: cheap to build on every call).

    values: knob -> value, None where the op's built-in default / heuristic applies.
    sources: knob -> where the value came from ("argument", a variable name, a preset
        file and key path, or "built-in ..."). skipped: preset values that did not fit
        this call: dicts with knob, value, source, reason. family: the preset family.
    shape_class: the op's class of this call's size.
    """

    values: dict
    sources: dict
    skipped: list
    family: str
    shape_class: str


@dataclass(frozen=True)
class _Layers:
    """The cached part of a resolve: per knob, (value, source, from_env) candidates."""

    device: DeviceInfo
    candidates: dict
    empty: bool
    builtin: ResolvedKnobs | None = field(default=None, compare=False)


_CACHE: dict[tuple, _Layers] = {}
_CACHE_MAX = 1024


def _layers(op: str, spec: dict[str, Knob], dt: str, cls: str, family: str | None) -> _Layers:
    gsnap = env_mod.snapshot()
    stamps = presets_mod.stack_stamps(gsnap)
    key = (op, dt, cls, family, _snapshot(), env_mod.snapshot_value(gsnap, env_mod.ENV_DEVICE), stamps)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    stack = presets_mod.current_stack(stamps)
    if family is None:
        device = presets_mod.select_family(stack, stamps, stacklevel=4)
    else:
        if not stack.has_family(family):
            raise TileConfigError(f"family {family!r}: no such preset family; known: {', '.join(stack.family_keys())}")
        device = DeviceInfo(f"family={family}", "", family)
    cands: dict[str, list] = {name: [] for name in spec}
    for name, (value, var) in read_knob_env(op).items():
        cands[name].append((value, var, True))
    for prefix, entry in stack.knob_layers(device.family_key, op, dt, cls):
        for name, value in entry.items():
            cands[name].append((value, f"{prefix}.{name}", False))
    frozen = {k: tuple(v) for k, v in cands.items()}
    empty = not any(frozen.values())
    builtin = None
    if empty:
        builtin = ResolvedKnobs({k: None for k in spec}, {k: spec[k].builtin for k in spec}, [],
                                device.family_key, cls)
    layers = _Layers(device, frozen, empty, builtin)
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[key] = layers
    return layers


def resolve_knobs(
    op: str,
    dtype: Any,
    size: int,
    *,
    args: dict | None = None,
    fits: Callable[[str, Any], str | None] | None = None,
    family: str | None = None,
) -> ResolvedKnobs:
    """The knobs of one call of `op`.

    Args:
        op: rms_norm | layer_norm | attention | mlstm | slstm | fused.
        dtype: the call's dtype (float32, float16, bfloat16; mx dtype or name).
        size: the size the shape class is keyed on (norms: row length n; attention: key
            length Lk; mlstm: sequence length S; slstm: head dim DH; fused: rows M).
        args: knob -> value from the op's arguments (None values are ignored); checked
            against each knob's accepted values (the op's keyword range).
        fits: callable(knob, value) -> None if the value fits this call, else the reason
            (see :func:`attention_fits`, :func:`slstm_fits`).
        family: use this preset family instead of the detected device's.

    Raises:
        TileConfigError: an unknown op or knob, a malformed argument or variable, or an
            argument / variable that does not fit this call; the message names it.
    """
    spec = _check_op(op)
    dt = dtype_name(dtype)
    cls = knob_shape_class(op, size)
    lay = _layers(op, spec, dt, cls, family)
    given = {k: v for k, v in args.items() if v is not None} if args else {}
    if lay.empty and not given:
        b = lay.builtin
        return ResolvedKnobs(dict(b.values), dict(b.sources), [], b.family, cls)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    skipped: list[dict] = []
    for name in given:
        if name not in spec:
            raise TileConfigError(f"{ARGUMENT} {name}={given[name]!r}: {op} has the knobs {', '.join(KNOB_OPS[op])}")
    for name, knob in spec.items():
        if name in given:
            value = given[name]
            msg = knob.problem(value, for_arg=True)
            if msg is None and fits is not None:
                msg = fits(name, value)
            if msg:
                raise TileConfigError(f"{ARGUMENT} {name}={value!r} ({op}): {msg}")
            values[name], sources[name] = value, ARGUMENT
            continue
        for value, source, from_env in lay.candidates[name]:
            msg = fits(name, value) if fits is not None else None
            if msg:
                if from_env:
                    raise TileConfigError(f"{source}={value!r}: {msg} (the variable applies to every {op} call; "
                                          "unset it or choose a value that fits)")
                skipped.append({"knob": name, "value": value, "source": source,
                                "reason": f"{msg}: skipped for this call"})
                continue
            values[name], sources[name] = value, source
            break
        else:
            values[name], sources[name] = None, knob.builtin
    return ResolvedKnobs(values, sources, skipped, lay.device.family_key, cls)


# ---------------------------------------------------------------------------------------
# Explain
# ---------------------------------------------------------------------------------------


def explain_knobs(
    op: str,
    dtype: Any,
    size: Any,
    *,
    args: dict | None = None,
    fits: Callable[[str, Any], str | None] | None = None,
    family: str | None = None,
) -> dict[str, Any]:
    """What :func:`resolve_knobs` picks for one call, for people tuning kernels.

    Args:
        op, dtype, args, fits, family: as for :func:`resolve_knobs`.
        size: the class size (an int), or a whole shape in the tuner's notation (a tuple:
            norms (ROWS, N), attention (B, H, Lq, Lk, D), mlstm (B, H, S, D), slstm
            (B, H, S, DH)); the shape (or slstm's DH) also gives the shape fit unless
            `fits` is passed.

    Returns a dict: op, dtype, size, shape (or None), shape_class, family, device,
    values, sources, skipped, env (knob -> variable), builtin (knob -> the built-in rule).
    """
    presets_mod.reload_presets()  # diagnostics always read the files as they are now
    spec = _check_op(op)
    shape = None
    if isinstance(size, (tuple, list)):
        shape = tuple(int(s) for s in size)
        size = shape_size(op, shape)
    elif isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise TileConfigError(f"explain_knobs: size must be a non-negative int or a shape tuple, got {size!r}")
    if fits is None:
        fits = shape_fits(op, dtype, shape if shape is not None else size)
    res = resolve_knobs(op, dtype, size, args=args, fits=fits, family=family)
    device = _layers(op, spec, dtype_name(dtype), res.shape_class, family).device
    return {
        "op": op,
        "dtype": dtype_name(dtype),
        "size": size,
        "shape": shape,
        "shape_class": res.shape_class,
        "family": res.family,
        "device": device.name,
        "values": dict(res.values),
        "sources": dict(res.sources),
        "skipped": list(res.skipped),
        "env": {k: knob_env_var(op, k) for k in spec},
        "builtin": {k: spec[k].builtin for k in spec},
    }


def format_knobs(info: dict[str, Any]) -> str:
    """:func:`explain_knobs`' dict as a few lines of text."""
    shape = "x".join(str(s) for s in info["shape"]) if info.get("shape") else f"size {info['size']}"
    lines = [f"{info['op']} {info['dtype']} {shape} (class {info['shape_class']}, family {info['family']})"]
    for k, v in info["values"].items():
        shown = "built-in" if v is None else repr(v)
        lines.append(f"  {k} = {shown}   <- {info['sources'][k]}")
    for s in info["skipped"]:
        lines.append(f"  skipped {s['knob']}={s['value']!r} from {s['source']}: {s['reason']}")
    return "\n".join(lines)


def _reset() -> None:
    """Forget the cached lookups (for tests)."""
    _CACHE.clear()
