// simdgroup_matrix.h
// simdgroup_matrix<T, 8, 8>, simdgroup_load / store, simdgroup_multiply(_accumulate) for CUDA
// (layout and xk_frag_coord: compat.h).
// Included after compat.h by xlstm_kernels.cuda.kernel when a kernel's text needs it.
#ifndef XLSTM_CUDA_SIMDGROUP_MATRIX_H
#define XLSTM_CUDA_SIMDGROUP_MATRIX_H
namespace mlx::core::cu {

// Tensor-core operands (groupID g = lane / 4, t = lane % 4). The elements themselves are
// mma.m16n8k8's A operand (rows 0-7 of its 16 x 8: {M[g][2t], M[g][2t+1]}) and its
// accumulator; 2-byte matrices (half, bfloat) also keep the B operand
//   xk_b_ = {M[2t][g], M[2t+1][g]}    (8 x 8, "col")
// filled by simdgroup_load, make_filled_simdgroup_matrix, the diagonal constructor and a
// product; an element written through thread_elements() would leave it stale, so the
// non-const accessor is refused for 2-byte matrices at compile time (no body does it).
// An unused xk_b_ costs nothing: the compiler drops the loads that feed no product.
namespace msl_detail {
template <class T, bool TC = (sizeof(T) == 2)> struct mma_frags {};
template <class T> struct mma_frags<T, true> {
  unsigned xk_b_;
};
// The two elements at p and the next address form one 4-byte-aligned word of T (2-byte
// T read as T; `strided` != 0: they are not adjacent).
template <class T, class U> inline bool word_pair(const U* p, int strided) {
  if constexpr (sizeof(T) == 2 && same<T, U>::v) {
    return strided == 0 && (reinterpret_cast<size_t>(p) & 3) == 0;
  } else {
    return false;
  }
}
template <class T> inline unsigned pack2(T x0, T x1) {
  vec<T, 2> v;
  v.v[0] = x0;
  v.v[1] = x1;
  return *reinterpret_cast<const unsigned*>(&v);
}
}  // namespace msl_detail

template <typename T, int Cols, int Rows>
struct simdgroup_matrix : msl_detail::mma_frags<T> {
  static_assert(Cols == 8 && Rows == 8, "only 8x8 simdgroup matrices are supported");
  vec<T, 2> elements_;
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diag) {
    int r, c;
    msl_detail::lane_coord(msl_detail::lane_id(), r, c);
    const T z = msl_detail::conv<T>(0.0f);
    elements_[0] = r == c ? diag : z;
    elements_[1] = r == c + 1 ? diag : z;
    if constexpr (sizeof(T) == 2) {
      const int g = int(msl_detail::lane_id() / 4), t = int(msl_detail::lane_id() % 4);
      this->xk_b_ = msl_detail::pack2<T>(g == 2 * t ? diag : z, g == 2 * t + 1 ? diag : z);
    }
  }
  template <class U = T> vec<U, 2>& thread_elements() {
    static_assert(sizeof(U) != 2, "xlstm_kernels.cuda: writing elements of a half/bfloat simdgroup_matrix "
                                  "is not supported (its tensor-core fragments would go stale)");
    return elements_;
  }
  const vec<T, 2>& thread_elements() const { return elements_; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <typename T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.elements_[0] = value;
  m.elements_[1] = value;
  if constexpr (sizeof(T) == 2) m.xk_b_ = msl_detail::pack2<T>(value, value);
  return m;
}

// Each lane loads or stores only its own elements (2-byte matrices: also its fragments).
template <typename T, typename U, int C, int R>
inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, const U* src, unsigned long elements_per_row = 8,
                           vec<unsigned long, 2> matrix_origin = vec<unsigned long, 2>(0, 0),
                           bool transpose_matrix = false) {
  int r, c;
  const uint lane = msl_detail::lane_id();
  msl_detail::lane_coord(lane, r, c);
  const long ld = long(elements_per_row);
  const U* base = src + long(matrix_origin.y) * ld + long(matrix_origin.x);
  // M[i][j] = base[i * si + j * sj]
  const long si = transpose_matrix ? 1 : ld, sj = transpose_matrix ? ld : 1;
  // A pair of 2-byte elements that lies in one aligned 32-bit word is read as that word.
  const U* pe = base + r * si + c * sj;  // M[r][c], M[r][c + 1]
  if (msl_detail::word_pair<T, U>(pe, transpose_matrix ? 2 : 0)) {
    d.elements_ = *reinterpret_cast<const vec<T, 2>*>(pe);
  } else {
    d.elements_[0] = msl_detail::conv<T>(pe[0]);
    d.elements_[1] = msl_detail::conv<T>(pe[sj]);
  }
  if constexpr (sizeof(T) == 2) {
    const long g = long(lane / 4), t2 = 2 * long(lane % 4);
    const U* pb = base + t2 * si + g * sj;  // M[2t][g], M[2t + 1][g]
    if (msl_detail::word_pair<T, U>(pb, transpose_matrix ? 0 : 2)) {
      d.xk_b_ = *reinterpret_cast<const unsigned*>(pb);
    } else {
      d.xk_b_ = msl_detail::pack2<T>(msl_detail::conv<T>(pb[0]), msl_detail::conv<T>(pb[si]));
    }
  }
}

template <typename T, typename U, int C, int R>
inline void simdgroup_store(const simdgroup_matrix<T, C, R>& d, U* dst, unsigned long elements_per_row = 8,
                            vec<unsigned long, 2> matrix_origin = vec<unsigned long, 2>(0, 0),
                            bool transpose_matrix = false) {
  int r, c;
  msl_detail::lane_coord(msl_detail::lane_id(), r, c);
  const long ld = long(elements_per_row);
  U* base = dst + long(matrix_origin.y) * ld + long(matrix_origin.x);
  if (transpose_matrix) {
    base[long(c) * ld + r] = msl_detail::conv<U>(d.elements_[0]);
    base[long(c + 1) * ld + r] = msl_detail::conv<U>(d.elements_[1]);
  } else {
    base[long(r) * ld + c] = msl_detail::conv<U>(d.elements_[0]);
    base[long(r) * ld + c + 1] = msl_detail::conv<U>(d.elements_[1]);
  }
}

