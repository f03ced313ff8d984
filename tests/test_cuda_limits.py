"""The cuda backend's plans within the shared memory of the GPU they run on
(xlstm_kernels.cuda.limits): sm_90's limits where the plans were measured, smaller
buffers on GPUs that allow less (sm_86 / sm_89: 99 KiB a block), so that no launch asks
for more than the GPU has. Host-side plans only: no GPU needed."""

from __future__ import annotations

import mlx.core as mx
import pytest

from xlstm_kernels.cuda import limits
from xlstm_kernels.ops import attention as att
from xlstm_kernels.ops import norm as norm_mod

KIB = 1024


@pytest.fixture
def arch(monkeypatch):
    """Pin the architecture the limits report (restored after the test)."""

    def use(name: str) -> None:
        monkeypatch.setattr(limits, "_arch", [name])

    return use


def test_limits_table_and_names():
    assert limits.shared_bytes_per_block("sm_90") == 227 * KIB
    assert limits.shared_bytes_per_block("sm_90a") == 227 * KIB  # arch-specific suffix
    assert limits.shared_bytes_per_block("SM_89") == 99 * KIB
    assert limits.shared_bytes_per_block("sm_80") == 163 * KIB
    assert limits.shared_bytes_per_sm("sm_90") == 228 * KIB
    assert limits.shared_bytes_per_sm("sm_86") == 100 * KIB
    # an architecture the table does not know: the smallest recent limits
    assert limits.shared_bytes_per_block("sm_999") == 99 * KIB
    assert limits.shared_bytes_per_sm("sm_999") == 100 * KIB


def test_limits_without_a_cuda_gpu_are_sm90s():
    """No CUDA device here (CI): the plans' own architecture, the one the emulator models."""
    from xlstm_kernels import cuda

    if cuda.is_available():
        pytest.skip("a CUDA device: the limits are its own")
    assert limits.architecture() == limits.DEFAULT_ARCHITECTURE == "sm_90"
    assert limits.shared_bytes_per_block() == 227 * KIB


@pytest.mark.parametrize("name, warps, st", [("sm_90", 4, 3), ("sm_80", 4, 3), ("sm_89", 4, 2), ("sm_75", 4, 1)])
def test_decode_tile_pass_within_the_gpu(arch, name, warps, st):
    """Split-KV tile pass 1, D = 128 in 16 bits (8.5 KiB a stage): 4 simdgroups x 3 stages
    (102 KiB) where the GPU allows it, fewer stages each where it does not (99 KiB: 2, 64 KiB:
    1); the launch asks for what it needs."""
    arch(name)
    h = mx.float16
    assert att._mma_warps(4, 128, 128, h, "cuda") == warps
    q, k = mx.zeros((1, 32, 1, 128), dtype=h), mx.zeros((1, 8, 4096, 128), dtype=h)
    _, kw = att._partial_mma_launch(q, k, k, att._Mask(0), 0.1, 512, "cuda")
    t = dict(kw["template"])
    assert (t["NW"], t["ST"]) == (warps, st)
    assert kw["shared_memory"] == warps * st * 16 * 272 * 2 <= limits.shared_bytes_per_block(name)


@pytest.mark.parametrize("name", ["sm_90", "sm_89", "sm_75"])
def test_prefill_tiles_within_the_gpu(arch, name):
    """The tile prefill's plan fits the GPU's block limit at every head dim it takes."""
    arch(name)
    for d in (64, 128, 256):
        wm, rb, bk, st = att._prefill_mma_plan(1024, d, d, mx.bfloat16, "cuda")
        assert att._prefill_mma_bytes(wm, rb, bk, st, d, d) <= limits.shared_bytes_per_block(name)
    if name == "sm_90":  # the measured plan: 4 x 2 x 64 keys x 2 stages at D = 128 (102 KiB)
        assert att._prefill_mma_plan(1024, 128, 128, mx.bfloat16, "cuda") == (4, 2, 64, 2)


@pytest.mark.parametrize("name", ["sm_90", "sm_89"])
@pytest.mark.parametrize("kind, n, dtype", [("rms", 8192, mx.float32), ("ln", 8192, mx.float32),
                                            ("rms", 8192, mx.bfloat16), ("ln", 4096, mx.float32)])
def test_norm_backward_stages_within_the_gpu(arch, monkeypatch, name, kind, n, dtype):
    """The staged norm backward's stages (x and g rows, NS deep) within the GPU's block
    limit: 8192-element float32 rows (128 KiB of two stages) stage on sm_90, not on sm_89;
    64 KiB of two stages on both."""
    arch(name)
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    x = mx.zeros((64, n), dtype=dtype)
    w = mx.ones((n,), dtype=dtype)
    spec, kwargs, _ = norm_mod._vjp_plan(kind, x, w, kind == "ln", x, 1e-5)
    staged = dict(kwargs["template"]).get("STAGED", False)
    need = kwargs.get("shared_memory", 0)
    assert need <= limits.shared_bytes_per_block(name)
    assert staged == (4 * n * dtype.size <= 64 * KIB or name == "sm_90")


@pytest.mark.parametrize("name", ["sm_90", "sm_89"])
def test_norm_forward_stages_within_the_gpu(arch, monkeypatch, name):
    """The staged RMSNorm forward's units per SM count the GPU's shared memory per SM."""
    arch(name)
    monkeypatch.setattr(norm_mod, "_plans_for_cuda", lambda: True)
    lay = norm_mod._layout(4096, 10**6, itemsize=4)
    per_sm = {"sm_90": 228 * KIB, "sm_89": 100 * KIB}[name]
    resident = norm_mod.RMS_VJP_SMS_CUDA * 9
    units, per = norm_mod._forward_stage_units(4096, lay, 4, resident + 1)
    assert per == min(norm_mod.RMS_FWD_STAGED_UNITS_PER_SM, per_sm // (32768 + 256 + 1024), 2048 // lay.tpr)
    assert per * (32768 + 256 + 1024) <= per_sm
