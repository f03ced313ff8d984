"""Threadgroup clusters in the emulator (CUDA's ``__cluster_dims__``, ``barrier.cluster`` and
distributed shared memory on Hopper): a kernel whose template list has the int ``XK_CLUSTER``
= C runs in clusters of C consecutive threadgroups along x, which see each other's
threadgroup memory through ``xk_cluster_peer`` and wait for each other at
``xk_cluster_sync`` (the contract: ``metal_src/_cluster.metal``).

The toy kernels write one row of floats a threadgroup into threadgroup memory, sync the
cluster and read the rows of all its threadgroups. The checks: results against NumPy
under every schedule (``check_schedules``), a missing or misplaced sync caught, a peer's
memory read after its threads returned named, divergence and mismatches at the cluster
sync reported, bad grids refused before launch, and XK_CLUSTER = 1 as without clusters.
These use the emulator's own keywords (schedules, workers): emulator-only.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels.emulate import EmulatorError, check_schedules, metal_kernel

pytestmark = pytest.mark.emulator_only

W = 48  # floats in each threadgroup's row
NCL, NY = 3, 2  # clusters along x, threadgroups along y

# Each threadgroup (rank r of its cluster) writes its row of `inp` into threadgroup memory,
# then writes out = sum_c (c + 1) * row_c - 0.5 * row_r over the cluster's ranks c.
_WRITE_ROW = """\
  threadgroup float row[W];
  const uint C = XK_CLUSTER;
  const uint r = threadgroup_position_in_grid.x % C;
  const uint t = thread_index_in_threadgroup;
  const uint n = threads_per_threadgroup.x;
  const uint g = threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x;
  for (uint i = t; i < W; i += n) {
    row[i] = inp[g * W + i];
  }
"""
_READ_PEERS = """\
  for (uint i = t; i < W; i += n) {
    float s = 0.0f;
    for (uint c = 0; c < C; ++c) {
      const threadgroup float* peer = xk_cluster_peer((const threadgroup float*)row, c);
      s += float(c + 1) * peer[i];
    }
    out[g * W + i] = s - 0.5f * row[i];
  }
"""
SYNC = "  xk_cluster_sync();\n"


def _body(before_sync: str = "", first: str = SYNC, final: str = SYNC) -> str:
    return _WRITE_ROW + before_sync + first + _READ_PEERS + final


def _kernel(name: str, body: str):
    return metal_kernel(name=name, input_names=["inp"], output_names=["out"], source=body)


def _inputs(c: int, seed: int = 0) -> np.ndarray:
    """(NY, NCL * c, W) random floats, away from zero."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.5, 2.0, (NY, NCL * c, W)) * rng.choice([-1.0, 1.0], (NY, NCL * c, W))
    return x.astype(np.float32)


def _reference(x: np.ndarray, c: int) -> np.ndarray:
    xs = x.astype(np.float64).reshape(NY, NCL, c, W)
    s = np.einsum("yacw,c->yaw", xs, np.arange(1, c + 1, dtype=np.float64))
    return (s[:, :, None, :] - 0.5 * xs).reshape(x.shape)


def _call(x: np.ndarray, c: int, tg: int, grid_x: int | None = None, **extra):
    return dict(
        inputs=[mx.array(x.ravel())],
        output_shapes=[(x.size,)],
        output_dtypes=[mx.float32],
        grid=(NCL * c * tg if grid_x is None else grid_x, NY, 1),
        threadgroup=(tg, 1, 1),
        template=[("W", W), ("XK_CLUSTER", c)],
        **extra,
    )


def _check(out, ref, tol: float = 1e-6) -> None:
    out = np.asarray(out, dtype=np.float64).reshape(ref.shape)
    assert np.all(np.isfinite(out))
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    assert err < tol, err


# (a) -------------------------------------------------------------------------------
@pytest.mark.parametrize("tg", [20, 40, 64])
@pytest.mark.parametrize("c", [2, 4, 8])
def test_cluster_reads_peers_rows(c, tg):
    """Every rank reads every peer's row after a sync, under every schedule (bit-identical)
    and with several workers; threadgroups of 20 and 40 threads end in partial simdgroups."""
    x = _inputs(c, seed=c * 100 + tg)
    k = _kernel("cl_rows", _body())
    (out,) = check_schedules(k, **_call(x, c, tg))
    _check(out, _reference(x, c))
    (again,) = k(**_call(x, c, tg), workers=3, schedule="random", seed=7)
    np.testing.assert_array_equal(np.array(again), np.array(out))


def test_cluster_with_check_bounds():
    x = _inputs(4, seed=3)
    (out,) = _kernel("cl_rows", _body())(**_call(x, 4, 40), check_bounds=True)
    _check(out, _reference(x, 4))


