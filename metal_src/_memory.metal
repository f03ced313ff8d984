// Shared by every kernel family (placed before each family's header section, see
// xlstm_kernels/runtime/sources.py): vector access to device memory, asynchronous copies.

// @header
// XK_NO_UNROLL before a loop: keep it rolled (a rare path whose unrolled loads would raise
// the kernel's register count, e.g. the element accesses of a misaligned row).
#ifndef XK_NO_UNROLL
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define XK_NO_UNROLL _Pragma("unroll 1")
#elif defined(__METAL_VERSION__)
#define XK_NO_UNROLL _Pragma("clang loop unroll(disable)")
#else
#define XK_NO_UNROLL
#endif
#endif

// Backend primitives. Here plain element loops (Apple's compiler merges neighbouring
// accesses, as in MLX's Metal kernels); a backend whose compiler does not defines
// XK_VECTOR_IO and its own versions (xlstm_kernels/cuda/vector_io.h: wide accesses).
//   xk_load<N>(p) / xk_store<N>(p, v)   N = 2 or 4 consecutive elements at p as one
//       vec<T, N>, any alignment; xk_load8 / xk_store8: 8 elements as two vec<T, 4>
//       (lo = p[0..4), hi = p[4..8)).
//   xk_run_aligned<W>(p)                whether the W elements at p (a "run", W = 1, 2, 4,
//       8) can be one wide access (CUDA: p aligned to min(W * sizeof(T), 16) bytes).
//   xk_load_w<W>(p, t) / xk_store_w<W>(p, t)   that access, between p and the thread
//       array t[0..W); only for p with xk_run_aligned<W>(p).
//   xk_load_runs<W, NR>(p, i0, stride, n, t) / xk_store_runs: NR runs of a row, below.
#ifndef XK_VECTOR_IO
template <int N, typename T>
METAL_FUNC vec<T, N> xk_load(const device T* p) {
  vec<T, N> v;
  for (int k = 0; k < N; k++) {
    v[k] = p[k];
  }
  return v;
}

template <int N, typename T>
METAL_FUNC void xk_store(device T* p, vec<T, N> v) {
  for (int k = 0; k < N; k++) {
    p[k] = v[k];
  }
}

template <typename T>
METAL_FUNC void xk_load8(const device T* p, thread vec<T, 4>& lo, thread vec<T, 4>& hi) {
  lo = xk_load<4>(p);
  hi = xk_load<4>(p + 4);
}

template <typename T>
METAL_FUNC void xk_store8(device T* p, vec<T, 4> lo, vec<T, 4> hi) {
  xk_store<4>(p, lo);
  xk_store<4>(p + 4, hi);
}

template <int W, typename T>
METAL_FUNC bool xk_run_aligned(const device T*) {
  return true;
}

template <int W, typename T>
METAL_FUNC void xk_load_w(const device T* p, thread T* t) {
  for (int k = 0; k < W; k++) {
    t[k] = p[k];
  }
}

template <int W, typename T>
METAL_FUNC void xk_store_w(device T* p, const thread T* t) {
  for (int k = 0; k < W; k++) {
    p[k] = t[k];
  }
}

// NR runs of W elements of a row of n elements: run j starts at element i0 + j * stride
// (stride a multiple of W, so every run has the alignment of p + i0); t[j * W + k] =
// p[i0 + j * stride + k], 0 at or past n. The runs that lie inside the row are wide
// accesses issued back to back (when p + i0 is aligned); the others (crossing the end,
// or misaligned) go element by element afterwards.
template <int W, int NR, typename T>
METAL_FUNC void xk_load_runs(const device T* p, uint i0, uint stride, uint n, thread T* t) {
  const bool al = xk_run_aligned<W>(p + i0);
  for (int j = 0; j < NR; j++) {
    const uint i = i0 + j * stride;
    if (al && i + W <= n) {
      xk_load_w<W>(p + i, t + j * W);
    }
  }
  for (int j = 0; j < NR; j++) {
    const uint i = i0 + j * stride;
    if (!(al && i + W <= n)) {
      for (int k = 0; k < W; k++) {
        t[j * W + k] = i + k < n ? p[i + k] : T(0.0f);
      }
    }
  }
}

