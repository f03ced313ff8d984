// Shared by the kernel families, as a named section: placed before a family's header
// section only where the kernel's text names xk_cluster_sync (xlstm_kernels/runtime/sources.py):
// threadgroup clusters, as the split-KV decode's one-launch form (attention_partial_mma with
// XK_CLUSTER > 1) uses them.

// @header xk_cluster_sync
// ---- Threadgroup clusters ------------------------------------------------------------------
// A kernel whose template list has the int XK_CLUSTER = C > 1 runs in clusters of C
// consecutive threadgroups along x (threadgroups_per_grid.x a multiple of C; a threadgroup's
// rank in its cluster is threadgroup_position_in_grid.x % C). The threadgroups of a cluster
// run at the same time and see each other's threadgroup memory:
//   xk_cluster_sync()            every thread of every threadgroup of the cluster waits here;
//                                threadgroup memory written before it is visible after it to
//                                the whole cluster (release / acquire).
//   xk_cluster_peer(p, rank)     the address of the same byte as p (in the calling
//                                threadgroup's memory) in threadgroup `rank` of the cluster.
// A threadgroup's memory is gone once its threads return: a body whose peers read its memory
// syncs the cluster once more before returning.
// Backends: cuda on sm_90 and newer (__cluster_dims__, barrier.cluster and mapa: the
// distributed shared memory of Hopper, xlstm_kernels/cuda/compat.h) and the emulator
// (xlstm_kernels/emulate/csrc/msl_sync.h) define XK_CLUSTER_NATIVE and these functions;
// XK_CLUSTER_MAX is the largest C a backend runs. Apple GPUs have no clusters: there
// XK_CLUSTER_MAX is 1, and a body checks `static_assert(XK_CLUSTER <= XK_CLUSTER_MAX)`.
#ifndef XK_CLUSTER_NATIVE
#define XK_CLUSTER_MAX 1
inline void xk_cluster_sync() {}
template <typename T>
inline threadgroup T* xk_cluster_peer(threadgroup T* p, uint) {
  return p;
}
#endif
