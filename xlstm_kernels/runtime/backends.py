"""Which backend runs the kernels: ``metal``, ``cuda``, ``emulate`` or ``reference``.

* ``metal``: ``mx.fast.metal_kernel`` on an Apple GPU.
* ``cuda``: the same Metal bodies on an NVIDIA GPU through ``mx.fast.cuda_kernel``
  (:mod:`xlstm_kernels.cuda`; MLX's CUDA backend, ``mlx[cuda13]``).
* ``emulate``: the same Metal bodies on the CPU through :mod:`xlstm_kernels.emulate`
  (Linux CI, debugging).
* ``reference``: plain ``mx`` ops, one reference implementation per op.

Selection, first match wins: :func:`use_backend` (a context manager, per thread and
task), the ``XLSTM_KERNELS_BACKEND`` environment variable (read on every call, so a
change takes effect at once), then ``metal`` where ``mx.metal.is_available()``,
``cuda`` where ``mx.cuda.is_available()``, else ``reference``. A backend that cannot run raises; nothing falls back silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator

import mlx.core as mx

__all__ = ["BACKENDS", "ENV_VAR", "BackendUnavailableError", "available", "current_backend", "default_backend", "use_backend"]

BACKENDS = ("metal", "emulate", "reference", "cuda")
ENV_VAR = "XLSTM_KERNELS_BACKEND"

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("xlstm_kernels_backend", default=None)


class BackendUnavailableError(RuntimeError):
    """The selected backend cannot run on this machine."""


def _check_name(name: object, source: str) -> str:
    if not isinstance(name, str) or name.strip().lower() not in BACKENDS:
        raise ValueError(f"{source}: unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return name.strip().lower()


def _cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available())
    except Exception:  # noqa: BLE001  an MLX built without the CUDA backend
        return False


def default_backend() -> str:
    """``metal`` where MLX has a Metal device, ``cuda`` where it has a CUDA device,
    else ``reference``."""
    if mx.metal.is_available():
        return "metal"
    if _cuda_available():
        return "cuda"
    return "reference"


def available(name: str) -> tuple[bool, str]:
    """Whether backend `name` can run here, and if not, why."""
    name = _check_name(name, "backend")
    if name == "metal":
        if mx.metal.is_available():
            return True, ""
        return False, "MLX has no Metal device on this machine (mx.metal.is_available() is False)"
    if name == "cuda":
        if _cuda_available():
            return True, ""
        return False, ("MLX has no CUDA device on this machine (mx.cuda.is_available() is False; "
                       "the backend needs an NVIDIA GPU and the mlx[cuda13] wheels)")
    if name == "emulate":
        from ..emulate.compiler import EmulatorCompileError, compiler

        try:
            compiler()
        except EmulatorCompileError as e:
            return False, str(e)
    return True, ""


def current_backend() -> str:
    """The backend the next op will run on."""
    name = _override.get()
    if name is not None:
        return name
    env = os.environ.get(ENV_VAR)
    if env is not None and env.strip():
        return _check_name(env, ENV_VAR)
    return default_backend()


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Run the ops inside the block on backend `name`.

    >>> with use_backend("emulate"):
    ...     y = xlstm_kernels.rms_norm(x, w, 1e-5)
    """
    token = _override.set(_check_name(name, "use_backend"))
    try:
        yield name
    finally:
        _override.reset(token)
