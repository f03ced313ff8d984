"""Scaled dot-product attention backed by ``metal_src/attention.metal``.

    scaled_dot_product_attention(q, k, v, *, scale, mask=None) -> o

mirrors ``mx.fast.scaled_dot_product_attention``:

    q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, DV) -> o (B, Hq, Lq, DV)

* float32, float16 or bfloat16, one dtype for q, k and v; the output has that dtype.
  Scores, the softmax (running max and sum) and the output accumulate in float32.
* Grouped-query attention: Hq a multiple of Hkv; query head h reads key/value head
  ``h // (Hq // Hkv)``.
* ``mask``: None; ``"causal"`` (query i sees keys j <= i + Lk - Lq, so the last query
  is aligned with the last key when Lq < Lk); a boolean array (True = attend); or an
  additive array (added to the scaled scores; its dtype must promote to q's dtype,
  as in MLX). Array masks broadcast to (B, Hq, Lq, Lk). They are passed to the kernels
  in their own shape together with their element strides along (batch, head, query,
  key), a stride of 0 on broadcast axes: the (B, Hq, Lq, Lk) mask is never
  materialised. Masked-out scores become finfo(float32).min (not -inf), as in MLX, so
  a row whose keys are all masked averages V uniformly; an additive -inf everywhere
  gives NaN, as in MLX.

Kernels (``metal_src/attention.metal``):

* ``attention_prefill``: flash attention forward, BQ x BK tiles, Q·Kᵀ and P·V as
  simdgroup_matrix 8x8 MMAs, online softmax with exp2. float32: every operand float
  (exact products; BQ 32, or 16/8 for short query runs; BK 32, or 16 from head dim
  128). float16 / bfloat16: Q, Kᵀ, V and P are fragments of the I/O dtype (tensor cores
  on CUDA), S and O accumulate in float32, P is rounded to the dtype for P·V (as MLX's
  Metal SDPA); each simdgroup owns RM = 2 fragments of 8 query rows when BQ is a
  multiple of 16 (one Kᵀ/V fragment read feeds two products); BQ 64 (32/16/8 for short
  query runs), BK 64 where the K and V tiles fit 32 KiB side by side, else 32. Every
  head dim from 1 to 256 runs on it (zero-padded to a multiple of 8 inside the tiles).
* ``attention_prefill_mma``: the prefill for float16 / bfloat16 on cuda (and the emulator,
  which tests what cuda runs): flash attention on 16 x 16 simdgroup-matrix blocks (tensor-core
  m16n8k16, ldmatrix and cp.async on CUDA). WM simdgroups of RB x 16 query rows each (BQ =
  16 * RB * WM), Q in threadgroup memory read per key tile, K / V tiles of BK keys through ST
  stages copied by all simdgroups, the online softmax on the accumulator registers and P
  converted in registers (no threadgroup round trip); head dims padded to multiples of 16;
  on CUDA, head dims that are multiples of 64 use swizzled unpadded tiles. Tiles per call from
  ``PREFILL_MMA_LAYOUTS`` / ``PREFILL_MMA_KEY_TILES`` / ``PREFILL_MMA_STAGES``: the largest
  layout whose BQ fits the query length, within the backend's threadgroup memory (227 KiB
  on cuda: 4 x 2 x 64 keys x 2 stages at D = 128, two blocks per SM; 32 KiB elsewhere) and
  ``_PREFILL_MMA_ACC_REGISTERS``. Knob ``prefill_mma`` (variable
  ``XLSTM_ATTENTION_PREFILL_MMA``); off by default on Apple GPUs and for float32. A call
  naming ``block_q=`` / ``block_k=`` runs ``attention_prefill``. With warpgroup products
  (template WG, ``PREFILL_MMA_WARPGROUP``: by default unmasked and causal calls with D == DV
  == 128 on sm_90, and the emulator) one or two warpgroups of 64 query rows multiply from
  unpadded warpgroup-layout K / V tiles (``wgmma`` on CUDA; P V takes P from registers), the
  next tile's scores and this tile's P V in flight together; ``PREFILL_WG_TILES`` (4, 1, 64,
  3) lets two threadgroups share an SM.
* ``attention_partial`` + ``attention_reduce``: split-KV decode. Pass 1 runs one
  threadgroup per (key block, key/value head and group of R of its query rows, batch):
  the (Hq / Hkv) query heads x Lq queries of a kv head share every K / V read (R = all of
  them when the registers allow, else the fewest even groups; see ``_partial_rows``).
  Its simdgroups walk the block in chunks of KC = 32 (or 16, when that lets more rows
  share a read) keys; lanes read runs of up to 16 bytes of each K / V row (one wide
  access when the rows are aligned for it, element loads otherwise), accumulate R x KC
  partial dot products, and a transposing butterfly per row turns them into one score
  per lane. Pass 1 writes, per (batch, head, query, key block), the block's normalised
  output (float32) and its log-sum-exp; pass 2 merges the blocks through their LSEs.
  Block size: the knob / argument, else automatic: ``SPLIT_KV_BLOCK_SIZE`` (256) halved
  (down to 64) until pass 1 has ``SPLIT_KV_TARGET_GROUPS`` (512) threadgroups.
  That pass 1 is the lane walk (``attention_partial``). The default for float16 / bfloat16
  on cuda (and the emulator) is the tile pass 1 ``attention_partial_mma`` (knob
  ``split_kv_mma``; float32 and Apple GPUs keep the lane walk unless the knob says
  otherwise): one threadgroup per (key block, kv head, group
  of up to 16 query rows), keys as the rows of simdgroup-matrix products (S^T = K Q^T,
  O^T = V^T P^T: tensor-core m16n8k16 on CUDA, 16 keys per product) over K / V tiles of
  ``SPLIT_KV_MMA_TILE`` (16) keys streamed through up to ``SPLIT_KV_MMA_MAX_STAGES`` (3)
  threadgroup-memory stages (cp.async on CUDA; 48 KiB budget there, 32 KiB elsewhere);
  ``SPLIT_KV_MMA_WARPS`` (4) such simdgroups per threadgroup share a key block (each
  every 4th tile, its own stages; their states merged in threadgroup memory; fewer
  simdgroups where their stages do not fit: 227 KiB in all on an sm_90 GPU, 99 KiB on
  sm_86 / sm_89, 32 KiB elsewhere);
  block size automatic from ``SPLIT_KV_MMA_MAX_BLOCK`` (4096) halved (down to 64) until the
  grid has ``SPLIT_KV_MMA_TARGET_GROUPS`` (128) threadgroups, then doubled while the keys make more than
  ``SPLIT_KV_MMA_MAX_BLOCKS`` (32) blocks. Where one stage does not fit
  (float32 with head dims near 256 on 32 KiB) the lane walk runs. Opt-in (knob
  ``split_kv_cluster`` = C, 2..8): the tile pass 1's threadgroups of consecutive key blocks
  form threadgroup clusters of C (the largest divisor of the block count up to C) that
  merge their blocks in threadgroup memory as pass 2 would; where one cluster holds every
  block, a decode step is one launch. Only the emulator and cuda on sm_90 with MLX's CUDA
  graphs off run clusters (:func:`_cluster_support`: a graph node MLX updates keeps a
  cluster kernel's shape for the next kernel); elsewhere the knob is an error. Not the default: on an H200 the
  one launch was slower than the pass pair at 64 MiB of K / V (session 38). Split-KV is
  chosen automatically for
  Lq <= ``SPLIT_KV_MAX_QUERIES`` (8) and Lk >= ``SPLIT_KV_MIN_KEYS`` (1024; override with
  the ``split_kv_min_keys`` argument or ``XLSTM_ATTENTION_SPLIT_KV_MIN_KEYS``, alias
  ``XLSTM_KERNELS_ATTN_SPLIT_MIN_KEYS``).
* ``attention_decode_stream``: decode without a key split, in one launch (knob
  ``split_kv_stream``; automatic on cuda with bulk copies (sm_90) for 32 to 64 (batch, kv
  head) pairs of one query row, head dims 128, 2-byte dtypes and no mask array, see
  ``STREAM_MIN_GROUPS``; the knob True runs it wherever it can, else the pair). One
  threadgroup per (kv head, batch) takes all its query rows (up to ``STREAM_MAX_ROWS``) and
  all its keys: ``STREAM_TILES`` (16-key tiles, 12 simdgroups, 2 stages at D = 128 on cuda)
  stream K and V unpadded into each simdgroup's stages, by bulk copies where the rows are
  contiguous and 16-byte aligned (``cp.async.bulk`` on an mbarrier on cuda; the lanes'
  element copies otherwise); 8 lanes read a key (conflict-free), reduce its dot products by
  shuffles, and keep an online softmax per (row, lane group); the simdgroups' states merge
  at the end into the output. Rows of K and V must be whole 16-byte words.

Knobs (:mod:`xlstm_kernels.tiles.knobs`, op ``attention``, shape class by Lk): ``block_q``,
``block_k`` (prefill tiles; the heuristic above when unset), ``split_kv_block_size``
(automatic when unset, see above; :func:`knob_values` reports ``SPLIT_KV_BLOCK_SIZE`` =
256, its largest value), ``split_kv_min_keys``, ``split_kv_mma`` (tile or lane pass 1;
``XLSTM_ATTENTION_SPLIT_KV_MMA=0`` selects the lane walk) and ``split_kv_cluster`` (above). Per call: the keyword
arguments (``block_q=``, ``block_k=``, ``block_size=``, ``split_kv_min_keys=``, or
``knobs=`` of :func:`scaled_dot_product_attention`), then ``XLSTM_ATTENTION_*`` variables,
then the presets. A block_k whose K/V tiles do not fit 32 KiB for the head dims is an
error from an argument or a variable and is skipped (next lower level) from a preset.
For 2-byte dtypes the P staging buffer (BQ / RM x (BK + 8) elements) adds to the tiles: a
block_q / block_k pair whose total exceeds 32 KiB is an error (use a smaller one).

Head dims above ``MAX_KERNEL_HEAD_DIM`` (256), zero-size inputs and the ``reference``
backend run :func:`attention_reference` (plain mx ops, float32 softmax).

Training: every entry point is differentiable (q, k, v and an additive mask). The
backward pass recomputes the attention through :func:`attention_reference` under
``mx.vjp``, in chunks of queries so that the float32 score matrix of one chunk stays
below ``BACKWARD_CHUNK_ELEMENTS`` elements. Why recomputation and not backward
kernels: the forward kernels are the inference hot path; the reference VJP is exact,
covers every mask kind and GQA ratio with one code path, and keeps the backward
numerically identical to MLX's own fallback, at the cost of O(chunk x Lk) memory and
mx-op speed. Boolean masks and causal get no gradient (they are not differentiable).
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import numpy as np

from ..cuda import limits as cuda_limits
from ..runtime import KernelSpec, const_array, current_backend, launch, prepare_launch
from ..tiles.gemm import dtype_name
from ..tiles.knobs import (ALIAS_SPLIT_MIN_KEYS, attention_block_k_bytes, attention_fits, knob_shape_class,
                           resolve_knobs)
from ._callcache import CallCache, bare_unless_traced, config_token, placeholder, replayable
from ._validate import check_array, check_int32, check_same_dtype

__all__ = [
    "BACKWARD_CHUNK_ELEMENTS",
    "MAX_KERNEL_HEAD_DIM",
    "SPLIT_KV_BLOCK_SIZE",
    "SPLIT_KV_MAX_QUERIES",
    "SPLIT_KV_MIN_KEYS",
    "SPLIT_KV_TARGET_GROUPS",
    "attention_decode_split_kv",
    "attention_partial",
    "attention_prefill",
    "attention_reduce",
    "attention_reference",
    "knob_values",
    "scaled_dot_product_attention",
]

#: Split-KV decode is used for at most this many queries ...
SPLIT_KV_MAX_QUERIES = 8
#: ... and at least this many keys (the split_kv_min_keys knob overrides).
SPLIT_KV_MIN_KEYS = 1024
#: The older variable for it, an alias of XLSTM_ATTENTION_SPLIT_KV_MIN_KEYS.
ENV_SPLIT_MIN_KEYS = ALIAS_SPLIT_MIN_KEYS
#: Keys per block of the split-KV pass 1 (default).
SPLIT_KV_BLOCK_SIZE = 256
#: Largest head dim (of q/k and of v) the kernels take; larger ones use the reference.
MAX_KERNEL_HEAD_DIM = 256
#: The backward pass recomputes scores for query chunks of at most this many elements.
BACKWARD_CHUNK_ELEMENTS = 1 << 24

_ARRAY = mx.array
_MASK_NONE, _MASK_CAUSAL, _MASK_BOOL, _MASK_ADD = 0, 1, 2, 3
_NO_MASK = mx.array([False])  # the mask buffer of calls without a mask array (made with its data: no kernel)
_TG_MEMORY = 32 * 1024

_INPUTS = ("q", "k", "v", "mask", "params", "scale")
# The kernels that read K and V take them as they are, through k_strides / v_strides (MLX
# would otherwise copy every input that is not row-contiguous before each launch: a KV
# cache slice k_cache[:, :, :lk] of a decode loop, or keys transposed from (B, L, H, D)).
# q and an array mask are made row-contiguous by the op (mx.contiguous: no copy when they
# are); the kernels index them as such.
_IN_PLACE = {"ensure_row_contiguous": False}
PREFILL = KernelSpec("attention", "attention_prefill", _INPUTS, ("o",), **_IN_PLACE)
PREFILL_MMA = KernelSpec("attention", "attention_prefill_mma", _INPUTS, ("o",), **_IN_PLACE)
PARTIAL = KernelSpec("attention", "attention_partial", _INPUTS, ("o_part", "lse"), **_IN_PLACE)
PARTIAL_MMA = KernelSpec("attention", "attention_partial_mma", _INPUTS, ("o_part", "lse"), **_IN_PLACE)
# pass 2 reads only klen's shape (Lk); klen is the call's k in place, or an empty array
STREAM = KernelSpec("attention", "attention_decode_stream", _INPUTS, ("o",), **_IN_PLACE)
REDUCE = KernelSpec("attention", "attention_reduce", ("o_part", "lse", "params", "klen"), ("o",), **_IN_PLACE)


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Mask:
    """A validated mask: kind, the array as the kernels read it, strides over (b, h, q, k)."""

    kind: int
    array: mx.array | None = None
    strides: tuple[int, int, int, int] = (0, 0, 0, 0)

    def buffer(self) -> mx.array:
        return self.array if self.array is not None else _NO_MASK

    def kernel_buffer(self) -> mx.array:
        """The buffer as the kernels index it (row-contiguous, in its own shape): they read
        their inputs as they are (K and V in place, see _IN_PLACE)."""
        return mx.contiguous(self.array) if self.array is not None else _NO_MASK

    def reference_mask(self) -> Any:
        return {_MASK_NONE: None, _MASK_CAUSAL: "causal"}.get(self.kind, self.array)


def _promotes_to(a: mx.Dtype, b: mx.Dtype) -> bool:
    """Whether MLX's promotion of `a` with `b` is `b` (``a`` can be added to a `b` array)."""
    # on the CPU: a float64 array may not even be made on a GPU (only its dtype is read)
    return mx.add(mx.zeros((1,), dtype=a, stream=mx.cpu), mx.zeros((1,), dtype=b, stream=mx.cpu),
                  stream=mx.cpu).dtype == b


