// xk_abi.h -- the contract between the emulator runtime (runtime.cpp, one shared
// library per process) and each compiled kernel library (a Metal body wrapped the
// way MLX wraps it, compiled as GNU C++17).
//
// The runtime owns fibers, threadgroup memory, barriers and the scheduler. A kernel
// library exports `xk_entry` (run one Metal thread) and `xk_tg_layout` (its
// threadgroup memory), and calls back into the runtime through the functions below,
// which the dynamic linker resolves against the runtime library (loaded RTLD_GLOBAL).
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A Metal uint3: 16 bytes, like Metal's (and the shim's) uint3. */
typedef struct __attribute__((aligned(16))) { uint32_t x, y, z, pad_; } xk_uint3;  /* aligned like uint3 */

/* Every attribute MLX's wrapper can pass to a kernel, computed per thread. */
typedef struct {
  xk_uint3 dispatch_threads_per_threadgroup;
  xk_uint3 grid_origin;
  xk_uint3 grid_size;
  xk_uint3 thread_position_in_grid;
  xk_uint3 thread_position_in_threadgroup;
  xk_uint3 threadgroup_position_in_grid;
  xk_uint3 threadgroups_per_grid;
  xk_uint3 threads_per_grid;
  xk_uint3 threads_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t thread_execution_width;
  uint32_t thread_index_in_quadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t thread_index_in_threadgroup;
  uint32_t threads_per_simdgroup;
} xk_thread_attrs;

typedef void (*xk_entry_fn)(void* const* buffers, const xk_thread_attrs* attrs);

/* One lane's part of a pending simdgroup collective. The lane's frame stays alive
   while it waits, so `in`/`out` point into it. When every live lane of the
   simdgroup has stopped, the runtime picks the earliest call site that lanes wait
   at and calls `resolve` once with all lanes waiting there (the active set). */
typedef struct xk_collective xk_collective;
typedef void (*xk_resolve_fn)(xk_collective* const* lanes /* [32]; NULL = inactive */,
                              int width /* lanes that exist in this simdgroup */);
struct xk_collective {
  const char* file;
  uint32_t line, column;
  const char* what; /* e.g. "simd_sum" */
  xk_resolve_fn resolve; /* NULL: a pure rendezvous (simdgroup_barrier) */
  const void* in;
  void* out;
  uint64_t arg; /* lane index, delta or mask, by operation */
};

/* Kernel code's state of one thread (the emulator's pending async copies): `bytes` of
   storage the runtime owns, 16-byte aligned, its first 64 bytes zeroed when the thread
   starts (kernel code allocates nothing inside a fiber). */
typedef struct {
  void* data;
  size_t bytes;
} xk_thread_slot_t;

/* ---- services the runtime provides to kernel code ---- */
void xk_threadgroup_barrier(const char* file, uint32_t line, uint32_t column);
/* Threadgroup clusters (a kernel with the template int XK_CLUSTER): a barrier over every
   thread of the cluster, and the address of the byte at p (in the running thread's
   threadgroup memory) in the memory of the cluster's threadgroup `rank`. */
void xk_cluster_barrier(const char* file, uint32_t line, uint32_t column);
void* xk_cluster_peer_address(const void* p, uint32_t rank);
void xk_collective_wait(xk_collective* op);
char* xk_threadgroup_memory(void);
xk_thread_slot_t* xk_thread_slot(void); /* the running thread's slot */
uint32_t xk_lane(void);       /* thread_index_in_simdgroup of the running thread */
uint32_t xk_simd_width(void); /* lanes that exist in its simdgroup (<= 32) */
/* Report an error found in kernel code. From a thread: ends that thread and the
   launch. From a resolver: recorded, the launch stops after the resolver returns. */
void xk_error(const char* message);

#ifdef __cplusplus
}
#endif
