// Normalisation kernels. Bodies for mx.fast.metal_kernel; the signature is generated
// by MLX (or by xlstm_kernels.emulate, which generates the same text).
//
// Launch: grid = (threads, rows, 1) in threads, threadgroup = (threads, 1, 1), so one
// threadgroup normalises one row; `threads` is a multiple of 32 (<= 1024).

// @kernel rms_norm
// y[r, i] = w[i] * T(x[r, i] * rsqrt(mean(x[r, :]^2) + eps))
// inputs:  x (rows, axis_size) T; w (axis_size) T (unused if !HAS_WEIGHT);
//          eps () float; axis_size () int
// outputs: y (rows, axis_size) T.  template: T, HAS_WEIGHT
uint row = threadgroup_position_in_grid.y;
uint tid = thread_index_in_threadgroup;
uint nthreads = threads_per_threadgroup.x;
uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
uint nsg = simdgroups_per_threadgroup;
const uint n = uint(axis_size);
const device T* xr = x + size_t(row) * n;
device T* yr = y + size_t(row) * n;

threadgroup float partial[32];
threadgroup float inv_rms;

// Level 1: each thread strides over the row, then each simdgroup reduces.
float acc = 0.0f;
for (uint i = tid; i < n; i += nthreads) {
  float v = float(xr[i]);
  acc += v * v;
}
acc = simd_sum(acc);
if (lane == 0) {
  partial[sg] = acc;
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// Level 2: the first simdgroup reduces the per-simdgroup partial sums.
if (sg == 0) {
  float p = lane < nsg ? partial[lane] : 0.0f;
  p = simd_sum(p);
  if (lane == 0) {
    inv_rms = metal::precise::rsqrt(p / float(n) + eps);
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

const float r = inv_rms;
for (uint i = tid; i < n; i += nthreads) {
  T normed = T(float(xr[i]) * r);
  yr[i] = HAS_WEIGHT ? T(w[i] * normed) : normed;
}