def _check_mask(mask: Any, target: tuple[int, int, int, int], dtype: mx.Dtype) -> _Mask:
    if mask is None:
        return _Mask(_MASK_NONE)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an mx.array, got the string {mask!r}")
        return _Mask(_MASK_CAUSAL)
    if not isinstance(mask, mx.array):
        raise TypeError(f"mask must be None, 'causal' or an mx.array, got {type(mask).__name__}")
    if mask.ndim > 4:
        raise ValueError(f"mask must have at most 4 dimensions (B, Hq, Lq, Lk), got shape {tuple(mask.shape)}")
    shape4 = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    if any(s not in (1, t) for s, t in zip(shape4, target)):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (B, Hq, Lq, Lk) = {target}"
        )
    if mask.dtype == mx.bool_:
        kind, arr = _MASK_BOOL, mask
    else:
        if mask.dtype == mx.complex64 or not _promotes_to(mask.dtype, dtype):
            raise TypeError(
                f"additive mask has dtype {mask.dtype}, which does not promote to the output dtype {dtype}; "
                f"cast it with mask.astype({dtype}) or pass a boolean mask"
            )
        kind, arr = _MASK_ADD, mask.astype(dtype)
    strides, acc = [0, 0, 0, 0], 1
    for i in range(3, -1, -1):
        strides[i] = acc if shape4[i] != 1 else 0
        acc *= shape4[i]
    return _Mask(kind, arr, tuple(strides))