# (b) -------------------------------------------------------------------------------
def test_missing_first_sync_is_caught():
    """Without the sync, ranks read peers' rows before they are written (poison)."""
    x = _inputs(4, seed=11)
    k = _kernel("cl_no_first_sync", _body(first=""))
    with pytest.raises(EmulatorError, match="poison|differs"):
        check_schedules(k, **_call(x, 4, 40))


def test_threadgroup_barrier_instead_of_cluster_sync_is_a_race():
    """A threadgroup_barrier orders only its own threadgroup: the sequential schedule (all
    threadgroups side by side) happens to give the right numbers, but reverse and random
    let one threadgroup run ahead of its peers up to the next cluster sync."""
    x = _inputs(4, seed=12)
    k = _kernel("cl_tg_barrier_only", _body(first="  threadgroup_barrier(mem_flags::mem_threadgroup);\n"))
    (out,) = k(**_call(x, 4, 40), schedule="sequential")
    _check(out, _reference(x, 4))
    with pytest.raises(EmulatorError, match="poison|differs"):
        check_schedules(k, **_call(x, 4, 40))


# (c) -------------------------------------------------------------------------------
# Rank 0 reads every peer's row after the first sync; the peers have nothing else to do.
_RANK0_READS = (
    _WRITE_ROW
    + SYNC
    + """\
  if (r == 0) {
    for (uint i = t; i < W; i += n) {
      float s = 0.0f;
      for (uint c = 0; c < C; ++c) {
        s += float(c + 1) * xk_cluster_peer(&row[0], c)[i];
      }
      out[(g / C) * W + i] = s;
    }
  }
"""
)


@pytest.mark.parametrize("c", [2, 4])
def test_rank0_reading_peers_needs_a_final_sync(c):
    x = _inputs(c, seed=21)
    xs = x.astype(np.float64).reshape(NY, NCL, c, W)
    ref = np.einsum("yacw,c->yaw", xs, np.arange(1, c + 1, dtype=np.float64))
    call = dict(_call(x, c, 40), output_shapes=[(NY * NCL * W,)])

    (out,) = check_schedules(_kernel("cl_rank0_synced", _RANK0_READS + SYNC), **call)
    _check(out, ref)

    # Without the final sync the peers return at once: under the reverse schedule they run
    # (and return) before rank 0 reads their memory, which is gone by then.
    k = _kernel("cl_rank0_unsynced", _RANK0_READS)
    with pytest.raises(EmulatorError) as info:
        k(**call, schedule="reverse", workers=1)
    msg = str(info.value)
    assert "threadgroup memory of threadgroup (1,0,0), whose threads had returned" in msg, msg  # the first peer read
    assert "xk_cluster_sync before returning" in msg, msg
    assert re.search(r"by thread \(\d+,0,0\) of threadgroup \(0,0,0\)", msg), msg


