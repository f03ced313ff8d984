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

:func:`device_array` makes such a constant once per (thread, stream, dtype, values): a GPU copy of the host data, padded past 8 bytes (so that it is allocated in
device memory), of which the caller gets a view of the original shape. The copy is
scheduled with ``mx.async_eval`` (it never waits for the GPU's queued work), and a
scheduled array is a constant to ``mx.compile`` (the graph replay of memoised calls
captures it as it is). Where a transform traces the calling thread (``mx.async_eval``
refuses: a backward planned inside ``mx.vjp``), a helper thread makes and evaluates the
copy (session 28; before, such plans kept the host array). ``XLSTM_KERNELS_CUDA_DEVICE_CONSTS=0`` turns it off (the host
arrays as they are).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any

import mlx.core as mx

from ..tiles.env import environ_version

#: Environment variable: 0 keeps constants in MLX's managed memory (the old behaviour).
ENV_VAR = "XLSTM_KERNELS_CUDA_DEVICE_CONSTS"
#: Bytes past which a constant is left where it is (large ones are not read per thread).
MAX_BYTES = 1024
#: Device copies kept per thread and stream (all dropped when full).
MAX_ENTRIES = 4096
#: Lazy copies (per-step values) kept per thread and stream, the oldest dropped first: a
#: decode loop needs only the current step's, and dropped copies free their buffers for
#: MLX to reuse.
MAX_LAZY_ENTRIES = 64

_local = threading.local()  # per thread: [(stream, {key: array})], streams compared by value


_env_memo: list = [None, True]  # (environ_version when read, enabled)


def enabled() -> bool:
    """Whether constants go to device memory (``XLSTM_KERNELS_CUDA_DEVICE_CONSTS``: unset
    or 1 = on, 0 = off). Re-read only when the environment changed
    (:func:`xlstm_kernels.tiles.env.environ_version`; os.environ.get costs ~2 us)."""
    version = environ_version()
    if version is not None and version == _env_memo[0]:
        return _env_memo[1]
    on = _parse(os.environ.get(ENV_VAR))
    _env_memo[:] = [version, on]
    return on


def _parse(text: str | None) -> bool:
    if text is None:
        return True
    low = text.strip().lower()
    if low in ("", "1", "true", "on", "yes"):
        return True
    if low in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{ENV_VAR}={text!r}: expected 1 or 0 (on / off)")


def _stream_cache() -> dict:
    """This thread's cache for its current default stream (streams compare by value but
    hash by identity: a short list, scanned)."""
    stream = mx.default_stream(mx.default_device())
    caches = getattr(_local, "caches", None)
    if caches is None:
        caches = _local.caches = []
    for known, cache in caches:
        if known == stream:
            return cache
    cache: dict = {}
    caches.append((stream, cache))
    return cache


def device_array(values: Any, dtype: mx.Dtype, *, lazy: bool = False) -> mx.array:
    """``mx.array(values, dtype=dtype)`` (`values`: a number or a flat list of numbers) as
    a view of a device-memory copy made on the current stream; the same array object for
    equal arguments on the same thread and stream. The host array where it is off, where
    the constant is large, or where no copy can be made (here or on the helper thread).

    `lazy` (one int32 value only): the copy is left in the graph instead of scheduled (no
    ``mx.async_eval``, ~20 us of host time less; one copy kernel): for values that change from step to step (a decode loop's
    position offset), passed to a kernel as an input of the call (never captured by a
    replayed graph as a constant, where an unevaluated copy would run again on every
    replay). The first evaluation that needs it runs the copy (one small kernel); later
    calls with the same value share it."""
    if lazy and (dtype != mx.int32 or (isinstance(values, list) and len(values) != 1)):
        raise ValueError(f"device_array(lazy=True) holds one int32 value, got {values!r} as {dtype}")
    if not enabled():
        return mx.array(values, dtype=dtype)
    if lazy:  # the short path of a per-step value (a new decode offset every step)
        scalar = not isinstance(values, list)
        value = values if scalar else values[0]
        cache = _stream_cache()
        key = (dtype, value if scalar else (value,), True)
        hit = cache.get(key)
        if hit is None:
            try:
                hit = _lazy_copy(value, () if scalar else (1,))
            except Exception:  # noqa: BLE001  (a transform refuses it: the host array)
                return mx.array(values, dtype=dtype)
            lazy_keys = cache.setdefault(_LAZY_KEYS, [])
            if len(lazy_keys) >= MAX_LAZY_ENTRIES:
                cache.pop(lazy_keys.pop(0), None)
            lazy_keys.append(key)
            cache[key] = hit
        return hit
    key = (dtype, tuple(values) if isinstance(values, list) else values, lazy)
    try:
        cache = _stream_cache()
        hit = cache.get(key)
    except TypeError:  # unhashable values (nested lists): no cache
        cache, hit = None, None
    if hit is not None:
        return hit
    host = mx.array(values, dtype=dtype)
    if host.nbytes > MAX_BYTES:
        return host
    try:
        view = _padded_copy(host)
        mx.async_eval(view)
    except Exception:  # noqa: BLE001  (a transform traces this thread, or no GPU stream here)
        view = _made_off_thread(values, dtype)
        if view is None:
            return host
    if cache is not None:
        if len(cache) >= MAX_ENTRIES:
            cache.clear()
        cache[key] = view
    return view


def _padded_copy(host: mx.array) -> mx.array:
    """A view of `host`'s shape of a device-memory copy of it, padded past 8 bytes (not
    MLX's managed scalar pool) by a concatenation (unevaluated)."""
    flat = host.reshape(-1)
    pad = max(1, -(-32 // host.itemsize) - flat.size)
    padded = mx.concatenate([flat, mx.zeros((pad,), dtype=host.dtype)])
    return padded[: flat.size].reshape(host.shape)


_helper: list = [None, False]  # the helper thread's executor (made at first use), and whether it failed
_helper_lock = threading.Lock()


def _made_off_thread(values: Any, dtype: mx.Dtype) -> mx.array | None:
    """The padded device copy of ``mx.array(values, dtype)``, made and evaluated on a helper
    thread; None where that fails.

    Why: a plan made while a transform traces this thread (the first backward of a
    signature runs inside ``mx.vjp`` / ``mx.grad``, a replayed call inside
    ``mx.compile``) may not schedule arrays (``mx.async_eval`` refuses), and the host
    array it would fall back to is managed memory, which the GPU reads over the host link
    at every launch. Session 28, H200, Nsight Compute: the LayerNorm backward's partial
    sums (bf16 2048x8192) spent ~21 us a call waiting for their params so; MLX's tracing
    state is per thread, so another thread may evaluate the copy meanwhile. The result
    is an evaluated constant (no graph, not a tracer)."""
    if _helper[1]:  # failed before (no GPU stream there, interpreter shutdown): not tried again
        return None

    def make() -> mx.array:
        view = _padded_copy(mx.array(values, dtype=dtype))
        mx.eval(view)
        return view

    try:
        if _helper[0] is None:
            with _helper_lock:
                if _helper[0] is None:
                    _helper[0] = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                       thread_name_prefix="xlstm-kernels-consts")
        return _helper[0].submit(make).result()
    except Exception:  # noqa: BLE001  (the caller keeps the host array)
        _helper[1] = True
        return None


def _lazy_copy(values: int, shape: tuple) -> mx.array:
    """One int32 value (`values`: an int) in device memory of `shape` (() or (1,)), made by
    a single copy kernel left in the graph: the value as a 4-byte host scalar (MLX's
    managed scalar pool, which the GPU reads in place), broadcast to three elements and
    widened to int64 (24 bytes, allocated on the stream in device memory), seen as int32
    again: the low word of the first element is the value (little-endian; two's
    complement: also for negative values).

    Session 21 (scripts/probe_rope_consts.py, raw_loop_*): a host array of more than 8 bytes
    is managed memory that the GPU faults in at its first read (~10 us a new value); a
    padded concatenation costs three kernels; ``mx.tile``'s copy is allocated in managed
    memory, which kernels then read as slowly as a host array."""
    wide = mx.broadcast_to(mx.array(values, dtype=mx.int32), (3,)).astype(mx.int64)
    first = wide.view(mx.int32)[:1]
    return first if shape == (1,) else first.reshape(shape)


_LAZY_KEYS = object()  # a stream cache's entry: the keys of its lazy copies, oldest first


def clear() -> None:
    """Drop this thread's cached device copies and forget a failure of the helper thread (tests)."""
    _local.caches = []
    _helper[1] = False