// D = A * B (+ C), accumulated in float.
// * A and B both half or both bfloat (sm_80+): one tensor-core mma.m16n8k8 (rows 8-15 of
//   its A are zero); A, C and D are already in its layout, B is the kept xk_b_: no shuffles.
// * otherwise, in float on the CUDA cores: lane (r, c) gathers row r of A and columns
//   c, c + 1 of B with 24 shuffles (12 for half / bfloat); float stays float32-exact.
// All 32 lanes take part, as on Metal.
namespace msl_detail {
// The two elements of lane `src`'s fragment, as floats (2-byte types in one shuffle).
template <class T> inline void shfl_pair(unsigned mask, const vec<T, 2>& e, int src, float& x0, float& x1) {
  if constexpr (sizeof(T) == 2) {
    const unsigned p = __shfl_sync(mask, *reinterpret_cast<const unsigned*>(&e), src);
    vec<T, 2> r;
    *reinterpret_cast<unsigned*>(&r) = p;
    x0 = conv<float>(r.v[0]);
    x1 = conv<float>(r.v[1]);
  } else {
    x0 = __shfl_sync(mask, conv<float>(e.v[0]), src);
    x1 = __shfl_sync(mask, conv<float>(e.v[1]), src);
  }
}
template <class TA, class TB>
inline void mma8_cores(float& d0, float& d1, const simdgroup_matrix<TA, 8, 8>& a, const simdgroup_matrix<TB, 8, 8>& b) {
  const unsigned mask = __activemask();
  const uint lane = lane_id();
  int r, c;
  lane_coord(lane, r, c);
  const int pc = c >> 1;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    float x0, x1, y00, y01, y10, y11;
    shfl_pair(mask, a.elements_, lane_of(r, p), x0, x1);           // A[r][2p], A[r][2p+1]
    shfl_pair(mask, b.elements_, lane_of(2 * p, pc), y00, y01);     // B[2p][c], B[2p][c+1]
    shfl_pair(mask, b.elements_, lane_of(2 * p + 1, pc), y10, y11); // B[2p+1][c], B[2p+1][c+1]
    d0 = fmaf(x0, y00, d0);
    d1 = fmaf(x0, y01, d1);
    d0 = fmaf(x1, y10, d0);
    d1 = fmaf(x1, y11, d1);
  }
}
template <class TA, class TB> struct tensor_core_pair {
  static constexpr bool v = false;
};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <> struct tensor_core_pair<::__half, ::__half> { static constexpr bool v = true; };
template <> struct tensor_core_pair<::__nv_bfloat16, ::__nv_bfloat16> { static constexpr bool v = true; };
#endif
// {d0, d1} = rows 0-7 of A * B + {c0, c1}, A and B 2-byte operands (packed pairs).
template <class T> inline void mma_m16n8k8(float& d0, float& d1, unsigned a, unsigned b, float c0, float c1) {
  float d2, d3;
  if constexpr (same<T, ::__nv_bfloat16>::v) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
                 : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)
                 : "r"(a), "r"(0u), "r"(b), "f"(c0), "f"(c1), "f"(0.0f), "f"(0.0f));
  } else {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
                 : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)
                 : "r"(a), "r"(0u), "r"(b), "f"(c0), "f"(c1), "f"(0.0f), "f"(0.0f));
  }
  (void)d2;
  (void)d3;
}
template <class TD, class TA, class TB, class TC>
inline void simdgroup_mma(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                          const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>* c) {
  float d0 = c ? conv<float>(c->elements_[0]) : 0.0f;
  float d1 = c ? conv<float>(c->elements_[1]) : 0.0f;
  if constexpr (tensor_core_pair<TA, TB>::v) {
    mma_m16n8k8<TA>(d0, d1, *reinterpret_cast<const unsigned*>(&a.elements_), b.xk_b_, d0, d1);
  } else {
    mma8_cores(d0, d1, a, b);
  }
  if constexpr (sizeof(TD) == 2) {
    // xk_b_ = {D[2t][g], D[2t+1][g]}: element g % 2 of lanes lane_of(2t, g / 2), lane_of(2t + 1, g / 2)
    const unsigned mask = 0xFFFFFFFFu;
    const uint lane = lane_id();
    const int g = int(lane / 4), t = int(lane % 4);
    const unsigned mine = pack2<TD>(conv<TD>(d0), conv<TD>(d1));
    const unsigned e0 = __shfl_sync(mask, mine, lane_of(2 * t, g / 2));
    const unsigned e1 = __shfl_sync(mask, mine, lane_of(2 * t + 1, g / 2));
    const unsigned sh = (g & 1) ? 16u : 0u;
    d.xk_b_ = ((e0 >> sh) & 0xFFFFu) | (((e1 >> sh) & 0xFFFFu) << 16);
  }
  d.elements_[0] = conv<TD>(d0);
  d.elements_[1] = conv<TD>(d1);
}
}  // namespace msl_detail

template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c) {
  msl_detail::simdgroup_mma(d, a, b, &c);
}

template <class TD, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b) {
  msl_detail::simdgroup_mma(d, a, b, static_cast<const simdgroup_matrix<TD, 8, 8>*>(nullptr));
}


