"""Which size class a bench run should use: GPU-sized cases, small ones for a CPU, or the
emulator's tiny ones."""

from __future__ import annotations

import mlx.core as mx

from ..runtime.backends import _cuda_available

__all__ = ["bench_kind"]


def bench_kind(backend: str) -> str:
    """"emulate" (tiny cases, not timed as a GPU), "gpu" (metal / cuda, or the reference
    backend where MLX runs on a GPU) or "cpu" (the reference backend on a CPU: small cases,
    since GPU-sized ones would take minutes each)."""
    if backend == "emulate":
        return "emulate"
    if backend in ("metal", "cuda") or mx.metal.is_available() or _cuda_available():
        return "gpu"
    return "cpu"
