// xk_kernel.h -- everything a kernel translation unit sees before MLX's generated
// text: the MSL types and math (msl_types.h), barriers and simd functions
// (msl_sync.h), the parts of MLX's utils.h prelude kernels use, and the storage
// behind rewritten `threadgroup` declarations.
#pragma once
#include "msl_sync.h"
#include "msl_types.h"

// ---------------------------------------------------------------------------
// MLX prelude (utils.h): the helpers custom kernels commonly call
// ---------------------------------------------------------------------------
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(IdxT elem, constant const int* shape, constant const int64_t* strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}

template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(uint3 elem, constant const int* shape, constant const int64_t* strides, int ndim) {
  IdxT loc = IdxT(elem.x) * IdxT(strides[ndim - 1]) + IdxT(elem.y) * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += IdxT(elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}

template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_1(uint elem, constant const int64_t& stride) {
  return IdxT(elem) * IdxT(stride);
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_2(uint2 elem, constant const int64_t strides[2]) {
  return IdxT(elem.x) * IdxT(strides[1]) + IdxT(elem.y) * IdxT(strides[0]);
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_3(uint3 elem, constant const int64_t strides[3]) {
  return IdxT(elem.x) * IdxT(strides[2]) + IdxT(elem.y) * IdxT(strides[1]) + IdxT(elem.z) * IdxT(strides[0]);
}

template <typename T, typename U>
inline T ceildiv(T n, U m) {
  return (n + m - 1) / m;
}

template <typename U>
struct Limits {
  static constexpr U max() { return metal::numeric_limits<U>::max(); }
};

// ---------------------------------------------------------------------------
// Threadgroup storage. `threadgroup float a[16][17];` in a body is rewritten (on
// the same line) to `typedef float xk_tg_t3[16][17]; auto& a = xk_tg<xk_tg_t3, 3>();`.
// Each declaration gets its own 16-byte-aligned slot, laid out once when the
// library is loaded; all threads of a threadgroup see the same slot.
// ---------------------------------------------------------------------------
namespace {
unsigned xk_tg_total_ = 0;
unsigned xk_tg_sizes_[XK_TG_DECLS > 0 ? XK_TG_DECLS : 1];

unsigned xk_tg_register(unsigned size, int id) {
  unsigned off = (xk_tg_total_ + 15u) & ~15u;
  xk_tg_total_ = off + size;
  xk_tg_sizes_[id] = size;
  return off;
}
template <class T, int ID>
struct xk_tg_slot {
  static const unsigned offset;
};
template <class T, int ID>
const unsigned xk_tg_slot<T, ID>::offset = xk_tg_register(sizeof(T), ID);

template <class T, int ID>
inline T& xk_tg() {
  return *reinterpret_cast<T*>(xk_threadgroup_memory() + xk_tg_slot<T, ID>::offset);
}
}  // namespace

extern "C" __attribute__((visibility("default"))) unsigned xk_tg_total(void) { return xk_tg_total_; }
extern "C" __attribute__((visibility("default"))) unsigned xk_tg_size(int id) {
  return id >= 0 && id < XK_TG_DECLS ? xk_tg_sizes_[id] : 0;
}

// ---------------------------------------------------------------------------
// Asynchronous copies (the bodies' xk_async_copy family, metal_src/_memory.metal) as
// CUDA runs them (xlstm_kernels/cuda/simdgroup_matrix.h): a copy of 4, 8 or 16 bytes into
// threadgroup memory from an address aligned to its size is a cp.async, landing as late as
// cp.async may: its source is read when issued, its destination holds 0xFF bytes (NaN in
// every float type) until the xk_async_wait<G> that completes its group (all but the G
// most recent groups the thread committed; copies not yet committed stay pending), and
// copies still pending when the thread ends never land. So a read before the wait sees
// NaN, and a store into a pending destination is overwritten when the copy lands. Other
// copies are synchronous, as on CUDA; xk_async_copy_aligned's preconditions (threadgroup
// destination, aligned addresses) are checked, and xk_async_runs_aligned answers as CUDA's
// does, so misaligned data takes the branch it takes there. Metal runs the portable,
// synchronous forms. The state lives in the runtime's per-thread slot (xk_thread_slot).
// ---------------------------------------------------------------------------
#define XK_ASYNC_COPY
namespace {
struct xk_async_rec {
  unsigned char* dst;
  unsigned n, group;
  unsigned char bytes[16];
};
struct xk_async_state {
  unsigned count, open;  // pending records; the group new copies join (those below it are committed)
  unsigned pad_[2];
  xk_async_rec recs[1];  // as many as the slot holds
};
inline xk_async_state* xk_async_me() { return static_cast<xk_async_state*>(xk_thread_slot()->data); }
inline unsigned xk_async_capacity() {
  return unsigned((xk_thread_slot()->bytes - offsetof(xk_async_state, recs)) / sizeof(xk_async_rec));
}
inline bool xk_async_in_threadgroup(const void* p, unsigned n) {
  const char* c = static_cast<const char*>(p);
  const char* lo = xk_threadgroup_memory();
  return c >= lo && c + n <= lo + xk_tg_total_;
}
inline void xk_async_push(void* dst, const void* src, unsigned n) {
  xk_async_state* s = xk_async_me();
  if (s->count == xk_async_capacity()) {
    xk_error("more asynchronous copies pending in one thread than the emulator keeps (commit and wait sooner)");
  }
  xk_async_rec& r = s->recs[s->count++];
  r.dst = static_cast<unsigned char*>(dst);
  r.n = n;
  r.group = s->open;
  memcpy(r.bytes, src, n);
  memset(dst, 0xFF, n);
}
// Whether CUDA's cp.async takes a copy of B bytes from src to dst.
template <unsigned B>
inline bool xk_async_takes(const void* dst, const void* src) {
  return (B == 4 || B == 8 || B == 16) && xk_async_in_threadgroup(dst, B) &&
         ((reinterpret_cast<size_t>(dst) | reinterpret_cast<size_t>(src)) & size_t(B - 1)) == 0;
}
}  // namespace
template <int N, typename T>
inline void xk_async_copy(threadgroup T* dst, const device T* src) {
  constexpr unsigned B = unsigned(N * sizeof(T));
  if (xk_async_takes<B>(dst, src)) {
    xk_async_push(dst, src, B);
  } else {
    for (int k = 0; k < N; ++k) dst[k] = src[k];
  }
}
template <int N, typename T>
inline void xk_async_copy_aligned(threadgroup T* dst, const device T* src) {
  constexpr unsigned B = unsigned(N * sizeof(T));
  if (B == 4 || B == 8 || B == 16) {
    if (!xk_async_in_threadgroup(dst, B)) {
      xk_error("xk_async_copy_aligned: the destination is not in threadgroup memory");
    }
    if (((reinterpret_cast<size_t>(dst) | reinterpret_cast<size_t>(src)) & size_t(B - 1)) != 0) {
      xk_error("xk_async_copy_aligned: an address is not aligned to the copy's size (check "
               "xk_async_runs_aligned first)");
    }
    xk_async_push(dst, src, B);
  } else {
    for (int k = 0; k < N; ++k) dst[k] = src[k];
  }
}
template <int N, typename T>
inline void xk_async_copy_aligned_l1(threadgroup T* dst, const device T* src) {
  xk_async_copy_aligned<N>(dst, src);
}
template <int N, typename T>
inline bool xk_async_runs_aligned(const device T* src, long ld) {
  constexpr size_t B = size_t(N) * sizeof(T);
  if (B == 4 || B == 8 || B == 16) {
    return ((reinterpret_cast<size_t>(src) | size_t(ld) * sizeof(T)) & (B - 1)) == 0;
  }
  return true;
}
inline void xk_async_commit() { xk_async_me()->open++; }
template <int G>
inline void xk_async_wait() {
  xk_async_state* s = xk_async_me();
  constexpr unsigned g = G < 0 ? 0u : unsigned(G);  // as CUDA's wait_group (a negative G: all)
  const unsigned done = s->open > g ? s->open - g : 0u;  // groups [0, done) complete
  unsigned k = 0;
  for (unsigned i = 0; i < s->count; ++i) {
    xk_async_rec& r = s->recs[i];
    if (r.group < done) {
      memcpy(r.dst, r.bytes, r.n);
    } else {
      s->recs[k++] = r;
    }
  }
  s->count = k;
}

// ---------------------------------------------------------------------------
// Bulk copies (metal_src/_memory.metal's xk_bulk_bar section) with CUDA's completion rules
// checked: a bar counts phases (0, 1, 2, ...); xk_bulk_expect arms the current phase with a
// byte count (once a phase), each xk_bulk_copy delivers its bytes to it, and xk_bulk_wait on
// the current phase's parity completes it, which must then be armed and have received exactly
// the bytes expected (on CUDA it would never complete: a hang), while a wait on the other
// parity returns at once (that phase completed earlier), as mbarrier.try_wait.parity. A copy
// must go to threadgroup memory, from and to 16-byte aligned addresses, in whole 16-byte
// words. The bytes land when the copy is issued (a read before the wait is not caught here,
// as on Metal; the schedules still catch a stage refilled before every lane read it).
// State in the bar's 8 bytes: phase (bits 0-15), armed (bit 16), a 15-bit mark that
// xk_bulk_init writes (bits 17-31: threadgroup memory starts poisoned, so an uninitialised
// bar fails the mark), and the bytes expected and not yet delivered as a signed 32-bit count
// (bits 32-63).
// ---------------------------------------------------------------------------
#define XK_BULK_COPY
typedef uint64_t xk_bulk_bar;
namespace {
constexpr uint64_t xk_bulk_armed_ = 1ull << 16;
constexpr uint64_t xk_bulk_ready_ = uint64_t(0x2B6D) << 17;  // the mark
constexpr uint64_t xk_bulk_mark_mask_ = uint64_t(0x7FFF) << 17;
inline int32_t xk_bulk_left(uint64_t b) { return int32_t(uint32_t(b >> 32)); }
inline uint64_t xk_bulk_with_left(uint64_t b, int64_t left) {
  if (left > INT32_MAX || left < INT32_MIN) {
    xk_error("xk_bulk: more bytes in one phase than a bar counts");
  }
  return (b & 0xFFFFFFFFull) | (uint64_t(uint32_t(int32_t(left))) << 32);
}
inline void xk_bulk_check_ready(const xk_bulk_bar* bar, const char* who) {
  if (!xk_async_in_threadgroup(bar, sizeof(xk_bulk_bar))) {
    xk_error(who);  // the message names the call
  }
  if ((*bar & xk_bulk_mark_mask_) != xk_bulk_ready_) {
    xk_error("xk_bulk: a bar used before xk_bulk_init");
  }
}
}  // namespace
inline void xk_bulk_init(xk_bulk_bar* bar) {
  if (!xk_async_in_threadgroup(bar, sizeof(xk_bulk_bar))) {
    xk_error("xk_bulk_init: the bar is not in threadgroup memory");
  }
  *bar = xk_bulk_ready_;
}
inline void xk_bulk_expect(xk_bulk_bar* bar, uint bytes) {
  xk_bulk_check_ready(bar, "xk_bulk_expect: the bar is not in threadgroup memory");
  if (*bar & xk_bulk_armed_) {
    xk_error("xk_bulk_expect: the bar's phase was armed already (one xk_bulk_expect a phase)");
  }
  *bar = xk_bulk_with_left(*bar | xk_bulk_armed_, int64_t(xk_bulk_left(*bar)) + bytes);
}
template <typename T>
inline void xk_bulk_copy(T* dst, const T* src, uint n, xk_bulk_bar* bar) {
  xk_bulk_check_ready(bar, "xk_bulk_copy: the bar is not in threadgroup memory");
  const size_t bytes = size_t(n) * sizeof(T);
  if (bytes % 16 != 0) {
    xk_error("xk_bulk_copy: a copy must be whole 16-byte words");
  }
  if (((reinterpret_cast<size_t>(dst) | reinterpret_cast<size_t>(src)) & 15u) != 0) {
    xk_error("xk_bulk_copy: an address is not 16-byte aligned (check xk_bulk_aligned first)");
  }
  if (bytes && !xk_async_in_threadgroup(dst, unsigned(bytes))) {
    xk_error("xk_bulk_copy: the destination is not (wholly) in threadgroup memory");
  }
  memcpy(dst, src, bytes);
  *bar = xk_bulk_with_left(*bar, int64_t(xk_bulk_left(*bar)) - int64_t(bytes));
}
inline void xk_bulk_wait(xk_bulk_bar* bar, uint parity) {
  xk_bulk_check_ready(bar, "xk_bulk_wait: the bar is not in threadgroup memory");
  const uint64_t b = *bar;
  if ((b & 1u) != (parity & 1u)) {
    return;  // the phase of that parity completed before the current one began
  }
  if (!(b & xk_bulk_armed_)) {
    xk_error("xk_bulk_wait: waits on a phase that no xk_bulk_expect armed (on CUDA: a hang)");
  }
  if (xk_bulk_left(b) != 0) {
    xk_error(xk_bulk_left(b) > 0 ? "xk_bulk_wait: the phase expects more bytes than its copies deliver (on CUDA: a hang)"
                                 : "xk_bulk_wait: the phase's copies deliver more bytes than it expects");
  }
  *bar = xk_bulk_ready_ | ((b + 1u) & 0xFFFFull);  // the next phase: not armed, nothing expected
}
template <typename T>
inline bool xk_bulk_aligned(const T* p) {
  return (reinterpret_cast<size_t>(p) & 15u) == 0;
}

// ---------------------------------------------------------------------------
// Bounds checks on fixed-size arrays (threadgroup and thread-local), built with
// -fsanitize=bounds: GCC calls these with the source location and the index.
// ---------------------------------------------------------------------------
#ifdef XK_CHECK_BOUNDS
extern "C" int snprintf(char*, size_t, const char*, ...);
namespace {
struct xk_ubsan_loc {
  const char* file;
  uint32_t line, column;
};
struct xk_ubsan_type {
  uint16_t kind, info;
  char name[1];
};
struct xk_ubsan_oob {
  xk_ubsan_loc loc;
  const xk_ubsan_type* array_type;
  const xk_ubsan_type* index_type;
};
void xk_report_oob(xk_ubsan_oob* d, uintptr_t index) {
  char msg[512];
  bool is_signed = d->index_type->info & 1;
  unsigned bits = 1u << (d->index_type->info >> 1);
  long long v = (long long)index;
  if (is_signed && bits < 64) v = (long long)(int64_t(index << (64 - bits)) >> (64 - bits));
  snprintf(msg, sizeof msg, "out-of-bounds index %lld into array of type %s at %s:%u:%u", v, d->array_type->name,
           d->loc.file, d->loc.line, d->loc.column);
  xk_error(msg);
}
}  // namespace
extern "C" __attribute__((visibility("hidden"))) void __ubsan_handle_out_of_bounds(void* d, void* index) {
  xk_report_oob(static_cast<xk_ubsan_oob*>(d), reinterpret_cast<uintptr_t>(index));
}
extern "C" __attribute__((visibility("hidden"))) void __ubsan_handle_out_of_bounds_abort(void* d, void* index) {
  xk_report_oob(static_cast<xk_ubsan_oob*>(d), reinterpret_cast<uintptr_t>(index));
}
#endif

// ---------------------------------------------------------------------------
// Give every barrier and collective call in kernel code its own site id, so that
// `if (c) { a = simd_sum(x); } else { a = simd_sum(y); }` on one line is two sites.
// (A function-like macro may name itself; it expands once per call site.)
// ---------------------------------------------------------------------------
#define XK_SITE_ARGS_AT(...) __VA_ARGS__ __VA_OPT__(, ) __FILE__, __LINE__, __COUNTER__ + 1u
#define threadgroup_barrier(...) threadgroup_barrier(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simdgroup_barrier(...) simdgroup_barrier(XK_SITE_ARGS_AT(__VA_ARGS__))
#define xk_cluster_sync(...) xk_cluster_sync(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_sum(...) simd_sum(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_product(...) simd_product(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_max(...) simd_max(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_min(...) simd_min(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_and(...) simd_and(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_or(...) simd_or(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_xor(...) simd_xor(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_sum(...) quad_sum(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_product(...) quad_product(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_max(...) quad_max(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_min(...) quad_min(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_and(...) quad_and(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_or(...) quad_or(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_xor(...) quad_xor(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_prefix_inclusive_sum(...) simd_prefix_inclusive_sum(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_prefix_exclusive_sum(...) simd_prefix_exclusive_sum(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_prefix_inclusive_product(...) simd_prefix_inclusive_product(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_prefix_exclusive_product(...) simd_prefix_exclusive_product(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_prefix_inclusive_sum(...) quad_prefix_inclusive_sum(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_prefix_exclusive_sum(...) quad_prefix_exclusive_sum(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_prefix_inclusive_product(...) quad_prefix_inclusive_product(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_prefix_exclusive_product(...) quad_prefix_exclusive_product(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_shuffle(...) simd_shuffle(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_shuffle_xor(...) simd_shuffle_xor(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_shuffle_up(...) simd_shuffle_up(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_shuffle_down(...) simd_shuffle_down(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_shuffle_rotate_up(...) simd_shuffle_rotate_up(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_shuffle_rotate_down(...) simd_shuffle_rotate_down(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_broadcast(...) simd_broadcast(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_broadcast_first(...) simd_broadcast_first(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_shuffle(...) quad_shuffle(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_shuffle_xor(...) quad_shuffle_xor(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_shuffle_up(...) quad_shuffle_up(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_shuffle_down(...) quad_shuffle_down(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_shuffle_rotate_up(...) quad_shuffle_rotate_up(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_shuffle_rotate_down(...) quad_shuffle_rotate_down(XK_SITE_ARGS_AT(__VA_ARGS__))
#define quad_broadcast(...) quad_broadcast(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_ballot(...) simd_ballot(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_all(...) simd_all(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_any(...) simd_any(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_is_first(...) simd_is_first(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simd_active_threads_mask(...) simd_active_threads_mask(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simdgroup_multiply_accumulate(...) simdgroup_multiply_accumulate(XK_SITE_ARGS_AT(__VA_ARGS__))
#define simdgroup_multiply(...) simdgroup_multiply(XK_SITE_ARGS_AT(__VA_ARGS__))
