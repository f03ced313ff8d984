"""Test-only Metal kernel bodies for ``tests/emulate`` (bodies for ``mx.fast.metal_kernel``).

MLX generates the signature: inputs/outputs by name, ``<input>_shape``/``_strides``/
``_ndim`` and thread attributes when the body mentions them. Every body starts on its
first line (no leading newline), so line N of the string is line N of
``<name>.metal`` in emulator messages. Launch geometry follows MLX: ``grid`` counts
threads, ``threadgroup`` is threads per group.

The broken GEMM variants used by the detection tests are built from ``GEMM_TILED``
with :func:`gemm_variant`, which edits exactly one marked spot.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------
# Tiled GEMM (detection tests)
# ---------------------------------------------------------------------------

# C = A @ B for A (M, K), B (K, N), C (M, N) of type T; one output element per thread.
# Threadgroup (TILE, TILE, 1); grid (TILE * ceil(N / TILE), TILE * ceil(M / TILE), 1).
# K is walked in TILE-wide tiles staged in threadgroup memory (As padded by PAD
# columns); loads are bounds-guarded so partial edge tiles read zeros. Barrier 1
# publishes the tiles, barrier 2 keeps them until every thread has read them.
GEMM_TILED = """\
const int M = A_shape[0], K = A_shape[1], N = B_shape[1];
const int tx = int(thread_position_in_threadgroup.x), ty = int(thread_position_in_threadgroup.y);
const int row = int(threadgroup_position_in_grid.y) * TILE + ty;
const int col = int(threadgroup_position_in_grid.x) * TILE + tx;
threadgroup float As[TILE][TILE + PAD];
threadgroup float Bs[TILE][TILE];
float acc = 0.0f;
for (int k0 = 0; k0 < K; k0 += TILE) {
  As[ty][tx] = (row < M && k0 + tx < K) ? float(A[row * K + k0 + tx]) : 0.0f;
  Bs[ty][tx] = (k0 + ty < K && col < N) ? float(B[(k0 + ty) * N + col]) : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int p = 0; p < TILE; ++p) {
    acc = fma(As[ty][p], Bs[p][tx], acc);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (row < M && col < N) {
  C[row * N + col] = T(acc);
}
"""

_GEMM_LOAD_A = "  As[ty][tx] = (row < M && k0 + tx < K) ? float(A[row * K + k0 + tx]) : 0.0f;\n"
_GEMM_BARRIER = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n"
_GEMM_INNER = "  for (int p = 0; p < TILE; ++p) {\n"
_GEMM_COL = "const int col = int(threadgroup_position_in_grid.x) * TILE + tx;\n"
_GEMM_ROW = "const int row = int(threadgroup_position_in_grid.y) * TILE + ty;\n"


def _replace_once(text: str, old: str, new: str, occurrence: int = 0) -> str:
    """Replace the `occurrence`-th (0-based) copy of `old` in `text`; it must exist."""
    start = -1
    for _ in range(occurrence + 1):
        start = text.find(old, start + 1)
        if start < 0:
            raise ValueError(f"marker not found: {old!r}")
    return text[:start] + new + text[start + len(old) :]


def gemm_variant(kind: str) -> str:
    """GEMM_TILED with one classic bug (or a typo) put in.

    kinds: "no_barrier_2" (tiles refilled while others still read them),
    "no_barrier_1" (tiles read before they are complete), "unguarded_load" (A load
    without bounds guard: reads past A in partial edge tiles), "early_return"
    (out-of-range rows return before the barriers), "split_barrier" (even and odd
    rows wait at different barriers), "tg_oob" (inner loop runs to p == TILE, one
    past the threadgroup arrays), "typo" (line 3 does not compile).
    """
    body = GEMM_TILED
    if kind == "no_barrier_2":
        return _replace_once(body, _GEMM_BARRIER, "", occurrence=1)
    if kind == "no_barrier_1":
        return _replace_once(body, _GEMM_BARRIER, "", occurrence=0)
    if kind == "unguarded_load":
        return _replace_once(body, _GEMM_LOAD_A, "  As[ty][tx] = float(A[row * K + k0 + tx]);\n")
    if kind == "early_return":
        return _replace_once(body, _GEMM_COL, _GEMM_COL + "if (row >= M) {\n  return;\n}\n")
    if kind == "split_barrier":
        split = (
            "  if (ty % 2 == 0) {\n"
            "    threadgroup_barrier(mem_flags::mem_threadgroup);\n"
            "  } else {\n"
            "    threadgroup_barrier(mem_flags::mem_threadgroup);\n"
            "  }\n"
        )
        return _replace_once(body, _GEMM_BARRIER, split, occurrence=0)
    if kind == "tg_oob":
        return _replace_once(body, _GEMM_INNER, "  for (int p = 0; p <= TILE; ++p) {\n")
    if kind == "typo":
        return _replace_once(body, _GEMM_ROW, "cnost int row = int(threadgroup_position_in_grid.y) * TILE + ty;\n")
    raise ValueError(kind)


# ---------------------------------------------------------------------------
# SIMD-group and quad-group collectives
# ---------------------------------------------------------------------------

# One collective per launch, chosen by the uniform scalar `op`. Lanes whose bit in
# `mask` is clear skip it (divergence) and keep their input. y gets value results,
# u vote results (low 32 bits of a ballot, or 0/1 for all/any). `src` holds each
# thread's shuffle/broadcast source lane, `d` the uniform shuffle_xor mask or
# shuffle_up/down delta. Votes test v > 0.
SIMD_OPS = """\
const uint gid = thread_position_in_grid.x;
const uint lane = thread_index_in_simdgroup;
const float v = x[gid];
float r = v;
uint b = 0;
if ((mask >> lane) & 1u) {
  switch (op) {
    case 0: r = simd_sum(v); break;
    case 1: r = simd_max(v); break;
    case 2: r = simd_min(v); break;
    case 3: r = simd_prefix_inclusive_sum(v); break;
    case 4: r = simd_prefix_exclusive_sum(v); break;
    case 5: r = simd_shuffle(v, ushort(src[gid])); break;
    case 6: r = simd_shuffle_xor(v, ushort(d)); break;
    case 7: r = simd_shuffle_up(v, ushort(d)); break;
    case 8: r = simd_shuffle_down(v, ushort(d)); break;
    case 9: r = simd_broadcast(v, ushort(src[gid])); break;
    case 10: b = uint(uint64_t(simd_ballot(v > 0.0f)) & 0xFFFFFFFFull); break;
    case 11: b = simd_all(v > 0.0f) ? 1u : 0u; break;
    case 12: b = simd_any(v > 0.0f) ? 1u : 0u; break;
    case 13: r = quad_sum(v); break;
    case 14: r = simd_prefix_inclusive_product(v); break;
    case 15: r = simd_prefix_exclusive_product(v); break;
    default: break;
  }
}
y[gid] = r;
u[gid] = b;
"""
SIMD_OP_CODES = {
    "sum": 0,
    "max": 1,
    "min": 2,
    "prefix_inclusive_sum": 3,
    "prefix_exclusive_sum": 4,
    "shuffle": 5,
    "shuffle_xor": 6,
    "shuffle_up": 7,
    "shuffle_down": 8,
    "broadcast": 9,
    "ballot": 10,
    "all": 11,
    "any": 12,
    "quad_sum": 13,
    "prefix_inclusive_product": 14,
    "prefix_exclusive_product": 15,
}

# ---------------------------------------------------------------------------
# simdgroup_matrix
# ---------------------------------------------------------------------------

SIMDGROUP_MATRIX_HEADER = "#include <metal_simdgroup_matrix>\n"

# C (float) = A @ B with 8x8 simdgroup_matrix MMAs: T fragments (float or half), float
# accumulators. Threadgroup (64, 2, 1) = 4 simdgroups (2x2), each owning one 8x8 block
# of the threadgroup's 16x16 output tile. K runs in steps of 8 through zero-padded
# threadgroup tiles; the result goes through simdgroup_store into threadgroup memory
# and is copied out with bounds checks. Grid (64 * ceil(N / 16), 2 * ceil(M / 16), 1).
MMA_GEMM = """\
const int M = A_shape[0], K = A_shape[1], N = B_shape[1];
const uint tid = thread_index_in_threadgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int wm = int(sg) / 2, wn = int(sg) % 2;
const int row0 = int(threadgroup_position_in_grid.y) * 16;
const int col0 = int(threadgroup_position_in_grid.x) * 16;
threadgroup T As[16][8];
threadgroup T Bs[8][16];
threadgroup float Cs[16][16];
simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
for (int k0 = 0; k0 < K; k0 += 8) {
  const int i = int(tid) / 8, p = int(tid) % 8;
  As[i][p] = (row0 + i < M && k0 + p < K) ? T(A[(row0 + i) * K + k0 + p]) : T(0);
  const int q = int(tid) / 16, j = int(tid) % 16;
  Bs[q][j] = (k0 + q < K && col0 + j < N) ? T(B[(k0 + q) * N + col0 + j]) : T(0);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_matrix<T, 8, 8> fa;
  simdgroup_matrix<T, 8, 8> fb;
  simdgroup_load(fa, &As[wm * 8][0], 8);
  simdgroup_load(fb, &Bs[0][wn * 8], 16);
  simdgroup_multiply_accumulate(acc, fa, fb, acc);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
simdgroup_store(acc, &Cs[wm * 8][wn * 8], 16);
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint e = tid; e < 256u; e += 128u) {
  const int i = int(e) / 16, j = int(e) % 16;
  if (row0 + i < M && col0 + j < N) {
    C[(row0 + i) * N + col0 + j] = Cs[i][j];
  }
}
"""

# The register layout of an 8x8 simdgroup_matrix: one simdgroup loads the row-major
# 8x8 matrix `src` and every lane writes the two values it holds in thread_elements().
SIMDGROUP_LAYOUT = """\
const uint lane = thread_index_in_simdgroup;
simdgroup_matrix<float, 8, 8> m;
simdgroup_load(m, src, 8);
const vec<float, 2> e = m.thread_elements();
out[lane * 2] = e[0];
out[lane * 2 + 1] = e[1];
"""

# ---------------------------------------------------------------------------
# Reductions, atomics, dtypes
# ---------------------------------------------------------------------------

# RMS norm, one threadgroup per row: y = T(x * rsqrt(mean(x^2) + eps) * w). Two-level
# reduction: simd_sum per simdgroup, partial sums in threadgroup memory, then simd_sum
# of the partials in simdgroup 0. Threadgroup (threads, 1, 1); grid (threads, rows, 1).
RMS_NORM = """\
const uint row = threadgroup_position_in_grid.y;
const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint nsg = simdgroups_per_threadgroup;
const uint nthreads = threads_per_threadgroup.x;
const uint n = uint(x_shape[1]);
threadgroup float partial[32];
threadgroup float inv_rms;
float acc = 0.0f;
for (uint i = tid; i < n; i += nthreads) {
  const float v = float(x[row * n + i]);
  acc += v * v;
}
acc = simd_sum(acc);
if (lane == 0) {
  partial[sg] = acc;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (sg == 0) {
  float p = lane < nsg ? partial[lane] : 0.0f;
  p = simd_sum(p);
  if (lane == 0) {
    inv_rms = metal::precise::rsqrt(p / float(n) + eps);
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint i = tid; i < n; i += nthreads) {
  y[row * n + i] = T(float(x[row * n + i]) * inv_rms * float(w[i]));
}
"""

# Histogram with device atomics (atomic_outputs=True; outputs zeroed by init_value=0):
# bin b = clamp(floor((x - lo) * scale), 0, nbins - 1); counts[b] += 1 (int32) and
# sums[b] += x (float), both with atomic_fetch_add_explicit.
ATOMIC_HISTOGRAM = """\
const uint i = thread_position_in_grid.x;
if (i < uint(x_shape[0])) {
  const float v = x[i];
  int b = int(metal::floor((v - lo) * scale));
  b = metal::clamp(b, 0, nbins - 1);
  atomic_fetch_add_explicit(&counts[b], 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&sums[b], v, memory_order_relaxed);
}
"""

# Half / bfloat16 I/O (T): copy is the input unchanged (bit-exact round trip), prod is
# a * b computed in T, mixed is a * b + a computed in float and rounded to T once.
LOW_PRECISION = """\
const uint i = thread_position_in_grid.x;
if (i < uint(a_shape[0])) {
  copy[i] = a[i];
  prod[i] = a[i] * b[i];
  mixed[i] = T(float(a[i]) * float(b[i]) + float(a[i]));
}
"""

# Template arguments (T dtype, SCALE int, NEG bool) with 0-d scalar inputs (alpha from
# a Python float, beta from a Python int): out = T(+-(x * alpha * SCALE + beta)).
SCALAR_TEMPLATE = """\
const uint i = thread_position_in_grid.x;
if (i < uint(x_shape[0])) {
  const float r = float(x[i]) * alpha * float(SCALE) + float(beta);
  out[i] = T(NEG ? -r : r);
}
"""

# Row-major gather of a possibly strided input (ensure_row_contiguous=False):
# out[i] = 2 * inp[elem_to_loc(i, ...)] + 1, and seen[d] = inp_strides[d] (the strides
# the kernel was given, in elements).
STRIDED_GATHER = """\
const uint i = thread_position_in_grid.x;
uint total = 1;
for (int d = 0; d < inp_ndim; ++d) {
  total *= uint(inp_shape[d]);
}
if (i < total) {
  out[i] = 2.0f * inp[elem_to_loc(i, inp_shape, inp_strides, inp_ndim)] + 1.0f;
}
if (i < uint(inp_ndim)) {
  seen[i] = int(inp_strides[i]);
}
"""

# float4 / half4 vector loads and stores, 4 elements per thread: swizzle, vector
# arithmetic, float4(half4) conversion and dot.
VEC4 = """\
const uint i = thread_position_in_grid.x;
if (i < uint(xf_shape[0]) / 4) {
  const float4 a = reinterpret_cast<const device float4*>(xf)[i];
  const half4 h = reinterpret_cast<const device half4*>(xh)[i];
  const float4 hf = float4(h);
  reinterpret_cast<device float4*>(yf)[i] = a.wzyx * 2.0f + hf;
  reinterpret_cast<device half4*>(yh)[i] = half4(a * hf) + h;
  dots[i] = dot(a, hf);
}
"""

# metal::precise:: and metal::fast:: math on x in (0.1, 3): one output column each.
MATH_NAMESPACES = """\
const uint i = thread_position_in_grid.x;
if (i < uint(x_shape[0])) {
  const float v = x[i];
  device float* o = out + i * 8;
  o[0] = metal::precise::exp(v);
  o[1] = metal::precise::log(v);
  o[2] = metal::precise::rsqrt(v);
  o[3] = metal::precise::tanh(v - 1.5f);
  o[4] = metal::precise::sin(v);
  o[5] = metal::fast::exp(v);
  o[6] = metal::fast::log(v);
  o[7] = metal::fast::tanh(v - 1.5f);
}
"""
MATH_NAMESPACES_COLUMNS = (
    ("precise::exp", "precise"),
    ("precise::log", "precise"),
    ("precise::rsqrt", "precise"),
    ("precise::tanh", "precise"),
    ("precise::sin", "precise"),
    ("fast::exp", "fast"),
    ("fast::log", "fast"),
    ("fast::tanh", "fast"),
)

# Launch attributes of every thread, on a grid that is not a multiple of the
# threadgroup: info[t] = threads_per_threadgroup (actual size of this, possibly edge,
# group), dispatch_threads_per_threadgroup (requested size), thread_position_in_threadgroup,
# threadgroup_position_in_grid, with t the linear thread position in the grid.
LAUNCH_ATTRIBUTES = """\
const uint3 g = thread_position_in_grid;
const uint3 n = threads_per_grid;
device int* o = info + ((g.z * n.y + g.y) * n.x + g.x) * 12;
const uint3 a = threads_per_threadgroup;
const uint3 b = dispatch_threads_per_threadgroup;
const uint3 c = thread_position_in_threadgroup;
const uint3 e = threadgroup_position_in_grid;
o[0] = int(a.x); o[1] = int(a.y); o[2] = int(a.z);
o[3] = int(b.x); o[4] = int(b.y); o[5] = int(b.z);
o[6] = int(c.x); o[7] = int(c.y); o[8] = int(c.z);
o[9] = int(e.x); o[10] = int(e.y); o[11] = int(e.z);
"""

# Elementwise op over a 3-D grid (one thread per element of x (D, H, W)):
# out[z, y, x] = 2 * x[z, y, x] + (100 x + 10 y + z).
GRID_3D = """\
const uint3 g = thread_position_in_grid;
const uint D = uint(x_shape[0]), H = uint(x_shape[1]), W = uint(x_shape[2]);
if (g.x < W && g.y < H && g.z < D) {
  const uint idx = (g.z * H + g.y) * W + g.x;
  out[idx] = 2.0f * x[idx] + float(100 * g.x + 10 * g.y + g.z);
}
"""

# ---------------------------------------------------------------------------
# Infrastructure
# ---------------------------------------------------------------------------

# out = exp(inp) elementwise, guarded by the input size.
EXP = """\
const uint i = thread_position_in_grid.x;
if (i < uint(inp_shape[0])) {
  out[i] = metal::exp(inp[i]);
}
"""

# Writes 1 if the kernel was compiled with __FAST_MATH__ defined (math_mode "fast"), else 0.
FAST_MATH_PROBE = """\
const uint i = thread_position_in_grid.x;
#ifdef __FAST_MATH__
out[i] = 1.0f + 0.0f * inp[i];
#else
out[i] = 0.0f * inp[i];
#endif
"""


def unique_axpy(tag: int) -> str:
    """out = inp * 3 + 1, with `tag` in a comment so that the text (and the compiled
    library) is new: for the on-disk cache tests."""
    return (
        f"// cache test {tag}\n"
        "const uint i = thread_position_in_grid.x;\n"
        "if (i < uint(inp_shape[0])) {\n"
        "  out[i] = inp[i] * 3.0f + 1.0f;\n"
        "}\n"
    )
