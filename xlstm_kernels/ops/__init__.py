"""Differentiable ops; each runs a Metal kernel on the active backend."""

from .gemm import ACTIVATIONS, gemm_a_bt, gemm_at_b, gemm_av, linear
from .norm import rms_norm

__all__ = ["ACTIVATIONS", "gemm_a_bt", "gemm_at_b", "gemm_av", "linear", "rms_norm"]