// The stores of xk_load_runs: p[i0 + j * stride + k] = t[j * W + k] where below n.
template <int W, int NR, typename T>
METAL_FUNC void xk_store_runs(device T* p, uint i0, uint stride, uint n, const thread T* t) {
  const bool al = xk_run_aligned<W>(p + i0);
  for (int j = 0; j < NR; j++) {
    const uint i = i0 + j * stride;
    if (al && i + W <= n) {
      xk_store_w<W>(p + i, t + j * W);
    } else {
      for (int k = 0; k < W; k++) {
        if (i + k < n) {
          p[i + k] = t[j * W + k];
        }
      }
    }
  }
}
#endif

// xk_load_runs converted to float: v[j * W + k] = float(p[i0 + j * stride + k]).
template <int W, int NR, typename T>
METAL_FUNC void xk_load_runs_f(const device T* p, uint i0, uint stride, uint n, thread float* v) {
  T t[W * NR];
  xk_load_runs<W, NR>(p, i0, stride, n, t);
  for (int k = 0; k < W * NR; k++) {
    v[k] = float(t[k]);
  }
}

// xk_store_runs from float values: p[i0 + j * stride + k] = T(v[j * W + k]) where below n
// (one rounding to T; T = float stores the values as they are).
template <int W, int NR, typename T>
METAL_FUNC void xk_store_runs_f(device T* p, uint i0, uint stride, uint n, const thread float* v) {
  T t[W * NR];
  for (int k = 0; k < W * NR; k++) {
    t[k] = T(v[k]);
  }
  xk_store_runs<W, NR>(p, i0, stride, n, t);
}

// xk_load_runs_f of an optional buffer: v[k] = dflt (no memory access) when !HAS.
template <bool HAS, int W, int NR, typename T>
METAL_FUNC void xk_load_runs_f_or(const device T* p, uint i0, uint stride, uint n, thread float* v, float dflt) {
  if (HAS) {
    xk_load_runs_f<W, NR>(p, i0, stride, n, v);
  } else {
    for (int k = 0; k < W * NR; k++) {
      v[k] = dflt;
    }
  }
}

// One run (NR = 1) at element i.
template <int W, typename T>
METAL_FUNC void xk_load_run(const device T* p, uint i, uint n, thread T* t) {
  xk_load_runs<W, 1>(p, i, W, n, t);
}

template <int W, typename T>
METAL_FUNC void xk_store_run(device T* p, uint i, uint n, const thread T* t) {
  xk_store_runs<W, 1>(p, i, W, n, t);
}

// The same run (W elements at element i, below lim) of R rows p + r * rs, r < nr <= R:
// t[r * M + k] = p[r * rs + i + k].
//
// xk_rows_wide: whether all R rows are there, the run lies below lim and is aligned in
// every row (rs a multiple of W), i.e. each row's run is one wide access.
// xk_load_rows_w / xk_store_rows_w: those wide accesses, straight-line (a thread's loads
// are all in flight at once). xk_load_rows_each / xk_store_rows_each: row by row
// (xk_load_run: wide where aligned and inside, else element by element).
// xk_load_rows / xk_store_rows: the wide form when xk_rows_wide, else row by row. A kernel
// that moves several runs per row should test xk_rows_wide of all of them once and branch
// itself (as rope does): with one test per call, the compiler may merge the wide loads
// into the row-by-row path, where each row's load waits for the one before it.
template <int W, int R, typename T>
METAL_FUNC bool xk_rows_wide(const device T* p, size_t rs, uint i, uint lim, uint nr) {
  return nr == uint(R) && i + W <= lim && rs % W == 0 && xk_run_aligned<W>(p + i);
}

template <int W, int R, int M, typename T>
METAL_FUNC void xk_load_rows_w(const device T* p, size_t rs, uint i, thread T* t) {
  for (int r = 0; r < R; r++) {
    xk_load_w<W>(p + r * rs + i, t + r * M);
  }
}

template <int W, int R, int M, typename T>
METAL_FUNC void xk_store_rows_w(device T* p, size_t rs, uint i, const thread T* t) {
  for (int r = 0; r < R; r++) {
    xk_store_w<W>(p + r * rs + i, t + r * M);
  }
}

