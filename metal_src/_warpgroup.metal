// Shared by the kernel families, as a named section: placed before a family's header
// section only where the kernel's text (its body, its family's header and named sections)
// names xk_tile_wg (xlstm_kernels/runtime/sources.py): warpgroup products, as gemm_simd (WG)
// and the tile prefill (attention_prefill_mma, WG) use them.

// @header xk_tile_wg
// ---- Warpgroup products ------------------------------------------------------------------
// Four simdgroups (a warpgroup: simdgroups 4g .. 4g + 3) multiply 64 rows of the A tile by
// the whole B tile together; simdgroup 4g + w owns rows 64g + 16w .. + 15 (FM = 2 fragment
// rows) and every column (FN = BN / 8). Tiles sit in the warpgroup layout below.
//
// xk_tile_wg(r, c, rows): element (r, c) of a tile of `rows` rows (2-byte T, columns a
// multiple of 64 or exactly 64) stored as panels of 64 columns: panel c / 64 holds its rows
// of 128 bytes one after another, and in row r the 16-byte chunk q sits at q ^ (r & 7).
// (CUDA's wgmma reads exactly this: the 128-byte swizzle of its shared-memory descriptors,
// K-major for a K-contiguous operand, MN-major otherwise.)
inline int xk_tile_wg(int r, int c, int rows) {
  return (c >> 6) * rows * 64 + r * 64 + ((((c >> 3) ^ r) & 7) << 3) + (c & 7);
}

#ifndef XK_WARPGROUP_MMA
// Portable form, asynchronous as the hardware's: xk_wg_mma records the product of one K
// tile (the stage's A and B tiles) and returns; xk_wg_wait<G> runs the recorded products
// but the last G. So a body that reuses a stage before waiting for the products that read
// it computes wrong results here too (the emulator then fails the tests, as the GPU would).
// Each lane adds, for each element (row, col) it holds (fr, fc: its xk_frag_coord), the
// BK products of A row `row` and B column `col` read through xk_tile_wg.
// q: a per-thread queue of up to 4 recorded products (QA / QB: the stage tiles, QR: the
// simdgroup's first row in the A tile).
template <typename T, int BM, int BN, int BK, bool TRANS_A, bool TRANS_B>
struct xk_wg_queue {
  const threadgroup T* qa[4];
  const threadgroup T* qb[4];
  int qr[4];
  int n;
};
template <typename Q>
inline void xk_wg_init(thread Q& q) {
  q.n = 0;
}
template <typename T, int BM, int BN, int BK, bool TRANS_A, bool TRANS_B>
inline void xk_wg_mma(thread xk_wg_queue<T, BM, BN, BK, TRANS_A, TRANS_B>& q, thread simdgroup_matrix<float, 8, 8>* acc,
                      const threadgroup T* ta, const threadgroup T* tb, int ra) {
  q.qa[q.n] = ta;
  q.qb[q.n] = tb;
  q.qr[q.n] = ra;
  q.n += 1;
}
template <typename Q>
inline void xk_wg_commit(thread Q& q) {}
// The element (r, p) of op(A) and (p, c) of op(B) in the stage tiles.
template <typename T, int BM, int BN, int BK, bool TRANS_A>
inline float xk_wg_a(const threadgroup T* ta, int r, int p) {
  return float(TRANS_A ? ta[xk_tile_wg(p, r, BK)] : ta[xk_tile_wg(r, p, BM)]);
}
template <typename T, int BM, int BN, int BK, bool TRANS_B>
inline float xk_wg_b(const threadgroup T* tb, int p, int c) {
  return float(TRANS_B ? tb[xk_tile_wg(c, p, BN)] : tb[xk_tile_wg(p, c, BK)]);
}
template <int G, typename T, int BM, int BN, int BK, bool TRANS_A, bool TRANS_B>
inline void xk_wg_wait(thread xk_wg_queue<T, BM, BN, BK, TRANS_A, TRANS_B>& q, thread simdgroup_matrix<float, 8, 8>* acc,
                       int fr, int fc) {
  constexpr int FN = BN / 8;
  const int run = q.n - G;
  if (run <= 0) {
    return;
  }
  for (int u = 0; u < run; ++u) {
    for (int i = 0; i < 2; ++i) {
      const int r = q.qr[u] + i * 8 + fr;
      for (int j = 0; j < FN; ++j) {
        thread vec<float, 2>& e = reinterpret_cast<thread vec<float, 2>&>(acc[i * FN + j].thread_elements());
        for (int h = 0; h < 2; ++h) {
          const int c = j * 8 + fc + h;
          float s = 0.0f;
          for (int p = 0; p < BK; ++p) {
            s = metal::fma(xk_wg_a<T, BM, BN, BK, TRANS_A>(q.qa[u], r, p), xk_wg_b<T, BM, BN, BK, TRANS_B>(q.qb[u], p, c), s);
          }
          e[h] += s;
        }
      }
    }
  }
  for (int u = run; u < q.n; ++u) {
    q.qa[u - run] = q.qa[u];
    q.qb[u - run] = q.qb[u];
    q.qr[u - run] = q.qr[u];
  }
  q.n = G;
}
// xk_wg_wait_queue<G_ALL>: every product of queue q done, where the hardware counts the
// groups of all queues together and the caller knows that the G_ALL most recent ones belong
// to other queues (CUDA: wgmma.wait_group G_ALL). Here q's own products run.
template <int G_ALL, typename T, int BM, int BN, int BK, bool TRANS_A, bool TRANS_B>
inline void xk_wg_wait_queue(thread xk_wg_queue<T, BM, BN, BK, TRANS_A, TRANS_B>& q,
                             thread simdgroup_matrix<float, 8, 8>* acc, int fr, int fc) {
  xk_wg_wait<0>(q, acc, fr, fc);
}
// Shared-memory writes of this thread's finished copies made visible to the products
// (CUDA: a proxy fence; here nothing).
inline void xk_wg_fence_copies() {}
#endif
