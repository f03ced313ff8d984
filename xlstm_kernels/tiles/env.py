"""Environment-variable overrides for the GEMM tiles (read on every resolve).

    XLSTM_GEMM_TILE_AV / _ATB / _ABT   "TMxTN" or "TMxTNxTK" for gemm_av / gemm_at_b / gemm_a_bt.
                                       Sets the scalar tile and selects the scalar path, unless
                                       XLSTM_GEMM_PATH=simd: then it sets BMxBN[xBK].
    XLSTM_GEMM_PATH                    simd | scalar
    XLSTM_GEMM_PAD                     pad width: a non-negative integer, or a boolean word
                                       (true/yes/on = 1, false/no/off = 0)
    XLSTM_GEMM_DB                      double buffering (scalar path): boolean word
    XLSTM_GEMM_VEC4                    vector loads (scalar path): boolean word
    XLSTM_GEMM_ALIGN_EXECW             TN := 32 * RN (scalar path): boolean word
    XLSTM_GEMM_MICRO                   "RMxRN": outputs per thread (scalar path)
    XLSTM_GEMM_WARPS                   "WMxWN": simdgroups per threadgroup (simd path)
    XLSTM_GEMM_SPLIT_K                 K partitions on the simd path (1 = off), forced for every shape
    XLSTM_GEMM_STAGES                  K tiles in flight on the simd path (0 = as many as fit)
    XLSTM_GEMM_GEMV_THREADS            threads per threadgroup of the M == 1 kernel (32..1024, x32)
    XLSTM_KERNELS_PRESETS              path of a user presets YAML file
    XLSTM_KERNELS_DEVICE               pretend to be this preset family (or architecture string)

Boolean words: 1/0, true/false, yes/no, on/off (any case). An empty value counts as
unset. Anything else raises :class:`TileConfigError` naming the variable.
"""

from __future__ import annotations

import os
from typing import Any

from .errors import TileConfigError
from .gemm import MAX_SIMD_STAGES, parse_tile

__all__ = [
    "ENV_ALIGN_EXECW",
    "ENV_DB",
    "ENV_DEVICE",
    "ENV_GEMV_THREADS",
    "ENV_MICRO",
    "ENV_PAD",
    "ENV_PATH",
    "ENV_PRESETS",
    "ENV_SPLIT_K",
    "ENV_TILE",
    "ENV_VEC4",
    "ENV_WARPGROUP",
    "ENV_WARPS",
    "GEMM_ENV_VARS",
    "EnvLayer",
    "env_path",
    "make_snapshot",
    "parse_bool",
    "read_gemm_env",
    "snapshot",
    "snapshot_value",
]

ENV_TILE = {
    "gemm_av": "XLSTM_GEMM_TILE_AV",
    "gemm_at_b": "XLSTM_GEMM_TILE_ATB",
    "gemm_a_bt": "XLSTM_GEMM_TILE_ABT",
}
ENV_PATH = "XLSTM_GEMM_PATH"
ENV_PAD = "XLSTM_GEMM_PAD"
ENV_DB = "XLSTM_GEMM_DB"
ENV_VEC4 = "XLSTM_GEMM_VEC4"
ENV_ALIGN_EXECW = "XLSTM_GEMM_ALIGN_EXECW"
ENV_MICRO = "XLSTM_GEMM_MICRO"
ENV_WARPS = "XLSTM_GEMM_WARPS"
ENV_SPLIT_K = "XLSTM_GEMM_SPLIT_K"
ENV_STAGES = "XLSTM_GEMM_STAGES"
ENV_GEMV_THREADS = "XLSTM_GEMM_GEMV_THREADS"
ENV_WARPGROUP = "XLSTM_GEMM_WARPGROUP"
ENV_PRESETS = "XLSTM_KERNELS_PRESETS"
ENV_DEVICE = "XLSTM_KERNELS_DEVICE"

# Every variable a GEMM resolve reads (its values key the resolve cache).
GEMM_ENV_VARS = (
    *ENV_TILE.values(), ENV_PATH, ENV_PAD, ENV_DB, ENV_VEC4, ENV_ALIGN_EXECW, ENV_MICRO,
    ENV_WARPS, ENV_SPLIT_K, ENV_STAGES, ENV_GEMV_THREADS, ENV_WARPGROUP, ENV_PRESETS, ENV_DEVICE,
    "XDG_CONFIG_HOME", "HOME",
)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_BOOL_FORM = "expected one of 1, 0, true, false, yes, no, on, off"


_CHANGES = [0]  # changes made to os.environ through its mapping (see _CountingEnviron)