template <int W, int R, int M, typename T>
METAL_FUNC void xk_load_rows_each(const device T* p, size_t rs, uint i, uint lim, uint nr, thread T* t) {
  for (int r = 0; r < R; r++) {
    if (uint(r) < nr) {
      xk_load_run<W>(p + r * rs, i, lim, t + r * M);
    }
  }
}

template <int W, int R, int M, typename T>
METAL_FUNC void xk_store_rows_each(device T* p, size_t rs, uint i, uint lim, uint nr, const thread T* t) {
  for (int r = 0; r < R; r++) {
    if (uint(r) < nr) {
      xk_store_run<W>(p + r * rs, i, lim, t + r * M);
    }
  }
}

template <int W, int R, int M, typename T>
METAL_FUNC void xk_load_rows(const device T* p, size_t rs, uint i, uint lim, uint nr, thread T* t) {
  if (xk_rows_wide<W, R>(p, rs, i, lim, nr)) {
    xk_load_rows_w<W, R, M>(p, rs, i, t);
  } else {
    xk_load_rows_each<W, R, M>(p, rs, i, lim, nr, t);
  }
}

template <int W, int R, int M, typename T>
METAL_FUNC void xk_store_rows(device T* p, size_t rs, uint i, uint lim, uint nr, const thread T* t) {
  if (xk_rows_wide<W, R>(p, rs, i, lim, nr)) {
    xk_store_rows_w<W, R, M>(p, rs, i, t);
  } else {
    xk_store_rows_each<W, R, M>(p, rs, i, lim, nr, t);
  }
}

// Elements per run for a thread that moves NR elements of T per step: NR capped at 16
// bytes (float: 4, half / bfloat: 8) and at 8 elements.
#define XK_RUN(T, NR) ((NR) * int(sizeof(T)) <= 16 ? ((NR) < 8 ? (NR) : 8) : 16 / int(sizeof(T)))

// Runs known to lie inside the row (no bounds code), for kernels whose rows are exactly
// their threads' runs long, NR runs at i0 + j * stride as in xk_load_runs: `al` (uniform;
// the caller tested xk_run_aligned of every row it passes): each run one wide access
// (xk_load_w / xk_store_w); else element accesses. xk_full_load_f converts to float.
template <int W, int NR, typename T>
METAL_FUNC void xk_full_load_f(const device T* p, uint i0, uint stride, bool al, thread float* v) {
  if (al) {
    T t[W * NR];
    for (int j = 0; j < NR; j++) {
      xk_load_w<W>(p + i0 + j * stride, t + j * W);
    }
    for (int k = 0; k < W * NR; k++) {
      v[k] = float(t[k]);
    }
  } else {
    for (int j = 0; j < NR; j++) {
      for (int k = 0; k < W; k++) {
        v[j * W + k] = float(p[i0 + j * stride + k]);
      }
    }
  }
}

template <int W, int NR, typename T>
METAL_FUNC void xk_full_store(device T* p, uint i0, uint stride, bool al, const thread T* t) {
  for (int j = 0; j < NR; j++) {
    if (al) {
      xk_store_w<W>(p + i0 + j * stride, t + j * W);
    } else {
      for (int k = 0; k < W; k++) {
        p[i0 + j * stride + k] = t[j * W + k];
      }
    }
  }
}

// Asynchronous copies from device to threadgroup memory (attention.metal, norm.metal).
#ifndef XK_VECTOR_IO
// A run of W elements of threadgroup memory at p (aligned to min(W * sizeof(T), 16) bytes)
// into the thread array t[0..W): one wide access where the backend has them (vector_io.h).
template <int W, typename T>
METAL_FUNC void xk_load_w_tg(const threadgroup T* p, thread T* t) {
  for (int k = 0; k < W; k++) {
    t[k] = p[k];
  }
}
#endif

