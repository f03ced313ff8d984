"""Kernel texts handed to ``mx.fast.cuda_kernel`` as one ``#include`` line of a file.

MLX hashes the whole kernel text (header + source) on *every* launch: the JIT module's name
is ``std::hash`` of it (``CustomKernel::eval_gpu``). On the H100 host that costs about
0.28 us per KB and call; RMSNorm's 11.7 KB of header and body cost ~3 us a call, a tenth of
the kernel at 4096 x 4096 (``scripts/probe_evalcost.py``, session 10). So the texts go into
files named after their content and the kernel gets ``#include "<file>"`` (~100 bytes):
NVRTC reads the file when it compiles, MLX hashes only the line.

The name holds the SHA-256 of the content, so a changed text is a new file and a new module
name (MLX never reuses a module compiled from other text). An existing file is used only if
its content is exactly the text. The files live in ``XLSTM_KERNELS_CUDA_TEXT_DIR`` if set,
else ``$XDG_CACHE_HOME/xlstm_kernels/cuda-text`` (``~/.cache/...``), a directory of the user
only. Where no file can be written (read-only home, odd path) the text is passed as it is:
slower per call, same kernel.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading

__all__ = ["TEXT_DIR_ENV_VAR", "as_include", "text_dir"]

TEXT_DIR_ENV_VAR = "XLSTM_KERNELS_CUDA_TEXT_DIR"
_BAD_PATH_CHARS = '"\\\n\r'
_lock = threading.Lock()


def text_dir() -> str:
    """The directory of the kernel text files (not created here)."""
    env = os.environ.get(TEXT_DIR_ENV_VAR, "").strip()
    if env:
        return os.path.abspath(os.path.expanduser(env))
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "xlstm_kernels", "cuda-text")


def _write_once(path: str, data: bytes) -> bool:
    """Whether `path` holds exactly `data` (written now if absent or different)."""
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return True
    except OSError:
        pass
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
    return True


def as_include(text: str, stem: str) -> str:
    """``#include "<dir>/<stem>-<sha256 prefix>.cuh"`` of a file holding `text`, or `text`
    itself when no such file can be made. Called once per kernel object: the file is read
    back and compared each time, so a deleted or altered file is written again. `stem`: a
    readable part of the name, e.g. ``rms_norm.source``."""
    data = text.encode()
    digest = hashlib.sha256(data).hexdigest()[:32]
    directory = text_dir()
    safe_stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in stem)[:64] or "kernel"
    path = os.path.join(directory, f"{safe_stem}-{digest}.cuh")
    if any(c in path for c in _BAD_PATH_CHARS):
        return text
    with _lock:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError:
            return text
        if not _write_once(path, data):
            return text
    return f'#include "{path}"\n'