class _CountingEnviron(dict):
    """``os.environ``'s underlying bytes mapping (``os.environ._data`` on POSIX), counting
    every change made to it.

    ``os.environ`` stores each set or delete in this mapping (``self._data[key] = value``,
    ``del self._data[key]``) after calling ``putenv`` / ``unsetenv``, so counting them here
    sees every change made through ``os.environ`` (its item assignment, ``del``, ``pop``,
    ``update``, ``clear``, ``setdefault``; pytest's ``monkeypatch.setenv`` and
    ``unittest.mock.patch.dict`` use those). The count is bumped *after* the change, so a
    reader that sees the new count also sees the change. Reads are the built-in dict's."""

    __slots__ = ()

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, value)
        _CHANGES[0] += 1

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        _CHANGES[0] += 1

    def pop(self, *args):
        try:
            return dict.pop(self, *args)
        finally:
            _CHANGES[0] += 1

    def popitem(self):
        try:
            return dict.popitem(self)
        finally:
            _CHANGES[0] += 1

    def clear(self):
        dict.clear(self)
        _CHANGES[0] += 1

    def update(self, *args, **kwargs):
        try:
            dict.update(self, *args, **kwargs)
        finally:
            _CHANGES[0] += 1

    def setdefault(self, key, default=None):
        try:
            return dict.setdefault(self, key, default)
        finally:
            _CHANGES[0] += 1

    def __ior__(self, other):
        self.update(other)
        return self


def _count_environ_changes() -> _CountingEnviron | None:
    """Put a :class:`_CountingEnviron` under ``os.environ`` (POSIX, where its mapping is a
    plain dict), once per process; returns it, or None where that is not possible."""
    data = getattr(os.environ, "_data", None)
    if isinstance(data, _CountingEnviron):
        return data
    if os.name != "posix" or type(data) is not dict:
        return None
    counted = _CountingEnviron(data)
    os.environ._data = counted
    return counted


_COUNTED = _count_environ_changes()
_os = os


def environ_version() -> int | None:
    """A number that changes whenever ``os.environ`` does, or None where changes cannot be
    counted (not POSIX, or ``os.environ`` or its mapping replaced since this module was
    imported): then readers compare the environment itself. Two attribute reads and a
    list read: a call's configuration check costs this instead of comparing the whole
    environment (~0.5 us locally for 38 variables, more for a large environment), on every
    op call."""
    try:
        if _os.environ._data is _COUNTED:
            return _CHANGES[0]
    except AttributeError:
        pass
    return None


def make_snapshot(names: tuple[str, ...]):
    """A function returning the raw values of the variables `names` as a tuple (None
    where unset): for cache keys of resolvers (GEMM tiles, kernel knobs, the call memo).

    The tuple is memoised against :func:`environ_version` (bytes values from
    ``os.environ``'s mapping: ``os.environ.get`` encodes the key and decodes the value,
    ~1 us per variable): any change made through ``os.environ`` -- to one of `names` or
    not -- makes the next call re-read the values. Where changes are not counted, it is
    memoised against a copy of the whole mapping instead (one C-level dict comparison a
    call); elsewhere (not POSIX) every call reads the variables. So the result is always
    exactly what reading each variable now would give."""
    names = tuple(names)
    keys = tuple(os.fsencode(v) for v in names) if os.name == "posix" else ()
    memo = [-1, None, ()]  # (environ version, copy of the environment, values): never valid at first

    def snap() -> tuple:
        data = getattr(_os.environ, "_data", None)
        if data is _COUNTED and data is not None:  # (environ_version, inlined: every op call runs this)
            version = _CHANGES[0]
            if version == memo[0]:
                return memo[2]
            values = tuple(map(data.get, keys))
            memo[:] = [version, None, values]
            return values
        if keys and isinstance(data, dict):  # POSIX: the bytes mapping
            if memo[1] is not None and data == memo[1]:
                return memo[2]
            copy = dict(data)
            values = tuple(map(copy.get, keys))
            memo[:] = [-1, copy, values]
            return values
        get = _os.environ.get
        return tuple([get(v) for v in names])

    return snap


# The current values of every variable a GEMM resolve depends on (raw, for cache keys).
snapshot = make_snapshot(GEMM_ENV_VARS)

def snapshot_value(snap: tuple, var: str) -> str | None:
    """The value of `var` in a snapshot tuple of GEMM_ENV_VARS, as a str (None: unset)."""
    raw = snap[_INDEX[var]]
    return os.fsdecode(raw) if isinstance(raw, bytes) else raw


_INDEX = {v: i for i, v in enumerate(GEMM_ENV_VARS)}


def _get(var: str) -> str | None:
    value = os.environ.get(var)
    if value is None or not value.strip():
        return None
    return value.strip()