// ---- metal_src/_simdgroup.metal's GEMM building blocks on tensor cores ---------------------
// xk_mma2 / xk_mma2_k16: two 8x8 row blocks sharing B fragments, i.e. all 16 rows of one
// mma.m16n8k8 / mma.m16n8k16 (the fragments' registers are its A / B / C operands as
// they are: A {a0 rows 0-7, a1 rows 8-15} (k16: then the second k half), B {b.xk_b_},
// C/D {acc0, acc1}). Float accumulators with half x half or bfloat x bfloat operands
// only; anything else runs the simdgroup_multiply_accumulate calls of the portable form
// (float stays float32-exact).
// xk_frag_load_a / _b: one ldmatrix (.trans as the layout needs) of the registers of the
// fragment's role when the source is threadgroup memory with 16-byte aligned rows; the
// other role's registers are left unset. Otherwise simdgroup_load.
// xk_async_copy: cp.async of 4, 8 or 16 bytes (global -> shared, L1 bypassed for 16)
// when both addresses are aligned to the size, else a synchronous element copy;
// xk_async_commit / xk_async_wait<G>: cp.async.commit_group / wait_group G.
#define XK_SIMDGROUP_MMA
#define XK_ASYNC_COPY
#define XK_UNROLL _Pragma("unroll")
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define XK_SM80_ 1  // ldmatrix, cp.async (older GPUs: the plain loads and copies)
#else
#define XK_SM80_ 0
#endif
namespace msl_detail {
template <class TD, class TA, class TB> struct tc_f32acc {
  static constexpr bool v = same<TD, float>::v && tensor_core_pair<TA, TB>::v;
};
template <class T> inline void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (same<T, ::__nv_bfloat16>::v) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
template <class T> inline void mma_m16n8k8_full(float (&d)[4], unsigned a0, unsigned a1, unsigned b) {
  if constexpr (same<T, ::__nv_bfloat16>::v) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b));
  } else {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b));
  }
}
template <class T> inline unsigned word_of(const simdgroup_matrix<T, 8, 8>& m) {
  return *reinterpret_cast<const unsigned*>(&m.elements_);
}
// %laneid read as a pure value (no `volatile`): one read per thread that the compiler may
// hoist out of loops and share between fragment loads (compat.h's lane_id() is volatile,
// so every call would re-read it and redo the address arithmetic around it).
inline uint lane_id_pure() {
  uint r;
  asm("mov.u32 %0, %%laneid;" : "=r"(r));
  return r;
}
// ldmatrix .x1 (.trans): lanes 0-7 give the addresses of the 8 rows of an 8x8 b16 matrix.
template <bool TRANS> inline unsigned ldsm_x1(const void* row) {
  const unsigned a = unsigned(__cvta_generic_to_shared(row));
  unsigned r;
  if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];" : "=r"(r) : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r) : "r"(a));
  }
  return r;
}
// The 8 stored rows start at src + i * ld (i < 8) and ldmatrix can read them.
template <class T, class U> inline bool ldsm_ok(const U* src, unsigned long ld) {
  if constexpr (XK_SM80_ && sizeof(T) == 2 && same<T, U>::v) {
    return __isShared(src) && ((reinterpret_cast<size_t>(src) | size_t(ld * 2)) & 15) == 0;
  } else {
    return false;
  }
}
}  // namespace msl_detail

template <class TC, class TA, class TB>
inline void xk_mma2(simdgroup_matrix<TC, 8, 8>& acc0, simdgroup_matrix<TC, 8, 8>& acc1,
                    const simdgroup_matrix<TA, 8, 8>& a0, const simdgroup_matrix<TA, 8, 8>& a1,
                    const simdgroup_matrix<TB, 8, 8>& b) {
  if constexpr (msl_detail::tc_f32acc<TC, TA, TB>::v) {
    float d[4] = {acc0.elements_[0], acc0.elements_[1], acc1.elements_[0], acc1.elements_[1]};
    msl_detail::mma_m16n8k8_full<TA>(d, msl_detail::word_of(a0), msl_detail::word_of(a1), b.xk_b_);
    acc0.elements_[0] = d[0];
    acc0.elements_[1] = d[1];
    acc1.elements_[0] = d[2];
    acc1.elements_[1] = d[3];
  } else {
    simdgroup_multiply_accumulate(acc0, a0, b, acc0);
    simdgroup_multiply_accumulate(acc1, a1, b, acc1);
  }
}

template <class TC, class TA, class TB>
inline void xk_mma2_k16(simdgroup_matrix<TC, 8, 8>& acc0, simdgroup_matrix<TC, 8, 8>& acc1,
                        const simdgroup_matrix<TA, 8, 8>& a00, const simdgroup_matrix<TA, 8, 8>& a10,
                        const simdgroup_matrix<TA, 8, 8>& a01, const simdgroup_matrix<TA, 8, 8>& a11,
                        const simdgroup_matrix<TB, 8, 8>& b0, const simdgroup_matrix<TB, 8, 8>& b1) {
  if constexpr (msl_detail::tc_f32acc<TC, TA, TB>::v) {
    float d[4] = {acc0.elements_[0], acc0.elements_[1], acc1.elements_[0], acc1.elements_[1]};
    const unsigned a[4] = {msl_detail::word_of(a00), msl_detail::word_of(a10), msl_detail::word_of(a01),
                           msl_detail::word_of(a11)};
    msl_detail::mma_m16n8k16<TA>(d, a, b0.xk_b_, b1.xk_b_);
    acc0.elements_[0] = d[0];
    acc0.elements_[1] = d[1];
    acc1.elements_[0] = d[2];
    acc1.elements_[1] = d[3];
  } else {
    simdgroup_multiply_accumulate(acc0, a00, b0, acc0);
    simdgroup_multiply_accumulate(acc0, a01, b1, acc0);
    simdgroup_multiply_accumulate(acc1, a10, b0, acc1);
    simdgroup_multiply_accumulate(acc1, a11, b1, acc1);
  }
}

// Left operand role: elements_ = M[g][2t], M[g][2t + 1].
template <typename T, int C, int R, typename U>
inline void xk_frag_load_a(simdgroup_matrix<T, C, R>& m, const U* src, unsigned long elements_per_row,
                           bool transpose) {
  if (msl_detail::ldsm_ok<T, U>(src, elements_per_row)) {
    const U* row = src + long(msl_detail::lane_id_pure() & 7u) * long(elements_per_row);
    const unsigned w = transpose ? msl_detail::ldsm_x1<true>(row) : msl_detail::ldsm_x1<false>(row);
    *reinterpret_cast<unsigned*>(&m.elements_) = w;
  } else {
    simdgroup_load(m, src, elements_per_row, vec<unsigned long, 2>(0, 0), transpose);
  }
}

// Right operand role: 2-byte matrices fill xk_b_ = M[2t][g], M[2t + 1][g]; others elements_.
template <typename T, int C, int R, typename U>
inline void xk_frag_load_b(simdgroup_matrix<T, C, R>& m, const U* src, unsigned long elements_per_row,
                           bool transpose) {
  if constexpr (sizeof(T) == 2) {
    if (msl_detail::ldsm_ok<T, U>(src, elements_per_row)) {
      const U* row = src + long(msl_detail::lane_id_pure() & 7u) * long(elements_per_row);
      m.xk_b_ = transpose ? msl_detail::ldsm_x1<false>(row) : msl_detail::ldsm_x1<true>(row);
      return;
    }
  }
  simdgroup_load(m, src, elements_per_row, vec<unsigned long, 2>(0, 0), transpose);
}

