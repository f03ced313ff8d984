"""Compile emulator C++ (the runtime and each kernel) with the system compiler.

Shared libraries are cached on disk by a content hash of the source, the flags and
the compiler's identity, so a kernel is compiled once per machine, not once per
process. Writes are atomic (compile to a unique temporary name, then rename), so
two threads or processes building the same kernel at once are safe: both produce a
complete library and the last rename wins.

Environment:
    XLSTM_KERNELS_EMULATE_CACHE: cache directory
        (default ``$XDG_CACHE_HOME/xlstm_kernels/emulate`` or ``~/.cache/...``).
    CXX: the C++ compiler (default ``g++``, then ``c++``, then ``clang++``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from importlib import resources
from pathlib import Path

__all__ = [
    "EmulatorCompileError",
    "cache_dir",
    "compile_shared",
    "csrc_dir",
    "compiler",
]

_BASE_FLAGS = [
    "-std=gnu++17",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-fno-strict-aliasing",
    "-ffp-contract=off",
    "-fsigned-char",
    "-Wno-attributes",
    "-Wno-unknown-pragmas",
]


class EmulatorCompileError(RuntimeError):
    """The kernel (or the emulator runtime) did not compile.

    The message holds the compiler's diagnostics; file names and line numbers refer
    to the kernel's own text (``<name>.metal`` for the body,
    ``<name>.header.metal`` for the header).
    """


def csrc_dir() -> Path:
    """Directory of the emulator's C++ sources (shipped inside the package)."""
    return Path(str(resources.files("xlstm_kernels.emulate").joinpath("csrc")))


def cache_dir() -> Path:
    """The on-disk cache for compiled libraries (created on demand)."""
    env = os.environ.get("XLSTM_KERNELS_EMULATE_CACHE")
    if env:
        base = Path(env)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg) if xdg else Path.home() / ".cache"
        base = base / "xlstm_kernels" / "emulate"
    base.mkdir(parents=True, exist_ok=True)
    return base


@functools.lru_cache(maxsize=None)
def compiler() -> tuple[str, str]:
    """(path, identity) of the C++ compiler; raises if none is installed."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    for c in candidates:
        path = shutil.which(c)
        if path:
            out = subprocess.run([path, "--version"], capture_output=True, text=True)
            return path, out.stdout.splitlines()[0] if out.stdout else path
    raise EmulatorCompileError(
        "The Metal emulator needs a C++17 compiler (g++ or clang++); none was found on PATH "
        "(set CXX to choose one)."
    )


@functools.lru_cache(maxsize=None)
def _headers_digest() -> str:
    h = hashlib.sha256()
    root = csrc_dir()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _clean_diagnostics(stderr: str, tmp: str) -> str:
    lines = []
    for line in stderr.splitlines():
        line = line.replace(tmp + "/", "")
        if "xk_kernel.h" in line and "In file included" in line:
            continue
        lines.append(line)
    text = "\n".join(lines)
    # Keep the first errors: the rest is usually a cascade.
    errors = [m.start() for m in re.finditer(r"^.*\berror\b", text, re.M)]
    if len(errors) > 8:
        text = text[: errors[8]] + "\n... (more errors omitted)"
    return text


def compile_shared(
    source: str,
    *,
    name: str,
    opt: str = "-O1",
    extra_flags: tuple[str, ...] = (),
    two_step: bool = False,
) -> Path:
    """Compile C++ `source` into a shared library and return its cached path.

    Args:
        source: the translation unit.
        name: a readable stem for the cached file name.
        opt: optimisation flag.
        extra_flags: more compiler flags (they are part of the cache key).
        two_step: compile to an object first, then link without the flags (used for
            ``-fsanitize=bounds``, whose handlers the kernel defines itself, so no
            sanitizer runtime is linked).
    """
    cxx, ident = compiler()
    flags = [opt, *_BASE_FLAGS, *extra_flags, f"-I{csrc_dir()}", f"-I{csrc_dir() / 'msl'}"]
    link_flags = ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []
    flags += link_flags  # on macOS kernel libraries resolve the runtime's symbols at load time
    key = hashlib.sha256(
        "\0".join([source, " ".join(flags), ident, _headers_digest(), str(two_step)]).encode()
    ).hexdigest()[:24]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:60]
    target = cache_dir() / f"{stem}-{key}.so"
    if target.exists():
        return target
    with _lock_for(str(target)):
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(prefix="xk-build-") as tmp:
            src_path = Path(tmp) / f"{stem}.cpp"
            src_path.write_text(source)
            out_tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            if two_step:
                obj = Path(tmp) / f"{stem}.o"
                cmds = [
                    [cxx, *flags, "-c", str(src_path), "-o", str(obj)],
                    [cxx, "-shared", "-fPIC", *link_flags, str(obj), "-o", str(out_tmp)],
                ]
            else:
                cmds = [[cxx, *flags, str(src_path), "-o", str(out_tmp)]]
            for cmd in cmds:
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    out_tmp.unlink(missing_ok=True)
                    raise EmulatorCompileError(
                        f"compiling {name} failed:\n{_clean_diagnostics(proc.stderr, tmp)}"
                    )
            os.replace(out_tmp, target)
    return target
