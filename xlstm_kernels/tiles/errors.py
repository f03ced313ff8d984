"""The one error type of the tile layer."""

from __future__ import annotations

__all__ = ["TileConfigError"]


class TileConfigError(ValueError):
    """A tile configuration that cannot run, or a malformed setting.

    The message starts with where the bad value came from (an environment variable
    such as ``XLSTM_GEMM_TILE_AV``, a presets file and key path such as
    ``presets.yaml: families.m3.gemm.gemm_av.float16.tm``, or ``tiles= argument``)
    and says what is accepted.
    """
