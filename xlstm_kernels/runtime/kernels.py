"""Build kernel objects once and launch them on the active backend.

A :class:`KernelSpec` names a body in ``metal_src/`` and its buffer names. The kernel
object (``mx.fast.metal_kernel``, the emulator's, or the CUDA backend's, which runs the
same body through ``mx.fast.cuda_kernel``) is built once per backend and
spec and cached (thread-safe); MLX caches the compiled library per template, so
building per call would only waste time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from .backends import BackendUnavailableError, current_backend
from .sources import family_header, kernel_body

__all__ = ["KernelSpec", "get_kernel", "launch", "prepare_launch"]


@dataclass(frozen=True)
class KernelSpec:
    """One Metal kernel: ``metal_src/<family>.metal`` section `kernel`.

    Attributes:
        family: the source file stem (``"norm"``).
        kernel: the section name (``"rms_norm"``); also the MLX kernel name.
        input_names: buffer names of the inputs, in call order.
        output_names: buffer names of the outputs.
        header: extra header text before the family's ``@header`` section
            (e.g. ``#include <metal_simdgroup_matrix>``).
        atomic_outputs, ensure_row_contiguous: as for ``mx.fast.metal_kernel``.
    """

    family: str
    kernel: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    header: str = ""
    atomic_outputs: bool = False
    ensure_row_contiguous: bool = True

    def source(self) -> str:
        return kernel_body(self.family, self.kernel)

    def full_header(self) -> str:
        return self.header + family_header(self.family, self.kernel)


_cache: dict[tuple[str, KernelSpec], Any] = {}
_lock = threading.Lock()


def get_kernel(spec: KernelSpec, backend: str | None = None) -> Any:
    """The kernel object for `spec` on `backend` (default: the active one)."""
    backend = backend or current_backend()
    key = (backend, spec)
    k = _cache.get(key)  # a dict lookup is atomic; the lock only guards insertion
    if k is not None:
        return k
    if backend == "metal":
        if not mx.metal.is_available():
            raise BackendUnavailableError(
                "backend 'metal' was selected but MLX has no Metal device here; "
                "use XLSTM_KERNELS_BACKEND=emulate (CPU emulator) or =reference"
            )
        factory = mx.fast.metal_kernel
    elif backend == "emulate":
        from ..emulate import metal_kernel as factory
    elif backend == "cuda":
        from .backends import _cuda_available

        if not _cuda_available():
            raise BackendUnavailableError(
                "backend 'cuda' was selected but MLX has no CUDA device here (mx.cuda.is_available() is False); "
                "use XLSTM_KERNELS_BACKEND=emulate (CPU emulator) or =reference"
            )
        from ..cuda import metal_kernel as factory
    else:
        raise ValueError(f"backend {backend!r} runs no Metal kernels (ops use their reference path there)")
    k = factory(
        name=spec.kernel,
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source(),
        header=spec.full_header(),
        ensure_row_contiguous=spec.ensure_row_contiguous,
        atomic_outputs=spec.atomic_outputs,
    )
    with _lock:
        return _cache.setdefault(key, k)


def _takes_shared_memory(kernel: Any) -> bool:
    """Whether `kernel` takes a launch's ``shared_memory`` (cuda; the emulator, which
    models a CUDA launch with it); Metal's kernels declare their buffers statically."""
    if hasattr(kernel, "prepare"):
        return True
    from ..emulate import EmulatedKernel

    return isinstance(kernel, EmulatedKernel)


def launch(
    spec: KernelSpec,
    *,
    inputs: Sequence[Any],
    output_shapes: Sequence[Sequence[int]],
    output_dtypes: Sequence[mx.Dtype],
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
    template: Sequence[tuple[str, Any]] | None = None,
    init_value: float | None = None,
    backend: str | None = None,
    shared_memory: int = 0,
) -> list[mx.array]:
    """Run `spec` on `backend` (default: the active one). `grid` counts threads.
    `shared_memory`: bytes of dynamic threadgroup memory for a body that takes its buffer
    through ``XK_THREADGROUP_DYNAMIC`` on cuda; the emulator takes it as the limit of the
    CUDA launch it models (above Apple's 32 KiB); metal declares the buffer statically
    and ignores it."""
    kernel = get_kernel(spec, backend)
    extra = {"shared_memory": int(shared_memory)} if shared_memory and _takes_shared_memory(kernel) else {}
    return kernel(
        inputs=list(inputs),
        output_shapes=[tuple(s) for s in output_shapes],
        output_dtypes=list(output_dtypes),
        grid=tuple(grid),
        threadgroup=tuple(threadgroup),
        template=list(template) if template else None,
        init_value=init_value,
        **extra,
    )


def prepare_launch(
    spec: KernelSpec,
    *,
    inputs: Sequence[Any],
    output_shapes: Sequence[Sequence[int]],
    output_dtypes: Sequence[mx.Dtype],
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
    template: Sequence[tuple[str, Any]] | None = None,
    init_value: float | None = None,
    backend: str | None = None,
    shared_memory: int = 0,
):
    """A function ``run(inputs) -> outputs`` doing what :func:`launch` does with these
    keywords, for repeated calls whose inputs have the same ranks as `inputs` (an example
    of them) and the same dtypes: the per-call host work is left to MLX. For memoised op
    calls (:mod:`xlstm_kernels.ops._callcache`)."""
    kernel = get_kernel(spec, backend)
    if hasattr(kernel, "prepare"):  # the cuda backend: launch plan resolved once
        return kernel.prepare(zero_d=[getattr(a, "ndim", 0) == 0 for a in inputs], output_shapes=output_shapes,
                              output_dtypes=output_dtypes, grid=grid, threadgroup=threadgroup,
                              template=template, init_value=init_value, shared_memory=int(shared_memory))
    kwargs = dict(output_shapes=[tuple(s) for s in output_shapes], output_dtypes=list(output_dtypes),
                  grid=tuple(grid), threadgroup=tuple(threadgroup), template=list(template) if template else None,
                  init_value=init_value)
    if shared_memory and _takes_shared_memory(kernel):
        kwargs["shared_memory"] = int(shared_memory)

    def run(inputs: Sequence[Any]) -> list[mx.array]:
        return kernel(inputs=list(inputs), **kwargs)

    return run


def const_array(values: Any, dtype: mx.Dtype, backend: str | None = None, *, lazy: bool = False) -> mx.array:
    """A small constant kernel input (shape parameters, eps, scale): ``mx.array(values,
    dtype=dtype)`` (`values`: a number or a flat list), on the cuda backend a view of a
    device-memory copy made once per value (:mod:`xlstm_kernels.cuda.constants`: MLX keeps
    arrays made from host data in managed memory, which kernels may wait for). `lazy`: the
    copy stays in the graph, not scheduled at once (for per-step values such as a decode
    position offset, passed as a call's input; see ``device_array``)."""
    if (backend or current_backend()) == "cuda":
        global _device_array
        if _device_array is None:
            from ..cuda.constants import device_array as _device_array
        return _device_array(values, dtype, lazy=lazy)
    return mx.array(values, dtype=dtype)


_device_array = None  # cuda.constants.device_array, imported at first use
