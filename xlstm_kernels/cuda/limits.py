"""Shared-memory limits of the NVIDIA GPU the cuda backend's plans are made for.

The plans were measured on sm_90 (H100 / H200: 227 KiB of dynamic shared memory a block
may opt into, 228 KiB an SM). Other GPUs allow less (sm_86 / sm_89 / sm_120: 99 KiB a
block, 100 KiB an SM), and a launch asking for more fails there. Plans that size their
buffers by the GPU ask :func:`shared_bytes_per_block` / :func:`shared_bytes_per_sm`.

The architecture comes from ``mx.device_info(mx.gpu)["architecture"]`` ("sm_90"), read
once (:func:`xlstm_kernels.tiles.presets` reads the same). Without a CUDA GPU (the
emulator, which models the H100's launches; plan tests) the limits are sm_90's. An
architecture not in the table gets the smallest limits of the table's recent ones.
"""

from __future__ import annotations

_KIB = 1024

#: Dynamic shared memory a block may opt into, by architecture (CUDA C++ Programming Guide,
#: "Technical Specifications per Compute Capability").
SHARED_BYTES_PER_BLOCK = {
    "sm_70": 96 * _KIB, "sm_72": 96 * _KIB, "sm_75": 64 * _KIB,
    "sm_80": 163 * _KIB, "sm_86": 99 * _KIB, "sm_87": 163 * _KIB, "sm_89": 99 * _KIB,
    "sm_90": 227 * _KIB, "sm_100": 227 * _KIB, "sm_103": 227 * _KIB,
    "sm_120": 99 * _KIB, "sm_121": 99 * _KIB,
}
#: Shared memory of one SM, by architecture (the same table).
SHARED_BYTES_PER_SM = {
    "sm_70": 96 * _KIB, "sm_72": 96 * _KIB, "sm_75": 64 * _KIB,
    "sm_80": 164 * _KIB, "sm_86": 100 * _KIB, "sm_87": 164 * _KIB, "sm_89": 100 * _KIB,
    "sm_90": 228 * _KIB, "sm_100": 228 * _KIB, "sm_103": 228 * _KIB,
    "sm_120": 100 * _KIB, "sm_121": 100 * _KIB,
}
#: The architecture assumed without a CUDA GPU (the one the plans were measured on).
DEFAULT_ARCHITECTURE = "sm_90"
#: ... and the one whose limits an unknown architecture gets.
UNKNOWN_ARCHITECTURE = "sm_89"

_arch: list = []  # [normalised architecture], read once


def _normalise(arch: str) -> str:
    """"sm_90a" -> "sm_90"; "SM_89" -> "sm_89"; anything else as it is, lower-cased."""
    a = arch.strip().lower()
    return a[:-1] if a.startswith("sm_") and a[-1:].isalpha() else a


def architecture() -> str:
    """The CUDA GPU's architecture ("sm_90"), DEFAULT_ARCHITECTURE without one."""
    if not _arch:
        arch = DEFAULT_ARCHITECTURE
        try:
            from . import is_available

            if is_available():
                import mlx.core as mx

                arch = _normalise(str(mx.device_info(mx.gpu).get("architecture", ""))) or UNKNOWN_ARCHITECTURE
        except Exception:  # noqa: BLE001  (no MLX CUDA device info: the plans' own architecture)
            arch = DEFAULT_ARCHITECTURE
        _arch.append(arch)
    return _arch[0]


def shared_bytes_per_block(arch: str | None = None) -> int:
    """Dynamic shared memory a block may have on `arch` (default: this GPU's)."""
    a = _normalise(arch) if arch else architecture()
    return SHARED_BYTES_PER_BLOCK.get(a, SHARED_BYTES_PER_BLOCK[UNKNOWN_ARCHITECTURE])


def shared_bytes_per_sm(arch: str | None = None) -> int:
    """Shared memory of one SM on `arch` (default: this GPU's)."""
    a = _normalise(arch) if arch else architecture()
    return SHARED_BYTES_PER_SM.get(a, SHARED_BYTES_PER_SM[UNKNOWN_ARCHITECTURE])


def has_clusters(arch: str | None = None) -> bool:
    """Whether `arch` (default: this GPU's) launches threadgroup clusters (thread-block
    clusters and distributed shared memory: sm_90 and newer)."""
    a = _normalise(arch) if arch else architecture()
    try:
        return int(a.removeprefix("sm_")) >= 90
    except ValueError:
        return False


def has_bulk_copies(arch: str | None = None) -> bool:
    """Whether `arch` (default: this GPU's) has bulk copies into shared memory completed on an
    mbarrier (``cp.async.bulk``, Hopper's TMA: sm_90 and newer)."""
    return has_clusters(arch)