#ifndef XK_ASYNC_COPY
// dst[0..N) = src[0..N), possibly asynchronous: complete for this thread after
// xk_async_commit() and xk_async_wait<G>() with at most G later commits; other threads
// see them after a barrier that follows the wait. Here plain synchronous copies.
template <int N, typename T>
inline void xk_async_copy(threadgroup T* dst, const device T* src) {
  for (int k = 0; k < N; ++k) {
    dst[k] = src[k];
  }
}
inline void xk_async_commit() {}
template <int G>
inline void xk_async_wait() {}
// xk_async_copy when dst and src are multiples of N * sizeof(T) bytes from 0.
template <int N, typename T>
inline void xk_async_copy_aligned(threadgroup T* dst, const device T* src) {
  for (int k = 0; k < N; ++k) {
    dst[k] = src[k];
  }
}
// xk_async_copy_aligned through the L1 cache where the backend chooses (CUDA: cp.async.ca).
template <int N, typename T>
inline void xk_async_copy_aligned_l1(threadgroup T* dst, const device T* src) {
  for (int k = 0; k < N; ++k) {
    dst[k] = src[k];
  }
}
// Whether runs of N elements at src + r * ld + c * N meet xk_async_copy_aligned's
// precondition (a threadgroup buffer of 16-byte aligned rows assumed). Here always.
template <int N, typename T>
inline bool xk_async_runs_aligned(const device T* src, long ld) {
  return true;
}
#endif

// @header xk_word
// Values held as 32-bit words of xk_word<T>::N elements (2 for 16-bit T, 1 for float),
// element 0 in the low bits: xk_word<T>::at(u, k) is element k of word u as float. (Kept as
// T, 16-bit elements make ptxas hold each high half in a register of its own and the
// converted floats besides: 48+ registers for 32 bfloat elements in a norm row; as words,
// 16. A bfloat's bits are a float's high half: a shift or a mask, where a conversion from
// the type costs ptxas two instructions.)
template <typename T>
struct xk_word {
  static constexpr int N = 1;
  static float at(uint u, int) { return as_type<float>(u); }
};
template <>
struct xk_word<half> {
  static constexpr int N = 2;
  static float at(uint u, int k) { return float(as_type<half>(ushort(k == 0 ? u : u >> 16))); }
};
template <>
struct xk_word<bfloat16_t> {
  static constexpr int N = 2;
  static float at(uint u, int k) { return as_type<float>(k == 0 ? u << 16 : u & 0xffff0000u); }
};

// @header xk_bulk_bar
// Bulk copies of a run of 16-byte words from device to threadgroup memory, completed on a
// barrier (attention_decode_stream: a named section, for the kernels that name xk_bulk_bar).
// One thread of a simdgroup issues; every thread that reads the destination waits:
//   threadgroup xk_bulk_bar bars[N];        one per stage
//   xk_bulk_init(bar)                      one thread, once, before the bar's first use
//                                          (a simdgroup barrier after it)
//   xk_bulk_expect(bar, bytes)             the issuing thread: the bar's current phase
//                                          completes once `bytes` have landed (CUDA:
//                                          mbarrier.arrive.expect_tx)
//   xk_bulk_copy(dst, src, n, bar)         the issuing thread: n elements, n * sizeof(T)
//                                          a multiple of 16, dst and src 16-byte aligned
//                                          (xk_bulk_aligned), counted on bar's phase
//   xk_bulk_wait(bar, parity)              until the bar's phase of that parity (0, 1, 0,
//                                          ... in issue order) completed
// followed by a simdgroup barrier before the destination is read (here, where the copies
// are the issuing thread's plain stores, that barrier is what publishes them). Backends
// with bulk copies define XK_BULK_COPY and their own versions (CUDA sm_90: cp.async.bulk;
// the emulator: checked phases, see emulate/csrc/xk_kernel.h).
#ifndef XK_BULK_COPY
typedef uint xk_bulk_bar;
inline void xk_bulk_init(threadgroup xk_bulk_bar* bar) {
  *bar = 0u;
}
inline void xk_bulk_expect(threadgroup xk_bulk_bar*, uint) {}
template <typename T>
inline void xk_bulk_copy(threadgroup T* dst, const device T* src, uint n, threadgroup xk_bulk_bar*) {
  for (uint k = 0; k < n; ++k) {
    dst[k] = src[k];
  }
}
inline void xk_bulk_wait(threadgroup xk_bulk_bar*, uint) {}
template <typename T>
inline bool xk_bulk_aligned(const device T*) {
  return true;
}
#endif
