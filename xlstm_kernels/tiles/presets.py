"""Preset files (YAML): strict loading, layering, device-family matching, rooflines.

Files, highest precedence first (each may hold just the families/fields it overrides):

    $XLSTM_KERNELS_PRESETS                            (must exist when set)
    $XDG_CONFIG_HOME/xlstm_kernels/presets.yaml       (default ~/.config/...; if present)
    xlstm_kernels.tuning/presets.yaml                 (shipped; importlib.resources)

Parsing is cached by (path, mtime, size), so an edited file is re-read on the next
resolve. The schema is documented at the top of the shipped ``tuning/presets.yaml``.
Within one family, a (op, dtype, shape class) lookup merges field by field, most
specific first::

    shapes.<class>.<op>.<dtype>   shapes.<class>.<op>.default
    shapes.<class>.default.<dtype> shapes.<class>.default.default
    gemm.<op>.<dtype>   gemm.<op>.default   gemm.default.<dtype>   gemm.default.default

Shape classes by M*N*K (output M x N, reduction K): small < 2**21 (128**3) <= medium
< 2**30 (1024**3) <= large.

The non-GEMM kernels' knobs (:mod:`xlstm_kernels.tiles.knobs`) live in two more optional
sections of a family, validated as strictly::

    kernels:        <op> -> <dtype|default> -> {knob: value}
    kernel_shapes:  <small|medium|large> -> <op> -> <dtype|default> -> {knob: value}

looked up most specific first: kernel_shapes.<class>.<op>.<dtype>,
kernel_shapes.<class>.<op>.default, kernels.<op>.<dtype>, kernels.<op>.default (each op
has its own shape classes, see the knobs module).
"""

from __future__ import annotations

import importlib.resources
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import yaml

from .env import ENV_DEVICE, ENV_PRESETS, snapshot, snapshot_value
from .errors import TileConfigError
from .gemm import DTYPES, FIELDS, OPS, GemmConfig, accepted_form, check_field

__all__ = [
    "FAMILY_CPU",
    "FAMILY_FALLBACK",
    "ROOFLINE_KEYS",
    "SHAPE_CLASSES",
    "DeviceInfo",
    "PresetFile",
    "PresetStack",
    "current_stack",
    "detect_device",
    "load_preset_file",
    "roofline",
    "select_family",
    "shape_class",
    "shipped_presets_path",
    "user_presets_path",
]

FAMILY_FALLBACK = "generic_apple"
FAMILY_CPU = "cpu"
SHAPE_CLASSES = ("small", "medium", "large")
SMALL_MNK = 1 << 21  # 128**3
LARGE_MNK = 1 << 30  # 1024**3
ROOFLINE_KEYS = ("fp32_tflops", "fp16_tflops", "bf16_tflops", "bandwidth_gbs")
SHIPPED_DISPLAY = "presets.yaml"

_TOP_KEYS = ("version", "anchors", "families")
_FAMILY_KEYS = ("match", "roofline", "device_rooflines", "compute_units", "gemm", "shapes", "kernels", "kernel_shapes")
_MATCH_KEYS = ("architecture", "device_name")
_FAMILY_KEY = re.compile(r"[A-Za-z0-9_]+")
_YAML_PATHS = ("simd", "scalar")  # gemv is chosen by shape (M == 1), not by a preset


def shape_class(m: int, n: int, k: int) -> str:
    """'small' | 'medium' | 'large' by M*N*K (see the module docstring)."""
    mnk = m * n * k
    if mnk < SMALL_MNK:
        return "small"
    return "medium" if mnk < LARGE_MNK else "large"


# ---------------------------------------------------------------------------------------
# One file
# ---------------------------------------------------------------------------------------

Entry = dict  # field -> value, one YAML config mapping


