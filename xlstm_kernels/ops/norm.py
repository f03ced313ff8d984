"""Normalisation ops backed by ``metal_src/norm.metal``: RMSNorm, LayerNorm, multi-head LayerNorm.

    rms_norm(x, weight, eps)                               like mx.fast.rms_norm
    layer_norm(x, weight, bias, eps)                       like mx.fast.layer_norm
    multihead_layer_norm(x, weight, bias, num_heads, eps)  LayerNorm of each head slice

x is (..., D) float32, float16 or bfloat16; weight and bias are (D,) or None. Statistics
are reduced in float32; the output has the promoted dtype of x, weight and bias (as
mx.fast does: float16 with bfloat16 gives float32). Every op is differentiable: the
VJP runs the ``*_vjp`` kernels (dx directly; dweight/dbias as per-group partial sums of
shape (groups, D) from the same kernel, float32, or bfloat16 for 16-bit rows:
PARTIALS_BF16, PARTIALS_FP16),
added over groups in float32 by ``norm_partials_sum``.

Kernel choice (``_plan``). Threads move "runs" of up to 16 consecutive bytes (4 float32 /
8 float16/bfloat16 elements) with one vector access each, consecutive threads on
consecutive runs (``metal_src/norm.metal``). Without the ``n_reads`` knob the layout is
automatic: rows of at most 32 runs (n <= 128 float32 / 256 16-bit) run one simdgroup per
row (8 rows per threadgroup, no barriers); rows up to ``CACHED_MAX`` (4096 float32 / 8192
16-bit) take about ``CACHED_THREADS`` = 128 threads per row, each holding
ceil(runs / 128) runs (rounded up to a power of two) in registers (many 16-byte loads in
flight per thread, as MLX's CUDA norms); longer rows the looped kernels (``LOOPED_THREADS`` = 1024 threads,
``LOOPED_RUNS`` runs per step). The backward takes about ``VJP_THREADS`` = 256 threads
per row with at most ``VJP_MAX_READS`` = 16 elements each, else its looped kernels. On
CUDA the RMSNorm backward of rows whose x and g fit two stages of ``RMS_VJP_STAGE_BYTES``
(16-bit rows to 16384, float32 to 8192) is *staged*: persistent units of 128+ threads with
up to 32 elements each copy their rows into shared memory (``cp.async``) while they
reduce an earlier one, as MLX's own CUDA kernel does, through a ring of stages (mostly
four: rows three ahead; ``_vjp_plan``, ``_vjp_stages``, the constants below). The
LayerNorm backward stages the same way. On CUDA a row of one simdgroup (a head of 64, say)
takes runs of ``_short_row_reads(n)`` elements, narrower than 16 bytes where that puts all
32 lanes to work, and the backward's units of such rows are whole threadgroups that add
their dw / db sums before writing them (TGSUM). On CUDA 16-bit LayerNorm forward rows that
the automatic layout gives one run a thread (512-2048 elements) take four runs a thread
(``LN_FWD_RUNS_CUDA_16BIT``: a row of 1024 is one simdgroup), and the staged backward plans
more units a SM for short rows on GPUs faster than the H100 (``RMS_VJP_SHORT_PAIR_BYTES``:
scaled by the preset roofline's bandwidth), there with 16-bit rows of 1024 in 64-thread units
(``RMS_VJP_NARROW_*``: six a SM).
Multi-head LayerNorm is the LayerNorm kernels on (rows * num_heads, head_dim) rows with
the weight slice of head ``row % num_heads``.

The forward kernels' knobs (:mod:`xlstm_kernels.tiles.knobs`, ops ``rms_norm`` and
``layer_norm``; multi-head LayerNorm uses ``layer_norm``'s): ``n_reads`` (elements per
thread per step; when set, ceil(n / n_reads) threads per row rounded up to a multiple of
32, one simdgroup per row up to 32 * n_reads, looped beyond 1024 * n_reads; unset: the
automatic layout, whose elements per thread ``knob_values`` reports), ``simd_rows``
(default ``SIMD_ROWS`` = 8) and ``looped_threads`` (default ``LOOPED_THREADS``). Per
call: the ``knobs=`` argument, then ``XLSTM_RMS_NORM_*`` / ``XLSTM_LAYER_NORM_*``
variables, then the presets, then these defaults. The backward kernels keep the module
defaults: the tuner times the forward only, so a tuned forward value says nothing about
the backward's register use.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..cuda import limits as cuda_limits
from ..runtime import KernelSpec, const_array, current_backend, launch, prepare_launch
from ..tiles.knobs import resolve_knobs
from ._callcache import CallCache, replayable
from ._validate import check_array, check_int32

__all__ = [
    "knob_values",
    "layer_norm",
    "layer_norm_reference",
    "multihead_layer_norm",
    "multihead_layer_norm_reference",
    "rms_norm",
    "rms_norm_reference",
]

RMS_NORM = KernelSpec("norm", "rms_norm", ("x", "w", "eps", "params"), ("y",))
RMS_NORM_LOOPED = KernelSpec("norm", "rms_norm_looped", ("x", "w", "eps", "params"), ("y",))
LAYER_NORM = KernelSpec("norm", "layer_norm", ("x", "w", "b", "eps", "params"), ("y",))
LAYER_NORM_LOOPED = KernelSpec("norm", "layer_norm_looped", ("x", "w", "b", "eps", "params"), ("y",))
RMS_NORM_VJP = KernelSpec("norm", "rms_norm_vjp", ("x", "w", "g", "eps", "params"), ("dx", "dwp"))
RMS_NORM_VJP_LOOPED = KernelSpec("norm", "rms_norm_vjp_looped", ("x", "w", "g", "eps", "params"), ("dx", "dwp"))
LAYER_NORM_VJP = KernelSpec("norm", "layer_norm_vjp", ("x", "w", "g", "eps", "params"), ("dx", "dwp", "dbp"))
PARTIALS_SUM = KernelSpec("norm", "norm_partials_sum", ("dwp", "dbp", "params"), ("dw", "db"))
PARTIALS_SUM_COLS = KernelSpec("norm", "norm_partials_sum_cols", ("dwp", "dbp", "params"), ("dw", "db"))
LAYER_NORM_VJP_LOOPED = KernelSpec(
    "norm", "layer_norm_vjp_looped", ("x", "w", "g", "eps", "params"), ("dx", "dwp", "dbp")
)

_SPECS = {
    ("rms", False, False): RMS_NORM,
    ("rms", True, False): RMS_NORM_LOOPED,
    ("ln", False, False): LAYER_NORM,
    ("ln", True, False): LAYER_NORM_LOOPED,
    ("rms", False, True): RMS_NORM_VJP,
    ("rms", True, True): RMS_NORM_VJP_LOOPED,
    ("ln", False, True): LAYER_NORM_VJP,
    ("ln", True, True): LAYER_NORM_VJP_LOOPED,
}

# Automatic layout (the n_reads knob unset). A thread moves runs of RUN_BYTES (float32: 4
# elements, 16-bit: 8; metal_src/norm.metal); rows of at most 32 runs take one simdgroup,
# longer rows about CACHED_THREADS threads with ceil(runs / CACHED_THREADS) runs each (a power
# of two) in registers (as MLX's CUDA norms: many 16-byte loads in flight per thread), up to
# CACHED_MAX;
# longer rows the looped kernels (LOOPED_THREADS threads, LOOPED_RUNS runs per step).
RUN_BYTES = 16
N_READS = 4  # float32 elements per 16-byte run (the automatic n_reads of float32 rows up to 512)
CACHED_THREADS = 128
CACHED_MAX = 4096  # longest float32 row kept in registers (16-bit: twice as long)
LOOPED_THREADS = 1024
LOOPED_RUNS = 1
SIMD_ROWS = 8  # rows (simdgroups) per threadgroup in the simdgroup-per-row layout
# RMSNorm forward and backward: rows of exactly tpr * n_reads elements run the kernel's FULL path (no
# bounds code: wide accesses when x, y and w are 16-byte aligned, checked in the kernel,
# else element accesses). False: always the general path (for comparisons; clear the
# call memo, _CALLS.clear(), after changing it).
FULL_ROWS = True
# The forward's FULL path for these dtypes (the backward takes it for every dtype). Session 4
# kept float32 rows on the general path (H100: 2348 vs 2629 GB/s); since session 7 (full-warp
# reductions, the hardware rsqrt on CUDA, the uniform row index) FULL is the faster one for
# float32 too (scripts/probe_rms.py "full" vs "default": 0.98-0.99x vs 0.92-0.96x MLX).
FULL_FORWARD_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# LayerNorm's forward takes the FULL path as well (session 17; False: its general path),
# multi-head LayerNorm's too (session 19; False: heads take the general path).
LN_FULL_ROWS = True
LN_FULL_HEADS = True
# LayerNorm's FULL forward and staged backward rows take their statistics from one reduction
# of the threads' moments (kernel template MOM: each thread's mean, squared deviations and,
# backward, its gw sums, merged pairwise over the row; one barrier a row where the two-pass
# form takes two). False: mean, then the deviations from it (two reductions).
LN_MOMENTS = True
# LayerNorm's FULL forward rows of one simdgroup: rows a simdgroup (kernel template RW), every
# row's x loads issued before the first row's reduction (RW times the bytes in flight a
# simdgroup); 1: a row a simdgroup. On the CUDA plan, on GPUs whose preset bandwidth passes
# RMS_VJP_UNITS_REF_GBPS (the H200 / GH200 presets; the H100 keeps its plans: not measured
# there), rows (and heads) of at most LN_FWD_SHORT_ROW_BYTES take LN_FWD_SHORT_ROWS_A_SIMD.
# H200, session 49, marginal chains (probe_norm_marginal.py, outputs kept; share of the copy,
# one row -> two a simdgroup): bf16 LayerNorm 65536x256 66-68 -> 76-80%, fp16 71-74 -> 77%,
# multi-head bf16 16384x4x256 68-69 -> 77-79%, bf16 131072x128 50-51 -> 54%, float32 65536x128
# 89-90 -> 94-98%; rows of 1 KiB lost (bf16 32768x512 and multi-head 4096x8x512 75-77 -> 58%,
# 16384x1024 84-85 -> 55%) but with the row loop rolled, their words in local memory (offline
# ptxas: a 64-byte stack frame at 1 KiB, none at 512 bytes). Session 50, the loop unrolled
# (XK_ROWS_UNROLL), two rows against one: bf16 32768x512 (rows of 1 KiB) 76 -> 81-83%,
# fp16 78-86 -> 85-88%, multi-head bf16 4096x8x512 76-78 -> 76-83%, fp16 82-83 -> 83-85%; rows of
# 2 KiB lose (bf16 16384x1024 84-85 -> 78-79%): the rule takes rows of at most 1 KiB. An
# occupancy hint on top (XK_MIN_BLOCKS 6 / 8: 40 / 32 registers, the latter spilling) no faster
# (8: 57-74%). Three or four rows no better than two. 0 bytes: off.
LN_FWD_ROWS_A_SIMD = 1
LN_FWD_SHORT_ROWS_A_SIMD = 2
LN_FWD_SHORT_ROW_BYTES = 1024
# ... and with RW > 1 on rows of one head (the RW rows share w and b) of at most
# LN_FWD_EARLY_WB_ROW_BYTES: w and b loaded once, right after the x loads (template EWB), where
# the kernel otherwise loads them for each row after its statistics (an L2 round trip after the
# reduction's; ptxas does not hoist them). H200, session 50, marginal chains, loads after -> once
# early, two runs on two machines: bf16 65536x256 73-74 -> 77-79% of copy and 72-74 -> 78%,
# float32 65536x128 92-93 -> 99%+ and 91-93 -> 100%+. Rows of 1 KiB: bf16 32768x512 80-82 ->
# 83-84% and 82 -> 79%, fp16 87 -> 91-95% and 84 -> 86%+, with 75 registers instead of 42 (sm_90a
# ptxas; 512-byte rows 46 / 40 instead of 32): not taken. Not for heads (each row's own slice,
# loaded early for each row: 78 -> 74-79%) nor rows of one row a simdgroup (early loads for each
# row: bf16 16384x1024 83-85 -> 67%, 4096x4096 83-85 -> 74-76%: 58-64 registers instead of 38-42).
# 0: off. (Changed at run time: clear _CALLS, the plan memo.)
LN_FWD_EARLY_WB_ROW_BYTES = 512
# LayerNorm's FULL forward rows of 16-bit T: the affine step, T(T(w * T(c)) + b), in T's own
# arithmetic (template AFT; CUDA: __hmul_rn / __hadd_rn, never contracted into a fused
# multiply-add) where the float route converts to T and back for each rounding. The same bits
# (every finite pair of half and of bfloat checked against one correct rounding, session 51).
# H200, session 51, marginal chains, float route -> T (two runs): bf16 LayerNorm 32768x512
# 80-85 -> 89-93% of copy, 65536x256 76-83 -> 90-99%, multi-head 4096x8x512 80-83 -> 88-90%,
# 4096x4096 80-89 -> 87-94%. False: the float route.
LN_FWD_AFFINE_IN_T = True
# Backward (automatic layout): about VJP_THREADS threads per row, at most VJP_MAX_READS
# elements per thread (the unit keeps x, g, w and the dw/db sums of its columns in
# registers), longer rows the looped backward kernels.
VJP_THREADS = 256
VJP_MAX_READS = 16
# Registers per thread asked of the CUDA compiler (the XK_MIN_BLOCKS occupancy hint,
# xlstm_kernels/cuda/kernel.py: resident blocks per SM = 65536 // (registers * threads)) for
# the cached forward's FULL rows: FORWARD_BASE_REGISTERS plus one per 4 bytes of the row a
# thread holds (the kernel keeps it as 32-bit words), rounded up to 8 (the allocation unit);
# 0: no hint. The forward is latency-bound: its time is about (rows / rows resident per SM) x
# one row's round trip (Nsight Compute, H100, session 7: 4096x4096 bf16 at 10 vs 12 blocks
# per SM, 3.1 vs 2.6 waves, 28.3 vs 20.7 us), so registers per row decide. sm_90a ptxas
# (scripts/cuda_sass.py): 64 bytes a thread 37 registers unhinted (128 threads: 12 rows per SM),
# 128 bytes 56 without spills (64 threads: 18 rows), float32 128 bytes 56.
FORWARD_BASE_REGISTERS = 24
# ... only where a thread holds at most this many bytes of its row
HINT_MAX_ROW_BYTES = 256


def _forward_registers(row_bytes: int) -> int:
    """Registers per thread asked for a FULL forward thread holding `row_bytes` of its row."""
    if FORWARD_BASE_REGISTERS <= 0 or row_bytes > HINT_MAX_ROW_BYTES:
        return 0
    return -(-(FORWARD_BASE_REGISTERS + row_bytes // 4) // 8) * 8


# The RMSNorm forward's FULL rows on CUDA, staged (the kernel's STAGED): persistent units of
# the cached layout, RMS_FWD_STAGED_UNITS_PER_SM per SM at most (fewer where their two
# stages of a row, 2 * n elements, or their threads do not fit an SM), each taking every
# units-th row and copying its next row into threadgroup memory (cp.async) while it reduces
# and writes this one. Only where the unstaged kernel's rows make more than
# RMS_FWD_STAGED_MIN_WAVES and at most RMS_FWD_STAGED_MAX_WAVES waves of resident threadgroups
# (its second, partial wave leaves SMs idle; the units share the rows evenly). Rows whose
# two stages pass RMS_FWD_STAGE_BYTES stay unstaged. H100, scripts/probe_rms.py (session 19,
# outputs kept, ratio to mx.fast.rms_norm unstaged -> staged; docs/CUDA.md): float32
# 1536x4096 (1.3 waves) 0.92-0.93 -> 1.04-1.13, 2048x4096 (1.7) 1.01-1.02 -> 1.22-1.24,
# 2048x2048 (1.3) 0.85 -> 0.92, bfloat16 2048x8192 (1.7) 1.02-1.03 -> 1.05-1.15, 2048x4096
# (1.3) 1.00-1.03 -> 1.01-1.02; staging lost within one wave (bfloat16 1024x8192, 0.9: 1.01 ->
# 0.91), at 1.9 (bfloat16 3072x4096: 1.08 -> 0.96) and past two (float32 4096x4096, 3.4:
# 0.98 -> 0.93-0.97; 16384x4096: 1.00 -> 0.95).
RMS_FWD_STAGED_CUDA = True
RMS_FWD_STAGE_BYTES = 65536
RMS_FWD_STAGED_UNITS_PER_SM = 8
RMS_FWD_STAGED_MIN_WAVES = 1.0
RMS_FWD_STAGED_MAX_WAVES = 1.75
RMS_FWD_RED_BYTES = 2 * 32 * 4  # rms_norm's reduction scratch (red_a, red_b)

VJP_REGISTERS = 0
# Backward: enough (group, head) units to fill the GPU (about this many threads in
# all); each unit sums dw/db over rows_per_group rows, so the partials (float32, or
# bfloat16 for 16-bit rows) stay near 2 MiB whatever the batch.
VJP_TARGET_THREADS = 131072
# The RMSNorm backward on CUDA, cached layout of VJP_THREADS threads per row: one wave of
# units (an H100's 132 SMs x 2 resident blocks of 256 threads at its ~124 registers), so
# that no partial last wave idles most SMs while it runs (H100, scripts/probe_rms.py "vjp_1wave", session 6: 16384x4096 0.99 -> 1.01x MLX
# float32, 4096x4096 0.95 -> 0.97x float32, 0.86 -> 0.93x bfloat16).
RMS_VJP_TARGET_THREADS_CUDA = 132 * 2 * 256
# ... and for 16-bit rows about this many threads per row (one 16-byte run each on a 4096 row):
# H100, scripts/probe_rms.py "vjp_512" vs "vjp" (session 7): bf16 0.91 -> 0.94x MLX
# (16384x4096), 0.87 -> 0.91x (4096x4096); fp16 0.92 -> 0.96x, 0.89 -> 0.92x. float32 rows
# keep VJP_THREADS (0.98 -> 0.90x with 512).
RMS_VJP_THREADS_CUDA_16BIT = 512
RMS_VJP_THREADS_CUDA_32BIT = VJP_THREADS
# ... whose units stage their next row of x and g in threadgroup memory (the kernel's STAGED:
# cp.async on CUDA, the stages in dynamic shared memory) where both stages of both fit in
# RMS_VJP_STAGE_BYTES, laid out as MLX's CUDA backward is: at least
# RMS_VJP_STAGED_THREADS_CUDA threads a row, each with at most RMS_VJP_STAGED_MAX_READS
# elements (a 4096 row: 128 x 32), as many units as fit RMS_VJP_SMS_CUDA SMs, at most
# RMS_VJP_STAGED_UNITS_PER_SM a SM (:func:`_staged_units_per_sm`: registers at the
# RMS_VJP_STAGED_REGISTERS hint, shared memory), each taking every groups-th row
# (RMS_VJP_STAGED_STRIDED). H200, scripts/probe_rms.py, session 13, ratio to MLX's VJP (device
# time) against the unstaged 512 x 8 / 256 x 16 layouts: bf16 16384x4096 0.80 -> 0.92-0.97,
# 16384x2048 0.77 -> 1.04, 16384x1024 0.68-0.81 -> 0.85-0.94, 2048x8192 0.89-0.90 -> 1.02
# (64 KiB of stages), 1024x16384 1.46 (128 KiB); float32 2048x8192 0.73-0.79 -> 1.39-1.45
# (128 KiB), 4096x8192 0.73 -> 1.51, 4096-row float32 within +-4%. Two or four units per SM,
# no hint and 256 threads were no better; strided rows against consecutive ones: within the
# noise in the probe, 49 -> 43 us in Nsight Compute (bf16 4096x4096; MLX's: 27 us).
RMS_VJP_STAGED_CUDA = True
RMS_VJP_STAGE_BYTES = 131072
RMS_VJP_STAGED_THREADS_CUDA = 128
RMS_VJP_STAGED_MAX_READS = 32
RMS_VJP_SMS_CUDA = 132  # an H100's or H200's SMs
RMS_VJP_STAGED_UNITS_PER_SM = 3
# ... or as many as hold RMS_VJP_STAGED_THREADS_PER_SM threads, where units are narrower than
# 128 threads (short rows: 16-bit rows of 512 elements run 64-thread units, of which three a
# SM left the backward latency-bound). H100, scripts/probe_vjp_units.py chained through dx
# (session 23): multi-head LayerNorm bf16 4096x8x512 78.3 -> 55.0 us at six 64-thread units
# a SM (53.1 at eight); the 128-thread rows keep three (six read -8% to +16% there).
RMS_VJP_STAGED_THREADS_PER_SM = 384
RMS_VJP_STAGED_REGISTERS = 160
# ... and units whose rows' x and g take at most RMS_VJP_SHORT_PAIR_BYTES together (16-bit rows
# up to 2048 elements, float32 up to 1024) as many more as the GPU's memory bandwidth (its
# preset roofline figure) passes RMS_VJP_UNITS_REF_GBPS, the H100's, on which the three were
# measured: rows that short keep a unit's stages small, and a faster memory needs more bytes in
# flight for the same latency (Little's law). An H200 (4800 GB/s) plans floor(3 x 4800 / 3350)
# = 4, the hint's registers lowered to fit them (128 a thread at 128 threads; the kernels use
# 69-80). H200, scripts/probe_norm_marginal.py (session 42, marginal chains, us a call, 3 -> 4
# units): RMSNorm bf16 16384x1024 35.8 -> 31.5, LayerNorm bf16 8192x2048 32.1 -> 28.8, float32
# 16384x1024 RMSNorm 52.5 -> 51.5, LayerNorm 53.9 -> 52.9; rows of 4096 lost 0-3% with more
# units (kept at three). The H100 and slower GPUs plan three as before. 0: off.
RMS_VJP_SHORT_PAIR_BYTES = 8192
RMS_VJP_UNITS_REF_GBPS = 3350.0
# ... and on GPUs whose preset bandwidth passes RMS_VJP_UNITS_REF_GBPS (whatever
# RMS_VJP_SHORT_PAIR_BYTES says; the presets: H200 / GH200), 16-bit rows of at most
# RMS_VJP_NARROW_MAX_N elements that RMS_VJP_NARROW_THREADS threads tile exactly (in effect rows
# of 1024: shorter ones had such units already, 513-1023 keep their wider ones) stage in units of
# that many threads (16 elements a thread; six units a SM by RMS_VJP_STAGED_THREADS_PER_SM)
# rather than RMS_VJP_STAGED_THREADS_CUDA: twice the units for the same threads, each row's sums
# over two simdgroups instead of four. H200, session 47 (Nsight Compute, warm caches, bf16
# 16384x1024): RMSNorm backward kernel 32.3 -> 29.2 us, LayerNorm 35.7 -> 28.8 (MLX's a + b on
# the same shape: 25.1); marginal chains (probe_norm_marginal.py) 74-77 -> 81-87% and 68-71 ->
# 82-84% of the copy; 16-bit rows of 2048 and float32 rows were no faster with 64-thread units
# (float32 LayerNorm 16384x1024 99 -> 91%), so they keep 128. Not measured on the H100, which
# keeps its plans (its bandwidth is the reference). 0: off.
RMS_VJP_NARROW_MAX_N = 1024
RMS_VJP_NARROW_THREADS = 64
# Staged units of one simdgroup: where a staged row's layout is 32 threads, the unit is one
# simdgroup a threadgroup, its row sums by shuffles alone (the kernels' ONE_SIMD: no threadgroup
# barrier a row); 12 units a SM by RMS_VJP_STAGED_THREADS_PER_SM. On GPUs whose preset
# bandwidth passes RMS_VJP_UNITS_REF_GBPS (as the narrow units above), 16-bit rows of at most
# RMS_VJP_ONE_SIMD_MAX_N elements try 32 threads first: in effect rows of 256 and 512 (shorter
# ones are not staged; rows of 1024 were no faster, their kernel 29.2 -> 29.3 us and their
# partials' sum 5.0 -> 8.0 with twice the units). H200, session 48, marginal chains
# (probe_norm_marginal.py, share of the copy, 64-thread or unstaged units -> one simdgroup):
# bf16 RMSNorm 65536x256 62 -> 92%, LayerNorm 65536x256 42 -> 88%, RMSNorm 32768x512 72 -> 88%
# (fp16 72 -> 84%), LayerNorm 32768x512 69 -> 82%, multi-head LayerNorm 4096x8x512 66 -> 79%
# (fp16 67 -> 77%); Nsight Compute, that last kernel 35.6 -> 29.2 us. float32 rows of 512 and
# 16-bit rows of 768 (96-thread layouts) do not change. Not measured on the H100. False: such
# layouts are not staged; 0: no rows try 32 threads first (RMS_VJP_NARROW_THREADS = 32 still
# gives them to every 16-bit row of 256-1024, under the cap below: rows of 1024 four a SM).
RMS_VJP_STAGED_ONE_SIMD = True
RMS_VJP_ONE_SIMD_MAX_N = 512
# ... and no more one-simdgroup units a SM (any 32-thread staged unit) than hold
# RMS_VJP_ONE_SIMD_PAIR_BYTES_PER_SM bytes of their rows' x and g (a row each): rows of 512
# eight a SM, rows of 256 twelve (the threads' cap). H200, session 48, marginal chains, share of the copy at 12 -> 8 units a SM: multi-head
# LayerNorm 4096x8x512 79-80 -> 84-85%, RMSNorm 32768x512 85 -> 87-89%, LayerNorm 32768x512
# 84-85 -> 89-90%; rows of 256 lost at 8 (RMSNorm 65536x256 86-90 -> 78-80%, LayerNorm 83-84
# -> 76%) and read the same at 16 as at 12. 0: no cap.
RMS_VJP_ONE_SIMD_PAIR_BYTES_PER_SM = 16384
RMS_VJP_STAGED_STRIDED = True  # a unit takes every groups-th row (as MLX's), not consecutive ones
# Stage through L1 (cp.async.ca, as MLX's kernel) instead of bypassing it (.cg): H200, Nsight
# Compute bf16 4096x4096 44.8 against 41.3 us, the probe within its noise (session 13).
RMS_VJP_STAGE_L1 = False
# Stages of the staged backward (the kernels' NS >= 2, :func:`_vjp_stages`): a unit copies its
# rows NS - 1 ahead. RMS_VJP_STAGES, as many as RMS_VJP_STAGE_BYTES holds, except rows whose x
# and g take RMS_VJP_TWO_STAGES bytes (both ends included), which keep two. H100,
# scripts/probe_vjp_chain.py (session 24: chained through dx, outputs kept, two runs), us a
# call at 2 -> 4 stages: multi-head LayerNorm float32 4096x8x512 97.9 -> 87.1 and 103.9 -> 91.3,
# bfloat16 4096x8x512 62.1 -> 59.9, RMSNorm bfloat16 16384x1024
# 54.3 -> 48.9; float32 4096-element rows (four stages: one unit a SM) RMSNorm 4096x4096
# 86.0 -> 83.4 and 89.2 -> 87.7, LayerNorm 91.7 -> 92.7 and 92.5 -> 90.7. Rows of 8-16 KiB of
# x and g lost: float32 16384x1024 RMSNorm 80.9 -> 83.6 and 86.4 -> 89.3, LayerNorm 82.5 -> 88.8.
RMS_VJP_STAGES = 4
RMS_VJP_TWO_STAGES = (8192, 16384)
RMS_VJP_RED_BYTES = 2 * 64 * 4 + 16  # rms_norm_vjp's reduction scratch (red; red_p's 16-byte stand-in)
# layer_norm_vjp's (red_a, red_b, red_c, red2, red_m: two sets of four moments' parts, and the
# 16 bytes of red_p, TGSUM's scratch, that a staged launch has as a stand-in)
LN_VJP_RED_BYTES = 32 * 4 + 32 * 4 + 32 * 8 + 2 * 64 * 4 + 2 * 4 * 32 * 4 + 16
# The LayerNorm backward on CUDA: rows that VJP_THREADS threads would loop over (more than
# VJP_MAX_READS elements a thread) take twice the threads, up to this many, to stay cached
# (H100, scripts/probe_norm_layout.py, session 11, 2048x8192 pipelined: bfloat16 0.54 ->
# 1.06x MLX at 512 threads, float32 1.08 -> 1.09x).
LN_VJP_MAX_THREADS_CUDA = 1024
# ... and its units stage their next row as the RMSNorm backward's do (RMS_VJP_STAGED_*
# layout and limits; session 17). False: the cached layout above.
LN_VJP_STAGED_CUDA = True
# ... with threads of LN_VJP_WIDE_READS or more elements planned at LN_VJP_STAGED_REGISTERS
# registers (RMS_VJP_STAGED_REGISTERS otherwise): such a thread holds its weight runs, dw and
# db sums (3 x 32 floats) across the unit's rows, more than the ~170 registers that three
# 128-thread units a SM leave; at 255, two units a SM. Where the stages' shared memory allows
# only one unit a SM (float32 rows of 4096, any row of 8192+), nothing changes. H100,
# scripts/probe_vjp_chain.py at marginal chains (PROBE_VC_MARGINAL=1, session 26), bfloat16
# 4096x4096: 45.9 -> 40.5 us (three units -> two, 73 -> 83% of copy).
LN_VJP_STAGED_REGISTERS = 255
LN_VJP_WIDE_READS = 32
# The backward's rows of one simdgroup on CUDA (heads of up to 32 16-byte runs; by kind) take
# runs of _short_row_reads(n) elements, narrower than 16 bytes where that fills more of the 32 lanes
# (heads of 64: 2 elements a lane, all 32 lanes, where 16-byte runs fill 16 lanes in float32
# and 8 in 16-bit). H100 kernel durations (scripts/ncu_times.sh, session 30,
# ncu-times-cuda-session30.txt), multi-head LayerNorm 8192x4x64 backward: float32 13.3 ->
# 10.7 us, bfloat16 24.0 -> 11.0 (a copy of the 24 / 12 MiB: 9.9, 7.8); RMSNorm 65536x128
# bfloat16 48.7 -> 24.4 (copy 20.6, MLX's kernel 24.8), float32 unchanged (4-element runs).
VJP_SHORT_LANES_CUDA = {"rms": True, "ln": True}
# ... and those rows' units are whole threadgroups of VJP_TG_SIMDGROUPS simdgroups (template
# TGSUM) whose dw / db sums are added in the threadgroup: that many times fewer partials for
# norm_partials_sum (8192x4x64: 1024 groups of 256 columns -> 128, 11.8 -> 3.9 us; RMSNorm
# 65536x128: 4096 groups of 128 -> 512, 33.3-33.6 -> 6.7-6.8 us).
VJP_TG_PARTIALS_CUDA = {"rms": True, "ln": True}
VJP_TG_SIMDGROUPS = 8  # (the kernels' scratch: 2 x 8 x 32 x 8 floats at most, 16 KiB)
# The forward's rows of one simdgroup on CUDA in runs of _short_row_reads(n) elements, as the
# backward's (where the n_reads knob is automatic). H100 kernel durations (session 30):
# multi-head LayerNorm 8192x4x64 float32 10.6 -> 7.4 us, bfloat16 17.0 -> 8.2 (a copy of the
# bytes: 7.5, 6.9); RMSNorm 65536x128 bfloat16 21.4 -> 12.6 (copy 14.1, MLX's 43.2), float32
# unchanged (its 16-byte runs already fill the lanes).
FWD_SHORT_LANES_CUDA = {"rms": True, "ln": True}
# LayerNorm's forward on CUDA, 16-bit rows the automatic layout gives one 16-byte run a thread
# (up to CACHED_THREADS runs: 512 and 1024 elements): LN_FWD_RUNS_CUDA_16BIT runs a thread
# instead (a power of two, fewer where the row would get fewer than 32 threads; only where the
# row is a whole number of such threads, so FULL rows stay FULL): more bytes in flight a thread,
# and the per-row reductions and index work shared by fewer threads (a row of 1024 becomes one
# simdgroup: no barrier, no threadgroup memory). H200, scripts/probe_norm_marginal.py
# (session 42, marginal chains, us a call): bfloat16 16384x1024 25.0 -> 19.1 (n_reads 8 -> 32;
# 67 -> 88% of the copy, MLX's 30.9), multi-head 4096x8x512 25.2 -> 21.8 (8 -> 16; 32 elements
# a lane of one simdgroup: 32 would idle half of them, 57.8). float32 rows keep the automatic
# layout (16384x1024 at 16 elements a thread: 35.6 against 35.4). 0: off.
LN_FWD_RUNS_CUDA_16BIT = 4


def _short_row_reads(n: int) -> int:
    """Elements a lane for a row of n elements held by one simdgroup: the least power of two
    that 32 lanes cover n with (at least 1)."""
    return _pow2_at_least(max(1, -(-n // 32)))


# ---------------------------------------------------------------------------------------
# References (plain mx ops, float32 statistics): the ``reference`` backend
# ---------------------------------------------------------------------------------------


def _affine(normed: mx.array, weight: mx.array | None, bias: mx.array | None) -> mx.array:
    """``bias + weight * normed`` in normed's dtype, each step rounded like the kernels."""
    y = normed
    if weight is not None:
        y = weight.astype(normed.dtype) * y
    if bias is not None:
        y = y + bias.astype(normed.dtype)
    return y


