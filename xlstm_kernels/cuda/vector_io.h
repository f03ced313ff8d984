// vector_io.h -- the vector-access primitives of metal_src/_memory.metal for CUDA.
//
// _memory.metal defines them as element loops unless XK_VECTOR_IO is set; NVCC does not
// merge such loops into wide accesses, so here:
//   xk_load / xk_store / xk_load8 / xk_store8 (N consecutive elements, any alignment):
//       one 4-, 8- or 16-byte global access when p is aligned to the access size (checked
//       at run time: an MLX array sliced at an offset is row-contiguous and reaches the
//       kernel uncopied, so any element-aligned address occurs), else two accesses of
//       half the size, down to single elements;
//   xk_run_aligned<W>(p): p aligned to min(W * sizeof(T), 16) bytes;
//   xk_load_w / xk_store_w: the run of W elements as 16-byte (or W * sizeof(T)-byte)
//       accesses without checks (the caller tested xk_run_aligned, once for many runs);
//   xk_load_runs / xk_store_runs: as _memory.metal's, but the loaded words are unpacked
//       into T only after every run's load is issued (an unpack right after a load would
//       wait for it, so the loads of a thread would not overlap).
// Included right after compat.h (vec<T, N> is alignas(N * sizeof(T)) there, N = 2, 4),
// before the family header.
#ifndef XLSTM_CUDA_VECTOR_IO_H
#define XLSTM_CUDA_VECTOR_IO_H
#define XK_VECTOR_IO

