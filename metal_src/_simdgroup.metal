// Shared by every kernel family: placed before each family's header section
// (xlstm_kernels/runtime/sources.py; files named _*.metal are not families).

// @header
// Lane (thread_index_in_simdgroup) -> (row, first column) of the two elements it holds in
// an 8x8 simdgroup_matrix; the second element is at column + 1. Metal leaves this layout
// to the implementation: this is Apple GPUs' (and the emulator's). A backend that lays the
// elements out differently (xlstm_kernels.cuda: the tensor cores' accumulator layout)
// defines XK_SIMDGROUP_LAYOUT and its own xk_frag_coord; bodies never assume a layout.
// XK_FRAG_ROW_XOR_A / _B: the two lane bits in which the 4 lanes holding one row differ.
#ifndef XK_SIMDGROUP_LAYOUT
inline void xk_frag_coord(uint lane, thread int& row, thread int& col) {
  const int qid = int(lane) / 4;
  row = (qid & 4) + (int(lane) / 2) % 4;
  col = (qid & 2) * 2 + (int(lane) % 2) * 2;
}
#define XK_FRAG_ROW_XOR_A 1
#define XK_FRAG_ROW_XOR_B 8
#endif

// Max / sum of a per-lane value over the 4 lanes that hold the same fragment row (every
// lane gets the result). All 32 lanes must call it.
inline float xk_frag_row_max(float v) {
  v = metal::max(v, simd_shuffle_xor(v, ushort(XK_FRAG_ROW_XOR_A)));
  return metal::max(v, simd_shuffle_xor(v, ushort(XK_FRAG_ROW_XOR_B)));
}

inline float xk_frag_row_sum(float v) {
  v += simd_shuffle_xor(v, ushort(XK_FRAG_ROW_XOR_A));
  return v + simd_shuffle_xor(v, ushort(XK_FRAG_ROW_XOR_B));
}
