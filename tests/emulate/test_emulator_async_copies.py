"""The emulator's asynchronous copies (xk_async_copy and friends) land as late as CUDA's
cp.async may: at the xk_async_wait that completes their group, not before. A kernel that
reads a staged tile before its wait gets the emulator's poison pattern (pending destinations
hold 0xFF bytes, NaN in every float type), which the launch reports once it reaches an
output; a store into a destination whose copy is still pending is overwritten when the copy
lands. A synchronous emulation would hide such bugs, which CUDA shows only sometimes.

Each kernel stages a row of 64 floats per threadgroup of 32 threads through threadgroup
memory (two copies a thread, in two groups) and writes it back out; variants drop or move
the wait."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels.emulate import EmulatorError, metal_kernel

pytestmark = pytest.mark.emulator_only

ROWS, WIDTH = 3, 64


def _kernel(name: str, middle: str, commit_second: bool = True):
    """Thread t of row r copies x[r, t] into tile[t] (group 0) and x[r, 32 + t] into
    tile[32 + t] (group 1, or no group when `commit_second` is off), runs `middle`, a
    barrier, and writes the tile to y[r]."""
    body = f"""
threadgroup float tile[{WIDTH}];
const uint t = thread_position_in_threadgroup.x;
const uint r = threadgroup_position_in_grid.y;
const device float* row = x + r * {WIDTH};
xk_async_copy_aligned<1>(tile + t, row + t);
xk_async_commit();
xk_async_copy_aligned<1>(tile + 32 + t, row + 32 + t);
{"xk_async_commit();" if commit_second else ""}
{middle}
threadgroup_barrier(mem_flags::mem_threadgroup);
y[r * {WIDTH} + t] = tile[t];
y[r * {WIDTH} + 32 + t] = tile[32 + t];
"""
    return metal_kernel(name=name, input_names=["x"], output_names=["y"], source=body)


def _run(kernel) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(7).standard_normal((ROWS, WIDTH)).astype(np.float32)
    (y,) = kernel(inputs=[mx.array(x)], output_shapes=[(ROWS, WIDTH)], output_dtypes=[mx.float32],
                  grid=(32, ROWS, 1), threadgroup=(32, 1, 1))
    return x, np.asarray(y)


def test_copies_land_at_the_wait_that_completes_them():
    x, y = _run(_kernel("async_wait_all", "xk_async_wait<0>();"))
    assert np.array_equal(y, x)


def test_a_read_before_the_wait_is_reported():
    """No wait at all: the staged tile is read while both copies are pending."""
    with pytest.raises(EmulatorError, match=r"192 of 192 elements still hold the poison .*xk_async_wait"):
        _run(_kernel("async_no_wait", ""))


def test_wait_for_all_but_the_newest_group():
    """xk_async_wait<1> after two commits completes group 0 only: the tile's second half
    (96 of the 192 outputs) is still pending when it is read."""
    with pytest.raises(EmulatorError, match=r"96 of 192 elements still hold the poison"):
        _run(_kernel("async_wait_one", "xk_async_wait<1>();"))


def test_uncommitted_copies_stay_pending():
    """A copy issued after the last commit belongs to no group, so no wait completes it."""
    with pytest.raises(EmulatorError, match=r"96 of 192 elements still hold the poison"):
        _run(_kernel("async_uncommitted", "xk_async_wait<0>();", commit_second=False))


def test_a_store_into_a_pending_destination_is_overwritten_when_the_copy_lands():
    """A thread zeroes its tile entries while their copies are pending, then waits: the
    copies land over the zeros (on CUDA the order of the two is not defined). Zeroed after
    the wait, the zeros stay."""
    x, y = _run(_kernel("async_store_then_wait", "tile[t] = 0.0f; tile[32 + t] = 0.0f; xk_async_wait<0>();"))
    assert np.array_equal(y, x)
    x, y = _run(_kernel("async_wait_then_store", "xk_async_wait<0>(); tile[t] = 0.0f; tile[32 + t] = 0.0f;"))
    assert not y.any()


def _one_thread(name: str, body: str):
    kernel = metal_kernel(name=name, input_names=["x"], output_names=["y"], source=body)
    x = np.arange(16, dtype=np.float32)
    (y,) = kernel(inputs=[mx.array(x)], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(1, 1, 1),
                  threadgroup=(1, 1, 1))
    return x, np.asarray(y)


def test_other_copies_are_synchronous_as_on_cuda():
    """Copies cp.async does not take run synchronously, as CUDA's header runs them: 32 bytes,
    and an xk_async_copy from a misaligned source."""
    x, y = _one_thread("async_sync_forms", """
threadgroup float tile[16];
xk_async_copy_aligned<8>(tile, x);      // 32 bytes: no cp.async
xk_async_copy<4>(tile + 8, x + 9);      // 16 bytes from an address 4 bytes past alignment
y[0] = tile[1]; y[1] = tile[7]; y[2] = tile[8]; y[3] = tile[11];
""")
    assert list(y) == [1.0, 7.0, 9.0, 12.0]


def test_runs_aligned_answers_as_cuda():
    x, y = _one_thread("async_runs_aligned", """
y[0] = xk_async_runs_aligned<4>(x, 16) ? 1.0f : 0.0f;       // 16-byte runs, rows of 64 bytes
y[1] = xk_async_runs_aligned<4>(x + 1, 16) ? 1.0f : 0.0f;   // the base 4 bytes off
y[2] = xk_async_runs_aligned<4>(x, 18) ? 1.0f : 0.0f;       // rows of 72 bytes
y[3] = xk_async_runs_aligned<8>(x + 1, 3) ? 1.0f : 0.0f;    // 32-byte runs: never a cp.async
""")
    assert list(y) == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("what, body, message", [
    ("misaligned", "threadgroup float tile[8];\nxk_async_copy_aligned<4>(tile, x + 1);", "not aligned"),
    ("not_threadgroup", "float local[4];\nxk_async_copy_aligned<4>(local, x);", "not in threadgroup memory"),
])
def test_aligned_copy_preconditions_are_checked(what, body, message):
    """xk_async_copy_aligned is a bare cp.async on CUDA: a destination outside threadgroup
    memory or a misaligned address is an error there, and is reported here."""
    with pytest.raises(EmulatorError, match=message):
        _one_thread(f"async_pre_{what}", body + "\ny[0] = 0.0f; y[1] = 0.0f; y[2] = 0.0f; y[3] = 0.0f;")