@dataclass
class Family:
    """One family of one file, validated. gemm/shapes: (op|default) -> (dtype|default) -> Entry."""

    match: dict[str, list[str]] | None = None
    roofline: dict[str, float] = field(default_factory=dict)
    # device-name substring -> roofline figures that differ for those devices (an H200 in the
    # H100's family: the same SMs, more bandwidth)
    device_rooflines: dict[str, dict[str, float]] = field(default_factory=dict)
    compute_units: int | None = None  # threadgroups the GPU runs at once per wave (SMs); GEMM split-K rule
    gemm: dict[str, dict[str, Entry]] = field(default_factory=dict)
    shapes: dict[str, dict[str, dict[str, Entry]]] = field(default_factory=dict)
    kernels: dict[str, dict[str, Entry]] = field(default_factory=dict)  # op -> dtype -> knobs
    kernel_shapes: dict[str, dict[str, dict[str, Entry]]] = field(default_factory=dict)  # class -> op -> ...


@dataclass
class PresetFile:
    path: str
    display: str  # how errors and sources name the file
    families: dict[str, Family]


class _Checker:
    def __init__(self, display: str):
        self.display = display

    def fail(self, where: str, msg: str) -> TileConfigError:
        return TileConfigError(f"{self.display}: {where}: {msg}" if where else f"{self.display}: {msg}")

    def mapping(self, node: Any, where: str, allowed: tuple[str, ...] | None, what: str = "") -> dict:
        if node is None:
            return {}
        if not isinstance(node, dict):
            raise self.fail(where, f"expected a mapping{what}, got {type(node).__name__} {node!r}")
        for key in node:
            if not isinstance(key, str):
                raise self.fail(where, f"keys must be strings, got {key!r}")
            if allowed is not None and key not in allowed:
                raise self.fail(_join(where, key), f"unknown key '{key}'; expected one of {', '.join(allowed)}")
        return node

    def str_list(self, node: Any, where: str) -> list[str]:
        if isinstance(node, str):
            node = [node]
        if not isinstance(node, list) or not all(isinstance(s, str) and s for s in node):
            raise self.fail(where, f"expected a list of non-empty strings, got {node!r}")
        return list(node)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _parse_entry(chk: _Checker, node: Any, where: str) -> Entry:
    node = chk.mapping(node, where, tuple(FIELDS), " of GEMM fields")
    entry: Entry = {}
    for key, value in node.items():
        if key == "path":
            if value not in _YAML_PATHS:
                raise chk.fail(_join(where, key), f"expected 'simd' or 'scalar' (gemv is chosen for M == 1), got {value!r}")
        else:
            msg = check_field(key, value)
            if msg:
                raise chk.fail(_join(where, key), f"expected {accepted_form(key)}, got {value!r} ({type(value).__name__})")
        entry[key] = value
    return entry


def _parse_gemm(chk: _Checker, node: Any, where: str) -> dict[str, dict[str, Entry]]:
    node = chk.mapping(node, where, (*OPS, "default"), " of op -> dtype -> fields")
    out: dict[str, dict[str, Entry]] = {}
    for op, per_dtype in node.items():
        w = _join(where, op)
        per_dtype = chk.mapping(per_dtype, w, (*DTYPES, "default"), " of dtype -> fields")
        out[op] = {dt: _parse_entry(chk, e, _join(w, dt)) for dt, e in per_dtype.items()}
    return out


def _parse_knob_entry(chk: _Checker, op: str, node: Any, where: str) -> Entry:
    from .knobs import KNOBS  # (knobs imports this module)

    spec = KNOBS[op]
    node = chk.mapping(node, where, tuple(spec), f" of {op} knobs")
    entry: Entry = {}
    for key, value in node.items():
        msg = spec[key].problem(value)
        if msg:
            raise chk.fail(_join(where, key), f"{msg}, got {value!r} ({type(value).__name__})")
        entry[key] = value
    return entry


