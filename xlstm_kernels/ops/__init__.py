"""Differentiable ops; each runs a Metal kernel on the active backend."""

from .gemm import gemm_av
from .norm import rms_norm

__all__ = ["gemm_av", "rms_norm"]
