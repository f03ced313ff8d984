"""Small constant kernel inputs (shape parameters, eps, scale) in device memory.

MLX's CUDA allocator puts every array made from host data (``mx.array([...])``) and every
array of at most 8 bytes in managed (unified) memory; a kernel that reads one may wait for
the page to come over the host link. MLX's own kernels take such values by value, as
kernel arguments; ``mx.fast.cuda_kernel`` has only array inputs (and template constants,
which would compile a kernel per value). Measured on an H200 (session 14,
``scripts/probe_consts.py``): Nsight Compute put 39% of the RMSNorm backward's stall
samples (bf16 4096x4096) on the first read of its params; with the constants in device
memory, its training-step time went from 38.6 to 31.9 us (MLX: 30.6-32.8), the 1x4096
forward's chained time from 13.2 to 8.0 us.

:func:`device_array` makes such a constant once per (thread, stream, dtype, shape,
values): a GPU copy of the host data, padded past 8 bytes (so that it is allocated in
device memory), of which the caller gets a view of the original shape. The copy is
scheduled with ``mx.async_eval`` (it never waits for the GPU's queued work), and a
scheduled array is a constant to ``mx.compile`` (the graph replay of memoised calls
captures it as it is). ``XLSTM_KERNELS_CUDA_DEVICE_CONSTS=0`` turns it off (the host
arrays as they are).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Sequence

import mlx.core as mx

#: Environment variable: 0 keeps constants in MLX's managed memory (the old behaviour).
ENV_VAR = "XLSTM_KERNELS_CUDA_DEVICE_CONSTS"
#: Bytes past which a constant is left where it is (large ones are not read per thread).
MAX_BYTES = 1024
#: Device copies kept (least recently used dropped first).
MAX_ENTRIES = 4096

_cache: OrderedDict[tuple, mx.array] = OrderedDict()
_lock = threading.Lock()


def enabled() -> bool:
    """Whether constants go to device memory (``XLSTM_KERNELS_CUDA_DEVICE_CONSTS``: unset
    or 1 = on, 0 = off)."""
    text = os.environ.get(ENV_VAR)
    if text is None or text.strip().lower() in ("", "1", "true", "on", "yes"):
        return True
    if text.strip().lower() in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{ENV_VAR}={text!r}: expected 1 or 0 (on / off)")


def _flat_values(values: Any) -> tuple:
    if isinstance(values, (list, tuple)):
        return tuple(v for x in values for v in _flat_values(x))
    return (values,)


def device_array(values: Any, dtype: mx.Dtype, shape: Sequence[int] | None = None) -> mx.array:
    """``mx.array(values, dtype=dtype)`` (reshaped to `shape` if given) as a view of a
    device-memory copy made on the current stream; the same array object for equal
    arguments on the same thread and stream. Falls back to the host array when off,
    when the constant is large, or where the copy cannot be scheduled."""
    host = mx.array(values, dtype=dtype)
    if shape is not None:
        host = host.reshape(tuple(shape))
    if host.nbytes > MAX_BYTES or not enabled():
        return host
    try:
        stream = mx.default_stream(mx.default_device())
        key = (threading.get_ident(), str(stream), str(dtype), tuple(host.shape), _flat_values(values))
    except TypeError:  # unhashable values: no cache
        key = None
    if key is not None:
        with _lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
                return hit
    try:
        flat = host.reshape(-1)
        pad = max(1, -(-32 // host.itemsize) - flat.size)  # > 8 bytes: not MLX's managed scalar pool
        padded = mx.concatenate([flat, mx.zeros((pad,), dtype=dtype)])
        view = padded[: flat.size].reshape(host.shape)
        mx.async_eval(view)
    except Exception:  # noqa: BLE001  (no GPU stream here, or a transform refuses it: the host array)
        return host
    if key is not None:
        with _lock:
            _cache[key] = view
            while len(_cache) > MAX_ENTRIES:
                _cache.popitem(last=False)
    return view


def clear() -> None:
    """Drop the cached device copies (tests)."""
    with _lock:
        _cache.clear()
