"""The cuda backend's generated text, checked without a GPU (the kernels themselves run in
``pytest --backend cuda`` on an NVIDIA machine; see docs/CUDA.md)."""

from __future__ import annotations

from xlstm_kernels.cuda import compat_header
from xlstm_kernels.cuda.kernel import CudaKernel

BODY = """\
const uint i = thread_position_in_grid.x + threads_per_grid.x * threadgroup_position_in_grid.y;
y[i] = x[i];
"""


def test_prologue_reads_block_idx_for_a_native_grid_and_divides_otherwise():
    k = CudaKernel("copy_probe", ["x"], ["y"], BODY)
    native = k.cuda_source((False,), (("T", "dtype", "float32"),), native_grid=True)
    linear = k.cuda_source((False,), (("T", "dtype", "float32"),), native_grid=False)
    assert "uint3(blockIdx.x, blockIdx.y, blockIdx.z)" in native and "xk_bid_" not in native
    assert "xk_bid_ % uint(xk_grid[3])" in linear and "blockIdx.y" not in linear
    for text in (native, linear):
        assert "using T = float;" in text
        assert text.rstrip().endswith("y[i] = x[i];")
        # threads past Metal's grid (CUDA rounds the grid up to whole blocks) leave first
        assert text.index("return;") < text.index('#line 1 "copy_probe.metal"')


def test_compat_header_maps_half_and_bfloat_products_to_tensor_cores():
    h = compat_header()
    assert "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32" in h
    assert "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32" in h
    assert "__CUDA_ARCH__ >= 800" in h  # older GPUs keep the shuffle path