def _parse_kernels(chk: _Checker, node: Any, where: str) -> dict[str, dict[str, Entry]]:
    """<op> -> <dtype|default> -> knobs (the `kernels` section, or one class of `kernel_shapes`)."""
    from .knobs import KNOBS

    if node is None:
        return {}
    if not isinstance(node, dict):
        raise chk.fail(where, f"expected a mapping of op -> dtype -> knobs, got {type(node).__name__} {node!r}")
    out: dict[str, dict[str, Entry]] = {}
    for op, per_dtype in node.items():
        w = _join(where, str(op))
        if op not in KNOBS:
            hint = ""
            if op in SHAPE_CLASSES:
                hint = " (shape classes go under kernel_shapes: kernel_shapes.<class>.<op>.<dtype>)"
            elif op in OPS or op == "default":
                hint = " (GEMM tiles go under gemm / shapes)"
            raise chk.fail(w, f"unknown key '{op}'; expected one of {', '.join(KNOBS)}{hint}")
        per_dtype = chk.mapping(per_dtype, w, (*DTYPES, "default"), " of dtype -> knobs")
        out[op] = {dt: _parse_knob_entry(chk, op, e, _join(w, dt)) for dt, e in per_dtype.items()}
    return out


def _parse_kernel_shapes(chk: _Checker, node: Any, where: str) -> dict[str, dict[str, dict[str, Entry]]]:
    from .knobs import KNOBS

    if node is None:
        return {}
    if not isinstance(node, dict):
        raise chk.fail(where, f"expected a mapping of shape class -> op -> dtype -> knobs, got "
                              f"{type(node).__name__} {node!r}")
    out = {}
    for cls, per_op in node.items():
        if cls not in SHAPE_CLASSES:
            hint = " (kernel_shapes.<class>.<op>.<dtype>: the class comes first)" if cls in KNOBS else ""
            raise chk.fail(_join(where, str(cls)), f"unknown key '{cls}'; expected one of "
                                                   f"{', '.join(SHAPE_CLASSES)}{hint}")
        out[cls] = _parse_kernels(chk, per_op, _join(where, cls))
    return out


def _parse_roofline(chk: _Checker, node: Any, where: str) -> dict[str, float]:
    """Roofline figures (a subset of ROOFLINE_KEYS), each a positive number."""
    out = {}
    for k, v in chk.mapping(node, where, ROOFLINE_KEYS).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise chk.fail(_join(where, k), f"expected a positive number, got {v!r}")
        out[k] = float(v)
    return out