namespace mlx::core::cu {
namespace xk_vio {
template <int B> struct word;  // an unsigned type of B bytes (B-aligned)
template <> struct word<2> { typedef unsigned short type; };
template <> struct word<4> { typedef unsigned int type; };
template <> struct word<8> { typedef ::uint2 type; };
template <> struct word<16> { typedef ::uint4 type; };

// B bytes from s (global, aligned to the element size E) to d (local, aligned to min(B, 16)).
template <int B, int E> inline void load(void* d, const void* s) {
  if constexpr (B > 16) {
    load<16, E>(d, s);
    load<B - 16, E>(static_cast<char*>(d) + 16, static_cast<const char*>(s) + 16);
  } else {
    typedef typename word<B>::type W;
    if (B == E || (reinterpret_cast<size_t>(s) & size_t(B - 1)) == 0) {
      *static_cast<W*>(d) = *static_cast<const W*>(s);
    } else if constexpr (B > E) {
      load<B / 2, E>(d, s);
      load<B / 2, E>(static_cast<char*>(d) + B / 2, static_cast<const char*>(s) + B / 2);
    }
  }
}

// B bytes from s (local, aligned to min(B, 16)) to d (global, aligned to E).
template <int B, int E> inline void store(void* d, const void* s) {
  if constexpr (B > 16) {
    store<16, E>(d, s);
    store<B - 16, E>(static_cast<char*>(d) + 16, static_cast<const char*>(s) + 16);
  } else {
    typedef typename word<B>::type W;
    if (B == E || (reinterpret_cast<size_t>(d) & size_t(B - 1)) == 0) {
      *static_cast<W*>(d) = *static_cast<const W*>(s);
    } else if constexpr (B > E) {
      store<B / 2, E>(d, s);
      store<B / 2, E>(static_cast<char*>(d) + B / 2, static_cast<const char*>(s) + B / 2);
    }
  }
}

// B bytes from s to d, both aligned to min(B, 16): words of min(B, 16) bytes.
template <int B> inline void copy(void* d, const void* s) {
  constexpr int C = B < 16 ? B : 16;
  typedef typename word<C>::type W;
#pragma unroll
  for (int o = 0; o < B; o += C) {
    *reinterpret_cast<W*>(static_cast<char*>(d) + o) = *reinterpret_cast<const W*>(static_cast<const char*>(s) + o);
  }
}

template <typename T> struct alignas(16) pair4 {
  vec<T, 4> lo, hi;
};
template <typename T, int W> struct alignas(W * sizeof(T) < 16 ? W * sizeof(T) : 16) run {
  T v[W];
};
}  // namespace xk_vio

template <int W, typename T> inline bool xk_run_aligned(const T* p) {
  constexpr size_t B = W * sizeof(T) < 16 ? W * sizeof(T) : 16;
  return (reinterpret_cast<size_t>(p) & (B - 1)) == 0;
}

template <int W, typename T> inline void xk_load_w(const T* p, T* t) {
  xk_vio::run<T, W> b;
  xk_vio::copy<W * int(sizeof(T))>(&b, p);
#pragma unroll
  for (int k = 0; k < W; ++k) t[k] = b.v[k];
}

// _memory.metal's xk_load_w_tg (threadgroup memory; address spaces are one in CUDA).
template <int W, typename T> inline void xk_load_w_tg(const T* p, T* t) { xk_load_w<W>(p, t); }
template <int W, typename T> inline void xk_store_w(T* p, const T* t) {
  xk_vio::run<T, W> b;
#pragma unroll
  for (int k = 0; k < W; ++k) b.v[k] = t[k];
  xk_vio::copy<W * int(sizeof(T))>(p, &b);
}

template <int N, typename T> inline vec<T, N> xk_load(const T* p) {
  static_assert(N == 2 || N == 4, "xk_load<N>: N = 2 or 4");
  vec<T, N> v;
  xk_vio::load<N * int(sizeof(T)), int(sizeof(T))>(&v, p);
  return v;
}

template <int N, typename T> inline void xk_store(T* p, vec<T, N> v) {
  static_assert(N == 2 || N == 4, "xk_store<N>: N = 2 or 4");
  xk_vio::store<N * int(sizeof(T)), int(sizeof(T))>(p, &v);
}

template <typename T> inline void xk_load8(const T* p, vec<T, 4>& lo, vec<T, 4>& hi) {
  xk_vio::pair4<T> b;
  xk_vio::load<8 * int(sizeof(T)), int(sizeof(T))>(&b, p);
  lo = b.lo;
  hi = b.hi;
}

template <typename T> inline void xk_store8(T* p, vec<T, 4> lo, vec<T, 4> hi) {
  xk_vio::pair4<T> b;
  b.lo = lo;
  b.hi = hi;
  xk_vio::store<8 * int(sizeof(T)), int(sizeof(T))>(p, &b);
}
template <int W, int NR, typename T>
inline void xk_load_runs(const T* p, uint i0, uint stride, uint n, T* t) {
  xk_vio::run<T, W> r[NR];
  const bool al = xk_run_aligned<W>(p + i0);
#pragma unroll
  for (int j = 0; j < NR; ++j) {
    const uint i = i0 + j * stride;
    if (al && i + W <= n) xk_vio::copy<W * int(sizeof(T))>(&r[j], p + i);
  }
#pragma unroll
  for (int j = 0; j < NR; ++j) {
    const uint i = i0 + j * stride;
    if (al && i + W <= n) {
#pragma unroll
      for (int k = 0; k < W; ++k) t[j * W + k] = r[j].v[k];
    } else {
#pragma unroll
      for (int k = 0; k < W; ++k) t[j * W + k] = i + k < n ? p[i + k] : T(0.0f);
    }
  }
}

template <int W, int NR, typename T>
inline void xk_store_runs(T* p, uint i0, uint stride, uint n, const T* t) {
  const bool al = xk_run_aligned<W>(p + i0);
#pragma unroll
  for (int j = 0; j < NR; ++j) {
    const uint i = i0 + j * stride;
    if (al && i + W <= n) {
      xk_store_w<W>(p + i, t + j * W);
    } else {
#pragma unroll
      for (int k = 0; k < W; ++k) {
        if (i + k < n) p[i + k] = t[j * W + k];
      }
    }
  }
}
}  // namespace mlx::core::cu

#endif  // XLSTM_CUDA_VECTOR_IO_H
