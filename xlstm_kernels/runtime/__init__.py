"""Kernel runtime: backend choice, kernel sources, kernel objects and launches."""

from .backends import BACKENDS, ENV_VAR, BackendUnavailableError, available, current_backend, default_backend, use_backend
from .kernels import KernelSpec, const_array, get_kernel, launch, prepare_launch
from .sources import KernelSourceError, families, family_header, kernel_body

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "BackendUnavailableError",
    "KernelSourceError",
    "KernelSpec",
    "available",
    "const_array",
    "current_backend",
    "default_backend",
    "families",
    "family_header",
    "get_kernel",
    "kernel_body",
    "launch",
    "prepare_launch",
    "use_backend",
]
