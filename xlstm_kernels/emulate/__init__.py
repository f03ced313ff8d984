"""A CPU emulator for ``mx.fast.metal_kernel``: run Metal kernel bodies on Linux.

``metal_kernel`` takes exactly MLX's arguments and returns a callable with MLX's
call keywords, so code written for ``mx.fast.metal_kernel`` runs unchanged::

    from xlstm_kernels import emulate

    kernel = emulate.metal_kernel(
        name="myexp", input_names=["inp"], output_names=["out"],
        source="uint i = thread_position_in_grid.x; out[i] = metal::exp(inp[i]);",
    )
    (y,) = kernel(inputs=[x], grid=(x.size, 1, 1), threadgroup=(256, 1, 1),
                  output_shapes=[x.shape], output_dtypes=[x.dtype])

Every thread runs as a fiber with real barrier and simd-group semantics; see
:mod:`xlstm_kernels.emulate.kernel` for what it detects.
"""

from .compiler import EmulatorCompileError
from .kernel import (
    MAX_THREADGROUP_MEMORY,
    EmulatedKernel,
    EmulatorError,
    check_schedules,
    metal_kernel,
)

__all__ = [
    "MAX_THREADGROUP_MEMORY",
    "EmulatedKernel",
    "EmulatorCompileError",
    "EmulatorError",
    "check_schedules",
    "metal_kernel",
]
