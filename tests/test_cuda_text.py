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


SWIZZLE_CHECK = r"""
#include <cstdio>
#include <set>
static unsigned g_lane = 0;
namespace msl_detail {
inline unsigned lane_id_pure() { return g_lane; }
}
inline unsigned long __cvta_generic_to_shared(const void*) { return 0; }
namespace msl_detail { using ::msl_detail::lane_id_pure; }
@SWIZZLE@
// A tile of ROWS x LD 2-byte elements (LD * 2 a multiple of 128): every check prints a line
// on failure and the program exits with the number of failures.
int main() {
  int bad = 0;
  for (int ld : {64, 128, 256}) {
    const int rows = 64;
    std::set<int> seen;  // a bijection on the tile, each element staying in its own row
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < ld; c += 8) {
        const int o = xk_tile_swz(r, c, ld);
        if (o % 8 || o / ld != r || !seen.insert(o).second) { std::printf("swz %d %d %d -> %d\n", ld, r, c, o); ++bad; }
        if (xk_tile_swz(r + 8, c, ld) != o + 8 * ld) { std::printf("8-row step %d %d %d\n", ld, r, c); ++bad; }
      }
    for (int tr = 0; tr < 2; ++tr)
      for (int r0 = 0; r0 + 16 <= rows; r0 += 8)
        for (int c0 = 0; c0 + 16 <= ld; c0 += 16) {
          std::set<int> groups[4];
          for (unsigned l = 0; l < 32; ++l) {
            g_lane = l;
            const unsigned a = msl_detail::ldsm_x4_row_sw((const unsigned short*)nullptr, r0, c0, ld, tr != 0);
            const int rr = l & 7, ro = l & 8, co = (l & 16) >> 1;
            const int mr = r0 + (tr ? co + rr : ro + rr), mc = c0 + (tr ? ro : co);
            if (a != unsigned(xk_tile_swz(mr, mc, ld)) * 2u) { std::printf("lane %u %d %d %d %d\n", l, ld, tr, r0, c0); ++bad; }
            groups[l / 8].insert((a / 16) % 8);  // 16-byte bank group of this row of matrix l / 8
          }
          for (auto& g : groups)
            if (g.size() != 8) { std::printf("bank conflict %d %d %d %d\n", ld, tr, r0, c0); ++bad; }
        }
  }
  return bad;
}
"""


def test_swizzled_tile_addressing(tmp_path):
    """The CUDA GEMM's swizzled tiles (simdgroup_matrix.h), compiled for the host with
    stand-ins for the lane id and shared-address conversion: xk_tile_swz is a bijection
    keeping rows, 8 rows on adds 8 * ld (the copies' runs), every lane's ldmatrix address
    is the swizzled element it must read, and the 8 rows of each 8 x 8 matrix lie in 8
    different 16-byte bank groups (conflict-free)."""
    import re
    import shutil
    import subprocess
    from importlib import resources

    import pytest

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler")
    text = resources.files("xlstm_kernels.cuda").joinpath("simdgroup_matrix.h").read_text()
    m = re.search(r"#define XK_TILE_SWIZZLE XK_SM80_\n(.*?\n}  // namespace msl_detail\n)", text, re.S)
    assert m, "swizzle helpers not found in simdgroup_matrix.h"
    src = tmp_path / "swz.cpp"
    src.write_text(SWIZZLE_CHECK.replace("@SWIZZLE@", m.group(1)))
    exe = tmp_path / "swz"
    subprocess.run([cxx, "-std=c++17", "-O1", str(src), "-o", str(exe)], check=True, capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[:2000]