// xk_frag_load_a4 / _b4: the four fragments of a 16 x 16 block (m<r><c> at rows 8r,
// columns 8c) with one ldmatrix.x4 (.trans as the layout and role need): lanes 8f .. 8f+7
// address the rows of fragment f = m00, m10, m01, m11. The caller guarantees threadgroup
// memory with 16-byte aligned rows (no checks). Other types: four simdgroup_loads.
namespace msl_detail {
template <bool TRANS> inline void ldsm_x4(unsigned (&r)[4], unsigned a) {
  if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  }
}
// This lane's row address for an x4 load of the 16 x 16 block at src, as a 32-bit shared
// address: src's shared address plus a per-lane element offset (int arithmetic; the
// offset depends only on the lane and ld, so it is computed once per loop).
template <class U> inline unsigned ldsm_x4_row(const U* src, unsigned long ld, bool transpose) {
  const int l = int(lane_id_pure());
  const int rr = l & 7, ro = (l & 8), co = (l & 16) >> 1;  // row in fragment, its block's row / column offset
  const unsigned off = unsigned(transpose ? (co + rr) * int(ld) + ro : (ro + rr) * int(ld) + co) * unsigned(sizeof(U));
  // The add is kept opaque so that the lane's offset stays one value shared by every load
  // with this ld (instead of being folded into each load's own base).
  unsigned a;
  asm("add.u32 %0, %1, %2;" : "=r"(a) : "r"(unsigned(__cvta_generic_to_shared(src))), "r"(off));
  return a;
}
template <class T, class U> struct ldsm4_ok {
  static constexpr bool v = XK_SM80_ && sizeof(T) == 2 && same<T, U>::v;
};
template <class T, class U>
inline void frag_load4_plain(simdgroup_matrix<T, 8, 8>& m00, simdgroup_matrix<T, 8, 8>& m10,
                             simdgroup_matrix<T, 8, 8>& m01, simdgroup_matrix<T, 8, 8>& m11, const U* src,
                             unsigned long ld, bool transpose) {
  const vec<unsigned long, 2> o(0, 0);
  simdgroup_load(m00, src, ld, o, transpose);
  simdgroup_load(m10, src + (transpose ? 8 : 8 * long(ld)), ld, o, transpose);
  simdgroup_load(m01, src + (transpose ? 8 * long(ld) : 8), ld, o, transpose);
  simdgroup_load(m11, src + 8 * long(ld) + 8, ld, o, transpose);
}
}  // namespace msl_detail

namespace msl_detail {
// One ldmatrix.x4 from this lane's row address into the four fragments' registers of the
// left (A: ldsm4_a) or right (B: ldsm4_b) operand role (.trans as layout and role need).
template <class T> inline void ldsm4_a(simdgroup_matrix<T, 8, 8>& m00, simdgroup_matrix<T, 8, 8>& m10,
                                       simdgroup_matrix<T, 8, 8>& m01, simdgroup_matrix<T, 8, 8>& m11,
                                       unsigned row, bool transpose) {
  unsigned r[4];
  if (transpose) {
    ldsm_x4<true>(r, row);
  } else {
    ldsm_x4<false>(r, row);
  }
  *reinterpret_cast<unsigned*>(&m00.elements_) = r[0];
  *reinterpret_cast<unsigned*>(&m10.elements_) = r[1];
  *reinterpret_cast<unsigned*>(&m01.elements_) = r[2];
  *reinterpret_cast<unsigned*>(&m11.elements_) = r[3];
}
template <class T> inline void ldsm4_b(simdgroup_matrix<T, 8, 8>& m00, simdgroup_matrix<T, 8, 8>& m10,
                                       simdgroup_matrix<T, 8, 8>& m01, simdgroup_matrix<T, 8, 8>& m11,
                                       unsigned row, bool transpose) {
  unsigned r[4];
  if (transpose) {
    ldsm_x4<false>(r, row);
  } else {
    ldsm_x4<true>(r, row);
  }
  m00.xk_b_ = r[0];
  m10.xk_b_ = r[1];
  m01.xk_b_ = r[2];
  m11.xk_b_ = r[3];
}
}  // namespace msl_detail

template <typename T, typename U>
inline void xk_frag_load_a4(simdgroup_matrix<T, 8, 8>& m00, simdgroup_matrix<T, 8, 8>& m10,
                            simdgroup_matrix<T, 8, 8>& m01, simdgroup_matrix<T, 8, 8>& m11, const U* src,
                            unsigned long elements_per_row, bool transpose) {
  if constexpr (msl_detail::ldsm4_ok<T, U>::v) {
    msl_detail::ldsm4_a(m00, m10, m01, m11, msl_detail::ldsm_x4_row(src, elements_per_row, transpose), transpose);
  } else {
    msl_detail::frag_load4_plain(m00, m10, m01, m11, src, elements_per_row, transpose);
  }
}

template <typename T, typename U>
inline void xk_frag_load_b4(simdgroup_matrix<T, 8, 8>& m00, simdgroup_matrix<T, 8, 8>& m10,
                            simdgroup_matrix<T, 8, 8>& m01, simdgroup_matrix<T, 8, 8>& m11, const U* src,
                            unsigned long elements_per_row, bool transpose) {
  if constexpr (msl_detail::ldsm4_ok<T, U>::v) {
    msl_detail::ldsm4_b(m00, m10, m01, m11, msl_detail::ldsm_x4_row(src, elements_per_row, transpose), transpose);
  } else {
    msl_detail::frag_load4_plain(m00, m10, m01, m11, src, elements_per_row, transpose);
  }
}