def _check_inputs(q, k, v, scale, mask) -> _Mask:
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        check_array(x, name, ndim=4)
    check_same_dtype(q, "q", k, "k")
    check_same_dtype(q, "q", v, "v")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    bq, hq, lq, d = q.shape
    bk, hkv, lk, dk = k.shape
    if bk != bq or v.shape[0] != bq:
        raise ValueError(
            f"q (B, Hq, Lq, D), k and v must share the batch size B: got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if dk != d:
        raise ValueError(
            f"head dim mismatch: q (B, Hq, Lq, D) has D={d} but k (B, Hkv, Lk, D) has D={dk}: "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if tuple(v.shape[1:3]) != (hkv, lk):
        raise ValueError(
            f"k (B, Hkv, Lk, D) and v (B, Hkv, Lk, DV) must agree on Hkv and Lk: got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"the number of query heads Hq={hq} must be a multiple of the number of key/value heads Hkv={hkv}: "
            f"got q (B, Hq, Lq, D) {tuple(q.shape)}, k (B, Hkv, Lk, D) {tuple(k.shape)}"
        )
    return _check_mask(mask, (bq, hq, lq, lk), q.dtype)


def _check_int(value: Any, name: str, *, minimum: int = 1, multiple: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or value % multiple:
        raise ValueError(f"{name} must be an int >= {minimum} and a multiple of {multiple}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------
# Reference (plain mx ops)
# ---------------------------------------------------------------------------------------


def _reference_core(q, k, v, scale: float, kind: int, marr, q_start: int, lq_total: int) -> mx.array:
    """Attention of queries [q_start, q_start + q.shape[2]) of a length-`lq_total` query sequence."""
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    if 0 in (b, hq, lq, dv):
        # an empty output, without mx ops on empty operands (MLX 0.32's CUDA matmul crashed the
        # process on them on the H100)
        return mx.zeros((b, hq, lq, dv), dtype=q.dtype)
    g = hq // hkv
    qf = q.astype(mx.float32).reshape(b, hkv, g, lq, d) * scale
    kf = k.astype(mx.float32)[:, :, None]
    vf = v.astype(mx.float32)[:, :, None]
    s = (qf @ kf.swapaxes(-1, -2)).reshape(b, hq, lq, lk)
    lowest = mx.array(mx.finfo(mx.float32).min, dtype=mx.float32)
    if kind == _MASK_CAUSAL:
        rows = mx.arange(q_start, q_start + lq)[:, None] + (lk - lq_total)
        s = mx.where(mx.arange(lk)[None, :] <= rows, s, lowest)
    elif kind == _MASK_BOOL:
        s = mx.where(marr, s, lowest)
    elif kind == _MASK_ADD:
        s = s + marr.astype(mx.float32)
    p = mx.softmax(s, axis=-1)
    out = (p.reshape(b, hkv, g, lq, lk) @ vf).reshape(b, hq, lq, dv)
    return out.astype(q.dtype)


def attention_reference(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None) -> mx.array:
    """The attention with plain mx ops (float32 scores and softmax); the ``reference``
    backend, the backward pass and the tests' oracle. Same arguments as
    :func:`scaled_dot_product_attention`; differentiable by MLX."""
    m = _check_inputs(q, k, v, scale, mask)
    return _reference(q, k, v, float(scale), m)


def _reference(q, k, v, scale: float, m: _Mask) -> mx.array:
    b, hq, lq, _ = q.shape
    lk, dv = k.shape[2], v.shape[3]
    if lk == 0:  # softmax over no keys: MLX returns zeros
        return mx.zeros((b, hq, lq, dv), dtype=q.dtype)
    return _reference_core(q, k, v, scale, m.kind, m.array, 0, lq)


def _slice_q_axis(marr: mx.array, c0: int, c1: int) -> tuple[mx.array, int | None]:
    """The mask rows of queries [c0, c1) and the axis they were cut along (None: broadcast)."""
    if marr.ndim >= 2 and marr.shape[-2] > 1:
        axis = marr.ndim - 2
        idx = [slice(None)] * marr.ndim
        idx[axis] = slice(c0, c1)
        return marr[tuple(idx)], axis
    return marr, None


def _reference_vjp(q, k, v, scale: float, m: _Mask, madd, cot):
    """(dq, dk, dv, dmask) by recomputing the reference in query chunks."""
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    chunk = max(1, BACKWARD_CHUNK_ELEMENTS // max(1, b * hq * lk))
    dq_parts, dm_parts = [], []
    dk = dv = dm_sum = None
    dm_axis = None
    for c0 in range(0, lq, chunk):
        c1 = min(lq, c0 + chunk)
        qc, cc = q[:, :, c0:c1], cot[:, :, c0:c1]
        if m.kind == _MASK_ADD:
            mc, dm_axis = _slice_q_axis(madd, c0, c1)

            def fn(qq, kk, vv, mm, c0=c0):
                return _reference_core(qq, kk, vv, scale, _MASK_ADD, mm, c0, lq)

            _, grads = mx.vjp(fn, [qc, k, v, mc], [cc])
            if dm_axis is None:
                dm_sum = grads[3] if dm_sum is None else dm_sum + grads[3]
            else:
                dm_parts.append(grads[3])
        else:
            mc = _slice_q_axis(m.array, c0, c1)[0] if m.kind == _MASK_BOOL else None

            def fn(qq, kk, vv, mc=mc, c0=c0):
                return _reference_core(qq, kk, vv, scale, m.kind, mc, c0, lq)

            _, grads = mx.vjp(fn, [qc, k, v], [cc])
        dq_parts.append(grads[0])
        dk = grads[1] if dk is None else dk + grads[1]
        dv = grads[2] if dv is None else dv + grads[2]
    dq = dq_parts[0] if len(dq_parts) == 1 else mx.concatenate(dq_parts, axis=2)
    if m.kind != _MASK_ADD:
        dm = None
    elif dm_axis is None:
        dm = dm_sum
    else:
        dm = dm_parts[0] if len(dm_parts) == 1 else mx.concatenate(dm_parts, axis=dm_axis)
    return dq, dk, dv, dm


# ---------------------------------------------------------------------------------------
# Kernel launches
# ---------------------------------------------------------------------------------------


def _round8(n: int) -> int:
    return -(-n // 8) * 8


def _prefill_rm(block_q: int, dtype: mx.Dtype) -> int:
    """8-row query fragments per simdgroup (RM): 2 for 2-byte dtypes when BQ allows (each
    K^T / V fragment read from threadgroup memory then feeds 2 tensor-core products)."""
    return 2 if dtype != mx.float32 and block_q % 16 == 0 else 1


def _prefill_shares(block_q: int, block_k: int, d: int, dv: int, dtype: mx.Dtype) -> bool:
    """Whether the prefill kernel loads K and V in turn into one buffer (SHARE)."""
    itemsize = 4 if dtype == mx.float32 else 2
    pad = 16 // itemsize
    ps = 0 if itemsize == 4 else block_q // (8 * _prefill_rm(block_q, dtype)) * 8 * (block_k + pad)
    return (block_k * (_round8(d) + _round8(dv) + 2 * pad) + ps) * itemsize > _TG_MEMORY


def _prefill_tg_bytes(block_q: int, block_k: int, d: int, dv: int, dtype: mx.Dtype) -> int:
    """Threadgroup bytes of ``attention_prefill``, as the kernel declares them: the K/V
    tiles (one shared buffer when both and the P buffer do not fit 32 KiB) plus, for
    2-byte dtypes, the P / Q staging buffers (8 rows x (BK + 8) per simdgroup)."""
    itemsize = 4 if dtype == mx.float32 else 2
    pad = 16 // itemsize
    ldk, ldv = _round8(d) + pad, _round8(dv) + pad
    ps = 0 if itemsize == 4 else block_q // (8 * _prefill_rm(block_q, dtype)) * 8 * (block_k + pad)
    kv = block_k * (max(ldk, ldv) if _prefill_shares(block_q, block_k, d, dv, dtype) else ldk + ldv)
    return (kv + ps) * itemsize


def _prefill_tiles(lq: int, d: int, dv: int, dtype: mx.Dtype, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    """(BQ, BK). float32: BQ = 32 (16/8 for short query runs), BK = 32 (16 from head dim
    128). float16 / bfloat16 (tensor cores on CUDA): BQ up to 64, BK = 64 where the K and
    V tiles fit 32 KiB side by side, else 32 (else 16)."""
    half = dtype != mx.float32
    if block_q is None:
        block_q = 8 if lq <= 8 else 16 if lq <= 16 else 32 if (lq <= 32 or not half) else 64
    if block_k is None:
        if half:  # the largest BK whose K and V tiles fit side by side (no shared buffer)
            block_k = next((bk for bk in (64, 32) if not _prefill_shares(block_q, bk, d, dv, dtype)), 16)
        else:
            block_k = 32 if max(d, dv) < 128 else 16
    _check_int(block_q, "block_q", minimum=8, multiple=8)
    _check_int(block_k, "block_k", minimum=8, multiple=8)
    if block_q > 256:
        raise ValueError(f"block_q must be <= 256 (32 simdgroups of 8 query rows), got {block_q}")
    itemsize = 4 if dtype == mx.float32 else 2
    need = attention_block_k_bytes(block_k, d, dv, itemsize)
    if need > _TG_MEMORY:
        raise ValueError(
            f"block_k={block_k} with head dims ({d}, {dv}) in {dtype} needs {need} bytes of threadgroup memory (> 32 KiB)"
        )
    total = _prefill_tg_bytes(block_q, block_k, d, dv, dtype)
    if total > _TG_MEMORY:
        raise ValueError(
            f"block_q={block_q} with block_k={block_k} and head dims ({d}, {dv}) in {dtype} needs {total} bytes of "
            f"threadgroup memory (> 32 KiB: K/V tiles plus the P staging buffer); use a smaller block_q or block_k"
        )
    return block_q, block_k


def _params(values: list) -> mx.array:
    """A launch's int64 parameter vector (runtime.const_array: in device memory on cuda).
    It holds no Lk: the kernels read that from the shapes, so the same parameters serve a
    decode loop's every step."""
    return const_array(values, mx.int64)


@functools.lru_cache(maxsize=64)
def _klen(num_keys: int) -> mx.array:
    """attention_reduce's ``klen`` input where no k is at hand (``attention_reduce`` called
    alone): an empty (1, 1, num_keys, 0) array, whose shape (passed by value) carries Lk;
    it has no data. The op passes its k instead (same axis 2)."""
    return mx.array(np.empty((1, 1, num_keys, 0), dtype=np.int8))


def _scale_array(scale: float) -> mx.array:
    return const_array(scale, mx.float32)


def _prefill_launch(q, k, v, m: _Mask, scale: float, block_q=None, block_k=None) -> tuple[KernelSpec, dict]:
    """(spec, launch kwargs) of the prefill kernel."""
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    bq, bk = _prefill_tiles(lq, d, dv, q.dtype, block_q, block_k)
    rm = _prefill_rm(bq, q.dtype)
    mbuf = m.kernel_buffer()
    params = _params([hq, hkv, lq, 0, *m.strides, 0, 0])  # Lk: k_shape[2] (by value)
    threads = 32 * (bq // (8 * rm))
    check_int32("scaled_dot_product_attention", "the prefill grid x (threads per query block * blocks)",
                threads * -(-lq // bq), f"q has shape {tuple(q.shape)}")
    return PREFILL, dict(
        inputs=[q, k, v, mbuf, params, _scale_array(scale)],
        output_shapes=[(b, hq, lq, dv)],
        output_dtypes=[q.dtype],
        grid=(threads * -(-lq // bq), hq, b),
        threadgroup=(threads, 1, 1),
        template=[("T", q.dtype), ("MT", mbuf.dtype), ("D", d), ("DV", dv), ("BQ", bq), ("BK", bk), ("RM", rm),
                  ("MASK", m.kind)],
    )


def _tg_budget(backend: str) -> int:
    """Threadgroup memory a tile kernel (the tile prefill, the tile pass 1) may take on
    `backend`: on cuda the dynamic shared memory a block may have on this GPU
    (:func:`xlstm_kernels.cuda.limits.shared_bytes_per_block`: 227 KiB on sm_90, where two
    blocks of the default prefill tiles fit an SM; 99 KiB on sm_86 / sm_89), 32 KiB
    elsewhere (Apple GPUs, the emulator)."""
    return cuda_limits.shared_bytes_per_block() if backend == "cuda" else _TG_MEMORY


#: Simdgroup layouts (WM simdgroups x RB blocks of 16 query rows each) of the tile prefill,
#: largest first: a call takes the first whose BQ = 16 * RB * WM does not exceed its query
#: length rounded up to 16 (else the smallest), then falls back along the list until the
#: tiles fit the budget.
PREFILL_MMA_LAYOUTS = ((4, 2), (4, 1), (2, 1), (1, 1))
#: Stages (ST) and keys per tile (BK) tried for each layout, stages first, first fit wins:
#: the register rule gives D = 64 tiles of 128 keys (H100, 1x32x32x1024x1024x64: 0.91-0.95x
#: MLX against 0.64-0.68x with 64 keys; probe-prefill-cuda-h100-session8-r2.txt), D = 128
#: tiles of 64.
PREFILL_MMA_KEY_TILES = (128, 64, 32, 16)
PREFILL_MMA_STAGES = (2, 1)
#: Float accumulator registers per lane the tile prefill may hold: RB x 16 rows of O (DVP
#: columns) and of S (BK keys) over 32 lanes, RB * (DVP + BK) / 2. 192 keeps ptxas (sm_90,
#: 255 registers at 128 threads) free of spills: RB 2 with DV <= 128 and BK 64; RB 1 above.
_PREFILL_MMA_ACC_REGISTERS = 192
#: Swizzled tiles (template SWZ) on backends that have them (CUDA) for head dims that are
#: multiples of 64: rows of whole 128-byte lines instead of padded rows.
PREFILL_MMA_SWIZZLE = True
#: (WM, RB, BK, ST) for every call when set (probes, tests); must fit the budget.
PREFILL_MMA_TILES: tuple[int, int, int, int] | None = None
#: Warpgroup products in the tile prefill (template WG: CUDA's wgmma on sm_90, the portable
#: form of metal_src/_warpgroup.metal on the emulator), with PREFILL_WG_TILES and the Q, K,
#: V tiles in the warpgroup layout and P in registers (see :func:`_prefill_wg`). None
#: (default): the calls where the H100 measured it faster than the mma.sync tiles, unmasked
#: and causal ones with D == DV == 128 (session 37, probe-prefill-wg-cuda-h100-session37.txt:
#: 1.07-1.21x; D = 64 was mixed, other masks not measured); True: every call it can run
#: (float16 / bfloat16, D == DV of 64 or 128, at least 64 queries; tests, probes); False:
#: none. Never with PREFILL_MMA_TILES.
PREFILL_MMA_WARPGROUP: bool | None = None
#: (WM, RB, BK, ST) of the warpgroup prefill: WM 4 (one warpgroup, 64 query rows) or 8 (two,
#: 128 rows sharing each K / V tile), 64- or 128-key tiles, ST >= 3 stages (tile t + 1 is in
#: while tile t's P V runs). (4, 1, 64, 3): 112 KiB at D = 128, two threadgroups an SM,
#: which run out of step (the fastest on the H100, session 37).
PREFILL_WG_TILES = (4, 1, 64, 3)


def _prefill_mma_bytes(wm: int, rb: int, bk: int, st: int, d: int, dv: int, wg: bool = False) -> int:
    """Threadgroup bytes of ``attention_prefill_mma`` (2-byte dtypes): Q (BQ rows) and ST
    stages of BK K and V rows, head dims padded to multiples of 16 plus 16 bytes per row;
    with warpgroup products (`wg`) unpadded (P stays in registers)."""
    if wg:
        return (16 * rb * wm * d + st * bk * (d + dv)) * 2
    ldk, ldv = -(-d // 16) * 16 + 8, -(-dv // 16) * 16 + 8
    return (16 * rb * wm * ldk + st * bk * (ldk + ldv)) * 2


def _prefill_wg(lq: int, d: int, dv: int, dtype: mx.Dtype, backend: str, mask_kind: int = _MASK_NONE) -> bool:
    """Whether a tile-prefill call runs warpgroup products (PREFILL_WG_TILES, template WG).
    It can where there is no PREFILL_MMA_TILES, the dtype is float16 / bfloat16, D == DV of
    64 or 128, there are at least 64 queries (one warpgroup's rows), and the backend is cuda
    on sm_90 (wgmma; other GPUs would run the portable form) or the emulator (its portable
    form, with the launch's dynamic threadgroup memory, as on CUDA). Then PREFILL_MMA_WARPGROUP
    decides: None, unmasked and causal calls with D == 128 only; True, all; False, none."""
    if PREFILL_MMA_WARPGROUP is False or PREFILL_MMA_TILES is not None:
        return False
    if dtype not in (mx.float16, mx.bfloat16) or d != dv or d not in (64, 128) or lq < 64:
        return False
    if not (backend == "emulate" or (backend == "cuda" and cuda_limits.architecture() == "sm_90")):
        return False
    return True if PREFILL_MMA_WARPGROUP else (d == 128 and mask_kind in (_MASK_NONE, _MASK_CAUSAL))


def _prefill_mma_plan(lq: int, d: int, dv: int, dtype: mx.Dtype, backend: str) -> tuple[int, int, int, int] | None:
    """(WM, RB, BK, ST) of the tile prefill for a call, or None (float32, or no tiles fit
    the backend's threadgroup memory)."""
    if dtype == mx.float32:
        return None
    budget = _tg_budget(backend)
    if PREFILL_MMA_TILES is not None:
        wm, rb, bk, st = PREFILL_MMA_TILES
        if bk % 16 or bk % wm or min(wm, rb, st) < 1 or 32 * wm > 1024:
            raise ValueError(f"PREFILL_MMA_TILES={PREFILL_MMA_TILES}: expected (WM, RB, BK, ST) with BK a multiple "
                             f"of 16 and of WM, WM <= 32, RB and ST >= 1")
        need = _prefill_mma_bytes(wm, rb, bk, st, d, dv)
        if need > budget:
            raise ValueError(f"PREFILL_MMA_TILES={PREFILL_MMA_TILES} with head dims ({d}, {dv}) needs {need} bytes of "
                             f"threadgroup memory (> {budget} on backend {backend!r})")
        return wm, rb, bk, st
    rows = max(16, -(-lq // 16) * 16)
    layouts = PREFILL_MMA_LAYOUTS
    first = next((i for i, (wm, rb) in enumerate(layouts) if 16 * wm * rb <= rows), len(layouts) - 1)
    for wm, rb in layouts[first:]:
        for st in PREFILL_MMA_STAGES:
            for bk in PREFILL_MMA_KEY_TILES:
                regs = rb * (-(-dv // 16) * 16 + bk) // 2
                if (bk % wm == 0 and regs <= _PREFILL_MMA_ACC_REGISTERS
                        and _prefill_mma_bytes(wm, rb, bk, st, d, dv) <= budget):
                    return wm, rb, bk, st
    return None


def _prefill_mma_default(dtype: mx.Dtype, backend: str) -> bool:
    """The prefill_mma knob's built-in value: on for float16 / bfloat16 on cuda and on the
    emulator (which tests what cuda runs); off for float32 and on Apple GPUs (not measured
    there; attention_prefill follows MLX's Metal SDPA)."""
    return dtype != mx.float32 and backend != "metal"


def _use_prefill_mma(knob: bool | None, q, v, backend: str) -> bool:
    """Whether the prefill runs the tile kernel: the prefill_mma knob, else
    :func:`_prefill_mma_default`; never for float32 or where no tiles fit."""
    want = _prefill_mma_default(q.dtype, backend) if knob is None else bool(knob)
    return want and _prefill_mma_plan(q.shape[2], q.shape[3], v.shape[3], q.dtype, backend) is not None


def _prefill_wg_tiles(d: int, dv: int, backend: str) -> tuple[int, int, int, int]:
    """PREFILL_WG_TILES, checked: (WM, RB, BK, ST) with WM 4 or 8, RB 1, BK 64 or 128, ST >= 3 (the
    body's static_assert), within the backend's threadgroup memory (dynamic on cuda: 227 KiB
    on sm_90; the emulator models that launch, so its 32 KiB does not apply)."""
    wm, rb, bk, st = PREFILL_WG_TILES
    if wm not in (4, 8) or rb != 1 or bk not in (64, 128) or st < 3:
        raise ValueError(f"PREFILL_WG_TILES={PREFILL_WG_TILES}: expected (WM, 1, BK, ST) with WM 4 or 8, BK 64 or 128 "
                         f"and ST >= 3")
    need = _prefill_mma_bytes(wm, rb, bk, st, d, dv, wg=True)
    budget = cuda_limits.shared_bytes_per_block()
    if need > budget:
        raise ValueError(f"PREFILL_WG_TILES={PREFILL_WG_TILES} with head dims ({d}, {dv}) needs {need} bytes of "
                         f"threadgroup memory (> {budget} a block on {backend!r})")
    return wm, rb, bk, st


def _prefill_mma_launch(q, k, v, m: _Mask, scale: float, backend: str) -> tuple[KernelSpec, dict]:
    """(spec, launch kwargs) of the tile prefill: one threadgroup of WM simdgroups per
    (16 * RB * WM queries, query head, batch)."""
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    wg = _prefill_wg(lq, d, dv, q.dtype, backend, m.kind)
    wm, rb, bk, st = _prefill_wg_tiles(d, dv, backend) if wg else _prefill_mma_plan(lq, d, dv, q.dtype, backend)
    bq = 16 * rb * wm
    mbuf = m.kernel_buffer()
    params = _params([hq, hkv, lq, 0, *m.strides, 0, 0])  # Lk: k_shape[2] (by value)
    threads = 32 * wm
    check_int32("scaled_dot_product_attention", "the prefill grid x (threads per query block * blocks)",
                threads * -(-lq // bq), f"q has shape {tuple(q.shape)}")
    return PREFILL_MMA, dict(
        inputs=[q, k, v, mbuf, params, _scale_array(scale)],
        output_shapes=[(b, hq, lq, dv)],
        output_dtypes=[q.dtype],
        grid=(threads * -(-lq // bq), hq, b),
        threadgroup=(threads, 1, 1),
        template=[("T", q.dtype), ("MT", mbuf.dtype), ("D", d), ("DV", dv), ("MASK", m.kind),
                  ("WM", wm), ("RB", rb), ("BK", bk), ("ST", st), ("SWZ", int(PREFILL_MMA_SWIZZLE)), ("WG", int(wg))],
        # cuda: the body's tile buffer is dynamic shared memory (XK_THREADGROUP_DYNAMIC)
        shared_memory=-(-_prefill_mma_bytes(wm, rb, bk, st, d, dv, wg) // 16) * 16,
    )


#: Register estimate (32-bit registers per lane) of the split-KV pass 1 that R, the query
#: rows per threadgroup, must stay within: about 60 + R x (KC partial scores + q and
#: accumulator elements per lane) + the KC K-row runs in flight (fitted to ptxas -v of
#: the CUDA kernels, sm_90; above it they spill to local memory). 150 rather than the
#: spill limit: fewer rows per threadgroup, more threadgroups per SM (H100, fp16 decode
#: 8x32x8x8192x128: R = 2 at 823 GB/s vs R = 4 at 644 GB/s; scripts/probe_attention.py).
_PARTIAL_REG_BUDGET = 150
#: Threadgroup bytes the pass 1 may use for merging its simdgroups' states.
_PARTIAL_TG_BYTES = 28 * 1024
#: Threadgroups the automatic split-KV block size aims for (about 4 per SM on a 132-SM
#: H100): the block size halves from SPLIT_KV_BLOCK_SIZE (down to 64) until the grid
#: has at least this many.
SPLIT_KV_TARGET_GROUPS = 512


def _run_width(n: int, itemsize: int) -> int:
    """Elements per lane run of a row of n elements (split-KV pass 1): the widest power
    of 2 dividing n, at most 16 bytes, with 32 lanes' runs not past the row."""
    w = 1
    while 2 * w * itemsize <= 16 and n % (2 * w) == 0 and 32 * 2 * w <= n:
        w *= 2
    return w


def _partial_rows(rows: int, d: int, dv: int, dtype: mx.Dtype) -> tuple[int, int, int, int]:
    """(R, KC, WK, WV) of the split-KV pass 1 for `rows` = (Hq / Hkv) * Lq query rows per
    key/value head: R rows per threadgroup (all of them when the registers allow), KC =
    32 or 16 keys per chunk (16 when it lets more rows share one K / V read)."""
    itemsize = 4 if dtype == mx.float32 else 2
    wk, wv = _run_width(d, itemsize), _run_width(dv, itemsize)
    nk = -(-d // (32 * wk)) * wk
    nv = -(-dv // (32 * wv)) * wv
    best = (1, 32)
    for kc in (32, 16):
        r = 1
        while r < rows and 60 + (r + 1) * (kc + nk + nv) + kc * nk * itemsize // 4 <= _PARTIAL_REG_BUDGET:
            r += 1
        if -(-rows // r) < -(-rows // best[0]):
            best = (r, kc)
    r = -(-rows // -(-rows // best[0]))  # the same number of groups, rows spread evenly
    return r, best[1], wk, wv


def _partial_groups(b: int, hq: int, hkv: int, lq: int, lk: int, d: int, dv: int, dtype, block_size: int) -> int:
    r = _partial_rows(hq // hkv * lq, d, dv, dtype)[0]
    return b * hkv * -(-(hq // hkv * lq) // r) * -(-lk // block_size)


def _auto_block_size(q, k, v) -> int:
    """Split-KV block size when none is set: SPLIT_KV_BLOCK_SIZE, halved (down to 64)
    while the pass-1 grid has fewer than SPLIT_KV_TARGET_GROUPS threadgroups."""
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    bs = SPLIT_KV_BLOCK_SIZE
    while bs > 64 and _partial_groups(b, hq, hkv, lq, lk, d, dv, q.dtype, bs) < SPLIT_KV_TARGET_GROUPS:
        bs //= 2
    return bs


def _partial_launch(q, k, v, m: _Mask, scale: float, block_size: int) -> tuple[KernelSpec, dict]:
    """(spec, launch kwargs) of the split-KV pass 1: one threadgroup per (key block, key/
    value head and group of R of its query rows, batch)."""
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    rows = hq // hkv * lq
    r, kc, wk, wv = _partial_rows(rows, d, dv, q.dtype)
    nrg = -(-rows // r)
    nb = -(-lk // block_size)
    sow = -(-dv // (32 * wv)) * wv * 32
    nsg = max(1, min(8, -(-block_size // kc), _PARTIAL_TG_BYTES // (4 * r * (sow + 2))))
    mbuf = m.kernel_buffer()
    params = _params([hq, hkv, lq, 0, *m.strides, block_size, 0])  # Lk, n_blocks: k_shape, the grid
    check_int32("scaled_dot_product_attention", "the split-KV grid x (threads per block * key blocks)",
                32 * nsg * nb, f"k has shape {tuple(k.shape)}")
    return PARTIAL, dict(
        inputs=[q, k, v, mbuf, params, _scale_array(scale)],
        output_shapes=[(b, hq, lq, nb, dv), (b, hq, lq, nb)],
        output_dtypes=[mx.float32, mx.float32],
        grid=(32 * nsg * nb, hkv * nrg, b),
        threadgroup=(32 * nsg, 1, 1),
        template=[("T", q.dtype), ("MT", mbuf.dtype), ("D", d), ("DV", dv), ("NSG", nsg), ("MASK", m.kind),
                  ("R", r), ("KC", kc), ("WK", wk), ("WV", wv)],
    )


#: The tile pass 1 (``attention_partial_mma``): keys per tile (a multiple of 16) ...
SPLIT_KV_MMA_TILE = 16
#: ... at most this many threadgroup-memory stages (tile t + ST - 1 is copied while tile t
#: is computed), as many as fit the backend's budget: 48 KiB per simdgroup on cuda (once
#: CUDA's static shared memory per block; the stages are dynamic shared memory since session
#: 27, 227 KiB in all), 32 KiB per threadgroup elsewhere (Apple GPUs, the emulator).
#: A decode step's latency (chained calls, scripts/probe_decode.py, H200, session 14) wants
#: more bytes in flight per SM than two stages of a one-simdgroup walk give: with 512
#: groups, 3 stages ran as fast as 4 and up to 25% faster than 2. (Session 5 had picked 2
#: by the eval time of independent queued calls, which overlap on the GPU and hid that.)
SPLIT_KV_MMA_MAX_STAGES = 3
_MMA_STAGE_BUDGET = {"cuda": 48 * 1024}
_APPLE_STAGE_BUDGET_BYTES = 32 * 1024
#: Query rows per threadgroup of the tile pass 1 (two 8-row fragments); more rows per kv
#: head form several groups, spread evenly.
SPLIT_KV_MMA_MAX_ROWS = 16
#: Block sizes of the tile pass 1 when none is set: SPLIT_KV_MMA_MAX_BLOCK halved (down to
#: 64) until the grid has SPLIT_KV_MMA_TARGET_GROUPS threadgroups (of SPLIT_KV_MMA_WARPS
#: simdgroups each). One simdgroup's walk is latency-bound, so a call needs several per SM.
#: History (one-simdgroup threadgroups): session 14 (H200) raised the target from 128 to
#: 512 groups (8x32x8x8192 216 -> 111 us a call, 1x32x32x4096 93 -> 58); sessions 21-22
#: (H100) took 256 for heads whose K and V rows of a key pass 256 bytes (D = 128 in 16
#: bits). Session 27 (H100, bf16, marginal chains interleaved with MLX's op,
#: scripts/probe_decode_chain.py, probe-decode-chain-warps-cuda-h100-session27.txt): 4
#: simdgroups a threadgroup, aiming for 128 threadgroups on every head width, against
#: the one-simdgroup plan, us per call (MLX's op in parentheses): 1x32x8 heads D 128 at
#: 1024 keys 19.2 -> 17.7 (31.9), 4096 25.0 -> 21.7 (34.1), 8192 23.2 -> 19.2 (32.9), 16384
#: 38.1 -> 34.2 (32.3), 32768 62.9 -> 57.8 (55.4); 1x32x32x16384 D 64 56.0 -> 53.6 (55.4);
#: 1x32x32x4096 34.3 -> 32.0 (34.0); 4x32x8x2048 19.0 -> 16.4 (39.7); 8x32x8x8192 104.5 ->
#: 102.4 (121.2); 16x32x8x4096 104.3 -> 101.3 (99.6); 4x32x8x32768 195.1 -> 197.5 (194.7).
#: Fewer, longer key blocks with the same warps in flight also leave pass 2 less to merge.
SPLIT_KV_MMA_MAX_BLOCK = 4096
SPLIT_KV_MMA_TARGET_GROUPS = 128
#: ... and at most this many key blocks per (batch, kv head, row group), where that leaves
#: fewer groups: one decode sequence (few kv heads) gets fewer, longer walks. Session 17,
#: H200, bf16 1x32x8 heads D 128, chained calls interleaved with MLX
#: (scripts/probe_decode_chain.py, fastest quarter of 11 chains), us per call, 512 groups ->
#: at most 32 blocks: 4096 keys 41 -> 35, 8192 39 -> 35, 16384 57 -> 47-50, 32768 69 -> 62-64
#: (16 blocks: 35, 37, 61, 83). Batched shapes, whose rule already gives <= 32 blocks, keep
#: their plans. Pass 2 merges 32 blocks at a time.
SPLIT_KV_MMA_MAX_BLOCKS = 32


#: Simdgroups per threadgroup of the tile pass 1 (its NW): each walks every NW-th tile of
#: the block through its own stages, and the threadgroup merges their states, so that a
#: key block has NW warps in flight with no more blocks for pass 2 (see _mma_warps; fewer
#: where their stages do not fit, e.g. 2 for D = 128 in 32 KiB). Session 27, H100 (see
#: SPLIT_KV_MMA_TARGET_GROUPS): 4 at 3 stages (102 KiB at D = 128: two threadgroups an SM)
#: beat 1, 2 and 8 at the same block size and at the block sizes each does best with;
#: 2 and 4 stages no better.
SPLIT_KV_MMA_WARPS = 4
def _mma_bytes(rows_per_group: int, d: int, dv: int, dtype: mx.Dtype, st: int, warps: int, cluster: int = 1) -> int:
    """Threadgroup bytes of the tile pass 1: `warps` x `st` stages of K / V tiles, or (more
    than one simdgroup) their merge buffer, float O, max and sum per query row of each (and,
    in a cluster, the block's normalised O and lse per row, which the cluster reads)."""
    itemsize = 4 if dtype == mx.float32 else 2
    pad = 16 // itemsize
    stages = warps * st * SPLIT_KV_MMA_TILE * (_round8(d) + _round8(dv) + 2 * pad) * itemsize
    nq = 8 * -(-rows_per_group // 8)
    merge = warps * nq * (_round8(dv) + 2) * 4 if warps > 1 else 0
    if merge and cluster > 1:
        merge += nq * (dv + 1) * 4
    return -(-max(stages, merge) // 16) * 16


def _mma_plan(rows: int, d: int, dv: int, dtype: mx.Dtype, backend: str,
              warps: int = 1) -> tuple[int, int, int, int] | None:
    """(R, RM, KT, ST) of the tile pass 1 for `rows` = (Hq / Hkv) * Lq query rows per kv
    head and `warps` simdgroups per threadgroup, or None where one stage of K and V tiles
    per simdgroup (and their merge buffer) does not fit the backend's budget: a stage
    budget per simdgroup (48 KiB on cuda), within :func:`_tg_budget` in all (227 KiB on
    sm_90, 99 KiB on sm_86 / sm_89; 32 KiB on Apple GPUs and the emulator)."""
    itemsize = 4 if dtype == mx.float32 else 2
    pad = 16 // itemsize
    kt = SPLIT_KV_MMA_TILE
    stage = kt * (_round8(d) + _round8(dv) + 2 * pad) * itemsize
    total = _tg_budget(backend)
    per_warp = min(_MMA_STAGE_BUDGET.get(backend, _APPLE_STAGE_BUDGET_BYTES), total // warps)
    st = min(SPLIT_KV_MMA_MAX_STAGES, per_warp // stage)
    groups = -(-rows // SPLIT_KV_MMA_MAX_ROWS)
    r = -(-rows // groups)
    if st < 1 or _mma_bytes(r, d, dv, dtype, st, warps) > total:
        return None
    return r, -(-r // 8), kt, st


def _mma_warps(rows: int, d: int, dv: int, dtype: mx.Dtype, backend: str) -> int:
    """Simdgroups per threadgroup of the tile pass 1: SPLIT_KV_MMA_WARPS, halved while
    its stages do not fit the backend's threadgroup memory (1 always fits where the tile
    pass 1 runs)."""
    w = SPLIT_KV_MMA_WARPS
    while w > 1 and _mma_plan(rows, d, dv, dtype, backend, w) is None:
        w //= 2
    return w


def _mma_default(dtype: mx.Dtype, backend: str) -> bool:
    """The split_kv_mma knob's built-in value: on for float16 / bfloat16 (tensor cores) on
    cuda and on the emulator (which tests what cuda runs); off for float32 (float fragments
    are products through shuffles on CUDA) and on Apple GPUs (not measured there: a
    26 KiB single-simdgroup threadgroup may leave a GPU core mostly idle)."""
    return dtype != mx.float32 and backend != "metal"


def _use_mma(knob: bool | None, q, k, v, backend: str) -> bool:
    """Whether split-KV pass 1 runs the tile kernel: the split_kv_mma knob, else
    :func:`_mma_default`; never where one stage of its tiles does not fit."""
    want = _mma_default(q.dtype, backend) if knob is None else bool(knob)
    return want and _mma_plan(q.shape[1] // k.shape[1] * q.shape[2], q.shape[3], v.shape[3], q.dtype,
                              backend) is not None


def _auto_block_size_mma(q, k, v, backend: str, cluster_knob: int | None = None) -> int:
    """Tile pass 1 block size when none is set (:func:`_mma_block_for`; `cluster_knob`: the
    split_kv_cluster knob, see :func:`_clusters_possible`)."""
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    rows = hq // hkv * lq
    r = _mma_plan(rows, d, dv, q.dtype, backend)[0]
    return _mma_block_for(b * hkv * -(-rows // r), lk,
                          clusters=_clusters_possible(cluster_knob, rows, d, dv, q.dtype, backend))


def _mma_block_for(per_block: int, lk: int, target: int | None = None, clusters: bool = False) -> int:
    """The tile pass 1's automatic block size for `lk` keys, where each key block makes
    `per_block` threadgroups (batch x kv heads x row groups): SPLIT_KV_MMA_MAX_BLOCK halved
    (down to 64) while the grid has fewer than `target` threadgroups (default
    SPLIT_KV_MMA_TARGET_GROUPS), then raised (by powers of two,
    up to SPLIT_KV_MMA_MAX_BLOCK) until the keys make at most SPLIT_KV_MMA_MAX_BLOCKS blocks.
    `clusters` (the backend merges blocks in threadgroup clusters) and per_block below
    SPLIT_KV_CLUSTER_GROUPS: the same halving aiming for SPLIT_KV_CLUSTER_GROUPS threadgroups,
    where that gives 2 to MAX_CLUSTER blocks (one cluster: one launch)."""
    if clusters and target is None and per_block < SPLIT_KV_CLUSTER_GROUPS:
        bs = _mma_block_for(per_block, lk, SPLIT_KV_CLUSTER_GROUPS)
        if 2 <= -(-lk // bs) <= MAX_CLUSTER:
            return bs
    target = SPLIT_KV_MMA_TARGET_GROUPS if target is None else target
    bs = SPLIT_KV_MMA_MAX_BLOCK
    while bs > 64 and per_block * -(-lk // bs) < target:
        bs //= 2
    while bs < SPLIT_KV_MMA_MAX_BLOCK and -(-lk // bs) > SPLIT_KV_MMA_MAX_BLOCKS:
        bs *= 2
    return bs


def _partial_mma_launch(q, k, v, m: _Mask, scale: float, block_size: int, backend: str,
                        warps: int | None = None, cluster: int = 1) -> tuple[KernelSpec, dict]:
    """(spec, launch kwargs) of the tile pass 1: one threadgroup of `warps` simdgroups
    (default :func:`_mma_warps`) per (key block, key/value head and group of R of its query
    rows, batch). `cluster` > 1 (a divisor of the block count, :func:`_cluster_for`): that
    many consecutive blocks merged in a threadgroup cluster, so the outputs hold n_blocks /
    cluster blocks, o_part in q's dtype where that is one block (the attention output)."""
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    rows = hq // hkv * lq
    nw = _mma_warps(rows, d, dv, q.dtype, backend) if warps is None else warps
    plan = _mma_plan(rows, d, dv, q.dtype, backend, nw)
    if plan is None:
        raise ValueError(f"split-KV tile pass 1: one stage of {SPLIT_KV_MMA_TILE} keys of head dims ({d}, {dv}) in "
                         f"{q.dtype} for each of {nw} simdgroups does not fit the threadgroup memory of backend "
                         f"{backend!r}")
    r, rm, kt, st = plan
    nrg = -(-rows // r)
    nb = -(-lk // block_size)
    if cluster > 1 and (nb % cluster or nw < 2 or cluster > MAX_CLUSTER or not _has_clusters(backend)):
        why = _cluster_support(backend)
        raise ValueError(f"split-KV tile pass 1: a cluster of {cluster} key blocks needs a divisor of the {nb} "
                         f"blocks, at most {MAX_CLUSTER}, more than one simdgroup per threadgroup (plan: {nw})"
                         + (f"; {why}" if why else ""))
    nbo = nb // cluster
    mbuf = m.kernel_buffer()
    params = _params([hq, hkv, lq, 0, *m.strides, block_size, 0])  # Lk, n_blocks: k_shape, the grid
    check_int32("scaled_dot_product_attention", "the split-KV grid x (threads per block * key blocks)",
                32 * nw * nb, f"k has shape {tuple(k.shape)}")
    out_dtype = q.dtype if nbo == 1 and cluster > 1 else mx.float32
    return PARTIAL_MMA, dict(
        inputs=[q, k, v, mbuf, params, _scale_array(scale)],
        output_shapes=[(b, hq, lq, nbo, dv), (b, hq, lq, nbo)],
        output_dtypes=[out_dtype, mx.float32],
        grid=(32 * nw * nb, hkv * nrg, b),
        threadgroup=(32 * nw, 1, 1),
        template=[("T", q.dtype), ("OT", out_dtype), ("MT", mbuf.dtype), ("D", d), ("DV", dv), ("MASK", m.kind),
                  ("R", r), ("RM", rm), ("KT", kt), ("ST", st), ("NW", nw), ("XK_CLUSTER", cluster)],
        # cuda: the buffer is the launch's dynamic shared memory (the emulator and Metal
        # declare it statically, within 32 KiB)
        shared_memory=_mma_bytes(r, d, dv, q.dtype, st, nw, cluster) if backend == "cuda" else 0,
    )


#: The most key blocks a threadgroup cluster merges (CUDA's portable cluster size).
MAX_CLUSTER = 8
#: Split-KV in threadgroup clusters (the split_kv_cluster knob; metal_src/_cluster.metal): a
#: decode step with fewer threadgroups per key block (batch x kv heads x row groups) than
#: this splits its keys for this many threadgroups (:func:`_mma_block_for`), and where that
#: makes 2 to MAX_CLUSTER blocks, one cluster merges them all: one launch, no pass 2.
#: Session 38 (H200, MLX_USE_CUDA_GRAPHS=0, fp16 / bf16; probe-decode-cluster-cuda-h200-session38.txt):
#: kernel time (Nsight Compute) of one launch against the pass pair: 1x32x32x4096 25.8 (128
#: threadgroups in clusters of 4) and 27.5 (64 in clusters of 2) against 21.6 + 2.8 us,
#: 1x32x8x16384 28.3 (64 in clusters of 8) against 22.4 + 3.2: a cluster's threadgroups stream
#: slower than free ones, by more than pass 2 costs. Marginal chains, us a call, pair -> clusters:
#: 1x32x32x4096 26.1 -> 28.1, 1x32x8x16384 27.9 -> 29.0, 1x32x8x4096 21.0 -> 12.7 (one launch
#: instead of two short ones), 8x32x8x8192 75.4 -> 71.9. So clusters stay opt-in.
SPLIT_KV_CLUSTER_GROUPS = 64


def _mlx_cuda_graphs() -> bool:
    """Whether MLX's CUDA backend records CUDA graphs: MLX_USE_CUDA_GRAPHS unset, or set to a
    value whose leading integer (C's atoi, as MLX reads it) is not 0."""
    text = os.environ.get("MLX_USE_CUDA_GRAPHS")
    if text is None:
        return True
    m = re.match(r"\s*([+-]?\d+)", text)
    return bool(m and int(m.group(1)) != 0)


def _cluster_support(backend: str) -> str | None:
    """None where `backend` runs threadgroup clusters (the emulator; cuda on sm_90 and newer
    with MLX's CUDA graphs off), else why not. With graphs on, MLX updates a recorded graph
    in place (cudaGraphExecUpdate) whenever a new one has the same shape of nodes; a node
    that held a kernel compiled for clusters keeps its cluster shape, and a plain kernel
    updated into it whose block count is no multiple of that shape silently does not run,
    so calls long after, ours or MLX's own, give wrong results (session 38: 72 of 183
    attention tests failed with graphs on, none with them off;
    scripts/repro_mlx_cluster_graph.py shows it with two plain cuda_kernels)."""
    if backend == "emulate":
        return None
    if backend != "cuda":
        return f"backend {backend!r} has no threadgroup clusters (cuda on sm_90 and newer, the emulator)"
    if not cuda_limits.has_clusters():
        return f"threadgroup clusters need sm_90 or newer (this GPU is {cuda_limits.architecture()})"
    if _mlx_cuda_graphs():
        return ("threadgroup clusters on cuda need MLX's CUDA graphs off (MLX_USE_CUDA_GRAPHS=0 before MLX starts): "
                "MLX 0.32 updates a recorded graph's kernel nodes in place without their cluster shape")
    return None


def _has_clusters(backend: str) -> bool:
    """Whether `backend` runs threadgroup clusters now (:func:`_cluster_support`)."""
    return _cluster_support(backend) is None


def _clusters_possible(knob: int | None, rows: int, d: int, dv: int, dtype: mx.Dtype, backend: str) -> bool:
    """Whether the tile pass 1 of `rows` query rows per kv head runs in clusters: the
    split_kv_cluster knob asks for them (2..8; off by default), the backend has them, the
    plan has more than one simdgroup a threadgroup (they merge in threadgroup memory first)
    and the cluster's buffer fits beside the merge buffer."""
    if knob is None or knob < 2 or not _has_clusters(backend):
        return False
    nw = _mma_warps(rows, d, dv, dtype, backend)
    plan = _mma_plan(rows, d, dv, dtype, backend, nw)
    if nw < 2 or plan is None:
        return False
    r, _, _, st = plan
    return _mma_bytes(r, d, dv, dtype, st, nw, MAX_CLUSTER) <= _tg_budget(backend)


def _cluster_for(knob: int | None, nb: int, rows: int, d: int, dv: int, dtype: mx.Dtype, backend: str) -> int:
    """Key blocks of the tile pass 1 merged per threadgroup cluster (1: none) for `nb`
    blocks: the largest divisor of nb up to the split_kv_cluster knob, where
    :func:`_clusters_possible`."""
    if not _clusters_possible(knob, rows, d, dv, dtype, backend):
        return 1
    c = min(int(knob), MAX_CLUSTER)
    while c > 1 and nb % c:
        c -= 1
    return c


#: One-launch decode (``attention_decode_stream``): (keys a tile, simdgroups, stages) in
#: order of preference, the first whose threadgroup memory fits the backend (and, with more
#: than one query row, at most STREAM_MAX_WARPS_ROWS simdgroups: their registers). H100,
#: 1x32x32x4096x128 fp16 / bf16, marginal chains of the probe's kernel
#: (scripts/probe_decode_stream.py, session 39): 16-key tiles with 8 or 12 simdgroups
#: 27.2-27.9 us a call, 32-key tiles with 4 30.5, 8-key tiles with 16 28.3, against the
#: split-KV pair's 30.0-31.3. The op's own kernel (scripts/probe_stream_plans.py, session 40),
#: fp16 / bf16: (16, 12, 2) 29.1 / 28.7, (16, 8, 3) 29.6 / 30.2, (8, 16, 3) 30.9 / 32.9, the
#: pair 33.4 / 33.3 (a machine 1-3 us slower than session 39's).
STREAM_TILES = ((16, 12, 2), (16, 8, 3), (16, 8, 2), (16, 4, 2), (8, 4, 2), (8, 2, 2), (4, 2, 2), (4, 1, 2))
#: Simdgroups of a one-launch decode threadgroup with more than one query row (12 with four
#: rows asked more registers than a launch may have, session 39).
STREAM_MAX_WARPS_ROWS = 8
#: The most query rows (Hq / Hkv * Lq) one-launch decode takes (a lane keeps its words of each).
STREAM_MAX_ROWS = 8
#: The split_kv_stream knob's automatic choice (None): one-launch decode where a call has one
#: query row per kv head, head dims 128, a 2-byte dtype, no mask array, and between
#: STREAM_MIN_GROUPS and STREAM_MAX_GROUPS (batch, kv head) pairs, on cuda with bulk copies
#: (sm_90). Its threadgroups (one a pair, ~200 KiB of stages each) stream at most ~130 GB/s an
#: SM, so fewer pairs leave the GPU's bandwidth unused. H100, session 39, marginal chains
#: (scripts/probe_decode_chain.py sm0 / sm1, bf16), us a call, one-launch against the pair:
#: 1x32x32x4096 27.9 against 30.3 (MLX 31.8) and 28.2 against 31.7 (two runs); 1x32x32x8192
#: 51.5 against 54.0; 2x32x32x4096 (64 pairs) 53.9 against 54.2. The probe's kernel
#: (probe_decode_stream.py): 8 pairs (1x32x8x16384, 1x32x8x4096) 49-181 against 16-33, 64 pairs
#: of 4 rows (8x32x8x8192) 98.9 against 101.5, D = 64 (1x32x32x16384) 57.5 against 55.3.
STREAM_MIN_GROUPS = 32
STREAM_MAX_GROUPS = 64
#: One-launch decode's early refill (the kernel's ER): each lane loads its words of a tile into
#: registers and the stage is refilled before the arithmetic. H100, session 40 (as a patched
#: kernel): 30.58 against 29.49 us in Nsight Compute (164 registers against 104), chains within
#: noise; off. Kept as a variant for devices where the kernel sits further above its copies
#: (H200, session 46: 24.6 us against 17.9-18.5 for its geometry); not yet timed there. Read
#: when a call is built: set it before the first call (memoised calls keep their kernel).
STREAM_EARLY_REFILL = False


def _stream_bytes(tiles: tuple[int, int, int], rows: int, d: int, dv: int, dtype: mx.Dtype) -> int:
    """Threadgroup bytes of one-launch decode's buffer: the simdgroups' stages, or (after
    the walk, over them) the merge of the NW states (one a simdgroup) of each query row."""
    tb, nw, st = tiles
    itemsize = 4 if dtype == mx.float32 else 2
    stages = nw * st * tb * (d + dv) * itemsize
    merge = nw * rows * (dv + 2) * 4
    return -(-max(stages, merge) // 16) * 16


def _stream_budget(backend: str) -> int:
    """Threadgroup memory of one-launch decode on `backend` (its buffer and its stages' bars):
    cuda's per block, the same on the emulator (which models the cuda launch, and so tests
    the tiles cuda runs), 32 KiB on Apple GPUs."""
    return cuda_limits.shared_bytes_per_block() if backend in ("cuda", "emulate") else _TG_MEMORY


def _stream_plan(rows: int, d: int, dv: int, dtype: mx.Dtype, backend: str) -> tuple[int, int, int] | None:
    """(keys a tile, simdgroups, stages) of one-launch decode for `rows` query rows per kv
    head, or None where it cannot run: rows of K or V not whole 16-byte words, more than
    STREAM_MAX_ROWS rows, or no tiles of STREAM_TILES within :func:`_stream_budget`."""
    itemsize = 4 if dtype == mx.float32 else 2
    if (d * itemsize) % 16 or (dv * itemsize) % 16 or rows > STREAM_MAX_ROWS:
        return None
    budget = _stream_budget(backend)
    for tiles in STREAM_TILES:
        if rows > 1 and tiles[1] > STREAM_MAX_WARPS_ROWS:
            continue
        if _stream_bytes(tiles, rows, d, dv, dtype) + 8 * tiles[1] * tiles[2] <= budget:  # + the bars
            return tiles
    return None


def _stream_refusal(q, k, v, backend: str) -> str | None:
    """None where one-launch decode can run this call, else why not (the first of its
    conditions that the call fails)."""
    b, hq, lq, d = q.shape
    hkv, dv = k.shape[1], v.shape[3]
    rows = hq // hkv * lq
    if _stream_plan(rows, d, dv, q.dtype, backend) is None:
        itemsize = 4 if q.dtype == mx.float32 else 2
        if (d * itemsize) % 16 or (dv * itemsize) % 16:
            return (f"one-launch decode needs rows of K and V in whole 16-byte words (head dims ({d}, {dv}) in "
                    f"{q.dtype} are {d * itemsize} and {dv * itemsize} bytes)")
        if rows > STREAM_MAX_ROWS:
            return (f"one-launch decode takes at most {STREAM_MAX_ROWS} query rows per kv head "
                    f"(Hq / Hkv * Lq = {hq} / {hkv} * {lq} = {rows})")
        warps = f" (with more than one row, at most {STREAM_MAX_WARPS_ROWS} simdgroups)" if rows > 1 else ""
        return (f"one-launch decode has no tile plan of STREAM_TILES {STREAM_TILES} within {_stream_budget(backend)} "
                f"bytes of threadgroup memory for {rows} query rows per kv head and head dims ({d}, {dv}) in "
                f"{q.dtype}{warps}")
    return None


def _use_stream(knob: bool | None, q, k, v, m: _Mask, backend: str) -> bool:
    """Whether a split-KV call runs one-launch decode: the split_kv_stream knob (True: wherever
    it can run, see :func:`_stream_refusal`; elsewhere the split-KV pair, as split_kv_mma
    falls back to the lane walk), else the automatic rule of STREAM_MIN_GROUPS."""
    if knob is not None:
        return bool(knob) and _stream_refusal(q, k, v, backend) is None
    b, hq, lq, d = q.shape
    hkv, dv = k.shape[1], v.shape[3]
    return (backend == "cuda" and cuda_limits.has_bulk_copies() and q.dtype in (mx.float16, mx.bfloat16)
            and hq // hkv * lq == 1 and d == dv == 128 and m.array is None
            and STREAM_MIN_GROUPS <= b * hkv <= STREAM_MAX_GROUPS)


def _stream_launch(q, k, v, m: _Mask, scale: float, backend: str) -> tuple[KernelSpec, dict]:
    """(spec, launch kwargs) of one-launch decode: one threadgroup per (kv head, batch)."""
    b, hq, lq, d = q.shape
    hkv, dv = k.shape[1], v.shape[3]
    rows = hq // hkv * lq
    tiles = _stream_plan(rows, d, dv, q.dtype, backend)
    if tiles is None:
        raise ValueError(f"scaled_dot_product_attention: {_stream_refusal(q, k, v, backend)}")
    tb, nw, st = tiles
    mbuf = m.kernel_buffer()
    params = _params([hq, hkv, lq, 0, *m.strides, 0, 0])  # Lk: k's shape (by value)
    nbytes = _stream_bytes(tiles, rows, d, dv, q.dtype)
    return STREAM, dict(
        inputs=[q, k, v, mbuf, params, _scale_array(scale)],
        output_shapes=[(b, hq, lq, dv)],
        output_dtypes=[q.dtype],
        grid=(32 * nw, hkv, b),
        threadgroup=(32 * nw, 1, 1),
        template=[("T", q.dtype), ("MT", mbuf.dtype), ("D", d), ("DV", dv), ("MASK", m.kind), ("R", rows),
                  ("TB", tb), ("ST", st), ("NW", nw), ("ER", int(STREAM_EARLY_REFILL))],
        # cuda: the stages are the launch's dynamic shared memory (the bars static beside
        # them); the emulator models that launch (its limit: the stages and the bars)
        shared_memory={"cuda": nbytes, "emulate": nbytes + 8 * nw * st}.get(backend, 0),
    )


#: Split-KV pass 2: key blocks whose partial rows a lane loads before it adds any (the
#: kernel's RB; the sums are the same for every value). H100, marginal chains
#: (scripts/probe_decode_chain.py PROBE_DC_RULES="shipped rb8 rb16 rb32", session 26), bf16,
#: median us, 4 -> 8: 1x32x8x16384 39.3 -> 37.7, 1x32x8x4096 18.3 -> 17.5; 1x32x32x16384 D 64,
#: 8x32x8x8192 and 1x32x32x4096 within 0.3 us; 16 and 32 no better. Nsight Compute had pass 2
#: of 1x32x8x16384 at 16 us (caches flushed: its 8 threadgroups wait on one block's loads
#: after another).
REDUCE_BATCH = 8
#: Split-KV pass 2: the first REDUCE_BATCH blocks' partial rows are loaded before the row's
#: lse values are read and reduced (the kernel's PF), so that both go out together (one round
#: trip to memory for rows of at most REDUCE_BATCH blocks; the same sums). Session 28, H100,
#: Nsight Compute with warm caches (ncu-times-cuda-session28.txt), fp16 pass 2 median us,
#: without -> with: 1x32x8x16384 4.32 -> 4.16 (cuDNN's lean reduction 4.06), 1x32x32x4096
#: 3.84 -> 3.65, 1x32x8x4096 3.97 -> 3.79. Marginal chains: within their noise.
REDUCE_PREFETCH = True


def _reduce_launch(o_part, lse, block_size: int, num_keys: int, dtype, klen=None) -> tuple[KernelSpec, dict]:
    """(spec, launch kwargs) of the split-KV pass 2; `klen`: an array whose axis 2 is
    `num_keys` (the call's k), else an empty one is made."""
    *lead, nb, dv = o_part.shape
    rows = 1
    for s in lead:
        rows *= s
    params = _params([rows, 0, block_size, 0])  # n_blocks, Lk: o_part's and klen's shapes (by value)
    return REDUCE, dict(
        inputs=[o_part.reshape(rows, nb, dv), lse.reshape(rows, nb), params,
                _klen(num_keys) if klen is None else klen],
        output_shapes=[(rows, dv)],
        output_dtypes=[dtype],
        grid=(32, rows, 1),
        threadgroup=(32, min(4, rows), 1),
        template=[("T", dtype), ("DV", dv), ("RB", REDUCE_BATCH), ("PF", int(bool(REDUCE_PREFETCH)))],
    )


def _run(spec_kwargs, backend: str) -> list[mx.array]:
    spec, kwargs = spec_kwargs
    return launch(spec, backend=backend, **kwargs)


def _split_kv_forward(q, k, v, m: _Mask, scale: float, block_size: int | None, backend: str,
                      mma: bool = False, plans: dict | None = None, cluster: int | None = None) -> mx.array:
    """Pass 1 and pass 2 of one call (pass 1 alone where a threadgroup cluster merges all
    its key blocks, see :func:`_cluster_for`; `cluster`: the split_kv_cluster knob). `plans`
    (a dict kept by the caller, for masks without an array): the launches prepared once per
    (block size, block count) and reused, as a decode loop's growing cache calls with a new
    Lk every step (the kernels read Lk by value; the grid changes only with the block count)."""
    lk = k.shape[2]
    b, hq, lq, d = q.shape
    dv = v.shape[3]

    def clusters(bs: int) -> int:
        if not mma:
            return 1
        return _cluster_for(cluster, -(-lk // bs), hq // k.shape[1] * lq, d, dv, q.dtype, backend)

    if plans is not None and m.array is None:
        # a decode loop's step: the block size from Lk alone (a rule made once), the launches
        # per (block size, block count), Lk to pass 2 through k's shape
        rule = plans.get("block size")
        if rule is None:
            rule = plans["block size"] = _block_size_rule(q, k, v, block_size, mma, backend, cluster)
        bs = rule(lk)
        plan = plans.get((bs, -(-lk // bs)))
        if plan is None:
            # Pass 1's outputs declared (rows, n_blocks, DV) / (rows, n_blocks) and pass 2's
            # (B, Hq, Lq, DV): the same row-major bytes as the public shapes (kernels index
            # their outputs flat and read only their inputs' shapes), so a step runs no
            # reshape between or after the two launches.
            cl = clusters(bs)
            spec1, kw1 = (_partial_mma_launch(q, k, v, m, scale, bs, backend, cluster=cl) if mma
                          else _partial_launch(q, k, v, m, scale, bs))
            *lead, nb, _ = kw1["output_shapes"][0]
            rows = 1
            for n in lead:
                rows *= n
            last = cl > 1 and nb == 1  # pass 1's o_part is the output
            kw1 = {**kw1, "output_shapes": [(*q.shape[:3], dv) if last else (rows, nb, dv), (rows, nb)]}
            run1, consts1 = prepare_launch(spec1, **kw1, backend=backend), kw1["inputs"][3:]
            o_part, lse = run1([q, k, v, *consts1])
            if last:
                plan = plans[(bs, -(-lk // bs))] = (run1, consts1, None, None)
                return o_part
            spec2, kw2 = _reduce_launch(o_part, lse, bs * cl, lk, q.dtype, klen=k)
            kw2 = {**kw2, "output_shapes": [(*q.shape[:3], dv)]}
            plan = plans[(bs, -(-lk // bs))] = (run1, consts1, prepare_launch(spec2, **kw2, backend=backend),
                                               kw2["inputs"][2])
        else:
            o_part, lse = plan[0]([q, k, v, *plan[1]])
            if plan[2] is None:
                return o_part
        (o,) = plan[2]([o_part, lse, plan[3], k])
        return o
    bs = block_size or (_auto_block_size_mma(q, k, v, backend, cluster) if mma else _auto_block_size(q, k, v))
    cl = clusters(bs)
    spec1, kw1 = (_partial_mma_launch(q, k, v, m, scale, bs, backend, cluster=cl) if mma
                  else _partial_launch(q, k, v, m, scale, bs))
    o_part, lse = _run((spec1, kw1), backend)
    if cl > 1 and o_part.shape[3] == 1:
        return o_part.reshape(b, hq, lq, dv)
    (o,) = _run(_reduce_launch(o_part, lse, bs * cl, lk, q.dtype, klen=k), backend)
    return o.reshape(b, hq, lq, dv)


def _stream_forward(q, k, v, m: _Mask, scale: float, backend: str, plans: dict | None = None) -> mx.array:
    """One-launch decode of one call. `plans` (kept by the caller, for masks without an
    array): its launch, prepared once and reused while a decode loop's Lk grows (the kernel
    reads Lk from k's shape; its grid does not depend on it)."""
    if plans is not None and m.array is None:
        plan = plans.get("stream")
        if plan is None:
            spec, kw = _stream_launch(q, k, v, m, scale, backend)
            plan = plans["stream"] = (prepare_launch(spec, **kw, backend=backend), kw["inputs"][3:])
        (o,) = plan[0]([q, k, v, *plan[1]])
        return o
    (o,) = _run(_stream_launch(q, k, v, m, scale, backend), backend)
    return o


def _block_size_rule(q, k, v, block_size: int | None, mma: bool, backend: str, cluster_knob: int | None = None):
    """lk -> the split-KV block size of calls like this one that differ only in Lk (what
    _auto_block_size(_mma) give, computed from ints: no array attribute reads per call)."""
    if block_size:
        return lambda lk: block_size
    b, hq, lq, d = q.shape
    hkv, dv = k.shape[1], v.shape[3]
    if mma:
        rows = hq // hkv * lq
        per_block = b * hkv * -(-rows // _mma_plan(rows, d, dv, q.dtype, backend)[0])
        clusters = _clusters_possible(cluster_knob, rows, d, dv, q.dtype, backend)
        return lambda lk: _mma_block_for(per_block, lk, clusters=clusters)
    per_block = _partial_groups(b, hq, hkv, lq, 1, d, dv, q.dtype, 1)  # groups per key block
    top, target = SPLIT_KV_BLOCK_SIZE, SPLIT_KV_TARGET_GROUPS

    def rule(lk: int) -> int:
        bs = top
        while bs > 64 and per_block * -(-lk // bs) < target:
            bs //= 2
        return bs

    return rule


_ARG_KNOBS = {"block_q": "block_q", "block_k": "block_k", "block_size": "split_kv_block_size",
              "split_kv_min_keys": "split_kv_min_keys"}


def _knob_args(cfg: dict) -> dict:
    """The op's keyword arguments (validated as before) as knob arguments."""
    args = dict(cfg.get("knobs") or {})
    if cfg.get("block_q") is not None:
        _check_int(cfg["block_q"], "block_q", minimum=8, multiple=8)
    if cfg.get("block_k") is not None:
        _check_int(cfg["block_k"], "block_k", minimum=8, multiple=8)
    if cfg.get("block_size") is not None:
        _check_int(cfg["block_size"], "block_size")
    if cfg.get("split_kv_min_keys") is not None:
        _check_int(cfg["split_kv_min_keys"], "split_kv_min_keys", minimum=0)
    for arg, knob in _ARG_KNOBS.items():
        if cfg.get(arg) is not None:
            args[knob] = cfg[arg]
    return args


def knob_values(lq: int, lk: int, d: int, dv: int, dtype: Any, args: dict | None = None) -> dict[str, int]:
    """The knobs a call with these sizes uses, defaults and heuristics filled in:
    {"block_q", "block_k", "split_kv_block_size", "split_kv_min_keys", "split_kv_mma", "split_kv_cluster",
    "split_kv_stream", "prefill_mma"} (split_kv_cluster: the cluster size asked for, 0 for none;
    split_kv_stream: True / False as set, None for the automatic rule of :func:`_use_stream`).
    `args`: knob arguments ({knob: value})."""
    v = resolve_knobs("attention", dtype, lk, args=args, fits=attention_fits(d, dv, dtype)).values
    bq, bk = _prefill_tiles(lq, d, dv, getattr(mx, dtype_name(dtype)), v["block_q"], v["block_k"])
    mx_dtype = getattr(mx, dtype_name(dtype))
    backend = current_backend()
    mma = _mma_default(mx_dtype, backend) if v["split_kv_mma"] is None else bool(v["split_kv_mma"])
    pmma = _prefill_mma_default(mx_dtype, backend) if v["prefill_mma"] is None else bool(v["prefill_mma"])
    return {"block_q": bq, "block_k": bk,
            "split_kv_block_size": SPLIT_KV_BLOCK_SIZE if v["split_kv_block_size"] is None else v["split_kv_block_size"],
            "split_kv_min_keys": SPLIT_KV_MIN_KEYS if v["split_kv_min_keys"] is None else v["split_kv_min_keys"],
            "split_kv_mma": mma and _mma_plan(1, d, dv, mx_dtype, backend) is not None,
            "split_kv_cluster": v["split_kv_cluster"] or 0,
            "split_kv_stream": v["split_kv_stream"],
            "prefill_mma": pmma and _prefill_mma_plan(lq, d, dv, mx_dtype, backend) is not None}


# ---------------------------------------------------------------------------------------
# The differentiable op
# ---------------------------------------------------------------------------------------


_CALLS = CallCache("attention")


def _attention(q, k, v, scale, mask, path: str, cfg: dict) -> mx.array:
    """The op: validated, resolved and wrapped once per call signature (ops/_callcache.py)
    for masks None / "causal" and calls without a knobs dict; otherwise built per call."""
    last = _LAST_FAMILY[0]
    if last is not None and q.__class__ is _ARRAY and k.__class__ is _ARRAY and v.__class__ is _ARRAY:
        # the step after a family's call, in the same family at a new length: that call
        # again, without the memo lookups below (see _LAST_FAMILY)
        ks = k.shape
        lk = ks[2]
        fam = last[2]
        if (lk != fam.last_lk and last[4] == _FAMILIES.epoch
                and _family_prefix(q, k, v, ks, scale, mask, path, cfg) == last[0]
                and knob_shape_class("attention", lk) == last[1] and config_token() == last[3]
                and fam.takes(last[0][0][2], lk)):
            fam.last_lk = lk
            return fam(q, k, v, mask)
    key = None
    if (q.__class__ is _ARRAY and k.__class__ is _ARRAY and v.__class__ is _ARRAY
            and scale.__class__ in (float, int) and (mask is None or mask.__class__ is str)
            and cfg.get("knobs") is None):
        try:
            key = (q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype, scale, mask, path,
                   tuple(cfg.items()))  # cfg: the public function's keywords, always in one order
            hash(key)
        except TypeError:
            key = None
    fn = _CALLS.get(key) if key is not None else None
    if fn is None:
        fam_key = _family_key(key) if key is not None else None
        fam = _FAMILIES.get(fam_key) if fam_key is not None else None
        if fam is not None and fam is not _SEEN and fam.takes(key[0][2], key[2][2]):
            if fam.last_lk != key[2][2]:  # a new length: the family's call
                fam.last_lk = key[2][2]
                _remember_family(q, k, v, scale, mask, path, cfg, fam_key, fam)
                return fam(q, k, v, mask)
            # the same length twice in a row (a loop at a fixed length): memoised below, then replayed
        if fam is _SEEN:  # a second key length of this family: a growing cache, from now on one shared call
            fam = _build_attention(q, k, v, scale, mask, path, cfg, replay=False)
            _FAMILIES.put(fam_key, fam)
            if fam.takes(key[0][2], key[2][2]):
                _remember_family(q, k, v, scale, mask, path, cfg, fam_key, fam)
                return fam(q, k, v, mask)
        fn = _build_attention(q, k, v, scale, mask, path, cfg, replay=key is not None)
        if key is not None:
            _CALLS.put(key, fn)
            if fam_key is not None and fam is None:
                _FAMILIES.put(fam_key, _SEEN)
    return fn(q, k, v, mask)


# A decode loop's KV cache grows by a key a step, so each call has a new Lk: a new call
# signature, whose build (validation, knobs, plans) and graph recording cost ~400 us of
# host time a step on the H200 (scripts/probe_decode_loop.py: 1300 us a step pipelined
# against MLX's 31). Calls that differ from a memoised one only in Lk (same knob shape
# class) form a family: from its second key length on, one call built without graph
# replay serves them all (its launches are planned per call from the shapes; the kernels
# read Lk by value, so their parameter arrays repeat) while its path (split-KV or not)
# stays the same.
_FAMILIES = CallCache("attention decode", maxsize=256)
_SEEN = object()  # a family with one key length so far
# The last family call: (prefix, knob shape class, family, config token, the family
# memo's epoch). A decode loop
# calls the same family every step, and the memo lookups that find it (the full key's miss,
# the family key, the family memo) cost several microseconds of a ~20 us step (local, stub
# kernels); the next call checks these fields instead and, when they match at a new
# length, is that family's call. The prefix holds everything the family key holds but Lk
# (shapes, dtypes, scale, mask, path, keywords), the config token stands for the memo's
# configuration check and the epoch for the family still being in the memo, so the call is
# the one the lookups would have found. (A length memoised earlier as a call of its own,
# met again later, takes the family's call here: the same launches, the same result.)
_LAST_FAMILY: list = [None]


def _family_prefix(q, k, v, ks, scale, mask, path: str, cfg: dict) -> tuple | None:
    """What identifies a call's family apart from Lk (k's shape `ks` read once), or None
    where a call cannot be one (a knobs dict, a mask array, a non-number scale, k and v of
    other lengths, no keys)."""
    if (cfg.get("knobs") is not None or scale.__class__ not in (float, int)
            or not (mask is None or mask.__class__ is str)):
        return None
    vs = v.shape
    if len(ks) != 4 or len(vs) != 4 or vs[2] != ks[2] or ks[2] == 0:
        return None
    return (q.shape, q.dtype, ks[0], ks[1], ks[3], k.dtype, vs[0], vs[1], vs[3], v.dtype, scale, mask, path,
            tuple(cfg.items()))


def _remember_family(q, k, v, scale, mask, path: str, cfg: dict, fam_key: tuple, fam) -> None:
    """Record `fam` as the last family called (_LAST_FAMILY)."""
    prefix = _family_prefix(q, k, v, k.shape, scale, mask, path, cfg)
    _LAST_FAMILY[0] = None if prefix is None else (prefix, fam_key[-1], fam, config_token(), _FAMILIES.epoch)


def _family_key(key: tuple) -> tuple | None:
    """The memo key (q, k and v's shapes and dtypes first) without Lk, plus its knob shape
    class, or None for calls whose k and v disagree in length (validated by the full
    build), with no keys, or that are not decode-sized."""
    qs, ks, vs = key[0], key[2], key[4]
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return None
    lk = ks[2]
    if lk == 0 or vs[2] != lk or qs[2] > SPLIT_KV_MAX_QUERIES:  # an empty cache takes the reference path
        return None
    return (qs, key[1], (ks[0], ks[1], ks[3]), key[3], (vs[0], vs[1], vs[3]), *key[5:],
            knob_shape_class("attention", lk))


def _build_attention(q, k, v, scale, mask, path: str, cfg: dict, replay: bool = False):
    """Validate one call and build fn(q, k, v, mask) -> o for its signature (`replay`: a
    memoised signature, whose launches cuda / metal record once and replay)."""
    m = _check_inputs(q, k, v, scale, mask)
    scale = float(scale)
    b, hq, lq, d = q.shape
    lk, dv = k.shape[2], v.shape[3]
    if path == "prefill":
        _prefill_tiles(lq, d, dv, q.dtype, cfg.get("block_q"), cfg.get("block_k"))  # bad tiles fail early
    args = _knob_args(cfg)
    kv = resolve_knobs("attention", q.dtype, lk, args=args, fits=attention_fits(d, dv, q.dtype)).values
    block_q, block_k = kv["block_q"], kv["block_k"]
    block_size = kv["split_kv_block_size"]
    asked = path
    min_keys = SPLIT_KV_MIN_KEYS if kv["split_kv_min_keys"] is None else kv["split_kv_min_keys"]
    if path == "auto":
        split = lq <= SPLIT_KV_MAX_QUERIES and lk >= min_keys
        path = "split" if split else "prefill"

    def takes(lq2: int, lk2: int) -> bool:
        """Whether a call with these lengths takes the path this one took (decode families)."""
        if asked != "auto":
            return True
        return (lq2 <= SPLIT_KV_MAX_QUERIES and lk2 >= min_keys) == (path == "split")

    backend = current_backend()
    if backend == "reference" or 0 in (b, hq, lq, d, dv, lk) or max(d, dv) > MAX_KERNEL_HEAD_DIM:
        def reference(q, k, v, mask):
            return _reference(q, k, v, scale, m if mask is None or isinstance(mask, str) else _check_inputs(
                q, k, v, scale, mask))

        reference.takes = takes
        reference.last_lk = lk
        return reference
    stream = path == "split" and _use_stream(kv["split_kv_stream"], q, k, v, m, backend)
    mma = path == "split" and not stream and _use_mma(kv["split_kv_mma"], q, k, v, backend)
    if path == "split" and (kv["split_kv_cluster"] or 0) >= 2 and _cluster_support(backend) is not None:
        raise ValueError(f"split_kv_cluster={kv['split_kv_cluster']}: {_cluster_support(backend)}")
    # the tile prefill, unless the call names attention_prefill's tiles (block_q= / block_k=)
    prefill_mma = (path == "prefill" and cfg.get("block_q") is None and cfg.get("block_k") is None
                   and _use_prefill_mma(kv["prefill_mma"], q, v, backend))
    if path == "split":  # the reduction sees B * Hq * Lq rows (a shape dimension and its grid y)
        check_int32("scaled_dot_product_attention", "rows B * Hq * Lq of the split-KV reduction", b * hq * lq,
                    f"q has shape {tuple(q.shape)}")

    split_plans: dict = {}  # the split-KV launches per (block size, block count): see _split_kv_forward

    def forward(q, k, v, mm: _Mask) -> mx.array:
        q = mx.contiguous(q)  # k and v are read in place (_IN_PLACE)
        if path == "split":
            if stream:
                return _stream_forward(q, k, v, mm, scale, backend, split_plans)
            return _split_kv_forward(q, k, v, mm, scale, block_size, backend, mma, split_plans,
                                     kv["split_kv_cluster"])
        if prefill_mma:
            (o,) = _run(_prefill_mma_launch(q, k, v, mm, scale, backend), backend)
            return o
        (o,) = _run(_prefill_launch(q, k, v, mm, scale, block_q, block_k), backend)
        return o

    additive = m.kind == _MASK_ADD
    absent = placeholder(q.dtype)

    @mx.custom_function
    def f(q, k, v, extra):
        return forward(q, k, v, replace(m, array=extra) if additive else m)

    @f.vjp
    def f_vjp(primals, cotangent, output):
        q, k, v, extra = primals
        dq, dk, dv_, dm = _reference_vjp(q, k, v, scale, m, extra if additive else None, cotangent)
        return dq, dk, dv_, dm if additive else mx.zeros_like(extra)

    def bare(q, k, v, extra):
        return forward(q, k, v, replace(m, array=extra) if additive else m)

    # replayed, or (a decode family: Lk changes every call) the bare forward on plain calls
    f = replayable(f, backend, bare=bare) if replay else bare_unless_traced(f, backend, bare)

    def call(q, k, v, mask):
        # an array mask is checked per call (its values are this call's); memoised calls have none
        extra = _check_inputs(q, k, v, scale, mask).array if additive else absent
        return f(q, k, v, extra)

    call.takes = takes
    call.last_lk = lk
    return call


def scaled_dot_product_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    split_kv_min_keys: int | None = None,
    knobs: dict | None = None,
) -> mx.array:
    """softmax(scale · q kᵀ + mask) v, like ``mx.fast.scaled_dot_product_attention``.

    Args:
        q: (B, Hq, Lq, D) float32, float16 or bfloat16.
        k: (B, Hkv, Lk, D), q's dtype; Hq must be a multiple of Hkv.
        v: (B, Hkv, Lk, DV), q's dtype.
        scale: the score scale (usually D ** -0.5).
        mask: None, ``"causal"``, a boolean array (True = attend) or an additive array
            whose dtype promotes to q's, broadcastable to (B, Hq, Lq, Lk).
        split_kv_min_keys: decode with the split-KV kernels when Lq <= 8 and Lk >= this
            (default: the knob, ``SPLIT_KV_MIN_KEYS`` = 1024 unless
            ``$XLSTM_ATTENTION_SPLIT_KV_MIN_KEYS`` / ``$XLSTM_KERNELS_ATTN_SPLIT_MIN_KEYS``
            or a preset sets it).
        knobs: optional {knob: value} of the attention knobs (block_q, block_k,
            split_kv_block_size, split_kv_min_keys), above the environment and presets;
            ``split_kv_min_keys=`` wins over ``knobs["split_kv_min_keys"]``.

    Returns:
        (B, Hq, Lq, DV) in q's dtype.

    Differentiable in q, k, v and an additive mask; the backward pass recomputes the
    attention with the reference ops (see the module docstring).
    """
    if knobs is not None and not isinstance(knobs, dict):
        raise TypeError(f"knobs must be a dict of knob -> value or None, got {type(knobs).__name__}")
    return _attention(q, k, v, scale, mask, "auto", {"split_kv_min_keys": split_kv_min_keys, "knobs": knobs})


def attention_prefill(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> mx.array:
    """The same op always on the flash-attention (prefill) kernel.

    ``block_q`` (queries per threadgroup, a multiple of 8, <= 256) and ``block_k`` (keys
    per tile, a multiple of 8) override the tile choice (default: the knobs, else the
    heuristic of the module docstring). Differentiable.
    """
    return _attention(q, k, v, scale, mask, "prefill", {"block_q": block_q, "block_k": block_k})


def attention_decode_split_kv(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    block_size: int | None = None,
) -> mx.array:
    """The same op always on the decode path: the split-KV pair (``attention_partial`` over
    blocks of ``block_size`` keys, default: the split_kv_block_size knob, else automatic,
    then ``attention_reduce``), or one launch without a split (``attention_decode_stream``)
    where the split_kv_stream knob or its automatic rule takes it (``block_size`` then
    unused). Meant for short query runs (Lq <= 8) over long contexts, but correct for any
    shape. Differentiable."""
    return _attention(q, k, v, scale, mask, "split", {"block_size": block_size})


def attention_partial(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None, block_size: int | None = None,
    mma: bool | None = None,
) -> tuple[mx.array, mx.array]:
    """Split-KV pass 1 alone (a kernel backend; not differentiable). `mma`: the tile kernel
    (``attention_partial_mma``) or the lane walk (``attention_partial``); None: as the op
    decides by default (tiles for float16 / bfloat16 where they fit).

    Returns:
        o_part (B, Hq, Lq, n_blocks, DV) float32: each key block's softmax-normalised
        output; lse (B, Hq, Lq, n_blocks) float32: the block's natural-log
        log-sum-exp of the (masked) scores, -inf for a block without visible keys.
        n_blocks = ceil(Lk / block_size).
    """
    m = _check_inputs(q, k, v, scale, mask)
    block_size = _check_int(block_size or SPLIT_KV_BLOCK_SIZE, "block_size")
    if 0 in q.shape or 0 in k.shape or 0 in v.shape or max(q.shape[3], v.shape[3]) > MAX_KERNEL_HEAD_DIM:
        raise ValueError("attention_partial needs non-empty inputs with head dims <= 256")
    backend = current_backend()
    if backend == "reference":
        raise ValueError("attention_partial runs a kernel; the 'reference' backend has none")
    q = mx.contiguous(q)  # k and v are read in place (_IN_PLACE)
    if _use_mma(mma, q, k, v, backend):
        o_part, lse = _run(_partial_mma_launch(q, k, v, m, float(scale), block_size, backend), backend)
    else:
        o_part, lse = _run(_partial_launch(q, k, v, m, float(scale), block_size), backend)
    return o_part, lse


def attention_reduce(
    o_part: mx.array, lse: mx.array, *, block_size: int, num_keys: int, dtype: mx.Dtype = mx.float32
) -> mx.array:
    """Split-KV pass 2 alone: (..., n_blocks, DV) partial outputs and (..., n_blocks)
    LSEs -> (..., DV) in `dtype`. `block_size` and `num_keys` (Lk) are those of pass 1."""
    check_array(o_part, "o_part", min_ndim=2)
    check_array(lse, "lse", min_ndim=1)
    if tuple(lse.shape) != tuple(o_part.shape[:-1]):
        raise ValueError(f"lse must have shape o_part.shape[:-1] = {tuple(o_part.shape[:-1])}, got {tuple(lse.shape)}")
    backend = current_backend()
    if backend == "reference":
        raise ValueError("attention_reduce runs a kernel; the 'reference' backend has none")
    # row-contiguous as the kernel indexes them (it reads its inputs as they are: _IN_PLACE)
    o_part, lse = mx.contiguous(o_part.astype(mx.float32)), mx.contiguous(lse.astype(mx.float32))
    (o,) = _run(_reduce_launch(o_part, lse, block_size, num_keys, dtype), backend)
    return o.reshape(*o_part.shape[:-2], o_part.shape[-1])
