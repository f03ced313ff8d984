"""Turn MLX's generated kernel text into a C++ translation unit for the emulator.

The text MLX builds (see :mod:`.signature`) is compiled almost verbatim: GCC ignores
the ``[[kernel]]``, ``[[buffer(i)]]`` and attribute annotations, and the shim headers
make ``device``/``constant``/``threadgroup`` empty and provide Metal's types, math and
simd functions. Only three edits are made, all line-preserving so that compiler
errors and runtime reports point at the kernel's own lines:

* ``#line`` directives before the header and the body (``<name>.metal``);
* ``threadgroup T a[..][..];`` declarations in the body become references to
  per-threadgroup storage shared by all fibers of the group;
* half literals ``1.5h`` become ``((half)1.5f)``.

An ``extern "C" xk_entry`` adapter then calls the kernel with one thread's
buffers and attributes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .signature import GeneratedKernel

__all__ = ["ThreadgroupDecl", "TranslationError", "TranslationUnit", "rewrite_threadgroup_decls", "translate"]

_TG_DECL = re.compile(
    r"\bthreadgroup\b(?!_)\s+"  # the address space (not threadgroup_barrier)
    r"(?P<type>(?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?)"  # element type
    r"\s+(?P<decls>[A-Za-z_][^;{}]*?)\s*;",  # declarators (pointers start with * or &: no match)
    re.S,
)
_DECLARATOR = re.compile(r"^\s*(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\[\]]*\]\s*)*)$", re.S)
_HALF_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")


class TranslationError(ValueError):
    """A kernel body uses a construct the emulator cannot translate."""


@dataclass(frozen=True)
class ThreadgroupDecl:
    """One threadgroup variable found in a kernel body."""

    id: int
    name: str
    type: str  # element type, e.g. "float"
    dims: str  # e.g. "[TM][TK + PAD]" ("" for a scalar)
    line: int  # 1-based line in the body


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "[<(":
            depth += 1
        elif ch in "]>)":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def rewrite_threadgroup_decls(body: str, first_id: int = 0) -> tuple[str, list[ThreadgroupDecl]]:
    """Rewrite ``threadgroup`` variable declarations into shared-storage references.

    ``threadgroup float a[16][17], b[8];`` becomes
    ``typedef float xk_tg_t0[16][17]; auto& a = xk_tg<xk_tg_t0, 0>(); ...`` on the
    same line(s); pointers (``threadgroup float* p``) are left alone.
    """
    decls: list[ThreadgroupDecl] = []

    def replace(m: re.Match) -> str:
        text = m.group(0)
        ty = " ".join(m.group("type").split())
        pieces = []
        line = body.count("\n", 0, m.start()) + 1
        for declarator in _split_top_level(m.group("decls")):
            d = _DECLARATOR.match(declarator)
            if not d:
                raise TranslationError(
                    f"line {line}: cannot read the threadgroup declaration {' '.join(text.split())!r}; "
                    "the emulator supports `threadgroup T name[dim]...;` with one or more declarators"
                )
            pieces.append((d.group("name"), " ".join(d.group("dims").split())))
        out = []
        for name, dims in pieces:
            i = first_id + len(decls)
            decls.append(ThreadgroupDecl(i, name, ty, dims, line))
            out.append(f"typedef {ty} xk_tg_t{i}{dims}; auto& {name} = xk_tg<xk_tg_t{i}, {i}>();")
        return " ".join(out) + "\n" * text.count("\n")

    # Match on a copy with comments and string literals blanked (same length, newlines
    # kept), so "threadgroup" in a comment is not taken for a declaration.
    masked = _blank_comments(body)
    out, last = [], 0
    for m in _TG_DECL.finditer(masked):
        original = _TG_DECL.match(body, m.start(), m.end())
        out.append(body[last : m.start()])
        out.append(replace(original) if original else body[m.start() : m.end()])
        last = m.end()
    out.append(body[last:])
    return "".join(out), decls


_COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', re.S)


def _blank_comments(text: str) -> str:
    """`text` with comments and string literals replaced by spaces (newlines kept)."""
    return _COMMENT_OR_STRING.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def rewrite_half_literals(text: str) -> str:
    """``1.0h`` (a Metal half literal) -> ``((half)1.0f)``; integers get a ``.0``."""

    def rep(m: re.Match) -> str:
        num = m.group(1)
        if not any(c in num for c in ".eE"):
            num += ".0"
        return f"((half){num}f)"

    return _HALF_LITERAL.sub(rep, text)


@dataclass
class TranslationUnit:
    """The C++ text to compile plus what the launcher needs to know about it."""

    text: str
    threadgroup_decls: list[ThreadgroupDecl]
    file_name: str  # name used in #line for the body


def _c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _argument(param, slot: int) -> str:
    """C++ expression passing buffer/attribute `param` to the kernel."""
    if param.kind == "attribute":
        if param.ctype == "uint3":
            return f"*reinterpret_cast<const uint3*>(&a->{param.name})"
        return f"a->{param.name}"
    ctype = param.ctype
    if ctype.endswith("&"):
        return f"*reinterpret_cast<{ctype[:-1]}*>(b[{slot}])"
    return f"reinterpret_cast<{ctype}>(b[{slot}])"


def translate(gen: GeneratedKernel, display_name: str) -> TranslationUnit:
    """Build the translation unit for one generated kernel.

    Args:
        gen: MLX's kernel text and signature, from :func:`.signature.generate`.
        display_name: base of the file names in diagnostics (``<name>.metal``).
    """
    src = gen.source
    header = src[gen.header_start : gen.header_end]
    signature = src[gen.signature_start : gen.body_start]
    body = src[gen.body_start : gen.body_end]
    tail = src[gen.body_end :]

    body, decls = rewrite_threadgroup_decls(body)
    body = rewrite_half_literals(body)
    header = rewrite_half_literals(header)
    body_file = f"{display_name}.metal"

    # Every buffer parameter consumes one slot of the buffer table, in signature order.
    args, slot = [], 0
    for p in gen.params:
        args.append(_argument(p, slot))
        if p.kind != "attribute":
            slot += 1

    parts = [
        f"#define XK_TG_DECLS {len(decls)}\n",
        '#include "xk_kernel.h"\n',
    ]
    if header:
        parts += [f"#line 1 {_c_string(display_name + '.header.metal')}\n", header]
        if not header.endswith("\n"):
            parts.append("\n")
    parts += [
        f"#line 1 {_c_string(display_name + '.signature')}\n",
        signature,
        f"#line 1 {_c_string(body_file)}\n",
        body,
        f"\n#line 1 {_c_string(display_name + '.instantiation')}\n",
        tail,
        "\n#line 1 \"xk_entry\"\n",
        'extern "C" __attribute__((visibility("default"))) void xk_entry(void* const* b, '
        "const xk_thread_attrs* a) {\n",
        "  (void)b; (void)a;\n",
        f"  {gen.instantiation}(\n    " + ",\n    ".join(args) + ");\n",
        "}\n",
    ]
    return TranslationUnit("".join(parts), decls, body_file)