// Swizzled tiles (XK_TILE_SWIZZLE): a tile of rows of ld 2-byte elements, ld * 2 a multiple
// of 128 bytes, no padding, where the 16-byte chunk c of row r is stored at chunk
// c ^ (r & 7) of that row. The eight rows an ldmatrix reads at one chunk then sit in eight
// different bank groups, and a cp.async of a row's 128 bytes fills whole 128-byte lines
// (a padded row of 144 bytes straddles two: Nsight Compute, session 6, counted 24 L2
// sectors per 16-sector warp copy and 2.6x the shared-memory wavefronts).
// xk_tile_swz(r, c): the element offset of (r, c) (c a multiple of 8) in such a tile.
// xk_frag_load_a4_sw / _b4_sw: xk_frag_load_a4 / _b4 of the 16 x 16 block at element
// (r0, c0) of the swizzled tile at `tile` (r0 a multiple of 8, c0 of 16).
#define XK_TILE_SWIZZLE XK_SM80_
inline int xk_tile_swz(int r, int c, int ld) {
  return r * ld + ((((c >> 3) ^ r) & 7) | ((c >> 3) & ~7)) * 8;
}
namespace msl_detail {
// This lane's row address: element (r0 + lr, c0 + lc) of the tile, swizzled. With r0 a
// multiple of 8 and c0 of 16 that is (r0 + lr) * ld + (c0 ^ kx), kx = ((lc / 8) ^ (lr & 7)) * 8
// depending on the lane only (one XOR per distinct c0 of the unrolled loops).
template <class U> inline unsigned ldsm_x4_row_sw(const U* tile, int r0, int c0, int ld, bool transpose) {
  const int l = int(lane_id_pure());
  const int rr = l & 7, ro = (l & 8), co = (l & 16) >> 1;
  const int lr = transpose ? co + rr : ro + rr;  // this lane's row and column offsets in memory
  const int lc = transpose ? ro : co;
  const int kx = (lc ^ (rr << 3)) & 56;
  return unsigned(__cvta_generic_to_shared(tile)) + unsigned((r0 + lr) * ld + (c0 ^ kx)) * unsigned(sizeof(U));
}
}  // namespace msl_detail

template <typename T, typename U>
inline void xk_frag_load_a4_sw(simdgroup_matrix<T, 8, 8>& m00, simdgroup_matrix<T, 8, 8>& m10,
                               simdgroup_matrix<T, 8, 8>& m01, simdgroup_matrix<T, 8, 8>& m11, const U* tile,
                               int r0, int c0, int ld, bool transpose) {
  if constexpr (msl_detail::ldsm4_ok<T, U>::v) {
    msl_detail::ldsm4_a(m00, m10, m01, m11, msl_detail::ldsm_x4_row_sw(tile, r0, c0, ld, transpose), transpose);
  } else {  // never swizzled (the body's SW needs 2-byte T on sm_80+): a plain tile
    msl_detail::frag_load4_plain(m00, m10, m01, m11, tile + long(r0) * ld + c0, (unsigned long)ld, transpose);
  }
}

template <typename T, typename U>
inline void xk_frag_load_b4_sw(simdgroup_matrix<T, 8, 8>& m00, simdgroup_matrix<T, 8, 8>& m10,
                               simdgroup_matrix<T, 8, 8>& m01, simdgroup_matrix<T, 8, 8>& m11, const U* tile,
                               int r0, int c0, int ld, bool transpose) {
  if constexpr (msl_detail::ldsm4_ok<T, U>::v) {
    msl_detail::ldsm4_b(m00, m10, m01, m11, msl_detail::ldsm_x4_row_sw(tile, r0, c0, ld, transpose), transpose);
  } else {  // never swizzled (the body's SW needs 2-byte T on sm_80+): a plain tile
    msl_detail::frag_load4_plain(m00, m10, m01, m11, tile + long(r0) * ld + c0, (unsigned long)ld, transpose);
  }
}

// xk_async_copy_aligned: cp.async with no checks (the caller guarantees shared dst and
// both addresses aligned to the copy's 4, 8 or 16 bytes); xk_async_runs_aligned: whether
// runs of N elements at src + r * ld + c * N are so aligned (one test, before a loop).
template <int N, typename T> inline void xk_async_copy_aligned(T* dst, const T* src) {
  constexpr int B = N * int(sizeof(T));
  if constexpr (XK_SM80_ && (B == 4 || B == 8 || B == 16)) {
    const unsigned d = unsigned(__cvta_generic_to_shared(dst));
    if constexpr (B == 16) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(d), "l"(src), "n"(B));
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = src[k];
  }
}
// xk_async_copy_aligned_l1: the same through L1 (cp.async.ca for 16 bytes too; MLX's CUDA
// RMSNorm backward stages its rows so).
template <int N, typename T> inline void xk_async_copy_aligned_l1(T* dst, const T* src) {
  constexpr int B = N * int(sizeof(T));
  if constexpr (XK_SM80_ && (B == 4 || B == 8 || B == 16)) {
    const unsigned d = unsigned(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(d), "l"(src), "n"(B));
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = src[k];
  }
}
template <int N, typename T> inline bool xk_async_runs_aligned(const T* src, long ld) {
  constexpr int B = N * int(sizeof(T));
  if constexpr (XK_SM80_ && (B == 4 || B == 8 || B == 16)) {
    return ((reinterpret_cast<size_t>(src) | size_t(ld) * sizeof(T)) & size_t(B - 1)) == 0;
  } else {
    return true;
  }
}

template <int N, typename T> inline void xk_async_copy(T* dst, const T* src) {
  constexpr int B = N * int(sizeof(T));
  if constexpr (XK_SM80_ && (B == 4 || B == 8 || B == 16)) {
    if (__isShared(dst) && ((reinterpret_cast<size_t>(dst) | reinterpret_cast<size_t>(src)) & size_t(B - 1)) == 0) {
      const unsigned d = unsigned(__cvta_generic_to_shared(dst));
      if constexpr (B == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
      } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(d), "l"(src), "n"(B));
      }
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) dst[k] = src[k];
}
#if XK_SM80_
inline void xk_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int G> inline void xk_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(G < 0 ? 0 : G) : "memory");
}
#else
inline void xk_async_commit() {}
template <int G> inline void xk_async_wait() {}
#endif

