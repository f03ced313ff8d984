// msl_sync.h -- Metal's synchronisation and SIMD-group functions for emulated kernels:
// threadgroup_barrier, simdgroup_barrier, simd_* and quad_* collectives, simd_vote,
// and 8x8 simdgroup_matrix with the hardware lane layout; and the threadgroup clusters'
// xk_cluster_sync and xk_cluster_peer (CUDA's, not Metal's).
//
// Every collective records its call site (__builtin_FILE/LINE/COLUMN), parks the
// calling thread's fiber, and is resolved by the runtime once all live lanes of the
// simdgroup have stopped: the lanes waiting at the same call site form the active set,
// which gives Metal's answer for `if (lane < 8) x = simd_sum(v);`.
#pragma once
#include "msl_types.h"
#include "xk_abi.h"

// Threadgroup clusters, natively (the contract and the portable stub that this replaces:
// metal_src/_cluster.metal). A kernel whose template list has the int XK_CLUSTER = C runs
// in clusters of C consecutive threadgroups along x, run side by side by the runtime
// (runtime.cpp): xk_cluster_sync waits for every thread of the cluster, and
// xk_cluster_peer(p, rank) is the same byte as p in threadgroup `rank`'s memory (both
// checked loudly, as threadgroup_barrier is).
#define XK_CLUSTER_NATIVE 1
#define XK_CLUSTER_MAX 8

// Call sites: file and line from the caller; the third number tells apart several
// calls on one line. xk_kernel.h wraps every barrier and collective in a macro that
// passes __COUNTER__ there (GCC < 13 has no __builtin_COLUMN).
#define XK_COLUMN() 0u
#define XK_SITE_PARAMS \
  const char *xk_file = __builtin_FILE(), unsigned xk_line = __builtin_LINE(), unsigned xk_col = XK_COLUMN()
#define XK_SITE_ARGS xk_file, xk_line, xk_col

namespace metal {

enum class mem_flags : uint32_t {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(uint32_t(a) | uint32_t(b));
}

inline void threadgroup_barrier(mem_flags = mem_flags::mem_none, XK_SITE_PARAMS) {
  xk_threadgroup_barrier(XK_SITE_ARGS);
}

inline void simdgroup_barrier(mem_flags = mem_flags::mem_none, XK_SITE_PARAMS) {
  xk_collective op = {xk_file, xk_line, xk_col, "simdgroup_barrier", nullptr, nullptr, nullptr, 0};
  xk_collective_wait(&op);
}

}  // namespace metal

inline void xk_cluster_sync(XK_SITE_PARAMS) { xk_cluster_barrier(XK_SITE_ARGS); }

// `threadgroup T*` is T* here (the address space is an empty macro); T may be const.
template <typename T>
inline T* xk_cluster_peer(T* p, uint rank) {
  return static_cast<T*>(xk_cluster_peer_address(p, rank));
}