# (d) -------------------------------------------------------------------------------
@pytest.mark.parametrize("grid_x", [6 * 40, 5 * 40 - 3], ids=["6_groups", "5_groups_partial"])
def test_grid_not_a_multiple_of_the_cluster_raises(grid_x):
    x = _inputs(4, seed=31)
    k = _kernel("cl_rows", _body())
    groups = -(-grid_x // 40)
    with pytest.raises(ValueError, match="XK_CLUSTER") as info:
        k(**_call(x, 4, 40, grid_x=grid_x))
    msg = str(info.value)
    assert f"{groups} threadgroups along x" in msg and "multiple of 4" in msg, msg
    assert f"({grid_x}, {NY}, 1)" in msg, msg  # the grid


@pytest.mark.parametrize("c", [0, 9, -2])
def test_cluster_size_out_of_range_raises(c):
    x = _inputs(1, seed=32)
    k = _kernel("cl_rows", _body())
    with pytest.raises(ValueError, match=rf"XK_CLUSTER={c}: expected an int in 1\.\.8"):
        k(**dict(_call(x, 1, 40, grid_x=NCL * 72 * 40), template=[("W", W), ("XK_CLUSTER", c)]))


# (e) -------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["sequential", "reverse", "random"])
@pytest.mark.parametrize(
    "early, exited",
    [("  if (r == 1 && t == 3) return;\n", "thread_index_in_threadgroup 3 of threadgroup (1,0,0)"),
     ("  if (r == 2) return;\n", "of threadgroup (2,0,0)")],
    ids=["one_thread", "whole_threadgroup"],
)
def test_return_before_cluster_sync_is_divergence(early, exited, schedule):
    x = _inputs(4, seed=41)
    k = _kernel("cl_early_return", _body(before_sync=early))
    with pytest.raises(EmulatorError, match="cluster sync divergence") as info:
        k(**_call(x, 4, 40), schedule=schedule, workers=1)
    msg = str(info.value)
    assert "the cluster of threadgroups (0..3,0,0)" in msg, msg
    assert exited in msg, msg
    assert "cl_early_return.metal:" in msg, msg  # the sync's site


def test_ranks_at_different_cluster_syncs_raise():
    split = """\
  if (r == 0) {
    xk_cluster_sync();
  } else {
    xk_cluster_sync();
  }
"""
    x = _inputs(2, seed=42)
    k = _kernel("cl_split_sync", _body(first=split))
    for schedule in ("sequential", "reverse"):
        with pytest.raises(EmulatorError, match="cluster sync mismatch") as info:
            k(**_call(x, 2, 40), schedule=schedule)
        msg = str(info.value)
        assert "cl_split_sync.metal:" in msg and "different xk_cluster_sync calls" in msg, msg


# (f) -------------------------------------------------------------------------------
# Rank 0 adds the sum of its own row to it (simd_sum and threadgroup barriers) while its
# peers already wait at the cluster sync.
_RANK0_REDUCES = """\
  threadgroup float part[32];
  if (r == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float v = 0.0f;
    for (uint i = t; i < W; i += n) {
      v += row[i];
    }
    v = simd_sum(v);
    if (thread_index_in_simdgroup == 0) {
      part[simdgroup_index_in_threadgroup] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint s = 0; s < simdgroups_per_threadgroup; ++s) {
      total += part[s];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = t; i < W; i += n) {
      row[i] += total;
    }
  }
"""


@pytest.mark.parametrize("tg", [40, 64])
def test_threadgroup_barriers_in_one_rank_while_peers_wait(tg):
    x = _inputs(4, seed=51)
    k = _kernel("cl_rank0_reduces", _body(before_sync=_RANK0_REDUCES))
    (out,) = check_schedules(k, **_call(x, 4, tg))
    xs = x.astype(np.float64).reshape(NY, NCL, 4, W).copy()
    xs[:, :, 0, :] += xs[:, :, 0, :].sum(-1, keepdims=True)
    _check(out, _reference(xs.reshape(x.shape), 4), tol=1e-5)


def test_threadgroup_barrier_against_cluster_sync_is_a_mismatch():
    split = """\
  if (t < 5) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    xk_cluster_sync();
  }
"""
    x = _inputs(2, seed=52)
    k = _kernel("cl_barrier_vs_sync", _body(first=split))
    for schedule in ("sequential", "reverse", "random"):
        with pytest.raises(EmulatorError, match="barrier mismatch in threadgroup") as info:
            k(**_call(x, 2, 40), schedule=schedule, workers=1)
        msg = str(info.value)
        assert "threadgroup_barrier at cl_barrier_vs_sync.metal:" in msg, msg
        assert "xk_cluster_sync at cl_barrier_vs_sync.metal:" in msg, msg


# (g) -------------------------------------------------------------------------------
def test_cluster_of_one_is_a_plain_threadgroup():
    """XK_CLUSTER = 1: xk_cluster_sync is a threadgroup barrier and xk_cluster_peer(p, 0)
    is p; the bits equal those of the same kernel written without clusters."""
    x = _inputs(1, seed=61)
    call = _call(x, 1, 40)
    (out,) = check_schedules(_kernel("cl_rows", _body()), **call)
    _check(out, _reference(x, 1))
    plain = (_body(first="  threadgroup_barrier(mem_flags::mem_threadgroup);\n", final="")
             .replace("xk_cluster_peer((const threadgroup float*)row, c)", "row")
             .replace("XK_CLUSTER", "1"))
    (same,) = check_schedules(_kernel("cl_plain", plain), **dict(call, template=[("W", W)]))
    np.testing.assert_array_equal(np.array(same), np.array(out))
    # without the XK_CLUSTER template at all: a cluster of one
    (none,) = check_schedules(_kernel("cl_none", _body().replace("XK_CLUSTER", "1")),
                              **dict(call, template=[("W", W)]))
    np.testing.assert_array_equal(np.array(none), np.array(out))


# xk_cluster_peer's checks --------------------------------------------------------------
def test_peer_rank_out_of_range_names_the_thread():
    bad = """\
  if (threadgroup_position_in_grid.x == 6 && threadgroup_position_in_grid.y == 1 && t == 1) {
    row[0] = xk_cluster_peer(&row[0], C)[0];
  }
"""
    x = _inputs(4, seed=71)
    k = _kernel("cl_bad_rank", _body(before_sync=bad))
    with pytest.raises(EmulatorError, match="xk_cluster_peer: rank 4, but the cluster has 4") as info:
        k(**_call(x, 4, 40))
    assert "by thread (241,1,0) of threadgroup (6,1,0)" in str(info.value), str(info.value)


def test_peer_of_a_pointer_outside_threadgroup_memory_raises():
    bad = """\
  if (t == 0) {
    row[0] = xk_cluster_peer(&inp[0], 1)[0];
  }
"""
    x = _inputs(2, seed=72)
    k = _kernel("cl_bad_pointer", _body(before_sync=bad))
    with pytest.raises(EmulatorError, match="not in the calling threadgroup's threadgroup memory"):
        k(**_call(x, 2, 40))