// ---- Bulk copies (metal_src/_memory.metal's xk_bulk_bar section) ----------------------------
// sm_90: cp.async.bulk global -> shared, each copy completing on an mbarrier (one arrival a
// phase: xk_bulk_expect's arrive.expect_tx by the issuing thread), waited with
// try_wait.parity. Before sm_90 the portable synchronous forms (the issuing thread's stores,
// published by the simdgroup barrier the bodies place after xk_bulk_wait).
#define XK_BULK_COPY
typedef unsigned long long xk_bulk_bar;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
inline unsigned xk_bulk_smem_(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }
inline void xk_bulk_init(xk_bulk_bar* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(xk_bulk_smem_(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
inline void xk_bulk_expect(xk_bulk_bar* bar, unsigned bytes) {
  asm volatile("{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }"
               ::"r"(xk_bulk_smem_(bar)), "r"(bytes) : "memory");
}
template <typename T> inline void xk_bulk_copy(T* dst, const T* src, unsigned n, xk_bulk_bar* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(xk_bulk_smem_(dst)), "l"(src), "r"(unsigned(n * sizeof(T))), "r"(xk_bulk_smem_(bar))
               : "memory");
}
inline void xk_bulk_wait(xk_bulk_bar* bar, unsigned parity) {
  const unsigned b = xk_bulk_smem_(bar);
  unsigned done = 0;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(b), "r"(parity) : "memory");
  } while (!done);
}
template <typename T> inline bool xk_bulk_aligned(const T* p) { return (reinterpret_cast<size_t>(p) & 15u) == 0; }
#else
inline void xk_bulk_init(xk_bulk_bar* bar) { *bar = 0ull; }
inline void xk_bulk_expect(xk_bulk_bar*, unsigned) {}
template <typename T> inline void xk_bulk_copy(T* dst, const T* src, unsigned n, xk_bulk_bar*) {
  for (unsigned k = 0; k < n; ++k) dst[k] = src[k];
}
inline void xk_bulk_wait(xk_bulk_bar*, unsigned) {}
template <typename T> inline bool xk_bulk_aligned(const T*) { return true; }
#endif

// ---- Warpgroup products (gemm_simd and attention_prefill_mma with WG; portable form in ---
// ---- metal_src/_warpgroup.metal) ---------------------------------------------------------
// Hopper's wgmma (sm_90a): each xk_wg_mma issues the BK / 16 products m64nBNk16 of one K
// tile for the four warps of a warpgroup, reading both operands from shared memory through
// descriptors (the 128-byte swizzle: exactly the tiles of xk_tile_wg, whose stage bases
// are 1024-byte aligned), accumulating in float into the warps' fragments (warp 4g + w of
// the block holds rows 16w .. 16w + 15 of the warpgroup's 64 as FM = 2 fragment rows of
// FN = BN / 8 fragments: the same lane layout as mma.sync, so the body's epilogue reads
// them as before). A K-contiguous operand is K-major (A of gemm_av / gemm_a_bt, B of
// gemm_a_bt: rows of 64 elements, 8-row groups 1024 bytes apart, a k-step of 16 is +32
// bytes, and past 64 columns the next panel of the tile's rows); an MN-contiguous one
// MN-major (panels of 64 columns BK * 128 bytes apart, a k-step is +2048 bytes). xk_wg_commit / xk_wg_wait<G>: wgmma.commit_group / wait_group G
// (products of all but the last G commits done, their accumulators readable).
// xk_wg_fence_copies: fence.proxy.async (this thread's finished cp.async writes visible to
// wgmma, which reads through the async proxy), before the barrier that publishes a tile.
// Without sm_90a (or for other shapes) the portable form of _warpgroup.metal runs instead.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define XK_WARPGROUP_MMA
template <typename T, int BM, int BN, int BK, bool TRANS_A, bool TRANS_B> struct xk_wg_queue {};
template <typename Q> inline void xk_wg_init(Q&) {}
namespace msl_detail {
inline unsigned long long wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}
template <int FN> inline void wg_fence_acc(simdgroup_matrix<float, 8, 8>* c) {
#pragma unroll
  for (int k = 0; k < 2 * FN; ++k) {
    asm volatile("" : "+f"(c[k].elements_[0]), "+f"(c[k].elements_[1])::"memory");
  }
}
#define XK_WG_D4(j, FN) "+f"(c[j].elements_[0]), "+f"(c[j].elements_[1]), "+f"(c[FN + j].elements_[0]), \
                        "+f"(c[FN + j].elements_[1])
// The accumulator operands of one m64nN product (N / 2 floats a lane: fragment j and FN + j of
// each 8-column block j), and the instruction's text for element type TY ("bf16" / "f16"): SS
// (both operands from shared memory: descriptors, then the transpose immediates TA, TB) or RS
// (A in 4 registers, B MN-major). One `asm` each, bfloat16 or half by T (XK_WG_ASM).
#define XK_WG_ACC_64 XK_WG_D4(0, 8), XK_WG_D4(1, 8), XK_WG_D4(2, 8), XK_WG_D4(3, 8), XK_WG_D4(4, 8), XK_WG_D4(5, 8), XK_WG_D4(6, 8), XK_WG_D4(7, 8)
#define XK_WG_ACC_128 XK_WG_D4(0, 16), XK_WG_D4(1, 16), XK_WG_D4(2, 16), XK_WG_D4(3, 16), XK_WG_D4(4, 16), XK_WG_D4(5, 16), XK_WG_D4(6, 16), XK_WG_D4(7, 16), XK_WG_D4(8, 16), XK_WG_D4(9, 16), XK_WG_D4(10, 16), XK_WG_D4(11, 16), XK_WG_D4(12, 16), XK_WG_D4(13, 16), XK_WG_D4(14, 16), XK_WG_D4(15, 16)
#define XK_WG_ACC_256 XK_WG_D4(0, 32), XK_WG_D4(1, 32), XK_WG_D4(2, 32), XK_WG_D4(3, 32), XK_WG_D4(4, 32), XK_WG_D4(5, 32), XK_WG_D4(6, 32), XK_WG_D4(7, 32), XK_WG_D4(8, 32), XK_WG_D4(9, 32), XK_WG_D4(10, 32), XK_WG_D4(11, 32), XK_WG_D4(12, 32), XK_WG_D4(13, 32), XK_WG_D4(14, 32), XK_WG_D4(15, 32), XK_WG_D4(16, 32), XK_WG_D4(17, 32), XK_WG_D4(18, 32), XK_WG_D4(19, 32), XK_WG_D4(20, 32), XK_WG_D4(21, 32), XK_WG_D4(22, 32), XK_WG_D4(23, 32), XK_WG_D4(24, 32), XK_WG_D4(25, 32), XK_WG_D4(26, 32), XK_WG_D4(27, 32), XK_WG_D4(28, 32), XK_WG_D4(29, 32), XK_WG_D4(30, 32), XK_WG_D4(31, 32)
#define XK_WG_SS_64(TY) "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
  "%32, %33, p, 1, 1, %35, %36;\n}\n"
