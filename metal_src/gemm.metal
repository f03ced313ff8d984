// GEMM kernels. Bodies for mx.fast.metal_kernel.
//
// Launch: grid = (ceil(K / TILE) * TILE, ceil(M / TILE) * TILE, batch) in threads,
// threadgroup = (TILE, TILE, 1): one thread per output element, one threadgroup per
// TILE x TILE output tile.

// @kernel gemm_av
// C = A . V with A (M, N), V (N, K) -> C (M, K); float accumulation.
// inputs:  A (M, N) T; V (N, K) T.   outputs: C (M, K) T.   template: T, TILE, PAD
uint tx = thread_position_in_threadgroup.x;
uint ty = thread_position_in_threadgroup.y;
const int M = A_shape[0];
const int N = A_shape[1];
const int K = V_shape[1];
const int row = int(threadgroup_position_in_grid.y * TILE + ty);
const int col = int(threadgroup_position_in_grid.x * TILE + tx);

threadgroup float As[TILE][TILE + PAD];
threadgroup float Vs[TILE][TILE + PAD];

float acc = 0.0f;
for (int t = 0; t < N; t += TILE) {
  // Cooperative load: each thread writes exactly one cell of each tile; cells
  // outside the matrices are zero so partial edge tiles need no special case.
  As[ty][tx] = (row < M && t + int(tx) < N) ? float(A[size_t(row) * N + t + tx]) : 0.0f;
  Vs[ty][tx] = (t + int(ty) < N && col < K) ? float(V[size_t(t + ty) * K + col]) : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // tiles complete before reading
  for (int p = 0; p < TILE; ++p) {
    acc = fma(As[ty][p], Vs[p][tx], acc);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // reads done before the next load
}
if (row < M && col < K) {
  C[size_t(row) * K + col] = T(acc);
}