def _parse_family(chk: _Checker, node: Any, where: str) -> Family:
    node = chk.mapping(node, where, _FAMILY_KEYS)
    fam = Family()
    if "match" in node:
        w = _join(where, "match")
        m = chk.mapping(node["match"], w, _MATCH_KEYS)
        fam.match = {k: chk.str_list(m.get(k, []), _join(w, k)) for k in _MATCH_KEYS}
    if "roofline" in node:
        fam.roofline = _parse_roofline(chk, node["roofline"], _join(where, "roofline"))
    if "device_rooflines" in node:
        w = _join(where, "device_rooflines")
        for name, r in chk.mapping(node["device_rooflines"], w, None).items():
            if not name.strip():
                raise chk.fail(w, "device-name keys must not be empty")
            fam.device_rooflines[name] = _parse_roofline(chk, r, _join(w, name))
    if "compute_units" in node:
        v = node["compute_units"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise chk.fail(_join(where, "compute_units"), f"expected a positive integer, got {v!r}")
        fam.compute_units = v
    if "gemm" in node:
        fam.gemm = _parse_gemm(chk, node["gemm"], _join(where, "gemm"))
    if "shapes" in node:
        w = _join(where, "shapes")
        s = chk.mapping(node["shapes"], w, SHAPE_CLASSES)
        fam.shapes = {cls: _parse_gemm(chk, g, _join(w, cls)) for cls, g in s.items()}
    if "kernels" in node:
        fam.kernels = _parse_kernels(chk, node["kernels"], _join(where, "kernels"))
    if "kernel_shapes" in node:
        fam.kernel_shapes = _parse_kernel_shapes(chk, node["kernel_shapes"], _join(where, "kernel_shapes"))
    return fam


def _knob_chain(fam: Family, op: str, dtype: str, cls: str | None) -> list[tuple[str, Entry]]:
    """(key path, knob entry) of `fam` for one knob lookup, most specific first."""
    out = []
    sections = ([(f"kernel_shapes.{cls}", fam.kernel_shapes.get(cls, {}))] if cls else []) + [("kernels", fam.kernels)]
    for prefix, sec in sections:
        per = sec.get(op)
        if not per:
            continue
        for d in (dtype, "default"):
            e = per.get(d)
            if e:
                out.append((f"{prefix}.{op}.{d}", e))
    return out


def _chain(fam: Family, op: str, dtype: str, cls: str | None) -> list[tuple[str, Entry]]:
    """(key path, entry) of `fam` for one lookup, most specific first."""
    out = []
    sections = ([(f"shapes.{cls}", fam.shapes.get(cls, {}))] if cls else []) + [("gemm", fam.gemm)]
    for prefix, sec in sections:
        for o in (op, "default"):
            per = sec.get(o)
            if not per:
                continue
            for d in (dtype, "default"):
                e = per.get(d)
                if e:
                    out.append((f"{prefix}.{o}.{d}", e))
    return out


# Fields whose built-in values are the "least demanding" (off / zero): a limit broken with
# them at their defaults is broken whatever a lower file says.
_MONOTONE = frozenset(("pad", "double_buffer", "vec4", "align_execw"))


def family_backend(fam: Family) -> str:
    """The kernel backend a family's configs run on, for their limits: "cuda" when every
    architecture it matches is a CUDA one (sm_*), else "metal" (Apple's limits, which the
    emulator shares)."""
    archs = (fam.match or {}).get("architecture") or []
    return "cuda" if archs and all(str(a).startswith("sm_") for a in archs) else "metal"


def _check_relations(chk: _Checker, name: str, fam: Family) -> None:
    """Raise for a tile that breaks a limit using only fields this file sets itself (the
    limits of the family's backend: family_backend)."""
    backend = family_backend(fam)
    classes = [None, *[c for c in SHAPE_CLASSES if c in fam.shapes]]
    for cls in classes:
        for op in OPS:
            for dtype in DTYPES:
                chain = _chain(fam, op, dtype, cls)
                merged: dict[str, Any] = {}
                where: dict[str, str] = {}
                for keypath, entry in reversed(chain):  # general first, specific overrides
                    for f, v in entry.items():
                        merged[f] = v
                        where[f] = keypath
                if not merged:
                    continue
                cfg = GemmConfig(**{k: v for k, v in merged.items() if k != "path"})
                explicit = set(merged) | _MONOTONE
                for fields, msg in cfg.problems(dtype, backend):
                    if set(fields) <= explicit:
                        f0 = next(f for f in fields if f in where)
                        raise chk.fail(f"families.{name}.{where[f0]}.{f0}", msg)


def _parse_file(text: str, display: str) -> dict[str, Family]:
    chk = _Checker(display)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TileConfigError(f"{display}: not valid YAML: {e}") from None
    doc = chk.mapping(doc, "", _TOP_KEYS, " at the top level")
    if "version" in doc and (doc["version"] != 1 or isinstance(doc["version"], bool)):
        raise chk.fail("version", f"only version 1 is understood, got {doc['version']!r}")
    fams_node = chk.mapping(doc.get("families"), "families", None, " of family key -> family")
    families: dict[str, Family] = {}
    for name, node in fams_node.items():
        if not _FAMILY_KEY.fullmatch(name):
            raise chk.fail(f"families.{name}", "family keys use letters, digits and '_' only")
        fam = _parse_family(chk, node, f"families.{name}")
        _check_relations(chk, name, fam)
        families[name] = fam
    return families


_FILE_CACHE: dict[str, tuple[tuple[int, int], PresetFile]] = {}


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def load_preset_file(path: str, display: str | None = None, stamp: tuple[int, int] | None = None) -> PresetFile:
    """Parse and validate one presets file (cached by path + mtime + size)."""
    path = os.fspath(path)
    display = display or path
    stamp = stamp or _stamp(path)
    if stamp is None:
        raise TileConfigError(f"{display}: presets file not found")
    hit = _FILE_CACHE.get(path)
    if hit is not None and hit[0] == stamp and hit[1].display == display:
        return hit[1]
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise TileConfigError(f"{display}: cannot read presets file: {e}") from None
    pf = PresetFile(path, display, _parse_file(text, display))
    _FILE_CACHE[path] = (stamp, pf)
    return pf


# ---------------------------------------------------------------------------------------
# The stack of files
# ---------------------------------------------------------------------------------------

_SHIPPED_PATH: str | None = None


def shipped_presets_path() -> str:
    global _SHIPPED_PATH
    if _SHIPPED_PATH is None:
        _SHIPPED_PATH = str(importlib.resources.files("xlstm_kernels.tuning") / "presets.yaml")
    return _SHIPPED_PATH


_USER_PATHS: dict[tuple, str] = {}


def user_presets_path(snap: tuple | None = None) -> str:
    """The default user presets file, $XDG_CONFIG_HOME (else ~/.config)/xlstm_kernels/presets.yaml
    (used only if it exists)."""
    snap = snap if snap is not None else snapshot()
    key = (snapshot_value(snap, "XDG_CONFIG_HOME"), snapshot_value(snap, "HOME"))
    hit = _USER_PATHS.get(key)
    if hit is None:
        base = key[0] or os.path.join(os.path.expanduser("~"), ".config")
        hit = _USER_PATHS[key] = os.path.join(base, "xlstm_kernels", "presets.yaml")
    return hit


@dataclass
class PresetStack:
    """Preset files, highest precedence first, and what they say together."""

    files: list[PresetFile]

    def family_keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for f in self.files:
            for k in f.families:
                seen.setdefault(k, None)
        return list(seen)

    def has_family(self, key: str) -> bool:
        return any(key in f.families for f in self.files)

    def match(self, key: str) -> dict[str, list[str]] | None:
        for f in self.files:
            fam = f.families.get(key)
            if fam is not None and fam.match is not None:
                return fam.match
        return None

    def backend(self, key: str) -> str:
        """The kernel backend family `key`'s configs are for (:func:`family_backend`)."""
        archs = (self.match(key) or {}).get("architecture") or []
        return "cuda" if archs and all(str(a).startswith("sm_") for a in archs) else "metal"

    def compute_units(self, key: str) -> int | None:
        """The family's compute_units from the highest-precedence file that sets it (no
        fallback family: None where no file does)."""
        for f in self.files:
            fam = f.families.get(key)
            if fam is not None and fam.compute_units is not None:
                return fam.compute_units
        return None

    def roofline(self, key: str, device_name: str = "") -> dict[str, float]:
        """The family's roofline figures (each from the highest-precedence file that sets it,
        else the fallback family's), with the figures of its ``device_rooflines`` entry whose
        name is the longest substring of `device_name` (case-insensitive; a tie goes to the
        higher-precedence file) in their place."""
        out: dict[str, float] = {}
        best: tuple[int, dict[str, float]] = (0, {})
        lname = device_name.lower()
        for f in self.files if lname else ():
            fam = f.families.get(key)
            for name, figures in (fam.device_rooflines.items() if fam is not None else ()):
                if name.lower() in lname and len(name) > best[0]:
                    best = (len(name), figures)
        out.update(best[1])
        for k in (key, FAMILY_FALLBACK):
            for f in self.files:
                fam = f.families.get(k)
                if fam is None:
                    continue
                for name, v in fam.roofline.items():
                    out.setdefault(name, v)
        missing = [k for k in ROOFLINE_KEYS if k not in out]
        if missing:
            raise TileConfigError(f"presets: family '{key}' has no roofline figures for {', '.join(missing)}")
        return {k: out[k] for k in ROOFLINE_KEYS}

    def layers(self, key: str, op: str, dtype: str, cls: str | None) -> list[tuple[str, Entry]]:
        """(source prefix, entry) for a lookup across files, highest precedence first."""
        out = []
        for f in self.files:
            fam = f.families.get(key)
            if fam is None:
                continue
            for keypath, entry in _chain(fam, op, dtype, cls):
                out.append((f"{f.display}: families.{key}.{keypath}", entry))
        return out

    def knob_layers(self, key: str, op: str, dtype: str, cls: str | None) -> list[tuple[str, Entry]]:
        """(source prefix, knob entry) of a kernel-knob lookup across files, highest first."""
        out = []
        for f in self.files:
            fam = f.families.get(key)
            if fam is None:
                continue
            for keypath, entry in _knob_chain(fam, op, dtype, cls):
                out.append((f"{f.display}: families.{key}.{keypath}", entry))
        return out


_STACK_CACHE: dict[tuple, PresetStack] = {}


# Preset files are stat()ed at most once per STAMP_TTL_S for the same environment (an op
# call resolves its tiles / knobs every time; two stats per call were a tenth of a small
# op's host time). A changed XLSTM_KERNELS_PRESETS / XDG variable is seen at once, an edit
# of a file in place within STAMP_TTL_S; reload_presets() forgets the memo (the tuner's
# writer calls it).
STAMP_TTL_S = 0.5
_STAMP_MEMO: list = [None, 0.0, None]  # [env snapshot, time checked, stamps]
RELOADS = [0]  # reload_presets() calls (memos built on the stamps compare it)


def reload_presets() -> None:
    """Make the next tile / knob resolve re-read the preset files' stamps (after editing one)."""
    _STAMP_MEMO[0] = None
    RELOADS[0] += 1


def stack_stamps(snap: tuple | None = None) -> tuple:
    """(path, display, stamp) of every preset file in play, highest first; raises if
    XLSTM_KERNELS_PRESETS names a missing file. `snap`: an env.snapshot()."""
    snap = snap if snap is not None else snapshot()
    now = time.monotonic()
    memo = _STAMP_MEMO
    if memo[0] == snap and now - memo[1] < STAMP_TTL_S:
        return memo[2]
    stamps = _read_stamps(snap)
    memo[0], memo[1], memo[2] = snap, now, stamps
    return stamps


def _read_stamps(snap: tuple) -> tuple:
    out = []
    env_file = (snapshot_value(snap, ENV_PRESETS) or "").strip()
    if env_file:
        path = os.path.abspath(os.path.expanduser(env_file))
        st = _stamp(path)
        if st is None:
            raise TileConfigError(f"{ENV_PRESETS}={env_file!r}: no such presets file")
        out.append((path, path, st))
    user = user_presets_path(snap)
    st = _stamp(user)
    if st is not None and not any(p == user for p, _, _ in out):
        out.append((user, user, st))
    shipped = shipped_presets_path()
    st = _stamp(shipped)
    if st is None:
        raise TileConfigError(f"{SHIPPED_DISPLAY}: the shipped presets file is missing at {shipped}")
    out.append((shipped, SHIPPED_DISPLAY, st))
    return tuple(out)


def current_stack(stamps: tuple | None = None) -> PresetStack:
    stamps = stamps if stamps is not None else stack_stamps()
    hit = _STACK_CACHE.get(stamps)
    if hit is None:
        hit = PresetStack([load_preset_file(p, d, s) for p, d, s in stamps])
        if len(_STACK_CACHE) > 16:
            _STACK_CACHE.clear()
        _STACK_CACHE[stamps] = hit
    return hit


# ---------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceInfo:
    """The GPU (or the CPU stand-in) and the preset family chosen for it."""

    name: str
    architecture: str
    family_key: str


_HARDWARE: list = []  # [(name, architecture) or None], filled once


def _hardware() -> tuple[str, str] | None:
    """(device_name, architecture) of the Metal or CUDA GPU, or None without a GPU."""
    if not _HARDWARE:
        info = None
        try:
            import mlx.core as mx

            if mx.metal.is_available():
                get = getattr(mx, "device_info", None) or mx.metal.device_info
                d = get()
                info = (str(d.get("device_name", "")), str(d.get("architecture", "")))
            elif getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
                d = mx.device_info(mx.gpu)  # device_name "NVIDIA H100 ...", architecture "sm_90"
                info = (str(d.get("device_name", "")), str(d.get("architecture", "")))
        except Exception:  # noqa: BLE001  (no MLX / no Metal: the CPU family)
            info = None
        _HARDWARE.append(info)
    return _HARDWARE[0]


def match_family(stack: PresetStack, name: str, architecture: str) -> str | None:
    """The family whose match rules fit best: longest architecture prefix, then (only if no
    architecture matched) the longest device-name substring; ties go to the earlier one."""
    arch = architecture.lower()
    lname = name.lower()
    best_arch, best_name = (0, None), (0, None)
    for key in stack.family_keys():
        m = stack.match(key)
        if not m:
            continue
        for p in m["architecture"]:
            if arch and arch.startswith(p.lower()) and len(p) > best_arch[0]:
                best_arch = (len(p), key)
        for s in m["device_name"]:
            if lname and s.lower() in lname and len(s) > best_name[0]:
                best_name = (len(s), key)
    return best_arch[1] or best_name[1]


_WARNED: set = set()
_SELECT_CACHE: dict[tuple, DeviceInfo] = {}


def _warn_unknown(name: str, architecture: str, stacklevel: int) -> None:
    if (name, architecture) in _WARNED:
        return
    _WARNED.add((name, architecture))
    warnings.warn(
        f"xlstm_kernels: no tile preset matches the device {name or '?'!r} (architecture "
        f"{architecture or '?'!r}); using the '{FAMILY_FALLBACK}' presets. Add a family for it "
        f"to a presets file ({ENV_PRESETS}) to tune it.",
        UserWarning,
        stacklevel=stacklevel + 2,
    )


def select_family(stack: PresetStack, stamps: tuple = (), stacklevel: int = 1) -> DeviceInfo:
    """The device and its family, honouring XLSTM_KERNELS_DEVICE; warns (once per device)
    when nothing matches and the generic_apple family is used (`stacklevel` as for
    warnings.warn, counted from the caller of select_family)."""
    override = os.environ.get(ENV_DEVICE, "").strip()
    key = (override, stamps)
    hit = _SELECT_CACHE.get(key)
    if hit is not None:
        return hit
    if override:
        if stack.has_family(override):
            info = DeviceInfo(f"{ENV_DEVICE}={override}", "", override)
        else:
            fam = match_family(stack, "", override)
            if fam is None:
                _warn_unknown(f"{ENV_DEVICE}={override}", override, stacklevel)
                fam = FAMILY_FALLBACK
            info = DeviceInfo(f"{ENV_DEVICE}={override}", override, fam)
    else:
        hw = _hardware()
        if hw is None:
            info = DeviceInfo("cpu", "", FAMILY_CPU)
        else:
            name, arch = hw
            fam = match_family(stack, name, arch)
            if fam is None:
                _warn_unknown(name, arch, stacklevel)
                fam = FAMILY_FALLBACK
            info = DeviceInfo(name, arch, fam)
    if len(_SELECT_CACHE) > 64:
        _SELECT_CACHE.clear()
    _SELECT_CACHE[key] = info
    return info


def detect_device() -> DeviceInfo:
    """The device (``mx.device_info()`` on Metal or CUDA, else the "cpu" family) and its family.

    ``XLSTM_KERNELS_DEVICE=<family key or architecture>`` overrides detection.
    """
    stamps = stack_stamps()
    return select_family(current_stack(stamps), stamps, stacklevel=2)


def roofline(family: str | None = None, device_name: str | None = None) -> dict[str, float]:
    """Peak fp32/fp16/bf16 TFLOP/s and memory GB/s of a preset family (default: this device's),
    for the device named `device_name` (default: this device where `family` is None, else
    none): a family's ``device_rooflines`` entries replace figures for the devices they name."""
    stamps = stack_stamps()
    stack = current_stack(stamps)
    if family is None:
        info = select_family(stack, stamps, stacklevel=2)
        family = info.family_key
        if device_name is None:
            device_name = info.name
    elif not stack.has_family(family):
        raise TileConfigError(f"roofline: unknown family {family!r}; known: {', '.join(stack.family_keys())}")
    return stack.roofline(family, device_name or "")


def _reset_caches() -> None:
    """Forget parsed files, device choices and the once-per-device warnings (for tests)."""
    from . import knobs

    _FILE_CACHE.clear()
    _STACK_CACHE.clear()
    _SELECT_CACHE.clear()
    _WARNED.clear()
    knobs._reset()