namespace metal {

// ---------------------------------------------------------------------------
// Element access shared by scalars and vectors
// ---------------------------------------------------------------------------
namespace xk {
template <class T>
struct elems {
  typedef T type;
  static constexpr int n = 1;
  static T& at(T& v, int) { return v; }
  static const T& at(const T& v, int) { return v; }
};
template <class T, int N>
struct elems<vec<T, N>> {
  typedef T type;
  static constexpr int n = N;
  static T& at(vec<T, N>& v, int i) { return v[i]; }
  static const T& at(const vec<T, N>& v, int i) { return v[i]; }
};
// Reductions of half and bfloat accumulate in float, like the hardware's wide adders.
template <class T>
struct acc {
  typedef T type;
};
template <>
struct acc<half> {
  typedef float type;
};
template <>
struct acc<bfloat> {
  typedef float type;
};

struct op_sum {
  template <class A>
  static A apply(A a, A b) { return a + b; }
  template <class A>
  static A identity() { return A(0); }
};
struct op_product {
  template <class A>
  static A apply(A a, A b) { return a * b; }
  template <class A>
  static A identity() { return A(1); }
};
struct op_max {
  template <class A>
  static A apply(A a, A b) {
    if (a != a) return a;
    if (b != b) return b;
    return a > b ? a : b;
  }
};
struct op_min {
  template <class A>
  static A apply(A a, A b) {
    if (a != a) return a;
    if (b != b) return b;
    return a < b ? a : b;
  }
};
struct op_and {
  template <class A>
  static A apply(A a, A b) { return a & b; }
};
struct op_or {
  template <class A>
  static A apply(A a, A b) { return a | b; }
};
struct op_xor {
  template <class A>
  static A apply(A a, A b) { return a ^ b; }
};

template <class T>
inline void poison(T& v) { memset(static_cast<void*>(&v), 0xFF, sizeof(T)); }

// Reduction over the active lanes of each group of G lanes (G = 32 simd, 4 quad).
template <class T, class Op, int G>
void resolve_reduce(xk_collective* const* lanes, int) {
  typedef typename elems<T>::type E;
  typedef typename acc<E>::type A;
  for (int g0 = 0; g0 < 32; g0 += G) {
    T result;
    bool any = false;
    for (int k = 0; k < elems<T>::n; ++k) {
      A a = A();
      bool first = true;
      for (int l = g0; l < g0 + G; ++l) {
        if (!lanes[l]) continue;
        A v = A(elems<T>::at(*static_cast<const T*>(lanes[l]->in), k));
        a = first ? v : Op::apply(a, v);
        first = false;
      }
      if (!first) elems<T>::at(result, k) = E(a);
      any = any || !first;
    }
    if (!any) continue;
    for (int l = g0; l < g0 + G; ++l)
      if (lanes[l]) *static_cast<T*>(lanes[l]->out) = result;
  }
}

template <class T, class Op, bool Inclusive, int G>
void resolve_prefix(xk_collective* const* lanes, int) {
  typedef typename elems<T>::type E;
  typedef typename acc<E>::type A;
  for (int k = 0; k < elems<T>::n; ++k) {
    for (int g0 = 0; g0 < 32; g0 += G) {
      A run = Op::template identity<A>();  // what the first active lane's exclusive scan sees
      for (int l = g0; l < g0 + G; ++l) {
        if (!lanes[l]) continue;
        A v = A(elems<T>::at(*static_cast<const T*>(lanes[l]->in), k));
        A after = Op::apply(run, v);
        elems<T>::at(*static_cast<T*>(lanes[l]->out), k) = E(Inclusive ? after : run);
        run = after;
      }
    }
  }
}

enum shuffle_kind { sh_index, sh_xor, sh_up, sh_down, sh_rotate_up, sh_rotate_down, sh_first };

// Shuffles read another lane's value. A source lane that exists but is inactive
// (diverged) gives an undefined value on the GPU: the emulator returns poison (NaN
// bytes) so a kernel that relies on it fails loudly.
template <class T, shuffle_kind K, int G>
void resolve_shuffle(xk_collective* const* lanes, int width) {
  int first_active = -1;
  for (int l = 0; l < 32; ++l)
    if (lanes[l]) {
      first_active = l;
      break;
    }
  for (int l = 0; l < 32; ++l) {
    if (!lanes[l]) continue;
    int base = l / G * G;
    int gw = G == 32 ? width : G;
    int i = l - base;
    long src;
    uint64_t a = lanes[l]->arg;
    switch (K) {
      case sh_index: src = long(a); break;
      case sh_xor: src = long(i ^ int(a)); break;
      case sh_up: src = i - long(a) < 0 ? i : i - long(a); break;
      case sh_down: src = i + long(a) >= gw ? i : i + long(a); break;
      case sh_rotate_up: src = ((i - long(a)) % gw + gw) % gw; break;
      case sh_rotate_down: src = (i + long(a)) % gw; break;
      default: src = first_active - base; break;
    }
    T* out = static_cast<T*>(lanes[l]->out);
    if (src < 0 || src >= gw || base + src >= 32 || !lanes[base + src])
      poison(*out);
    else
      *out = *static_cast<const T*>(lanes[base + src]->in);
  }
}

template <class T>
inline T wait_for(const char* what, xk_resolve_fn fn, const T& in, uint64_t arg, const char* f, unsigned line,
                  unsigned col) {
  T out;
  xk_collective op = {f, line, col, what, fn, &in, &out, arg};
  xk_collective_wait(&op);
  return out;
}
}  // namespace xk

#define XK_REDUCE(NAME, OP, G)                                                                 \
  template <class T>                                                                          \
  inline T NAME(T data, XK_SITE_PARAMS) {                                                     \
    return xk::wait_for<T>(#NAME, &xk::resolve_reduce<T, xk::OP, G>, data, 0, XK_SITE_ARGS);  \
  }
XK_REDUCE(simd_sum, op_sum, 32)
XK_REDUCE(simd_product, op_product, 32)
XK_REDUCE(simd_max, op_max, 32)
XK_REDUCE(simd_min, op_min, 32)
XK_REDUCE(simd_and, op_and, 32)
XK_REDUCE(simd_or, op_or, 32)
XK_REDUCE(simd_xor, op_xor, 32)
XK_REDUCE(quad_sum, op_sum, 4)
XK_REDUCE(quad_product, op_product, 4)
XK_REDUCE(quad_max, op_max, 4)
XK_REDUCE(quad_min, op_min, 4)
XK_REDUCE(quad_and, op_and, 4)
XK_REDUCE(quad_or, op_or, 4)
XK_REDUCE(quad_xor, op_xor, 4)
#undef XK_REDUCE

#define XK_PREFIX(NAME, OP, INCL, G)                                                                   \
  template <class T>                                                                                  \
  inline T NAME(T data, XK_SITE_PARAMS) {                                                             \
    return xk::wait_for<T>(#NAME, &xk::resolve_prefix<T, xk::OP, INCL, G>, data, 0, XK_SITE_ARGS);    \
  }
XK_PREFIX(simd_prefix_inclusive_sum, op_sum, true, 32)
XK_PREFIX(simd_prefix_exclusive_sum, op_sum, false, 32)
XK_PREFIX(simd_prefix_inclusive_product, op_product, true, 32)
XK_PREFIX(simd_prefix_exclusive_product, op_product, false, 32)
XK_PREFIX(quad_prefix_inclusive_sum, op_sum, true, 4)
XK_PREFIX(quad_prefix_exclusive_sum, op_sum, false, 4)
XK_PREFIX(quad_prefix_inclusive_product, op_product, true, 4)
XK_PREFIX(quad_prefix_exclusive_product, op_product, false, 4)
#undef XK_PREFIX

#define XK_SHUFFLE(NAME, KIND, G)                                                                        \
  template <class T>                                                                                    \
  inline T NAME(T data, uint64_t arg, XK_SITE_PARAMS) {                                                 \
    return xk::wait_for<T>(#NAME, &xk::resolve_shuffle<T, xk::KIND, G>, data, arg, XK_SITE_ARGS);       \
  }
XK_SHUFFLE(simd_shuffle, sh_index, 32)
XK_SHUFFLE(simd_shuffle_xor, sh_xor, 32)
XK_SHUFFLE(simd_shuffle_up, sh_up, 32)
XK_SHUFFLE(simd_shuffle_down, sh_down, 32)
XK_SHUFFLE(simd_shuffle_rotate_up, sh_rotate_up, 32)
XK_SHUFFLE(simd_shuffle_rotate_down, sh_rotate_down, 32)
XK_SHUFFLE(simd_broadcast, sh_index, 32)
XK_SHUFFLE(quad_shuffle, sh_index, 4)
XK_SHUFFLE(quad_shuffle_xor, sh_xor, 4)
XK_SHUFFLE(quad_shuffle_up, sh_up, 4)
XK_SHUFFLE(quad_shuffle_down, sh_down, 4)
XK_SHUFFLE(quad_shuffle_rotate_up, sh_rotate_up, 4)
XK_SHUFFLE(quad_shuffle_rotate_down, sh_rotate_down, 4)
XK_SHUFFLE(quad_broadcast, sh_index, 4)
#undef XK_SHUFFLE

template <class T>
inline T simd_broadcast_first(T data, XK_SITE_PARAMS) {
  return xk::wait_for<T>("simd_broadcast_first", &xk::resolve_shuffle<T, xk::sh_first, 32>, data, 0, XK_SITE_ARGS);
}

// ---------------------------------------------------------------------------
// Votes
// ---------------------------------------------------------------------------
struct simd_vote {
  typedef uint64_t vote_t;
  vote_t v;
  simd_vote() = default;
  explicit constexpr simd_vote(vote_t x) : v(x) {}
  explicit constexpr operator vote_t() const { return v; }
  constexpr bool all() const { return v == 0xFFFFFFFFull; }
  constexpr bool any() const { return v != 0; }
};

namespace xk {
// in: bool; out: uint64 mask of active lanes whose value is true (arg 1: of all active lanes)
inline void resolve_ballot(xk_collective* const* lanes, int) {
  uint64_t m = 0;
  for (int l = 0; l < 32; ++l)
    if (lanes[l] && (lanes[l]->arg || *static_cast<const bool*>(lanes[l]->in))) m |= uint64_t(1) << l;
  for (int l = 0; l < 32; ++l)
    if (lanes[l]) *static_cast<uint64_t*>(lanes[l]->out) = m;
}
inline uint64_t ballot(bool b, uint64_t all, const char* what, const char* f, unsigned line, unsigned col) {
  return wait_for<uint64_t>(what, &resolve_ballot, b, all, f, line, col);
}
inline uint64_t active_bits() {
  uint64_t lanes = xk_simd_width();
  return lanes >= 64 ? ~0ull : (uint64_t(1) << lanes) - 1;
}
}  // namespace xk

inline simd_vote simd_ballot(bool expr, XK_SITE_PARAMS) {
  return simd_vote(xk::ballot(expr, 0, "simd_ballot", XK_SITE_ARGS));
}
inline simd_vote simd_active_threads_mask(XK_SITE_PARAMS) {
  return simd_vote(xk::ballot(true, 1, "simd_active_threads_mask", XK_SITE_ARGS));
}
inline bool simd_all(bool expr, XK_SITE_PARAMS) {
  uint64_t active = xk::ballot(true, 1, "simd_all", XK_SITE_ARGS);
  uint64_t yes = xk::ballot(expr, 0, "simd_all", XK_SITE_ARGS);
  return yes == active;
}
inline bool simd_any(bool expr, XK_SITE_PARAMS) {
  return xk::ballot(expr, 0, "simd_any", XK_SITE_ARGS) != 0;
}
inline bool simd_is_first(XK_SITE_PARAMS) {
  uint64_t active = xk::ballot(true, 1, "simd_is_first", XK_SITE_ARGS);
  return (active & ((uint64_t(1) << xk_lane()) - 1)) == 0;
}

// ---------------------------------------------------------------------------
// simdgroup_matrix: 8x8, each lane holds two elements in the hardware layout
//   q = lane / 4; row = (q & 4) + (lane / 2) % 4; col = (q & 2) * 2 + (lane % 2) * 2 (+0, +1)
// ---------------------------------------------------------------------------
namespace xk {
inline void lane_coord(unsigned lane, int& row, int& col) {
  unsigned q = lane / 4;
  row = int((q & 4) + (lane / 2) % 4);
  col = int((q & 2) * 2 + (lane % 2) * 2);
}
}  // namespace xk

template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator supports 8x8 simdgroup matrices only");
  vec<T, 2> elements_;
  simdgroup_matrix() = default;
  // A diagonal matrix with `diag` on the diagonal, as in Metal.
  explicit simdgroup_matrix(T diag) {
    int r, c;
    xk::lane_coord(xk_lane(), r, c);
    elements_[0] = r == c ? diag : T(0);
    elements_[1] = r == c + 1 ? diag : T(0);
  }
  vec<T, 2>& thread_elements() { return elements_; }
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
  return m;
}

// Each lane loads or stores only its own two elements: no exchange between lanes.
template <typename T, typename U, int C, int R>
inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, const U* src, unsigned long elements_per_row = 8,
                           vec<unsigned long, 2> matrix_origin = vec<unsigned long, 2>(0, 0),
                           bool transpose_matrix = false) {
  int r, c;
  xk::lane_coord(xk_lane(), r, c);
  for (int i = 0; i < 2; ++i) {
    long row = transpose_matrix ? c + i : r, col = transpose_matrix ? r : c + i;
    d.elements_[i] = T(src[(long(matrix_origin.y) + row) * long(elements_per_row) + long(matrix_origin.x) + col]);
  }
}

template <typename T, typename U, int C, int R>
inline void simdgroup_store(const simdgroup_matrix<T, C, R>& d, U* dst, unsigned long elements_per_row = 8,
                            vec<unsigned long, 2> matrix_origin = vec<unsigned long, 2>(0, 0),
                            bool transpose_matrix = false) {
  int r, c;
  xk::lane_coord(xk_lane(), r, c);
  for (int i = 0; i < 2; ++i) {
    long row = transpose_matrix ? c + i : r, col = transpose_matrix ? r : c + i;
    dst[(long(matrix_origin.y) + row) * long(elements_per_row) + long(matrix_origin.x) + col] = U(d.elements_[i]);
  }
}

namespace xk {
template <class D, class A, class B, class C>
struct mma_args {
  const A* a;
  const B* b;
  const C* c;  // null: D = A * B
};

template <class D, class A, class B, class C>
void resolve_mma(xk_collective* const* lanes, int width) {
  int active = 0;
  for (int l = 0; l < 32; ++l) active += lanes[l] != nullptr;
  if (active != 32) {
    xk_error("simdgroup_multiply_accumulate needs all 32 lanes of the simdgroup; some lanes are inactive "
             "(diverged or returned) or the threadgroup size is not a multiple of 32");
    return;
  }
  (void)width;
  float a[8][8], b[8][8], c[8][8];
  for (int l = 0; l < 32; ++l) {
    const mma_args<D, A, B, C>* m = static_cast<const mma_args<D, A, B, C>*>(lanes[l]->in);
    int r, col;
    lane_coord(unsigned(l), r, col);
    for (int i = 0; i < 2; ++i) {
      a[r][col + i] = float(m->a->elements_[i]);
      b[r][col + i] = float(m->b->elements_[i]);
      c[r][col + i] = m->c ? float(m->c->elements_[i]) : 0.0f;
    }
  }
  for (int l = 0; l < 32; ++l) {
    D* d = static_cast<D*>(lanes[l]->out);
    int r, col;
    lane_coord(unsigned(l), r, col);
    for (int i = 0; i < 2; ++i) {
      float s = c[r][col + i];
      for (int k = 0; k < 8; ++k) s += a[r][k] * b[k][col + i];
      d->elements_[i] = decltype(d->elements_[i] + 0)(s);
    }
  }
}
}  // namespace xk

template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c,
                                          XK_SITE_PARAMS) {
  typedef simdgroup_matrix<TD, 8, 8> D;
  typedef simdgroup_matrix<TA, 8, 8> A;
  typedef simdgroup_matrix<TB, 8, 8> B;
  typedef simdgroup_matrix<TC, 8, 8> C;
  xk::mma_args<D, A, B, C> args = {&a, &b, &c};
  D out;
  xk_collective op = {xk_file, xk_line, xk_col, "simdgroup_multiply_accumulate",
                      &xk::resolve_mma<D, A, B, C>, &args, &out, 0};
  xk_collective_wait(&op);
  d = out;
}

template <class TD, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b, XK_SITE_PARAMS) {
  typedef simdgroup_matrix<TD, 8, 8> D;
  typedef simdgroup_matrix<TA, 8, 8> A;
  typedef simdgroup_matrix<TB, 8, 8> B;
  xk::mma_args<D, A, B, D> args = {&a, &b, nullptr};
  D out;
  xk_collective op = {xk_file, xk_line, xk_col, "simdgroup_multiply", &xk::resolve_mma<D, A, B, D>, &args, &out, 0};
  xk_collective_wait(&op);
  d = out;
}

}  // namespace metal
