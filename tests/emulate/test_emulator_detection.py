"""The emulator reports the classic Metal kernel bugs instead of returning plausible numbers.

Every test starts from the tiled GEMM of ``kernels.GEMM_TILED`` (8x8 tiles, shape
M x N x K = 33 x 29 x 31: 4 K-tiles, partial edge tiles on every axis) and puts in one
bug with ``kernels.gemm_variant``; the unmodified kernel is the control.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels.emulate import EmulatorCompileError, EmulatorError, check_schedules, metal_kernel


def _load_kernels():
    name = "xlstm_emulate_test_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("kernels.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


K = _load_kernels()
pytestmark = pytest.mark.emulator_only

TILE = 8
M, N, KD = 33, 29, 31  # K spans 4 tiles; every axis ends in a partial tile


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _operands(seed: int = 0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, KD)).astype(np.float32)
    b = rng.standard_normal((KD, N)).astype(np.float32)
    return a, b, a.astype(np.float64) @ b.astype(np.float64)


def _gemm(name: str, body: str):
    return metal_kernel(name=name, input_names=["A", "B"], output_names=["C"], source=body)


def _call_args(a, b, pad: int = 0, grid_x: int | None = None, threadgroup=(TILE, TILE, 1)):
    gx = TILE * _ceil(N, TILE) if grid_x is None else grid_x
    return dict(
        inputs=[mx.array(a), mx.array(b)],
        output_shapes=[(M, N)],
        output_dtypes=[mx.float32],
        grid=(gx, TILE * _ceil(M, TILE), 1),
        threadgroup=threadgroup,
        template=[("T", mx.float32), ("TILE", TILE), ("PAD", pad)],
    )


def _rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _line_of(body: str, needle: str) -> int:
    """1-based line of the first line of `body` containing `needle`."""
    for i, line in enumerate(body.splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in body")


@pytest.fixture(scope="module")
def operands():
    return _operands()


# 9 (and the control of every other test) -----------------------------------------
def test_correct_gemm_matches_reference_under_every_schedule(operands):
    a, b, ref = operands
    k = _gemm("det_gemm_ok", K.GEMM_TILED)
    args = _call_args(a, b)
    first = check_schedules(k, schedules=("sequential", "reverse", "random"), seeds=(1, 2, 3), **args)
    assert _rel_err(first[0], ref) < 1e-5
    # check_schedules demands bit identity; check it independently, with several workers too.
    base = np.asarray(first[0]).view(np.uint32)
    for schedule, seed, workers in (("reverse", 0, 1), ("random", 7, 2), ("sequential", 0, 3)):
        (c,) = k(**args, schedule=schedule, seed=seed, workers=workers)
        np.testing.assert_array_equal(np.asarray(c).view(np.uint32), base)


def test_correct_gemm_passes_check_bounds(operands):
    a, b, ref = operands
    (c,) = _gemm("det_gemm_ok", K.GEMM_TILED)(**_call_args(a, b), check_bounds=True)
    assert _rel_err(c, ref) < 1e-5


# 1 ----------------------------------------------------------------------------------
def test_missing_second_barrier_is_wrong_and_racy(operands):
    a, b, ref = operands
    k = _gemm("det_gemm_no_barrier_2", K.gemm_variant("no_barrier_2"))
    args = _call_args(a, b)
    (c,) = k(**args)  # sequential: thread 0 refills the tile while the others still read it
    c = np.asarray(c)
    assert not np.all(np.isfinite(c)) or _rel_err(c, ref) > 1e-2
    with pytest.raises(EmulatorError) as info:
        check_schedules(k, **args)
    msg = str(info.value)
    assert "race" in msg and "differs between schedules" in msg and "'C'" in msg


# 2 ----------------------------------------------------------------------------------
def test_missing_first_barrier_is_caught(operands):
    a, b, ref = operands
    k = _gemm("det_gemm_no_barrier_1", K.gemm_variant("no_barrier_1"))
    caught = []
    for schedule in ("sequential", "reverse", "random"):
        try:
            (c,) = k(**_call_args(a, b), schedule=schedule, seed=3)
        except EmulatorError as e:  # reading the still-poisoned tile
            assert "poison" in str(e)
            caught.append(schedule)
        else:
            c = np.asarray(c)
            assert not np.all(np.isfinite(c)) or _rel_err(c, ref) > 1e-2, schedule
            caught.append(schedule)
    assert len(caught) == 3


# 3 ----------------------------------------------------------------------------------
def test_out_of_bounds_read_in_edge_tile_names_the_buffer(operands):
    a, b, _ = operands
    k = _gemm("det_gemm_unguarded", K.gemm_variant("unguarded_load"))
    with pytest.raises(EmulatorError) as info:
        k(**_call_args(a, b), check_bounds=True, workers=1)
    msg = str(info.value)
    assert "out-of-bounds" in msg and "buffer 'A'" in msg, msg
    assert "thread (" in msg  # names the offending thread


# 4 ----------------------------------------------------------------------------------
def test_early_return_before_barrier_is_barrier_divergence(operands):
    a, b, _ = operands
    k = _gemm("det_gemm_early_return", K.gemm_variant("early_return"))
    for schedule in ("sequential", "reverse"):
        with pytest.raises(EmulatorError, match="barrier divergence") as info:
            k(**_call_args(a, b), schedule=schedule)
        # only the last row of threadgroups has rows >= M
        assert re.search(rf"threadgroup \(\d+,{M // TILE},0\)", str(info.value)), str(info.value)


# 5 ----------------------------------------------------------------------------------
def test_threadgroup_memory_over_32_kib_raises(operands):
    a, b, _ = operands
    k = _gemm("det_gemm_big_tile", K.GEMM_TILED)
    # As is TILE x (TILE + 1024) floats = 33,024 bytes, plus Bs: over 32 KiB.
    with pytest.raises(EmulatorError) as info:
        k(**_call_args(a, b, pad=1024))
    msg = str(info.value)
    assert "exceeds" in msg and "32 KiB" in msg
    assert "As" in msg  # the report lists the arrays


def test_more_than_1024_threads_per_group_raises(operands):
    a, b, _ = operands
    k = _gemm("det_gemm_ok", K.GEMM_TILED)
    with pytest.raises(ValueError, match="1024"):
        k(**_call_args(a, b, threadgroup=(32, 33, 1)))


# 6 ----------------------------------------------------------------------------------
def test_threads_at_different_barriers_raise(operands):
    a, b, _ = operands
    k = _gemm("det_gemm_split_barrier", K.gemm_variant("split_barrier"))
    with pytest.raises(EmulatorError, match="barrier mismatch") as info:
        k(**_call_args(a, b))
    assert "det_gemm_split_barrier.metal:" in str(info.value)


# 7 ----------------------------------------------------------------------------------
def test_threadgroup_array_index_out_of_bounds_names_the_line(operands):
    a, b, _ = operands
    body = K.gemm_variant("tg_oob")
    k = _gemm("det_gemm_tg_oob", body)
    line = _line_of(body, "acc = fma(As[ty][p], Bs[p][tx], acc);")
    with pytest.raises(EmulatorError) as info:
        k(**_call_args(a, b), check_bounds=True)
    msg = str(info.value)
    assert "out-of-bounds index 8" in msg, msg
    assert f"det_gemm_tg_oob.metal:{line}" in msg, msg


# 8 ----------------------------------------------------------------------------------
def test_unwritten_output_raises_and_init_value_fills_it(operands):
    a, b, ref = operands
    k = _gemm("det_gemm_ok", K.GEMM_TILED)
    short_grid = TILE * (_ceil(N, TILE) - 1)  # the last column of tiles is never launched
    with pytest.raises(EmulatorError) as info:
        k(**_call_args(a, b, grid_x=short_grid))
    msg = str(info.value)
    assert "output 'C'" in msg and "poison" in msg
    assert f"{M * (N - short_grid)} of {M * N} elements" in msg

    (c,) = k(**_call_args(a, b, grid_x=short_grid), init_value=-3.5)
    c = np.asarray(c)
    assert np.all(c[:, short_grid:] == np.float32(-3.5))
    assert _rel_err(c[:, :short_grid], ref[:, :short_grid]) < 1e-5
    # check_unwritten=False turns the check off (the poison stays visible as NaN)
    (c,) = k(**_call_args(a, b, grid_x=short_grid), check_unwritten=False)
    assert np.all(np.isnan(np.asarray(c)[:, short_grid:]))


# 10 ---------------------------------------------------------------------------------
def test_compile_error_points_at_the_kernel_line(operands):
    a, b, _ = operands
    body = K.gemm_variant("typo")
    line = _line_of(body, "cnost int row")
    assert line == 3
    k = _gemm("det_gemm_typo", body)
    with pytest.raises(EmulatorCompileError) as info:
        k(**_call_args(a, b))
    assert f"det_gemm_typo.metal:{line}:" in str(info.value)
    assert "cnost" in str(info.value)
    # an error in the header points at the header's own line
    header = "// helpers\ninline float twice(float v) {\n  retrun 2.0f * v;\n}\n"
    k = metal_kernel(name="det_gemm_header_typo", input_names=["A", "B"], output_names=["C"],
                     source=K.GEMM_TILED, header=header)
    with pytest.raises(EmulatorCompileError) as info:
        k(**_call_args(a, b))
    assert "det_gemm_header_typo.header.metal:3:" in str(info.value)


# Two reductions in a row through the same 32-entry scratch array with one barrier each:
# a fast simdgroup can overwrite scratch for the second reduction while a slow one still
# reads the first. On the GPU this is a race; the reverse/random schedules run one
# simdgroup ahead to its next barrier, so the bits differ from the sequential schedule.
_SCRATCH_REUSE = """
uint t = thread_index_in_threadgroup;
uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
uint nsg = simdgroups_per_threadgroup;
threadgroup float scratch[32];
float v = inp[t];
float s = simd_sum(v);
if (lane == 0) { scratch[sg] = s; }
threadgroup_barrier(mem_flags::mem_threadgroup);
float total = 0.0f;
for (uint i = 0; i < nsg; ++i) { total += scratch[i]; }
float s2 = simd_sum(v * v);
if (lane == 0) { scratch[sg] = s2; }   // SCRATCH2
threadgroup_barrier(mem_flags::mem_threadgroup);
float total2 = 0.0f;
for (uint i = 0; i < nsg; ++i) { total2 += scratch[i]; }
out[t] = total + 1000.0f * total2;
"""


@pytest.mark.emulator_only
@pytest.mark.parametrize("reuse", [True, False])
def test_scratch_reused_across_reductions_is_a_race(reuse):
    src = _SCRATCH_REUSE
    if not reuse:  # the fix: a second array
        src = src.replace("threadgroup float scratch[32];", "threadgroup float scratch[32];\nthreadgroup float scratch2[32];")
        src = src.replace("if (lane == 0) { scratch[sg] = s2; }   // SCRATCH2", "if (lane == 0) { scratch2[sg] = s2; }")
        src = src.replace("total2 += scratch[i];", "total2 += scratch2[i];")
    k = metal_kernel(name=f"scratch_{reuse}", input_names=["inp"], output_names=["out"], source=src)
    x = mx.array(np.random.default_rng(12).standard_normal(128).astype(np.float32))
    call = dict(inputs=[x], grid=(128, 1, 1), threadgroup=(128, 1, 1), output_shapes=[(128,)], output_dtypes=[mx.float32])
    if reuse:
        with pytest.raises(EmulatorError, match="race"):
            check_schedules(k, **call)
    else:
        (out,) = check_schedules(k, **call)
        xn = np.asarray(x, dtype=np.float64)
        assert np.allclose(np.asarray(out), xn.sum() + 1000.0 * (xn * xn).sum(), rtol=1e-5)
