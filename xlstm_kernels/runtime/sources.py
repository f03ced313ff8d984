"""Kernel bodies from ``metal_src/`` (shipped inside the package).

A family file ``metal_src/<family>.metal`` holds named sections::

    // @header            helpers shared by the family's kernels (passed as header=)
    ...
    // @header xk_row_moments   helpers passed (after the @header section) only to the
    ...                         kernels whose body names xk_row_moments
    // @kernel rms_norm   the body of one kernel
    ...

Lines before the first marker are a comment block and are ignored. Files named
``_<name>.metal`` are not families: their ``@header`` sections are placed before every
family's header (helpers all kernels share, such as ``xk_frag_coord``), their named
sections (``// @header xk_tile_wg``) before the headers of the kernels whose text names them.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

__all__ = ["KernelSourceError", "family_sections", "kernel_body", "family_header", "families"]

_MARKER = re.compile(r"^//\s*@(header|kernel)\b[ \t]*(\w*)[ \t]*$", re.M)


class KernelSourceError(LookupError):
    """A family or kernel section that does not exist in metal_src/."""


def families() -> list[str]:
    """Names of the shipped kernel families (``metal_src/*.metal``)."""
    root = resources.files("xlstm_kernels.metal_src")
    return sorted(p.name[: -len(".metal")] for p in root.iterdir()
                  if p.name.endswith(".metal") and not p.name.startswith("_"))


def _shared_names() -> list[str]:
    root = resources.files("xlstm_kernels.metal_src")
    return sorted(p.name[: -len(".metal")] for p in root.iterdir()
                  if p.name.endswith(".metal") and p.name.startswith("_"))


@functools.lru_cache(maxsize=None)
def family_sections(family: str) -> dict[str, str]:
    """``{"@header": text, "<kernel>": body, ...}`` for one family file."""
    path = resources.files("xlstm_kernels.metal_src").joinpath(f"{family}.metal")
    if not path.is_file():
        raise KernelSourceError(f"no kernel family {family!r} in metal_src/ (have: {', '.join(families())})")
    text = path.read_text()
    sections: dict[str, str] = {}
    marks = list(_MARKER.finditer(text))
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        if m.group(1) == "header":
            key = f"@header {m.group(2)}" if m.group(2) else "@header"
        else:
            key = m.group(2)
        if not key:
            raise KernelSourceError(f"metal_src/{family}.metal: '// @kernel' needs a name")
        if key in sections:
            raise KernelSourceError(f"metal_src/{family}.metal: section {key!r} appears twice")
        sections[key] = text[m.end() + 1 : end]
    return sections


def kernel_body(family: str, kernel: str) -> str:
    """The Metal body of `kernel` in `family`."""
    sections = family_sections(family)
    if kernel not in sections or kernel.startswith("@"):
        names = [k for k in sections if not k.startswith("@")]
        raise KernelSourceError(f"metal_src/{family}.metal has no kernel {kernel!r} (have: {', '.join(names)})")
    return sections[kernel]


@functools.lru_cache(maxsize=None)
def family_header(family: str, kernel: str | None = None) -> str:
    """The shared ``_*.metal`` headers, then the family's header section (whose helpers
    may call the shared ones), then its named header sections (``// @header <name>``):
    for `kernel`, those whose name its body mentions; without one, all of them. Every JIT
    build reads a kernel's whole text (held under 16 KiB on CUDA), so helpers that only a
    few of a family's kernels call live in named sections."""
    sections = family_sections(family)
    body = kernel_body(family, kernel) if kernel is not None else None
    own = [sections.get("@header", "")] + _named_sections(sections, body)
    shared = []
    if not family.startswith("_"):
        # shared named sections: where the body, the family's header or its named sections
        # included above name them (a family's header may call the shared helpers)
        text = "\n".join([body or ""] + own)
        for name in _shared_names():
            parts = family_sections(name)
            shared.append(parts.get("@header", ""))
            shared += _named_sections(parts, text if body is not None else None)
    return "\n".join(p for p in shared + own if p)


def _named_sections(sections: dict[str, str], text: str | None) -> list[str]:
    """The ``// @header <name>`` sections of `sections` whose name `text` mentions (all of
    them where `text` is None), in file order."""
    out = []
    for key, section in sections.items():
        name = key[len("@header "):] if key.startswith("@header ") else None
        if name and (text is None or re.search(rf"\b{re.escape(name)}\b", text)):
            out.append(section)
    return out