def parse_bool(var: str, text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise TileConfigError(f"{var}={text!r}: {_BOOL_FORM}")


def _parse_pad(var: str, text: str) -> int:
    word = text.strip().lower()
    if word.isdigit():
        return int(word)
    if word in _TRUE[1:]:
        return 1
    if word in _FALSE[1:]:
        return 0
    raise TileConfigError(
        f"{var}={text!r}: expected a pad width (a non-negative integer such as 0, 1 or 4) "
        f"or a boolean word (true/yes/on = 1, false/no/off = 0)"
    )


def _parse_pair(var: str, text: str, names: str) -> tuple[int, int]:
    parts = [p.strip() for p in text.lower().split("x")]
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise TileConfigError(f"{var}={text!r}: expected '{names}' with positive integers, e.g. '4x4'")
    return int(parts[0]), int(parts[1])


def _parse_int(var: str, text: str, lo: int, hi: int | None = None, multiple: int = 1, what: str = "") -> int:
    word = text.strip()
    ok = word.isdigit() and int(word) >= lo and (hi is None or int(word) <= hi) and int(word) % multiple == 0
    if not ok:
        rng = f"an integer >= {lo}" if hi is None else f"a multiple of {multiple} from {lo} to {hi}"
        raise TileConfigError(f"{var}={text!r}: expected {rng}{what}")
    return int(word)


def _parse_stages(var: str, text: str) -> int:
    word = text.strip()
    if not (word.isdigit() and int(word) <= MAX_SIMD_STAGES):
        raise TileConfigError(f"{var}={text!r}: expected an integer from 0 (as many as fit) to {MAX_SIMD_STAGES}")
    return int(word)


def env_path() -> tuple[str | None, str | None]:
    """(path, source) forced by XLSTM_GEMM_PATH, or (None, None)."""
    text = _get(ENV_PATH)
    if text is None:
        return None, None
    word = text.lower()
    if word not in ("simd", "scalar"):
        raise TileConfigError(f"{ENV_PATH}={text!r}: expected 'simd' or 'scalar'")
    return word, ENV_PATH


class EnvLayer:
    """Fields set by the environment for one op, with the variable behind each."""

    __slots__ = ("fields", "sources")

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.sources: dict[str, str] = {}

    def set(self, field: str, value: Any, source: str) -> None:
        self.fields[field] = value
        self.sources[field] = source


def read_gemm_env(op: str) -> EnvLayer:
    """Parse every GEMM variable that applies to `op`; raise on a malformed value."""
    layer = EnvLayer()
    path, path_src = env_path()
    if path is not None:
        layer.set("path", path, path_src)

    var = ENV_TILE[op]
    text = _get(var)
    if text is not None:
        sizes = parse_tile(text, f"{var}={text!r}")
        if path == "simd":
            names = ("bm", "bn", "bk")
        else:
            names = ("tm", "tn", "tk")
            if path is None:
                layer.set("path", "scalar", f"{var} (a tile selects the scalar path; {ENV_PATH}=simd sets BMxBN)")
        for name, size in zip(names, sizes):
            layer.set(name, size, var)

    text = _get(ENV_PAD)
    if text is not None:
        layer.set("pad", _parse_pad(ENV_PAD, text), ENV_PAD)
    for var, field in ((ENV_DB, "double_buffer"), (ENV_VEC4, "vec4"), (ENV_ALIGN_EXECW, "align_execw"),
                       (ENV_WARPGROUP, "warpgroup")):
        text = _get(var)
        if text is not None:
            layer.set(field, parse_bool(var, text), var)
    text = _get(ENV_MICRO)
    if text is not None:
        rm, rn = _parse_pair(ENV_MICRO, text, "RMxRN")
        layer.set("rm", rm, ENV_MICRO)
        layer.set("rn", rn, ENV_MICRO)
    text = _get(ENV_WARPS)
    if text is not None:
        wm, wn = _parse_pair(ENV_WARPS, text, "WMxWN")
        layer.set("wm", wm, ENV_WARPS)
        layer.set("wn", wn, ENV_WARPS)
    text = _get(ENV_SPLIT_K)
    if text is not None:
        layer.set("split_k", _parse_int(ENV_SPLIT_K, text, 1, what=" (1 = no split)"), ENV_SPLIT_K)
    text = _get(ENV_STAGES)
    if text is not None:
        layer.set("stages", _parse_stages(ENV_STAGES, text), ENV_STAGES)
    text = _get(ENV_GEMV_THREADS)
    if text is not None:
        layer.set("gemv_threads", _parse_int(ENV_GEMV_THREADS, text, 32, 1024, 32), ENV_GEMV_THREADS)
    return layer
