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
    assert "xk_bid_ % uint(xk_grid[3])" in linear and "blockIdx.x + gridDim.x * blockIdx.y" in linear
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


def test_compat_header_has_the_gemm_building_blocks():
    """metal_src/_simdgroup.metal's GEMM helpers on tensor cores: full 16-row mma (k8 and
    k16), ldmatrix fragment loads (plain and transposed) and cp.async tile copies, each
    replacing the portable form (XK_SIMDGROUP_MMA / XK_ASYNC_COPY) and kept to sm_80+."""
    h = compat_header()
    for dt in ("f16.f16", "bf16.bf16"):
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{dt}.f32" in h
    assert "ldmatrix.sync.aligned.m8n8.x1.shared.b16" in h
    assert "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16" in h
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in h
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in h
    assert "cp.async.cg.shared.global" in h and "cp.async.ca.shared.global" in h
    assert "cp.async.commit_group" in h and "cp.async.wait_group" in h
    for name in ("xk_mma2", "xk_mma2_k16", "xk_frag_load_a", "xk_frag_load_b", "xk_async_copy", "xk_async_commit",
                 "xk_async_wait"):
        assert f" {name}(" in h
    assert "#define XK_SIMDGROUP_MMA" in h and "#define XK_ASYNC_COPY" in h and "#define XK_UNROLL" in h
    assert h.index("#define XK_SM80_ 1") < h.index("#define XK_SM80_ 0")  # older GPUs: the plain path


def test_gemm_body_uses_the_building_blocks():
    from xlstm_kernels.runtime.sources import family_header, kernel_body

    simd = kernel_body("gemm", "gemm_simd")
    for name in ("xk_simd_tile_mma<", "xk_tile_load<", "xk_async_copy_aligned<", "xk_async_runs_aligned<",
                 "xk_async_commit()", "xk_async_wait<"):
        assert name in simd
    # the portable forms, in the gemm family header (the CUDA header replaces them)
    hdr = family_header("gemm")
    tile = hdr[hdr.index("inline void xk_simd_tile_mma("):]
    for name in ("xk_mma2_k16(", "xk_mma2(", "xk_frag_load_a(", "xk_frag_load_b(", "xk_frag_load_a4(",
                 "xk_frag_load_b4("):
        assert name in tile
    for name in ("inline void xk_frag_load_a4(", "inline void xk_frag_load_b4(", "inline void xk_async_copy_aligned(",
                 "inline bool xk_async_runs_aligned("):
        assert name in hdr
    assert "#ifndef XK_SIMDGROUP_MMA" in hdr and "#ifndef XK_ASYNC_COPY" in hdr and "inline void xk_tile_load(" in hdr
    assert "#define XK_UNROLL" in hdr