#define XK_WG_SS_128(TY) "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
  "%64, %65, p, 1, 1, %67, %68;\n}\n"
#define XK_WG_SS_256(TY) "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " " \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, " \
  "%128, %129, p, 1, 1, %131, %132;\n}\n"
#define XK_WG_RS_64(TY) "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
  "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
#define XK_WG_RS_128(TY) "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
  "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
#define XK_WG_ASM(TEXT, ACC, ...)                                  \
  if constexpr (same<T, ::__nv_bfloat16>::v) {                     \
    asm volatile(TEXT("bf16") : ACC : __VA_ARGS__);                \
  } else {                                                         \
    asm volatile(TEXT("f16") : ACC : __VA_ARGS__);                 \
  }
template <class T, int TA, int TB> inline void wgmma_n64(simdgroup_matrix<float, 8, 8>* c, unsigned long long da,
                                                         unsigned long long db) {
  XK_WG_ASM(XK_WG_SS_64, XK_WG_ACC_64, "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB))
}
template <class T, int TA, int TB> inline void wgmma_n128(simdgroup_matrix<float, 8, 8>* c, unsigned long long da,
                                                         unsigned long long db) {
  XK_WG_ASM(XK_WG_SS_128, XK_WG_ACC_128, "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB))
}
template <class T, int TA, int TB> inline void wgmma_n256(simdgroup_matrix<float, 8, 8>* c, unsigned long long da,
                                                         unsigned long long db) {
  XK_WG_ASM(XK_WG_SS_256, XK_WG_ACC_256, "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB))
}
// m64nNk16 with A in registers (a: the warp's 16 x 16 fragment, mma.sync's A layout), B
// MN-major from shared memory (imm-trans-b 1).
template <class T> inline void wgmma_rs_n64(simdgroup_matrix<float, 8, 8>* c, const unsigned* a,
                                               unsigned long long db) {
  XK_WG_ASM(XK_WG_RS_64, XK_WG_ACC_64, "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1))
}
template <class T> inline void wgmma_rs_n128(simdgroup_matrix<float, 8, 8>* c, const unsigned* a,
                                               unsigned long long db) {
  XK_WG_ASM(XK_WG_RS_128, XK_WG_ACC_128, "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1))
}

#undef XK_WG_ASM
#undef XK_WG_RS_64
#undef XK_WG_RS_128
#undef XK_WG_SS_64
#undef XK_WG_SS_128
#undef XK_WG_SS_256
#undef XK_WG_ACC_64
#undef XK_WG_ACC_128
#undef XK_WG_ACC_256
#undef XK_WG_D4
}  // namespace msl_detail
template <typename T, int BM, int BN, int BK, bool TRANS_A, bool TRANS_B>
inline void xk_wg_mma(xk_wg_queue<T, BM, BN, BK, TRANS_A, TRANS_B>&, simdgroup_matrix<float, 8, 8>* acc, const T* ta,
                      const T* tb, int ra, bool check_aligned = true) {
  if constexpr (sizeof(T) == 2 && BK % 16 == 0 && (BN == 64 || BN == 128 || BN == 256)) {
    const unsigned sa = unsigned(__cvta_generic_to_shared(ta)), sb = unsigned(__cvta_generic_to_shared(tb));
    // the swizzle is anchored at 1024-byte boundaries (check_aligned false: the caller checked
    // the same bases before; a trap among the products of a loop that also issues
    // xk_wg_mma_rs made ptxas serialise every product, C7520 "compiler-inserted WG.AR in
    // divergent path")
    if (check_aligned && ((sa | sb) & 1023u) != 0) __trap();
    const unsigned a0 = sa + unsigned(TRANS_A ? (ra >> 6) * BK * 128 : (ra & ~63) * 128);
    // a k-step of 16: MN-major +16 rows of 128 bytes; K-major +32 bytes within a panel of 64
    // columns, the next panel (BK > 64) rows * 128 bytes on (xk_tile_wg)
    constexpr unsigned A_LBO = TRANS_A ? unsigned(BK) * 128u : 16u, B_LBO = TRANS_B ? 16u : unsigned(BK) * 128u;
    constexpr unsigned A_PANEL = unsigned(BM) * 128u, B_PANEL = unsigned(BN) * 128u;
    const unsigned long long da0 = msl_detail::wg_desc(a0, A_LBO, 1024u), db0 = msl_detail::wg_desc(sb, B_LBO, 1024u);
    msl_detail::wg_fence_acc<BN / 8>(acc);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const unsigned ka = TRANS_A ? unsigned(kk) * 2048u : unsigned(kk >> 2) * A_PANEL + unsigned(kk & 3) * 32u;
      const unsigned kb = TRANS_B ? unsigned(kk >> 2) * B_PANEL + unsigned(kk & 3) * 32u : unsigned(kk) * 2048u;
      // a k-step's descriptor: the tile's plus its byte offset / 16 (the address field's 14
      // bits hold every shared address, so the sum never carries out of it)
      const unsigned long long da = da0 + (ka >> 4);
      const unsigned long long db = db0 + (kb >> 4);
      if constexpr (BN == 64) {
        msl_detail::wgmma_n64<T, TRANS_A ? 1 : 0, TRANS_B ? 0 : 1>(acc, da, db);
      } else if constexpr (BN == 128) {
        msl_detail::wgmma_n128<T, TRANS_A ? 1 : 0, TRANS_B ? 0 : 1>(acc, da, db);
      } else {
        msl_detail::wgmma_n256<T, TRANS_A ? 1 : 0, TRANS_B ? 0 : 1>(acc, da, db);
      }
    }
    // (no register fence here: an instruction defining the accumulators before the commit
    // makes ptxas serialise the products, warning C7515)
  } else {
    __trap();  // the host never picks WG for these (_warpgroup.metal's portable form is not compiled here)
  }
}
template <typename Q> inline void xk_wg_commit(Q&) { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int G, typename T, int BM, int BN, int BK, bool TRANS_A, bool TRANS_B>
inline void xk_wg_wait(xk_wg_queue<T, BM, BN, BK, TRANS_A, TRANS_B>&, simdgroup_matrix<float, 8, 8>* acc, int, int) {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(G < 0 ? 0 : G) : "memory");
  msl_detail::wg_fence_acc<BN / 8>(acc);
}
// xk_wg_wait_queue<G_ALL>: the products of q done, the caller knowing that the G_ALL most
// recent groups (of any queue) are not q's: wgmma.wait_group G_ALL.
template <int G_ALL, typename T, int BM, int BN, int BK, bool TRANS_A, bool TRANS_B>
inline void xk_wg_wait_queue(xk_wg_queue<T, BM, BN, BK, TRANS_A, TRANS_B>&, simdgroup_matrix<float, 8, 8>* acc, int,
                             int) {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(G_ALL) : "memory");
  msl_detail::wg_fence_acc<BN / 8>(acc);
}
inline void xk_wg_fence_copies() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// xk_wg_mma_rs (A in registers: each warp's 16 rows as its fragments pa[i * BK / 8 + j], B
// MN-major from the stage tile; _warpgroup.metal has the portable form): BK / 16 products m64nBNk16, k-step kk taking fragments (0, 2kk),
// (1, 2kk), (0, 2kk + 1), (1, 2kk + 1) as a0 .. a3. The fragments' registers must stay
// unchanged until the wait (ptxas keeps them).
template <typename T, int BN, int BK> struct xk_wg_queue_rs {};
template <typename T, int BN, int BK>
inline void xk_wg_mma_rs(xk_wg_queue_rs<T, BN, BK>&, simdgroup_matrix<float, 8, 8>* acc,
                         const simdgroup_matrix<T, 8, 8>* pa, const T* tb) {
  if constexpr (sizeof(T) == 2 && BK % 16 == 0 && (BN == 64 || BN == 128)) {
    constexpr int FK = BK / 8;
    // (no alignment trap here: see xk_wg_mma's check_aligned; the callers' B tiles share
    // their stage base with a checked xk_wg_mma operand)
    const unsigned sb = unsigned(__cvta_generic_to_shared(tb));
    unsigned a[BK / 16][4];  // every k-step's A registers, in place before the fence
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      a[kk][0] = *reinterpret_cast<const unsigned*>(&pa[2 * kk].elements_);
      a[kk][1] = *reinterpret_cast<const unsigned*>(&pa[FK + 2 * kk].elements_);
      a[kk][2] = *reinterpret_cast<const unsigned*>(&pa[2 * kk + 1].elements_);
      a[kk][3] = *reinterpret_cast<const unsigned*>(&pa[FK + 2 * kk + 1].elements_);
      asm volatile("" : "+r"(a[kk][0]), "+r"(a[kk][1]), "+r"(a[kk][2]), "+r"(a[kk][3])::"memory");
    }
    // a k-step of 16: +16 rows of 128 bytes (MN-major; panels of 64 columns BK * 128 bytes
    // apart), +2048 / 16 in the descriptor (see xk_wg_mma)
    const unsigned long long db0 = msl_detail::wg_desc(sb, unsigned(BK) * 128u, 1024u);
    msl_detail::wg_fence_acc<BN / 8>(acc);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const unsigned long long db = db0 + unsigned(kk) * (2048u >> 4);
      if constexpr (BN == 64) {
        msl_detail::wgmma_rs_n64<T>(acc, a[kk], db);
      } else {
        msl_detail::wgmma_rs_n128<T>(acc, a[kk], db);
      }
    }
  } else {
    __trap();  // the host never picks WG for these
  }
}
template <int G, typename T, int BN, int BK>
inline void xk_wg_wait(xk_wg_queue_rs<T, BN, BK>&, simdgroup_matrix<float, 8, 8>* acc, int, int) {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(G < 0 ? 0 : G) : "memory");
  msl_detail::wg_fence_acc<BN / 8>(acc);
}
#endif

