"""Rotary position embedding backed by ``metal_src/rope.metal``, like ``mx.fast.rope``.

    rope(x, dims, traditional=False, base=10000.0, scale=1.0, offset=0, freqs=None)
    x (..., L, D) -> (..., L, D), positions along L

Pair j (0 <= j < dims/2) of a row at position l is rotated by
``theta = scale * (l + offset) * inv_freq[j]`` with ``inv_freq[j] = base^(-j/(dims/2))``
or ``1 / freqs[j]``; traditional pairs are ``(2j, 2j+1)``, the default (split-half) pairs
``(j, j + dims/2)``; features ``[dims, D)`` pass through unchanged. ``offset`` is an int,
a 0-d integer array or one integer per batch element (shape ``(x.shape[0],)``).

The kernel rotates P consecutive pairs for N rows sharing a position per thread (cos/sin
in float, computed once per N rows; on cuda of theta reduced to [-pi, pi] with the fast
functions: ``FAST_TRIG``), reading and writing runs of
consecutive features with one 16-byte access each where aligned (8 bytes on cuda:
``pairs_per_thread``, ``RUN_BYTES``);
the VJP is the same kernel rotating by ``-theta`` (the rotation is orthogonal).
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import mlx.core as mx
import numpy as np

from ..runtime import KernelSpec, const_array, current_backend, prepare_launch
from ._callcache import CallCache, replayable

_get_ident = threading.get_ident
_MAIN_IDENT = threading.main_thread().ident
_default_stream = mx.default_stream
_default_device = mx.default_device
from ._validate import check_array, check_int32

__all__ = ["rope", "rope_reference"]

# x, offsets and freqs are read in place through their strides (queries / keys transposed
# from (B, L, H, D) are not row-contiguous, and MLX would copy them before every launch; a
# per-call mx.contiguous of offsets or freqs was a graph node of every call).
# The sizes reach the kernel as x's, freqs' and offsets' shapes (kernel arguments): a params
# array in device memory was a load before every thread's first data load (session 29).
ROPE = KernelSpec("rope", "rope", ("x", "offsets", "freqs", "scale"), ("y",), ensure_row_contiguous=False)

ROWS_PER_THREAD = 4  # N: rows that share one cos/sin evaluation and whose loads overlap (MLX uses 4)
_MAX_THREADS = 256  # threads per threadgroup at most, where MAX_THREADS names no other
#: Threads per threadgroup at most, per backend (else _MAX_THREADS). CUDA: 128. Session 29,
#: Nsight Compute kernel durations (scripts/ncu_times.sh, bf16, per-sequence offsets), 128
#: against 256: H100 2x32x4096x128 54.4 / 55.5 us, 1x32x2048x128 20.5 / 21.1, 32x32x1x128 3.7 /
#: 3.8, 4x32x8192x128 183.5 / 183.2; H200 2x32x4096x128 44.6 / 46.1. H100 bench (marginal
#: chains), 2x32x4096x128 bf16 / f16: 83.5 / 83.8% of copy against 82.6 / 82.7 and 80.5 / 76.6.
#: Apple GPUs keep 256 (not measured there).
MAX_THREADS = {"cuda": 128}


class _DefaultBase(float):
    """The default ``base`` (10000.0), distinguishable from an explicit ``base=10000.0``."""

    def __repr__(self) -> str:
        return "10000.0"


DEFAULT_BASE = _DefaultBase(10000.0)


@functools.lru_cache(maxsize=64)
def _base_freqs(half: int, base: float) -> mx.array:
    """``base^(j / half)`` for j < half, computed in float64 and rounded to float32 (cached)."""
    freqs = np.power(np.float64(base), np.arange(half, dtype=np.float64) / half)
    out = mx.array(freqs.astype(np.float32))
    mx.eval(out)
    return out


def _kernel_freqs(half: int, base: float, backend: str | None) -> mx.array:
    """:func:`_base_freqs` as the kernel reads them: on cuda a device-memory copy
    (runtime.const_array). An array made from host data lives in MLX's managed memory there,
    whose page moves to the host whenever the host writes a neighbour; a kernel reading
    it then waits for the page (session 29)."""
    if backend == "cuda":
        from ..cuda import constants

        if constants.enabled() and 4 * half <= constants.MAX_BYTES:  # else const_array's host array, made anew
            return const_array(_base_freqs_list(half, base), mx.float32, backend)
    return _base_freqs(half, base)


@functools.lru_cache(maxsize=64)
def _base_freqs_list(half: int, base: float) -> list[float]:
    return np.asarray(_base_freqs(half, base)).tolist()


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------
def _as_float32(freqs: mx.array) -> mx.array:
    """freqs in float32; float64 is cast on the CPU (GPUs have no float64 in MLX)."""
    if freqs.dtype == mx.float64:
        return freqs.astype(mx.float32, stream=mx.cpu)
    return freqs.astype(mx.float32)


def _check_args(x, dims, traditional, base, scale, offset, freqs) -> tuple[mx.array, mx.array | int]:
    """Validate everything; return (freqs as float32 (dims//2,), offset as int or int32 array)."""
    check_array(x, "x", min_ndim=2)
    d = x.shape[-1]
    if x.shape[-2] * d:  # the kernel sees x as (rows, L, D) with rows an int32
        check_int32("rope", "rows (x.size // (L * D))", x.size // (x.shape[-2] * d), f"x has shape {tuple(x.shape)}")
    if isinstance(dims, bool) or not isinstance(dims, (int, np.integer)):
        raise TypeError(f"dims must be an int, got {type(dims).__name__}")
    dims = int(dims)
    if dims <= 0 or dims % 2:
        raise ValueError(f"dims must be a positive even number (features are rotated in pairs), got {dims}")
    if dims > d:
        raise ValueError(f"dims ({dims}) must be <= x's last axis D={d} (x has shape {tuple(x.shape)})")
    if not isinstance(traditional, (bool, np.bool_)):
        raise TypeError(f"traditional must be a bool, got {type(traditional).__name__}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}")
    half = dims // 2

    if freqs is not None:
        if base is not None and base is not DEFAULT_BASE:
            raise ValueError(
                f"give either base or freqs, not both: got base={base!r} and freqs; pass base=None with freqs"
            )
        if not isinstance(freqs, mx.array):
            raise TypeError(f"freqs must be an mx.array, got {type(freqs).__name__}")
        if not mx.issubdtype(freqs.dtype, mx.floating):
            raise TypeError(f"freqs has dtype {freqs.dtype}; expected a floating dtype (float32, float16, bfloat16)")
        if tuple(freqs.shape) != (half,):
            raise ValueError(f"freqs must have shape (dims // 2,) = ({half},), got {tuple(freqs.shape)}")
        freqs32 = _as_float32(freqs)
    else:
        if base is None:
            raise ValueError("one of base and freqs must be given (both are None)")
        if isinstance(base, bool) or not isinstance(base, (int, float, np.floating, np.integer)):
            raise TypeError(f"base must be a float, got {type(base).__name__}")
        if not (math.isfinite(float(base)) and float(base) > 0):
            raise ValueError(f"base must be a positive finite float, got {base!r}")
        freqs32 = _base_freqs(half, float(base))

    if isinstance(offset, mx.array):
        if not mx.issubdtype(offset.dtype, mx.integer):
            raise TypeError(f"offset must be an integer array, got dtype {offset.dtype}")
        nb = x.shape[0] if x.ndim >= 3 else 1
        if offset.ndim == 0:
            offset = offset.reshape(1)
        elif tuple(offset.shape) != (nb,):
            raise ValueError(
                f"offset must be an int, a 0-d integer array or one offset per batch element, shape ({nb},) "
                f"for x of shape {tuple(x.shape)}; got shape {tuple(offset.shape)}"
            )
        offset = offset.astype(mx.int32)
    elif isinstance(offset, (int, np.integer)) and not isinstance(offset, bool):
        offset = int(offset)
        if not -(2**31) <= offset < 2**31:
            raise ValueError(f"offset must fit in int32, got {offset}")
    else:
        raise TypeError(f"offset must be an int or an integer mx.array, got {type(offset).__name__}")
    return freqs32, offset


# ---------------------------------------------------------------------------
# Reference (plain mx ops)
# ---------------------------------------------------------------------------
def _reference(x: mx.array, dims: int, traditional: bool, scale: float, offset, freqs32: mx.array) -> mx.array:
    half = dims // 2
    seq_len = x.shape[-2]
    pos = mx.arange(seq_len, dtype=mx.int32)
    if isinstance(offset, mx.array) and offset.size != 1:  # per batch: (B, 1, ..., 1, L) (B may be 0)
        pos = offset.reshape((offset.size,) + (1,) * (x.ndim - 2)) + pos
    else:
        pos = pos + (offset.reshape(()) if isinstance(offset, mx.array) else offset)
    theta = (scale * pos.astype(mx.float32))[..., None] * (1.0 / freqs32)  # (..., L, half)
    c, s = mx.cos(theta), mx.sin(theta)
    xr = x[..., :dims].astype(mx.float32)
    if traditional:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rot = mx.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
        rot = rot.reshape(*rot.shape[:-2], dims)
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
        rot = mx.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    rot = rot.astype(x.dtype)
    if dims < x.shape[-1]:
        rot = mx.concatenate([rot, x[..., dims:]], axis=-1)
    return rot


def rope_reference(
    x: mx.array,
    dims: int,
    *,
    traditional: bool = False,
    base: float | None = DEFAULT_BASE,
    scale: float = 1.0,
    offset: int | mx.array = 0,
    freqs: mx.array | None = None,
) -> mx.array:
    """:func:`rope` with plain mx ops (float32 math); the ``reference`` backend."""
    freqs32, offset = _check_args(x, dims, traditional, base, scale, offset, freqs)
    return _reference(x, int(dims), bool(traditional), float(scale), offset, freqs32)


# ---------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------
def _scale_array(scale: float) -> mx.array:
    """The kernel's 0-d scale input (runtime.const_array: in device memory on cuda, made once
    per value there)."""
    return const_array(scale, mx.float32)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _launch_geometry(gx: int, seq_len: int, gz: int, max_threads: int = _MAX_THREADS) -> tuple[int, int, int]:
    """Threadgroup (tx, ty, tz) of at most `max_threads` threads: x along features
    (coalesced), then positions, then rows."""
    tx = min(_pow2_at_least(gx), max_threads)
    ty = min(_pow2_at_least(seq_len), max_threads // tx)
    tz = min(_pow2_at_least(gz), max_threads // (tx * ty))
    return tx, ty, tz


#: Bytes of one run of features a thread reads (one vector access), per backend (else 16).
#: CUDA: 8. Session 17, H200, chained calls interleaved with MLX's
#: (scripts/probe_rope_small.py, fastest quarter of 11 chains): 8-byte runs (twice the
#: threads) were as fast or faster on 8 of 9 shapes, 1-8% (e.g. bf16 1x32x2048x128 28.2 ->
#: 26.4 us, 32x32x1x128 14.6 -> 13.8, float32 2x32x4096x128 87.8 -> 86.8); 4-byte runs
#: were slower on most. Apple GPUs keep 16 (not measured there).
RUN_BYTES = {"cuda": 8}

#: Backends whose kernel computes cos / sin from theta reduced to [-pi, pi] with the fast
#: (hardware) functions (metal_src/rope.metal, xk_rope_cos_sin; else the precise ones). CUDA
#: documents __sinf / __cosf to 2^-21.4 there; Metal documents its fast cos / sin to 2^-13
#: only. Session 29 (Nsight Compute kernel durations, bf16 2x32x4096x128, the kernel before
#: its sizes came from shapes): the fast functions of the unreduced angle 60.0 -> 56.8 us
#: on an H100; no cos / sin at all 51.4 -> 45.0 on an H200.
FAST_TRIG = {"cuda": True}


def pairs_per_thread(dtype: mx.Dtype, traditional: bool, half: int, run_bytes: int = 16) -> int:
    """P: pairs a thread rotates, so that each run of features is one `run_bytes` access
    (split-half: runs of P features, traditional: of 2P; at 16 bytes float32 P = 4 / 2, half
    and bfloat16 P = 8 / 4), capped at the largest power of two <= half."""
    run = max(1, run_bytes // dtype.size)
    p = run if not traditional else max(1, run // 2)
    return max(1, min(p, 1 << (half.bit_length() - 1)))


def kernel_shape(shape: tuple, per_batch: bool) -> tuple[int, int, int, int]:
    """The kernel's 4-D view (B, H, L, D) of x's shape (..., L, D): B the batch of
    per-batch offsets (x's first axis), H the other leading axes. A view of x without a copy
    for 2-D to 4-D x (a reshape that inserts unit axes), so that a transposed x is read in
    place; 5-D and up merge the middle axes."""
    *lead, seq_len, d = shape
    if not lead:
        return 1, 1, seq_len, d
    if len(lead) == 1:
        return (lead[0], 1, seq_len, d) if per_batch else (1, lead[0], seq_len, d)
    h = 1
    for s in lead[1:]:
        h *= s
    return lead[0], h, seq_len, d


def _launch_kwargs(x: mx.array, dims: int, traditional: bool, scale: float, offset, freqs32: mx.array,
                   backward: bool, backend: str | None = None) -> dict[str, Any]:
    """The launch keywords of the rope kernel for x (..., L, D) (see metal_src/rope.metal) on
    `backend` (its RUN_BYTES, MAX_THREADS and FAST_TRIG)."""
    if isinstance(offset, mx.array):
        offsets = offset
    else:
        offsets = _offset_array(offset, backend)
    per_batch = offsets.size > 1  # else one offset for every row
    b4, h4, seq_len, d = kernel_shape(tuple(x.shape), per_batch)
    half = dims // 2
    n = ROWS_PER_THREAD
    p = pairs_per_thread(x.dtype, traditional, half, run_bytes=RUN_BYTES.get(backend, 16))
    run = 2 * p if traditional else p
    z_per_group = -(-h4 // n)
    gx = -(-half // p) + -(-(d - dims) // run)
    gz = b4 * z_per_group
    return dict(
        inputs=[x.reshape(b4, h4, seq_len, d), offsets, freqs32, _scale_array(scale)],
        output_shapes=[(b4, h4, seq_len, d)],
        output_dtypes=[x.dtype],
        grid=(gx, seq_len, gz),
        threadgroup=_launch_geometry(gx, seq_len, gz, MAX_THREADS.get(backend, _MAX_THREADS)),
        template=[("T", x.dtype), ("TRADITIONAL", bool(traditional)), ("BACKWARD", bool(backward)), ("N", n),
                  ("P", p), ("FAST_TRIG", FAST_TRIG.get(backend, False))],
    )


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool = False,
    base: float | None = DEFAULT_BASE,
    scale: float = 1.0,
    offset: int | mx.array = 0,
    freqs: mx.array | None = None,
) -> mx.array:
    """Rotary position embedding, like ``mx.fast.rope``.

    Args:
        x: (..., L, D) float32, float16 or bfloat16; positions along the second-to-last
            axis. With per-batch offsets the first axis is the batch (x at least 3-D).
        dims: features rotated, even and <= D; features ``[dims, D)`` are copied through.
        traditional: pair consecutive features ``(2j, 2j+1)`` instead of ``(j, j+dims/2)``.
        base: inv_freq[j] = base^(-j/(dims/2)). Give ``base=None`` when passing freqs
            (the default base is ignored when freqs is given; an explicit one is an error).
        scale: multiplies the positions.
        offset: int, 0-d integer array, or integer array of shape (x.shape[0],) (one
            starting position per batch element).
        freqs: (dims // 2,) floating array; inv_freq[j] = 1 / freqs[j] (computed in float32).

    Returns:
        (..., L, D) in x's dtype (mx.fast.rope promotes to float32 when freqs is float32
        and x is not; this op keeps x's dtype). Math in float32.

    Differentiable in x: the VJP rotates the cotangent by ``-theta`` with the same kernel.
    offset and freqs get no gradient.
    """
    key = _call_key(x, dims, traditional, base, scale, offset, freqs)
    fn = _CALLS.get(key) if key is not None else None
    if fn is None:
        fn = _build_call(x, dims, traditional, base, scale, offset, freqs, replay=key is not None)
        if key is not None:
            _CALLS.put(key, fn)
    return fn(x, offset, freqs)


_CALLS = CallCache("rope")


def _call_key(x, dims, traditional, base, scale, offset, freqs) -> tuple | None:
    """What validation and the launch depend on (an int offset's value is not: it is an
    input of the kernel), or None when an argument's type is unusual (checked every call)."""
    if not isinstance(x, mx.array) or dims.__class__ is not int or traditional.__class__ is not bool:
        return None
    if scale.__class__ not in (float, int) or base.__class__ not in (float, int, _DefaultBase, type(None)):
        return None
    if offset.__class__ is int:
        off = int
    elif isinstance(offset, mx.array):
        off = (offset.shape, offset.dtype)
    else:
        return None
    if freqs is not None and not isinstance(freqs, mx.array):
        return None
    fr = None if freqs is None else (freqs.shape, freqs.dtype)
    return (x.shape, x.dtype, dims, traditional, base, base is DEFAULT_BASE, scale, off, fr)


def _offset_array(offset: int, backend: str | None = None) -> mx.array:
    """A call's int offset as the kernel's (1,) int32 input, one array per value.

    On cuda a device-memory copy left in the graph (runtime.const_array, lazy: a decode
    loop's offset changes every step; its first call runs one small copy kernel, the
    step's other calls share it). A host array lives in MLX's managed memory, and the
    kernel's read of it cost up to ~2 us a call, depending on where the page last was
    (session 21, scripts/probe_rope_consts.py: raw vs raw_devoff). Elsewhere the host
    array."""
    if backend == "cuda":
        return const_array([offset], mx.int32, backend, lazy=True)
    return _host_offset_array(offset)


@functools.lru_cache(maxsize=4096)
def _host_offset_array(offset: int) -> mx.array:
    return mx.array([offset], dtype=mx.int32)


def _build_call(x, dims, traditional, base, scale, offset, freqs, replay: bool = False):
    """Validate one call and build fn(x, offset, freqs) -> y for its signature (`replay`:
    a memoised signature, whose launch cuda / metal record once and replay)."""
    freqs32, offset_checked = _check_args(x, dims, traditional, base, scale, offset, freqs)
    dims, traditional, scale = int(dims), bool(traditional), float(scale)
    given_freqs = freqs is not None

    def inputs(offset, freqs):
        """(offsets, freqs32) of one call: an int offset is range-checked here."""
        if isinstance(offset, mx.array):  # as given: the kernel reads it through its strides
            offs = (offset.reshape(1) if offset.ndim == 0 else offset).astype(mx.int32)
        else:
            if not -(2**31) <= offset < 2**31:
                raise ValueError(f"offset must fit in int32, got {offset}")
            offs = offset
        return offs, (_as_float32(freqs) if given_freqs else freqs32)

    backend = current_backend()
    if backend == "cuda" and not given_freqs:
        freqs32 = _kernel_freqs(dims // 2, float(base), backend)
    if backend == "reference" or x.size == 0:
        def reference(x, offset, freqs):
            offs, fr = inputs(offset, freqs)
            return _reference(x, dims, traditional, scale, offs, fr)

        return reference

    example = _launch_kwargs(x, dims, traditional, scale, offset_checked, freqs32, False, backend)
    scale_arr = example["inputs"][3]
    runs = {backward: prepare_launch(ROPE, **_launch_kwargs(x, dims, traditional, scale, offset_checked, freqs32,
                                                            backward, backend), backend=backend)
            for backward in (False, True)}

    flat = tuple(example["output_shapes"][0])  # the kernel's (B, H, L, D)

    def rotate(inp: mx.array, offs: mx.array, fr: mx.array, backward: bool) -> mx.array:
        shape = inp.shape  # reshaped only when not already (B, H, L, D): a view of inp
        (y,) = runs[backward]([inp if shape == flat else inp.reshape(flat), offs, fr, scale_arr])
        return y if shape == flat else y.reshape(shape)

    @mx.custom_function
    def f(x, offs, fr):
        return rotate(x, offs, fr, False)

    @f.vjp
    def f_vjp(primals, cotangent, output):  # offset and freqs get no gradient
        x, offs, fr = primals
        return rotate(cotangent.astype(x.dtype), offs, fr, True), mx.zeros_like(offs), mx.zeros_like(fr)

    if replay:
        f = replayable(f, backend, bare=lambda x, offs, fr: rotate(x, offs, fr, False))

    if offset.__class__ is int and not given_freqs:
        # The common call (an int offset, default frequencies; the memo key fixes both):
        # a range check, the memoised offset array, the custom function.
        if backend != "cuda":
            def call_int(x, offset, freqs):
                if not -(2**31) <= offset < 2**31:
                    raise ValueError(f"offset must fit in int32, got {offset}")
                return f(x, _host_offset_array(offset), freqs32)

            return call_int

        # cuda: the last offset's device value kept here for the main thread and its stream
        # (a decode step's q and k share it; the constants cache's lookup costs ~2 us)
        last: list = [None, None, None]  # offset, stream, array

        def call_int_cuda(x, offset, freqs):
            if not -(2**31) <= offset < 2**31:
                raise ValueError(f"offset must fit in int32, got {offset}")
            if _get_ident() != _MAIN_IDENT:
                return f(x, _offset_array(offset, backend), freqs32)
            stream = _default_stream(_default_device())
            if offset == last[0] and stream == last[1]:
                return f(x, last[2], freqs32)
            offs = _offset_array(offset, backend)
            last[:] = (offset, stream, offs)
            return f(x, offs, freqs32)

        return call_int_cuda

    _last_offsets: list = [None]  # (offsets array given, stream, its device copy) of the last call

    def call(x, offset, freqs):
        offs, fr = inputs(offset, freqs)
        if not isinstance(offs, mx.array):
            offs = _offset_array(offs, backend)
        elif backend == "cuda" and offs.nbytes <= SMALL_OFFSETS_BYTES and x.nbytes >= SMALL_OFFSETS_MIN_X_BYTES:
            offs = _device_offsets(offs, _last_offsets, offset)
        return f(x, offs, fr)

    return call


#: Offset arrays of at most this many bytes (one or two sequences' int32 offsets) go through
#: :func:`_device_offsets` on cuda before the kernel reads them, where x has at least
#: SMALL_OFFSETS_MIN_X_BYTES: the copy's own read of the managed scalar costs ~12 us, hidden
#: behind the previous call's kernel only where that one is long (a CUDA graph runs the copy,
#: which depends on nothing in the chain, beside it). H100, marginal chains (session 26),
#: bf16 per-sequence offsets, without -> with the copy: 2x32x4096x128 60.4 / 61.2 -> 55.0 /
#: 54.1 us, 2x32x2048x128 38.5 / 39.8 -> 33.5 / 33.4; decode 1x32x1x128 3.9 / 4.1 -> 15.9 /
#: 15.3 and 2x32x1x128 4.3 / 4.2 -> 16.6 / 16.2 (hence the floor on x).
SMALL_OFFSETS_BYTES = 8
SMALL_OFFSETS_MIN_X_BYTES = 32 << 20
#: Rows of :func:`_device_offsets`' (rows, B) copy, whose row 0 the kernel reads: 3 (12 B
#: bytes, past MLX's 8-byte scalar pool; the knob lets a probe try larger copies).
SMALL_OFFSETS_COPY_ROWS = 3


def _device_offsets(offs: mx.array, last: list | None = None, key: Any = None) -> mx.array:
    """`offs` (B,) int32 as a view of row 0 of a (SMALL_OFFSETS_COPY_ROWS, B) array made by
    one add kernel (12 B bytes: MLX allocates it in device memory). MLX's CUDA allocator
    keeps every array of at most 8 bytes in a managed scalar pool; each threadgroup of the
    RoPE kernel that reads such an offset waits for the host link. H100,
    scripts/probe_rope_small.py at marginal chains (session 26), bf16, per-sequence offsets
    against one int offset: 2x32x4096x128 62.6 against 51.0 us, 2x32x2048x128 39.6 against
    28.0; 4x32x4096x128 (16 bytes of offsets, device memory once read) 95.1 against 94.9.
    Where it pays: SMALL_OFFSETS_MIN_X_BYTES.

    Row 0 is taken by a slice, never ``wide[0]``: MLX indexes with an int by a gather into a
    new array, B int32 = 8 bytes for one or two sequences, which lands back in the scalar
    pool (session 44, H200, scripts/probe_rope_offsets.py: the bench's 2x32x4096x128 row
    read 73-77% of copy with the gathered row, 93-97% with a view of a device buffer).

    `last` (a one-element list the caller keeps) and `key` (the array the caller was given):
    the copy made for the last `key` on the same stream is reused (a model's layers rotate q
    and k with one offsets array; MLX arrays do not change, and the entry holds `key`, so
    its id is not reused). The entry is one tuple, replaced whole (threads may share it)."""
    stream = mx.default_stream(mx.default_device()) if last is not None else None
    if last is not None:
        entry = last[0]
        if entry is not None and entry[0] is key and entry[1] == stream:
            return entry[2]
    rows = SMALL_OFFSETS_COPY_ROWS
    zeros = const_array([0] * rows, mx.int32)  # a device constant, made once per stream
    wide = (offs.reshape(1, -1) + zeros.reshape(rows, 1))[:1].reshape(-1)  # a view (see above)
    if last is not None:
        last[0] = (key, stream, wide)
    return wide