def rms_norm_reference(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """RMSNorm with plain mx ops (float32 statistics); the ``reference`` backend."""
    xf = x.astype(mx.float32)
    normed = (xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return _affine(normed, weight, None)


def _ln_normed(xf: mx.array, eps: float) -> mx.array:
    mean = mx.mean(xf, axis=-1, keepdims=True)
    xc = xf - mean
    return xc * mx.rsqrt(mx.mean(xc * xc, axis=-1, keepdims=True) + eps)


def layer_norm_reference(x: mx.array, weight: mx.array | None, bias: mx.array | None, eps: float) -> mx.array:
    """LayerNorm with plain mx ops (float32 two-pass statistics); the ``reference`` backend."""
    normed = _ln_normed(x.astype(mx.float32), eps).astype(x.dtype)
    return _affine(normed, weight, bias)


def multihead_layer_norm_reference(
    x: mx.array, weight: mx.array | None, bias: mx.array | None, num_heads: int, eps: float
) -> mx.array:
    """Multi-head LayerNorm with plain mx ops; each head slice of the last axis is normalised."""
    d = x.shape[-1]
    xh = x.astype(mx.float32).reshape(*x.shape[:-1], num_heads, d // num_heads)
    normed = _ln_normed(xh, eps).reshape(x.shape).astype(x.dtype)
    return _affine(normed, weight, bias)


# ---------------------------------------------------------------------------------------
# Launch plans
# ---------------------------------------------------------------------------------------


# Small constant inputs (runtime.const_array: in device memory on cuda, made once per value
# there), made when a call signature is planned.
def _ints(*values: int) -> mx.array:
    return const_array(list(values), mx.int32)


@functools.lru_cache(maxsize=64)
def _float_bits(value: float) -> int:
    """The bits of float32(value) as an int (eps as a compile-time constant of the FULL
    forward: no load of the eps buffer, which every block of the grid reads at once)."""
    return int(np.array(value, dtype=np.float32).view(np.int32))


def _eps(eps: float) -> mx.array:
    return const_array(eps, mx.float32)


@functools.lru_cache(maxsize=8)
def _dummy(dtype: mx.Dtype) -> mx.array:
    """Stand-in buffer for an absent weight or bias (never read)."""
    return mx.array([0], dtype=dtype)


@dataclass(frozen=True)
class _Layout:
    looped: bool
    one_simd: bool
    tpr: int  # threads per row (threadgroup x)
    rows_per_tg: int  # threadgroup y (simdgroup-per-row layout), else 1
    n_reads: int = N_READS  # the kernel's N_READS: elements per thread (per step when looped)


def _itemsize(dtype: Any) -> int:
    if isinstance(dtype, str):
        dtype = getattr(mx, dtype)
    return dtype.size


def _pow2_at_least(k: int) -> int:
    return 1 << max(0, (k - 1).bit_length())


def _layout(n: int, units: int, n_reads: int | None = None, simd_rows: int | None = None,
            looped_threads: int | None = None, itemsize: int = 4, vjp: bool = False,
            vjp_threads: int | None = None, max_reads: int | None = None) -> _Layout:
    """The thread layout for rows of n elements of `itemsize` bytes and `units` rows.

    With the n_reads knob: ceil(n / n_reads) threads per row rounded up to a multiple of
    32, one simdgroup per row when that is 32, looped beyond 1024 * n_reads. Without it
    (None) the automatic layout of the module comment (`vjp`: the backward's). Knobs left
    at None use the module constants (read at call time); `vjp_threads`: the backward's
    threads per row in place of VJP_THREADS, `max_reads` its elements a thread in place of
    VJP_MAX_READS and of the CACHED_MAX bound (the staged backward's)."""
    looped = LOOPED_THREADS if looped_threads is None else looped_threads
    if n_reads is None:
        run = RUN_BYTES // itemsize
        runs = -(-n // run)
        threads = (VJP_THREADS if vjp_threads is None else vjp_threads) if vjp else CACHED_THREADS
        per = _pow2_at_least(-(-runs // threads))  # runs per thread
        most = VJP_MAX_READS if max_reads is None else max_reads
        too_long = n > CACHED_MAX * 4 // itemsize and max_reads is None  # (max_reads: its own bound)
        if too_long or (vjp and per * run > max(run, most)):
            return _Layout(True, False, looped, 1, run * (1 if vjp else LOOPED_RUNS))
        n_reads = run * per
    elif n > 1024 * n_reads:
        return _Layout(True, False, looped, 1, n_reads)
    tpr = max(32, -(-(-(-n // n_reads)) // 32) * 32)
    if tpr == 32:
        rows = max(1, min(SIMD_ROWS if simd_rows is None else simd_rows, units))
        return _Layout(False, True, 32, rows, n_reads)
    return _Layout(False, False, tpr, 1, n_reads)


_KNOB_OP = {"rms": "rms_norm", "ln": "layer_norm"}


def _forward_knobs(kind: str, n: int, dtype: mx.Dtype, knobs: dict | None) -> dict:
    """The resolved forward knobs (None = the module default) for rows of n elements."""
    if knobs is not None and not isinstance(knobs, dict):
        raise TypeError(f"{_KNOB_OP[kind]}: knobs must be a dict of knob -> value or None, got {type(knobs).__name__}")
    return resolve_knobs(_KNOB_OP[kind], dtype, n, args=knobs).values


def knob_values(op: str, n: int, dtype: Any, knobs: dict | None = None) -> dict[str, int]:
    """The forward knobs a call of `op` ("rms_norm" or "layer_norm") with rows of n
    elements uses, defaults filled in: {"n_reads", "simd_rows", "looped_threads"}
    (n_reads unset: the automatic layout's elements per thread)."""
    kind = {"rms_norm": "rms", "layer_norm": "ln", "multihead_layer_norm": "ln"}[op]
    v = _forward_knobs(kind, n, dtype, knobs)
    lay = _forward_layout(kind, n, 1, v, _itemsize(dtype))
    return {"n_reads": lay.n_reads,
            "simd_rows": SIMD_ROWS if v["simd_rows"] is None else v["simd_rows"],
            "looped_threads": LOOPED_THREADS if v["looped_threads"] is None else v["looped_threads"]}


def _forward_layout(kind: str, n: int, rows: int, kv: dict, itemsize: int) -> _Layout:
    """The forward's layout for `rows` rows of n elements at the knob values `kv`: _layout's,
    with a row of one simdgroup in runs that fill its lanes (_short_row_reads) where n_reads is
    automatic and FWD_SHORT_LANES_CUDA[kind] holds on cuda."""
    lay = _layout(n, rows, kv["n_reads"], kv["simd_rows"], kv["looped_threads"], itemsize)
    if kv["n_reads"] is not None or not _plans_for_cuda():
        return lay
    if lay.one_simd and FWD_SHORT_LANES_CUDA.get(kind, False) and _short_row_reads(n) < lay.n_reads:
        lay = _layout(n, rows, _short_row_reads(n), kv["simd_rows"], kv["looped_threads"], itemsize)
    elif kind == "ln" and itemsize == 2 and not lay.looped and not lay.one_simd:
        reads = _ln_fwd_reads_16bit(n)
        if reads > lay.n_reads:
            lay = _layout(n, rows, reads, kv["simd_rows"], kv["looped_threads"], itemsize)
    return lay


def _ln_fwd_reads_16bit(n: int) -> int:
    """Elements a thread of a 16-bit LayerNorm forward row of n elements on CUDA
    (LN_FWD_RUNS_CUDA_16BIT): the most runs up to that many, a power of two, that keep at
    least 32 threads a row and tile it exactly (n a multiple of 32 threads x the run); 0
    where none does or the rule is off."""
    run = RUN_BYTES // 2
    per = LN_FWD_RUNS_CUDA_16BIT
    while per >= 1 and (n % (32 * per * run) or per & (per - 1)):
        per -= 1
    return per * run if per >= 1 else 0


def _plan(
    kind: str,
    x: mx.array,
    weight: mx.array | None,
    bias: mx.array | None,
    eps: float,
    num_heads: int = 1,
    knobs: dict | None = None,
) -> tuple[KernelSpec, dict[str, Any]]:
    """(spec, launch keywords) of the forward kernel; x (..., num_heads * n), contiguous dtypes.
    `knobs`: the op's knobs= argument (see the module docstring)."""
    n = x.shape[-1] // num_heads
    rows = x.size // n
    dtype = x.dtype
    kv = _forward_knobs(kind, n, dtype, knobs)
    lay = _forward_layout(kind, n, rows, kv, dtype.size)
    dummy = _dummy(dtype)
    template: list[tuple[str, Any]] = [("T", dtype), ("HAS_W", weight is not None)]
    inputs = [x.reshape(rows, n), weight if weight is not None else dummy]
    if kind == "ln":
        template.append(("HAS_B", bias is not None))
        inputs.append(bias if bias is not None else dummy)
    template.append(("N_READS", lay.n_reads))
    if not lay.looped:
        template.append(("ONE_SIMD", lay.one_simd))
        # FULL rows: whole 32-bit words per run (16-bit rows: n_reads even); RMSNorm one head,
        # LayerNorm any (session 19: multi-head LayerNorm too)
        full = (FULL_ROWS and dtype in FULL_FORWARD_DTYPES and lay.tpr * lay.n_reads == n
                and (num_heads == 1 or (kind == "ln" and LN_FULL_HEADS))
                and lay.n_reads * dtype.size % 4 == 0 and (kind == "rms" or LN_FULL_ROWS))
        template += [("FULL", int(full)), ("NF", n if full else 0), ("EPSB", _float_bits(eps) if full else 0)]
        if kind == "ln":
            template.append(("MOM", bool(full and LN_MOMENTS)))
            rw = _ln_rows_a_simd(n * dtype.size) if full and lay.one_simd else 1
            ewb = rw > 1 and num_heads == 1 and n * dtype.size <= LN_FWD_EARLY_WB_ROW_BYTES
            aft = full and LN_FWD_AFFINE_IN_T and dtype.size == 2
            template += [("RW", rw), ("EWB", bool(ewb)), ("AFT", bool(aft))]
        if kind == "rms":
            stage_units, per_sm = _forward_stage_units(n, lay, dtype.size, rows) if full else (0, 0)
            template.append(("STAGED", stage_units > 0))
            if stage_units:
                template += _occupancy_hint_blocks(per_sm)
            elif full:
                template += _occupancy_hint(_forward_registers(lay.n_reads * dtype.size), lay.tpr * lay.rows_per_tg)
    inputs += [_eps(float(eps)), _ints(rows, n, num_heads)]
    r = lay.rows_per_tg
    simdgroups = -(-rows // dict(template).get("RW", 1))  # RW rows a simdgroup (ONE_SIMD rows)
    if lay.one_simd and simdgroups < r:  # fewer simdgroups than the threadgroup's rows
        r = simdgroups
    groups = r * -(-simdgroups // r)
    extra: dict[str, Any] = {}
    if kind == "rms" and not lay.looped and dict(template)["STAGED"]:
        groups = _forward_stage_units(n, lay, dtype.size, rows)[0]
        extra["shared_memory"] = 2 * n * dtype.size + RMS_FWD_RED_BYTES
    kwargs = dict(
        inputs=inputs,
        output_shapes=[(rows, n)],
        output_dtypes=[dtype],
        grid=(lay.tpr, groups, 1),
        threadgroup=(lay.tpr, r, 1),
        template=template,
        **extra,
    )
    return _SPECS[(kind, lay.looped, False)], kwargs


def _ln_rows_a_simd(row_bytes: int) -> int:
    """Rows a simdgroup (template RW) of LayerNorm's FULL forward rows of one simdgroup, each
    of `row_bytes`: LN_FWD_SHORT_ROWS_A_SIMD for rows of at most LN_FWD_SHORT_ROW_BYTES on the
    CUDA plan of a GPU faster than RMS_VJP_UNITS_REF_GBPS, else LN_FWD_ROWS_A_SIMD."""
    short = (LN_FWD_SHORT_ROW_BYTES and row_bytes <= LN_FWD_SHORT_ROW_BYTES and _plans_for_cuda()
             and _device_bandwidth_gbs() > RMS_VJP_UNITS_REF_GBPS)
    return max(1, int(LN_FWD_SHORT_ROWS_A_SIMD if short else LN_FWD_ROWS_A_SIMD))


def _forward_stage_units(n: int, lay: _Layout, itemsize: int, rows: int) -> tuple[int, int]:
    """(units, units per SM) of the staged RMSNorm forward for FULL rows of n elements
    ((0, 0): not staged): RMS_FWD_STAGED_CUDA on the CUDA plan, a threadgroup-per-row layout,
    both stages within RMS_FWD_STAGE_BYTES, rows for more than RMS_FWD_STAGED_MIN_WAVES and at
    most RMS_FWD_STAGED_MAX_WAVES waves of the unstaged kernel's resident threadgroups (at its
    occupancy hint); RMS_VJP_SMS_CUDA SMs x the units that fit one (shared memory, 2048
    threads, RMS_FWD_STAGED_UNITS_PER_SM), at most one per row."""
    stage = 2 * n * itemsize
    if not (RMS_FWD_STAGED_CUDA and _plans_for_cuda()) or lay.one_simd or stage > _stage_cap(RMS_FWD_STAGE_BYTES):
        return 0, 0
    regs = _forward_registers(lay.n_reads * itemsize)  # the unstaged kernel's hint (0: none)
    resident = min(32, 2048 // lay.tpr, 65536 // (regs * lay.tpr) if regs else 32)
    if not RMS_FWD_STAGED_MIN_WAVES < rows / (RMS_VJP_SMS_CUDA * max(1, resident)) <= RMS_FWD_STAGED_MAX_WAVES:
        return 0, 0
    per = max(1, min(RMS_FWD_STAGED_UNITS_PER_SM,
                     _smem_per_sm() // (stage + RMS_FWD_RED_BYTES + 1024), 2048 // lay.tpr))
    return max(1, min(rows, RMS_VJP_SMS_CUDA * per)), per


def _occupancy_hint_blocks(blocks: int) -> list[tuple[str, Any]]:
    """The XK_MIN_BLOCKS template entry asking CUDA for `blocks` resident blocks per SM
    (none for 0)."""
    return [("XK_MIN_BLOCKS", max(1, min(32, blocks)))] if blocks > 0 else []


def _occupancy_hint(registers: int, threads: int) -> list[tuple[str, Any]]:
    """The XK_MIN_BLOCKS template entry that holds a `threads`-thread kernel to about
    `registers` registers per thread on CUDA (none for 0; ignored by other backends)."""
    if registers <= 0:
        return []
    return [("XK_MIN_BLOCKS", max(1, min(32, 65536 // (registers * threads))))]


def _plans_for_cuda() -> bool:
    """Whether the backward plans take their CUDA-measured layouts (the active backend is
    cuda; tests patch this to run those layouts elsewhere)."""
    return current_backend() == "cuda"


def _smem_per_sm() -> int:
    """Shared memory of one SM of this CUDA GPU (228 KiB on sm_90, 1 KiB of it reserved per
    block; :mod:`xlstm_kernels.cuda.limits`)."""
    return cuda_limits.shared_bytes_per_sm()


def _stage_cap(budget: int) -> int:
    """`budget` (a staged kernel's bytes of stages), within the dynamic shared memory a block
    may have on this CUDA GPU, 2 KiB kept for the kernels' reduction scratch (227 KiB on
    sm_90: the budgets as measured; 99 KiB on sm_86 / sm_89)."""
    return min(budget, cuda_limits.shared_bytes_per_block() - 2048)


def _staged_units_per_sm(tpr: int, smem_bytes: int, registers: int | None = None, units: int | None = None,
                         pair_bytes: int = 0) -> int:
    """Units of the staged RMSNorm backward (`tpr` threads, `smem_bytes` of threadgroup
    memory each) to plan per SM: `units` (default RMS_VJP_STAGED_UNITS_PER_SM), or
    RMS_VJP_STAGED_THREADS_PER_SM threads' worth of narrower units, units of one simdgroup no
    more than RMS_VJP_ONE_SIMD_PAIR_BYTES_PER_SM holds of rows whose x and g take `pair_bytes`,
    fewer where their registers (at the `registers` hint, default RMS_VJP_STAGED_REGISTERS) or
    shared memory do not fit one SM; at least 1."""
    registers = RMS_VJP_STAGED_REGISTERS if registers is None else registers
    per = max(RMS_VJP_STAGED_UNITS_PER_SM if units is None else units, RMS_VJP_STAGED_THREADS_PER_SM // tpr)
    if tpr == 32 and pair_bytes and RMS_VJP_ONE_SIMD_PAIR_BYTES_PER_SM:
        per = min(per, max(1, RMS_VJP_ONE_SIMD_PAIR_BYTES_PER_SM // pair_bytes))
    if registers > 0:
        per = min(per, 65536 // (registers * tpr))
    return max(1, min(per, _smem_per_sm() // (smem_bytes + 1024)))


def _device_bandwidth_gbs() -> float:
    """The memory bandwidth (GB/s, the preset roofline's figure for this device) the staged
    backward's short-row units are scaled by: RMS_VJP_UNITS_REF_GBPS (the H100 the plans were
    measured on) unless the cuda backend is active (the emulator and plan tests model the
    H100, as :mod:`xlstm_kernels.cuda.limits` does)."""
    return _cuda_bandwidth_gbs() if current_backend() == "cuda" else RMS_VJP_UNITS_REF_GBPS


@functools.lru_cache(maxsize=1)
def _cuda_bandwidth_gbs() -> float:
    """This CUDA GPU's roofline bandwidth (GB/s, the presets' figure for its name), read once."""
    from ..tiles import roofline

    return float(roofline()["bandwidth_gbs"])


def _short_pair_units(pair_bytes: int, tpr: int, registers: int) -> tuple[int, int]:
    """(units a SM, register hint) of staged units whose rows' x and g take `pair_bytes`:
    RMS_VJP_STAGED_UNITS_PER_SM and `registers`, or for pairs of at most
    RMS_VJP_SHORT_PAIR_BYTES that many scaled by the device's bandwidth over
    RMS_VJP_UNITS_REF_GBPS (rounded down, never fewer), the hint lowered so that they fit."""
    base = RMS_VJP_STAGED_UNITS_PER_SM
    if not (RMS_VJP_SHORT_PAIR_BYTES and pair_bytes <= RMS_VJP_SHORT_PAIR_BYTES and RMS_VJP_UNITS_REF_GBPS > 0):
        return base, registers
    units = max(base, int(base * _device_bandwidth_gbs() / RMS_VJP_UNITS_REF_GBPS))
    if units > base and registers > 0:
        registers = min(registers, 65536 // (units * tpr))
    return units, registers


def _staged_min_threads(n: int, dtype: mx.Dtype) -> tuple[int, ...]:
    """The fewest threads a staged backward unit may have for rows of `n` elements of `dtype`,
    in the order to try them (the first whose layout tiles the row exactly is planned):
    on a GPU faster than RMS_VJP_UNITS_REF_GBPS, 16-bit rows try 32 (one simdgroup, where
    RMS_VJP_STAGED_ONE_SIMD, up to RMS_VJP_ONE_SIMD_MAX_N elements), then RMS_VJP_NARROW_THREADS
    (up to RMS_VJP_NARROW_MAX_N), then RMS_VJP_STAGED_THREADS_CUDA; other rows and GPUs only
    RMS_VJP_STAGED_THREADS_CUDA."""
    if not (dtype.size == 2 and _device_bandwidth_gbs() > RMS_VJP_UNITS_REF_GBPS):
        return (RMS_VJP_STAGED_THREADS_CUDA,)
    tries = [RMS_VJP_STAGED_THREADS_CUDA]
    if RMS_VJP_NARROW_MAX_N and n <= RMS_VJP_NARROW_MAX_N:
        tries.insert(0, RMS_VJP_NARROW_THREADS)
    if RMS_VJP_STAGED_ONE_SIMD and RMS_VJP_ONE_SIMD_MAX_N and n <= RMS_VJP_ONE_SIMD_MAX_N:
        tries.insert(0, 32)
    return tuple(dict.fromkeys(tries))


def _vjp_stages(pair_bytes: int) -> int:
    """Stages of the staged backward for rows whose x and g take `pair_bytes` together:
    two where RMS_VJP_TWO_STAGES holds them, else RMS_VJP_STAGES, fewer where those would
    pass RMS_VJP_STAGE_BYTES; at least 2."""
    lo, hi = RMS_VJP_TWO_STAGES
    if lo <= pair_bytes <= hi:
        return 2
    return max(2, min(RMS_VJP_STAGES, _stage_cap(RMS_VJP_STAGE_BYTES) // pair_bytes))


#: bfloat16 rows' backward partials (the units' dw / db sums) in bfloat16: each unit's float
#: sums are rounded once to bfloat16 on the way out, norm_partials_sum adds them in float.
#: Half the partials' bytes, and they are a backward's only traffic beyond x, g and dx. Where
#: a unit takes few rows they weigh: LayerNorm bf16 2048x8192 on an H100 (132 units of ~16
#: rows; 8.6 MB of float partials on 96 MiB) 42.9-43.3 us a kernel with float partials, 40.1-40.5
#: with half of them unwritten, 38.1-38.4 with none (a copy of the 96 MiB: 37.5; session 35,
#: Nsight Compute, warm caches). The rounding adds an error of the order of dw's own rounding
#: to bfloat16 (each partial's relative error <= 2^-8, random over units); MLX's own backward
#: rounds every row's g * xhat to the row's dtype before its sum. The looped kernels keep
#: float partials (they add into their cells row by row).
PARTIALS_BF16 = True
#: ... and float16 rows' partials in bfloat16 too (session 52): the same halved bytes, and
#: float's range, so no partial can overflow where dw does not. float16 partials were as fast
#: and one rounding finer (2^-11), but a unit's sum of g * xhat over its ~m / units rows
#: passes 65504 about rpg times sooner than MLX's per-row products do: dw would read inf or
#: nan where MLX's and the float partials give finite values (a review's CPU check). With
#: bfloat16 the cost is precision: each partial's relative error <= 2^-8, so dw's error is up
#: to ~3x MLX's (whose per-row products round to float16), within the 16-bit tolerance.
#: H200 marginal chains (probe-partials-fp16-cuda-h200-session52.txt), median us a call,
#: float -> bfloat16 (float16) partials: LayerNorm fp16 2048x8192 backward 35.8 / 34.9 ->
#: 32.4 (32.0 / 31.6), 4096x4096 33.0 / 32.0 -> 29.3 (30.2 / 28.1), RMSNorm 2048x8192 30.8 /
#: 32.0 -> 30.6 (30.6 / 30.7); 16384x1024 within its spread.
PARTIALS_FP16 = True


def _partials_dtype(dtype: mx.Dtype, looped: bool) -> mx.Dtype:
    """The dtype of the backward's partials dwp / dbp for rows of `dtype`: bfloat16 for the
    16-bit rows of the unlooped kernels (bfloat16 rows: PARTIALS_BF16; float16 rows:
    PARTIALS_FP16), else float32."""
    if looped:
        return mx.float32
    if (dtype == mx.bfloat16 and PARTIALS_BF16) or (dtype == mx.float16 and PARTIALS_FP16):
        return mx.bfloat16
    return mx.float32


def _vjp_plan(
    kind: str,
    x: mx.array,
    weight: mx.array | None,
    has_bias: bool,
    cotangent: mx.array,
    eps: float,
    num_heads: int = 1,
) -> tuple[KernelSpec, dict[str, Any], int]:
    """(spec, launch keywords, groups) of the backward kernel."""
    n = x.shape[-1] // num_heads
    m = x.size // (n * num_heads)  # outer rows
    dtype = x.dtype
    cuda = _plans_for_cuda()
    rms_cuda = kind == "rms" and cuda
    threads = VJP_THREADS
    if rms_cuda:
        threads = RMS_VJP_THREADS_CUDA_16BIT if dtype.size == 2 else RMS_VJP_THREADS_CUDA_32BIT
    lay = _layout(n, m * num_heads, itemsize=dtype.size, vjp=True, vjp_threads=threads)
    if kind == "ln" and cuda:
        while lay.looped and threads * 2 <= LN_VJP_MAX_THREADS_CUDA:
            threads *= 2
            lay = _layout(n, m * num_heads, itemsize=dtype.size, vjp=True, vjp_threads=threads)
    if cuda and VJP_SHORT_LANES_CUDA.get(kind, False) and lay.one_simd and _short_row_reads(n) < lay.n_reads:
        lay = _layout(n, m * num_heads, n_reads=_short_row_reads(n), itemsize=dtype.size, vjp=True)
    staged = False
    # the stages (2 x 2 x n elements) and the kernel's reduction scratch
    stage_bytes = 4 * n * dtype.size + (RMS_VJP_RED_BYTES if kind == "rms" else LN_VJP_RED_BYTES)
    stage_ok = (RMS_VJP_STAGED_CUDA if kind == "rms" else LN_VJP_STAGED_CUDA) and cuda
    stages = 2
    if stage_ok and FULL_ROWS and 4 * n * dtype.size <= _stage_cap(RMS_VJP_STAGE_BYTES):
        for least in _staged_min_threads(n, dtype):  # the first whose layout tiles the row exactly
            sthreads = max(least, _pow2_at_least(-(-n // RMS_VJP_STAGED_MAX_READS)))
            slay = _layout(n, m * num_heads, itemsize=dtype.size, vjp=True, vjp_threads=sthreads,
                           max_reads=RMS_VJP_STAGED_MAX_READS)
            # one simdgroup only where 32 threads were asked for (not rows too short for more)
            one_ok = not slay.one_simd or (RMS_VJP_STAGED_ONE_SIMD and least == 32 and slay.tpr == 32)
            if sthreads <= 1024 and not slay.looped and one_ok and slay.tpr * slay.n_reads == n:
                if slay.one_simd:  # one unit (one simdgroup) a threadgroup, as every staged unit
                    slay = _Layout(False, True, 32, 1, slay.n_reads)
                lay, threads, staged = slay, sthreads, True
                stages = _vjp_stages(2 * n * dtype.size)
                stage_bytes += 2 * (stages - 2) * n * dtype.size
                break
    full = kind == "rms" and not lay.looped and FULL_ROWS and lay.tpr * lay.n_reads == n
    regs = LN_VJP_STAGED_REGISTERS if kind == "ln" and lay.n_reads >= LN_VJP_WIDE_READS else RMS_VJP_STAGED_REGISTERS
    units_per_sm = None
    if staged:
        units_per_sm, regs = _short_pair_units(2 * n * dtype.size, lay.tpr, regs)
    if weight is None and not has_bias:
        rpg = 1  # no partials to keep small: one row per unit, most parallelism
    else:
        target = VJP_TARGET_THREADS
        if staged:
            target = RMS_VJP_SMS_CUDA * _staged_units_per_sm(lay.tpr, stage_bytes, regs, units_per_sm, 2 * n * dtype.size) * lay.tpr
        elif rms_cuda and not lay.looped and lay.tpr == threads:
            target = RMS_VJP_TARGET_THREADS_CUDA
        target_units = max(1, target // lay.tpr)
        rpg = -(-m // max(1, target_units // num_heads))
    # TGSUM: a unit of `tgsum` simdgroups (one threadgroup), each taking every tgsum-th of the
    # unit's rows, its dw / db sums added in the threadgroup (tgsum times fewer partials)
    tgsum = 0
    if (cuda and VJP_TG_PARTIALS_CUDA.get(kind, False) and lay.one_simd and not staged
            and (weight is not None or has_bias)):
        tgsum = max(1, min(VJP_TG_SIMDGROUPS, -(-m // rpg)))
        rpg *= tgsum
    groups = -(-m // rpg)
    if staged and RMS_VJP_STAGED_STRIDED and rpg > 1:  # strided rows: exactly the target's units
        groups = min(m, max(1, target_units // num_heads))
        rpg = -(-m // groups)
    units = groups * num_heads
    if tgsum:
        lay = _Layout(False, True, 32, tgsum, lay.n_reads)
    elif lay.one_simd and not staged:
        lay = _Layout(False, True, 32, max(1, min(SIMD_ROWS, units)), lay.n_reads)
    pdt = _partials_dtype(dtype, lay.looped)
    template: list[tuple[str, Any]] = [("T", dtype)] + ([] if lay.looped else [("PT", pdt)])
    template.append(("HAS_W", weight is not None))
    partial = (groups, num_heads * n)
    out_shapes: list[tuple[int, ...]] = [(m * num_heads, n), partial if weight is not None else (1,)]
    if kind == "ln":
        template.append(("HAS_B", has_bias))
        out_shapes.append(partial if has_bias else (1,))
    template.append(("N_READS", lay.n_reads))
    if not lay.looped:
        template.append(("ONE_SIMD", lay.one_simd))
        if kind == "rms":
            template.append(("FULL", int(full)))
        template += [("STAGED", bool(staged)), ("NF", n if staged else 0),
                     ("STRIDED", bool(staged and RMS_VJP_STAGED_STRIDED))]
        if kind == "rms":
            template.append(("STAGE_L1", bool(staged and RMS_VJP_STAGE_L1)))
        template.append(("NS", stages))
        if kind == "ln":
            template.append(("MOM", bool(staged and LN_MOMENTS)))
        template.append(("TGSUM", tgsum))
        if staged and regs > 0:
            template.append(("XK_MIN_BLOCKS", _staged_units_per_sm(lay.tpr, stage_bytes, regs, units_per_sm, 2 * n * dtype.size)))
        elif full:
            template += _occupancy_hint(VJP_REGISTERS, lay.tpr * lay.rows_per_tg)
    r = lay.rows_per_tg
    kwargs = dict(
        inputs=[
            x.reshape(m * num_heads, n),
            weight if weight is not None else _dummy(dtype),
            cotangent.astype(dtype).reshape(m * num_heads, n),
            _eps(float(eps)),
            _ints(m, n, num_heads, rpg, units),
        ],
        output_shapes=out_shapes,
        output_dtypes=[dtype] + [pdt] * (len(out_shapes) - 1),
        grid=(lay.tpr, r * (units if tgsum else -(-units // r)), 1),
        threadgroup=(lay.tpr, r, 1),
        template=template,
    )
    if staged:
        kwargs["shared_memory"] = stage_bytes
    return _SPECS[(kind, lay.looped, True)], kwargs, groups


#: Simdgroups of a norm_partials_sum threadgroup (each adds every PARTIALS_SIMDGROUPS-th
#: group of partials of the threadgroup's 32 columns); PARTIALS_SIMDGROUPS_CUDA on cuda.
#: Session 31, H100, Nsight Compute with warm caches (ncu-times-cuda-session31.txt), median us,
#: 8 / 16 / 32: LayerNorm bf16 2048x8192 backward's 132 x 8192 partials (dw and db) 5.06 /
#: 4.77 / 4.96, RMSNorm bf16 4096x4096's 396 x 4096 6.85 / 5.31 / 4.86. Session 46, H200
#: (probe-partials-cuda-h200-session46.txt), bf16 partials, 16 -> 32: 528 x 1024 (the H200's
#: short-row backward: 4 units a SM) 5.14 -> 3.73, 528 x 2048 5.39 -> 3.90, 264 x 1024 3.28
#: -> 3.04, 132 x 1024 2.85 -> 2.72, 396 x 4096 3.95 -> 3.73, 132 x 8192 3.39 / 3.39.
PARTIALS_SIMDGROUPS = 8
PARTIALS_SIMDGROUPS_CUDA = 32
#: Rows of partials a norm_partials_sum thread loads before adding them (one round trip to
#: memory each U rows; the sums' order does not depend on it), at most its simdgroup's rows.
#: PARTIALS_ROWS_CUDA on cuda. Session 32, H100, Nsight Compute with warm caches
#: (ncu-times-cuda-session32.txt), median us, 4 -> 32 (one round trip for every row of a
#: simdgroup up to 32): LayerNorm bf16 2048x8192 backward's 132 x 8192 partials 4.82 / 4.86 ->
#: 4.48 / 4.53 (two rounds), RMSNorm bf16 4096x4096's 396 x 4096 5.49 / 5.44 -> 4.56 / 4.51
#: (8 rows: 5.12 / 5.06). Columns of 2 or 4 floats a lane were slower (fewer threads).
PARTIALS_ROWS = 4
PARTIALS_ROWS_CUDA = 32


def _partials_sum_plan(groups: int, cols: int, dtype: mx.Dtype, has_w: bool, has_b: bool) -> dict[str, Any]:
    """Launch keywords of norm_partials_sum: the backward's (groups, cols) partials of dw (and
    db; float32, or bfloat16 for 16-bit rows: PARTIALS_BF16 / PARTIALS_FP16) summed over groups in float32 into (cols,) arrays
    of `dtype`; inputs [dwp, dbp, params] (a (1,) float stand-in for an absent one)."""
    sg = max(1, min(PARTIALS_SIMDGROUPS_CUDA if _plans_for_cuda() else PARTIALS_SIMDGROUPS, groups))
    dummy = _dummy(mx.float32)
    return dict(
        inputs=[dummy, dummy, _ints(groups, cols)],
        output_shapes=[(cols,) if has_w else (1,), (cols,) if has_b else (1,)],
        output_dtypes=[dtype, dtype],
        grid=(32 * -(-cols // 32), sg, 1),
        threadgroup=(32, sg, 1),
        template=[("T", dtype), ("HAS_W", bool(has_w)), ("HAS_B", bool(has_b)),
                  ("U", _partials_rows(groups, sg))],
    )


def _partials_rows(groups: int, simdgroups: int) -> int:
    """U of norm_partials_sum: PARTIALS_ROWS (PARTIALS_ROWS_CUDA on cuda), at most the rows a
    simdgroup adds (ceil(groups / simdgroups))."""
    cuda = _plans_for_cuda()
    u = PARTIALS_ROWS_CUDA if cuda else PARTIALS_ROWS
    if isinstance(u, bool) or not isinstance(u, int) or not 1 <= u <= 32:
        raise ValueError(f"PARTIALS_ROWS{'_CUDA' if cuda else ''}={u!r}: expected an int from 1 to 32")
    return max(1, min(u, -(-groups // simdgroups)))


#: norm_partials_sum_cols (a threadgroup per column) for the partials of CUDA backwards with at
#: most PARTIALS_BY_COLUMN_MAX_COLS columns and at least PARTIALS_BY_COLUMN_MIN_GROUPS groups,
#: PARTIALS_BY_COLUMN_THREADS threads a column (fewer where the groups are fewer): the partials
#: of short rows, where norm_partials_sum makes only C / 32 threadgroups. Session 31, H100,
#: Nsight Compute with warm caches (ncu-times-cuda-session31.txt), median us, strips -> by
#: column: 512 x 128 partials (RMSNorm 65536x128 backward, bf16 / f32) 7.07 -> 3.84 / 6.91 ->
#: 3.90; 128 x 256 twice (multi-head LayerNorm 8192x4x64) 3.89 -> 3.57. 128 or 512 threads a
#: column (3.79 / 3.84 us) no better than 256.
#: A column's threadgroup reads one element a 32-byte sector, so it pays only where each column
#: has many groups: PARTIALS_BY_COLUMN_MIN_RATIO (groups >= ratio x cols). Session 46, H200
#: (probe-partials-cuda-h200-session46.txt), bf16 partials, strips of 32 simdgroups against by
#: column: 528 x 128 3.82 / 3.22, 528 x 256 3.68 / 3.62, 1056 x 512 7.25 / 6.13 (ratios >= 2);
#: 528 x 512 3.68 / 4.50, 264 x 256 3.06 / 3.49, 528 x 1024 3.73 / 5.78 (through the ops, the
#: bf16 16384x1024 backward's sum: RMSNorm 6.2 -> 4.2 us, LayerNorm's dw and db 9.1 -> 4.7).
PARTIALS_BY_COLUMN_CUDA = True
PARTIALS_BY_COLUMN_MAX_COLS = 1024
PARTIALS_BY_COLUMN_MIN_GROUPS = 64
PARTIALS_BY_COLUMN_MIN_RATIO = 2
PARTIALS_BY_COLUMN_THREADS = 256


def _partials_sum_cols_plan(groups: int, cols: int, dtype: mx.Dtype, has_w: bool, has_b: bool) -> dict[str, Any]:
    """Launch keywords of norm_partials_sum_cols (inputs and outputs as _partials_sum_plan's):
    a threadgroup of up to PARTIALS_BY_COLUMN_THREADS threads (a multiple of 32, at most the
    groups rounded up to 32) for each of the cols columns."""
    kw = _partials_sum_plan(groups, cols, dtype, has_w, has_b)
    kw["template"] = [t for t in kw["template"] if t[0] != "U"]
    threads = min(PARTIALS_BY_COLUMN_THREADS, 32 * -(-groups // 32))
    kw.update(grid=(threads, cols, 1), threadgroup=(threads, 1, 1))
    return kw


def _partials_sum_launch(groups: int, cols: int, dtype: mx.Dtype, has_w: bool,
                         has_b: bool) -> tuple[KernelSpec, dict[str, Any]]:
    """(spec, launch keywords) of the backward's partials sum: norm_partials_sum_cols on CUDA
    where PARTIALS_BY_COLUMN_CUDA and the partials' shape call for it (few columns, each with
    many groups), else norm_partials_sum."""
    if (PARTIALS_BY_COLUMN_CUDA and _plans_for_cuda() and cols <= PARTIALS_BY_COLUMN_MAX_COLS
            and groups >= PARTIALS_BY_COLUMN_MIN_GROUPS and groups >= PARTIALS_BY_COLUMN_MIN_RATIO * cols):
        return PARTIALS_SUM_COLS, _partials_sum_cols_plan(groups, cols, dtype, has_w, has_b)
    return PARTIALS_SUM, _partials_sum_plan(groups, cols, dtype, has_w, has_b)


# ---------------------------------------------------------------------------------------
# Validation and the differentiable wrapper
# ---------------------------------------------------------------------------------------


def _promote(*dtypes: mx.Dtype) -> mx.Dtype:
    """The result dtype of the float inputs, as MLX promotes them (f16 with bf16 -> f32)."""
    out = dtypes[0]
    for d in dtypes[1:]:
        if d != out:
            out = mx.float32
    return out


def _validate(op: str, x, weight, bias, eps, num_heads: int = 1) -> tuple[mx.array, mx.array | None, mx.array | None]:
    check_array(x, "x", min_ndim=1)
    d = x.shape[-1]
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"{op}: num_heads must be a positive int, got {num_heads!r}")
    if d % num_heads:
        raise ValueError(
            f"{op}: num_heads={num_heads} does not divide the last axis of x (shape {tuple(x.shape)}, D={d})"
        )
    for arr, name in ((weight, "weight"), (bias, "bias")):
        if arr is None:
            continue
        check_array(arr, name, ndim=1)
        if arr.shape[0] != d:
            raise ValueError(
                f"{op}: {name} must have shape ({d},) to match the last axis of x {tuple(x.shape)}, "
                f"got {tuple(arr.shape)}"
            )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite non-negative float, got {eps!r}")
    if d:  # the kernels see x as (rows, D / num_heads) with rows an int32 (and a grid dimension)
        check_int32(op, "rows (x.size // (D / num_heads))", x.size // (d // num_heads), f"x has shape {tuple(x.shape)}")
    dtype = _promote(x.dtype, *(a.dtype for a in (weight, bias) if a is not None))
    cast = lambda a: None if a is None else (a if a.dtype == dtype else a.astype(dtype))  # noqa: E731
    return cast(x), cast(weight), cast(bias)


def _differentiable_fn(kind: str, x, weight, bias, eps: float, num_heads: int, backend: str,
                       knobs: dict | None = None, replay: bool = False):
    """fn(x, weight, bias) -> y for calls with the signature of these (validated, cast)
    arrays: the forward launch planned once, the backward through the *_vjp kernels.

    The per-call host path is kept short (a memoised call costs the memo lookup, one
    ``mx.custom_function`` call over exactly the arrays given, one kernel call): the
    custom function takes only the arrays present (x, then weight, then bias), x is
    reshaped only when it is not already (rows, n), and the constant inputs (eps,
    params, a stand-in for an absent weight / bias) are made once here. `replay` (a memoised
    signature): on cuda / metal the custom function is recorded once and replayed
    (ops/_callcache.replayable)."""
    has_w, has_b = weight is not None, bias is not None
    spec, kwargs = _plan(kind, x, weight, bias, eps, num_heads, knobs)
    run = prepare_launch(spec, **kwargs, backend=backend)
    rows, n = kwargs["output_shapes"][0]
    flat = (rows, n)
    # The kernels index x and y as (rows, n) row-contiguous buffers and never read their
    # shapes: x of this signature's shape goes in as it is and y comes out in that shape
    # (no Reshape node either way: a (B, L, D) decode norm's call has none).
    xshape = tuple(x.shape)
    run_as_x = run if xshape == flat else prepare_launch(spec, **dict(kwargs, output_shapes=[xshape]),
                                                         backend=backend)
    tail = list(kwargs["inputs"][-2:])  # the eps and params constants
    dummy = _dummy(x.dtype)
    n_args = 1 + has_w + has_b

    if kind == "ln":
        def forward(args):
            xa = args[0]
            w = args[1] if has_w else dummy
            b = args[1 + has_w] if has_b else dummy
            shape = xa.shape
            if shape == xshape:
                return run_as_x([xa, w, b, *tail])[0]
            (y,) = run([xa.reshape(flat), w, b, *tail])
            return y.reshape(shape)
    else:
        def forward(args):
            xa = args[0]
            w = args[1] if has_w else dummy
            shape = xa.shape
            if shape == xshape:
                return run_as_x([xa, w, *tail])[0]
            (y,) = run([xa.reshape(flat), w, *tail])
            return y.reshape(shape)

    @mx.custom_function
    def f(*args):
        return forward(args)

    # The backward launch, planned at the first backward of this signature (per cotangent
    # dtype): later ones cost one kernel call and the partial sums.
    plans: dict = {}

    def backward(xa, wa, cot):
        plan = plans.get(cot.dtype)
        if plan is None:
            bspec, bkw, groups = _vjp_plan(kind, xa, wa, has_b, cot, eps, num_heads)
            sums = None
            if has_w or has_b:  # the partials summed over groups and cast in one launch
                sspec, skw = _partials_sum_launch(groups, num_heads * n, xa.dtype, has_w, has_b)
                sums = (prepare_launch(sspec, **skw, backend=backend), skw["inputs"])
            plan = plans[cot.dtype] = (prepare_launch(bspec, **bkw, backend=backend), bkw["inputs"][3:], sums)
        brun, consts, sums = plan
        shape = xa.shape
        c2 = cot if cot.dtype == xa.dtype else cot.astype(xa.dtype)
        outs = brun([xa if shape == flat else xa.reshape(flat), wa if has_w else dummy,
                     c2 if shape == flat else c2.reshape(flat), *consts])
        grads = [outs[0] if shape == flat else outs[0].reshape(shape)]
        if sums is not None:
            srun, (absent_w, absent_b, sizes) = sums
            dw, db = srun([outs[1] if has_w else absent_w, outs[2] if has_b else absent_b, sizes])
            if has_w:
                grads.append(dw)
            if has_b:
                grads.append(db)
        return grads

    @f.vjp
    def f_vjp(primals, cotangent, output):
        if isinstance(primals, mx.array):  # a single primal comes unwrapped
            primals = (primals,)
        if isinstance(cotangent, (list, tuple)):
            cotangent = cotangent[0]
        grads = backward(primals[0], primals[1] if has_w else None, cotangent)
        return tuple(grads) if len(grads) > 1 else grads[0]

    if replay:
        f = replayable(f, backend, bare=lambda *args: forward(args))

    if n_args == 1:
        return lambda xa, wa, ba: f(xa)
    if n_args == 3:
        return f  # f(x, weight, bias)
    if has_w:
        return lambda xa, wa, ba: f(xa, wa)
    return lambda xa, wa, ba: f(xa, ba)


# ---------------------------------------------------------------------------------------
# The public ops: validated and planned once per call signature (ops/_callcache.py)
# ---------------------------------------------------------------------------------------

_CALLS = CallCache("norm")
_REFERENCES = {"rms_norm": lambda x, w, b, eps, nh: rms_norm_reference(x, w, eps),
               "layer_norm": lambda x, w, b, eps, nh: layer_norm_reference(x, w, b, eps),
               "multihead_layer_norm": lambda x, w, b, eps, nh: multihead_layer_norm_reference(x, w, b, nh, eps)}


def _call(op: str, x, weight, bias, eps, num_heads: int, knobs: dict | None) -> mx.array:
    """Run `op` ("rms_norm", "layer_norm", "multihead_layer_norm"): the first call of a
    signature validates and builds its function, later ones reuse it (one key tuple, one
    memo lookup, then the stored function)."""
    key = None
    if knobs is None and x.__class__ is _ARRAY and eps.__class__ in _NUMBER and num_heads.__class__ is int:
        try:
            key = (op, x.shape, x.dtype, None if weight is None else (weight.shape, weight.dtype),
                   None if bias is None else (bias.shape, bias.dtype), eps, num_heads)
        except AttributeError:  # weight / bias not arrays: validation says so
            key = None
        else:
            fn = _CALLS.get(key)
            if fn is not None:
                return fn(x, weight, bias)
    fn = _build_call(op, x, weight, bias, eps, num_heads, knobs, replay=key is not None)
    if key is not None:
        _CALLS.put(key, fn)
    return fn(x, weight, bias)


_ARRAY = mx.array
_NUMBER = (float, int)


def _build_call(op: str, x, weight, bias, eps, num_heads: int, knobs: dict | None, replay: bool = False):
    """Validate one call and build fn(x, weight, bias) -> y for its signature."""
    kind = "rms" if op == "rms_norm" else "ln"
    xv, wv, bv = _validate(op, x, weight, bias, eps, num_heads)
    dtype = xv.dtype
    cast = lambda a: None if a is None else a.astype(dtype)  # noqa: E731 (a no-op where the dtype matches)
    backend = current_backend()
    if backend == "reference" or xv.size == 0:
        if knobs is not None:  # checked all the same
            _forward_knobs(kind, xv.shape[-1] // num_heads, dtype, knobs)
        ref = _REFERENCES[op]
        return lambda x, w, b: ref(cast(x), cast(w), cast(b), eps, num_heads)
    fn = _differentiable_fn(kind, xv, wv, bv, eps, num_heads, backend, knobs, replay)
    if all(a is None or getattr(a, "dtype", None) == dtype for a in (x, weight, bias)):
        return fn  # nothing to cast: the memo hands out the differentiable function itself
    return lambda x, w, b: fn(cast(x), cast(w), cast(b))


def rms_norm(x: mx.array, weight: mx.array | None, eps: float = 1e-5, *, knobs: dict | None = None) -> mx.array:
    """Root-mean-square normalisation over the last axis, like ``mx.fast.rms_norm``.

    Args:
        x: (..., D) float32, float16 or bfloat16.
        weight: (D,) scale, or None.
        eps: finite, >= 0; added to the mean square before the reciprocal square root.
        knobs: optional {knob: value} of the forward kernel (``n_reads``, ``simd_rows``,
            ``looped_threads``; see the module docstring), above the environment and presets.

    Returns:
        (..., D) in the promoted dtype: ``weight * T(x * rsqrt(mean(x^2) + eps))``,
        statistics in float32.

    Differentiable (dx and dweight through the ``rms_norm_vjp`` kernels; dweight adds the
    units' partial sums in float32, each rounded once to bfloat16 for 16-bit rows:
    ``PARTIALS_BF16``, ``PARTIALS_FP16``).
    """
    return _call("rms_norm", x, weight, None, eps, 1, knobs)


def layer_norm(x: mx.array, weight: mx.array | None, bias: mx.array | None, eps: float = 1e-5, *,
               knobs: dict | None = None) -> mx.array:
    """Layer normalisation over the last axis, like ``mx.fast.layer_norm``.

    Args:
        x: (..., D) float32, float16 or bfloat16.
        weight: (D,) scale, or None.
        bias: (D,) shift, or None.
        eps: finite, >= 0; added to the variance.
        knobs: optional {knob: value} of the forward kernel (``n_reads``, ``simd_rows``,
            ``looped_threads``), above the environment and presets.

    Returns:
        (..., D) in the promoted dtype: ``bias + weight * T((x - mean) * rsqrt(var + eps))``,
        mean and centred variance in float32 (no sum of squares minus a squared sum: two
        passes, or the threads' centred moments merged pairwise, ``LN_MOMENTS``).

    Differentiable (dx, dweight, dbias through the ``layer_norm_vjp`` kernels; dweight and
    dbias add the units' partial sums in float32, each rounded once to bfloat16 for 16-bit
    rows: ``PARTIALS_BF16``, ``PARTIALS_FP16``).
    """
    return _call("layer_norm", x, weight, bias, eps, 1, knobs)


def multihead_layer_norm(
    x: mx.array, weight: mx.array | None, bias: mx.array | None, num_heads: int, eps: float = 1e-5, *,
    knobs: dict | None = None,
) -> mx.array:
    """LayerNorm of each head slice of the last axis separately (xLSTM's multi-head / group norm).

    Args:
        x: (..., num_heads * head_dim) float32, float16 or bfloat16; head h is the slice
            ``[h * head_dim, (h + 1) * head_dim)`` of the last axis.
        weight: (num_heads * head_dim,) scale, or None.
        bias: (num_heads * head_dim,) shift, or None.
        num_heads: a positive divisor of x's last axis.
        eps: finite, >= 0.
        knobs: optional {knob: value} of the forward kernel (layer_norm's knobs, keyed on
            the head slice length head_dim).

    Returns:
        (..., num_heads * head_dim) in the promoted dtype; each head slice normalised with
        its own mean and variance (float32), then scaled and shifted over all features.

    Differentiable (the ``layer_norm_vjp`` kernels with per-head weight slices).
    """
    return _call("multihead_layer_norm", x, weight, bias, eps, num_heads, knobs)
