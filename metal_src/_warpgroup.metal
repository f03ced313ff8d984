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
// simdgroup's first row in the A tile). check_aligned: CUDA's trap for tiles off the
// 1024-byte grid of its swizzle (false where the caller checked the same bases before).
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
                      const threadgroup T* ta, const threadgroup T* tb, int ra, bool check_aligned = true) {
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

// xk_wg_mma_rs: the product with its left operand in registers (CUDA: wgmma with A in
// registers): each simdgroup's 16 rows of A (BK columns) are its fragments pa[i * BK / 8 + j]
// (2-byte T, set by xk_frag_set_a: row 8i + fr, columns 8j + fc and + 1 of the lane), times
// the stage's B tile (BK x BN, MN-major in the warpgroup layout: element (p, c) at
// xk_tile_wg(p, c, BK)). The hardware reads the fragments while the product runs, so they
// must not change before the wait that covers it: here the product runs at that wait, from
// the values the fragments had at the issue, and is NaN if they changed since (a body that
// rewrites them too early fails its tests here too).
template <typename T, int BN, int BK>
struct xk_wg_queue_rs {
  const thread simdgroup_matrix<T, 8, 8>* pa[4];
  vec<float, 2> seen[4][BK / 4];  // the 2 x BK / 8 fragments' elements at the issue
  const threadgroup T* qb[4];
  int n;
};
template <typename T, int BN, int BK>
inline void xk_wg_mma_rs(thread xk_wg_queue_rs<T, BN, BK>& q, thread simdgroup_matrix<float, 8, 8>* acc,
                         const thread simdgroup_matrix<T, 8, 8>* pa, const threadgroup T* tb) {
  q.pa[q.n] = pa;
  for (int f = 0; f < BK / 4; ++f) {
    const vec<T, 2> e = pa[f].thread_elements();
    q.seen[q.n][f] = vec<float, 2>(float(e[0]), float(e[1]));
  }
  q.qb[q.n] = tb;
  q.n += 1;
}
template <int G, typename T, int BN, int BK>
inline void xk_wg_wait(thread xk_wg_queue_rs<T, BN, BK>& q, thread simdgroup_matrix<float, 8, 8>* acc, int fr,
                       int fc) {
  constexpr int FN = BN / 8;
  constexpr int FK = BK / 8;
  const int run = q.n - G;
  if (run <= 0) {
    return;
  }
  ushort src[4];  // the lanes holding columns 0, 2, 4, 6 of row fr of a fragment
  for (int s = 0; s < 32; ++s) {
    int r, c;
    xk_frag_coord(uint(s), r, c);
    if (r == fr) {
      src[c / 2] = ushort(s);
    }
  }
  for (int u = 0; u < run; ++u) {
    bool same = true;
    for (int f = 0; f < 2 * FK; ++f) {
      const vec<T, 2> e = q.pa[u][f].thread_elements();
      for (int h = 0; h < 2; ++h) {
        const float now = float(e[h]), was = q.seen[u][f][h];
        same = same && (now == was || (metal::isnan(now) && metal::isnan(was)));
      }
    }
    same = simd_all(same);
    float arow[2][BK];  // rows 8i + fr of the simdgroup's A, from the lanes that hold them
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < FK; ++j) {
        const vec<float, 2> v = q.seen[u][i * FK + j];
        for (int h = 0; h < 4; ++h) {
          arow[i][j * 8 + 2 * h] = simd_shuffle(v[0], src[h]);
          arow[i][j * 8 + 2 * h + 1] = simd_shuffle(v[1], src[h]);
        }
      }
    }
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < FN; ++j) {
        thread vec<float, 2>& e = reinterpret_cast<thread vec<float, 2>&>(acc[i * FN + j].thread_elements());
        for (int h = 0; h < 2; ++h) {
          const int c = j * 8 + fc + h;
          float s = 0.0f;
          for (int p = 0; p < BK; ++p) {
            s = metal::fma(arow[i][p], float(q.qb[u][xk_tile_wg(p, c, BK)]), s);
          }
          e[h] = same ? e[h] + s : NAN;
        }
      }
    }
  }
  for (int u = run; u < q.n; ++u) {
    q.pa[u - run] = q.pa[u];
    for (int f = 0; f < BK / 4; ++f) {
      q.seen[u - run][f] = q.seen[u][f];
    }
    q.qb[u - run] = q.qb[u];
  }
  q.n = G;
}
#endif