// ---- metal_src/attention.metal's split-KV tile helper (portable form there) -------------
// xk_frag_set_b: the elements (row fr, columns fc and fc + 1 of xk_frag_coord) of a fragment
// used only as the right operand of products, from floats (a float accumulator converted
// to T in registers): 2-byte matrices fill xk_b_ = {M[2t][g], M[2t + 1][g]} from the lane's
// {M[g][2t], M[g][2t + 1]} with one movmatrix.trans (an 8x8 b16 transpose across the warp,
// sm_75+; shuffles before); its left-operand registers are left unset (as xk_frag_load_b
// does). Other types: the elements.
#define XK_ATTN_MMA_HELPERS
template <class T>
inline void xk_frag_set_b(simdgroup_matrix<T, 8, 8>& m, float a, float b) {
  if constexpr (sizeof(T) == 2) {
    const unsigned w = msl_detail::pack2<T>(msl_detail::conv<T>(a), msl_detail::conv<T>(b));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    unsigned r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(w));
    m.xk_b_ = r;
#else
    // element g % 2 of lanes lane_of(2t, g / 2), lane_of(2t + 1, g / 2), as simdgroup_mma
    const uint lane = msl_detail::lane_id();
    const int g = int(lane / 4), t = int(lane % 4);
    const unsigned e0 = __shfl_sync(0xFFFFFFFFu, w, msl_detail::lane_of(2 * t, g / 2));
    const unsigned e1 = __shfl_sync(0xFFFFFFFFu, w, msl_detail::lane_of(2 * t + 1, g / 2));
    const unsigned sh = (g & 1) ? 16u : 0u;
    m.xk_b_ = ((e0 >> sh) & 0xFFFFu) | (((e1 >> sh) & 0xFFFFu) << 16);
#endif
  } else {
    m.elements_[0] = msl_detail::conv<T>(a);
    m.elements_[1] = msl_detail::conv<T>(b);
  }
}

// xk_frag_set_a: the same for a fragment used only as the left operand: its registers are
// the lane's own elements (mma's A layout is the accumulator's), so no data moves; a 2-byte
// matrix's right-operand register is left unset.
template <class T>
inline void xk_frag_set_a(simdgroup_matrix<T, 8, 8>& m, float a, float b) {
  m.elements_[0] = msl_detail::conv<T>(a);
  m.elements_[1] = msl_detail::conv<T>(b);
}

}  // namespace mlx::core::cu
#endif
