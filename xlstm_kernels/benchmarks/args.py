"""Parsing and checking the arguments of ``bench`` / ``tune`` / ``info``.

Every parser takes the text a user typed (or a list of values from Python) and the name
of the argument it came from, and raises :class:`BenchArgumentError` whose message
starts with that name and says what is accepted::

    >>> parse_shapes("64x64x64,12x", "--shapes")
    BenchArgumentError: --shapes: '12x' is not a shape; expected positive integers joined by 'x', ...
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import mlx.core as mx

__all__ = [
    "BenchArgumentError",
    "DTYPE_NAMES",
    "dtype_of",
    "parse_dtypes",
    "parse_names",
    "parse_positive_int",
    "parse_shapes",
    "shape_text",
]

DTYPE_NAMES = ("float32", "float16", "bfloat16")

_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


class BenchArgumentError(ValueError):
    """A malformed argument of bench / tune / info; the message names the argument."""


def _items(value: Any, name: str) -> list[str]:
    """A comma-separated string or an iterable of values -> non-empty list of stripped strings."""
    if value is None:
        raise BenchArgumentError(f"{name}: no value given")
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
    elif isinstance(value, Iterable):
        parts = [value_text(v).strip() for v in value]
    else:
        parts = [value_text(value).strip()]
    if not parts or any(not p for p in parts):
        raise BenchArgumentError(f"{name}: empty entry in {value!r}; expected a comma-separated list")
    return parts


def value_text(v: Any) -> str:
    if isinstance(v, mx.Dtype):
        return str(v).split(".")[-1]
    return str(v)


def parse_names(value: Any, name: str, allowed: Sequence[str], *, aliases: dict[str, Sequence[str]] | None = None,
                what: str = "name") -> list[str]:
    """A comma list of names from `allowed` (case-insensitive), in order, without repeats.

    `aliases` maps a word (e.g. "all") to the names it stands for.
    """
    out: list[str] = []
    aliases = aliases or {}
    for part in _items(value, name):
        word = part.lower()
        names = aliases.get(word) or ([word] if word in allowed else None)
        if names is None:
            choices = ", ".join([*allowed, *aliases])
            raise BenchArgumentError(f"{name}: unknown {what} {part!r}; expected a comma-separated list of {choices}")
        for n in names:
            if n not in out:
                out.append(n)
    return out


def dtype_of(name: str) -> mx.Dtype:
    """'float16' -> mx.float16 (canonical names only)."""
    return getattr(mx, name)


def parse_dtypes(value: Any, name: str = "--dtypes") -> list[str]:
    """Comma list (or list) of float32 / float16 / bfloat16 (aliases fp32, fp16, half, bf16, ...)
    -> canonical names."""
    out: list[str] = []
    for part in _items(value, name):
        canon = _DTYPE_ALIASES.get(part.lower().removeprefix("mlx.core."))
        if canon is None:
            raise BenchArgumentError(
                f"{name}: unknown dtype {part!r}; expected a comma-separated list of {', '.join(DTYPE_NAMES)}"
            )
        if canon not in out:
            out.append(canon)
    return out


def parse_shapes(value: Any, name: str = "--shapes", dims: int | None = 3,
                 form: str = "MxNxK (output M x N, reduction K), e.g. 64x64x64") -> list[tuple[int, ...]]:
    """Comma list of 'AxBxC' shapes, or a list of such strings / int tuples -> int tuples.

    `dims`: the number of sizes each shape must have (None: any number >= 1).
    """
    if isinstance(value, (list, tuple)) and value and all(_is_int(v) for v in value):
        value = [value]  # one shape given as a tuple of ints
    if isinstance(value, (list, tuple)):
        value = ["x".join(str(d) for d in v) if isinstance(v, (list, tuple)) else v for v in value]
    out: list[tuple[int, ...]] = []
    for part in _items(value, name):
        pieces = [p.strip() for p in part.lower().split("x")]
        if not all(p.isdigit() for p in pieces) or (dims is not None and len(pieces) != dims):
            want = f"{dims} positive integers" if dims else "positive integers"
            raise BenchArgumentError(f"{name}: {part!r} is not a shape; expected {want} joined by 'x': {form}")
        sizes = tuple(int(p) for p in pieces)
        if min(sizes) < 1:
            raise BenchArgumentError(f"{name}: {part!r} has a zero size; sizes must be positive: {form}")
        if sizes not in out:
            out.append(sizes)
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_positive_int(value: Any, name: str) -> int:
    """A positive integer (int or decimal text)."""
    if isinstance(value, bool):
        raise BenchArgumentError(f"{name}: must be a positive integer, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip()
        if not text.lstrip("-").isdigit():
            raise BenchArgumentError(f"{name}: must be a positive integer, got {value!r}")
        n = int(text)
    if n < 1:
        raise BenchArgumentError(f"{name}: must be a positive integer, got {n}")
    return n


def shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(int(d)) for d in shape)
