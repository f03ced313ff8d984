// A plain device-to-device copy: the instrument behind the bench's measured copy
// bandwidth (xlstm_kernels/benchmarks/copy_rate.py), against which the memory-bound
// ops' rates are read. Not an op of the package.

// @kernel copy_words
// dst = src for n 32-bit words. Each thread copies runs of 4 words (16 bytes, one wide
// load and one wide store: MLX's buffers start 16-byte aligned), grid-stride over the
// runs; the words past the last whole run one at a time.
// Threadgroup (TG, 1, 1); grid any number of threads (a multiple of TG).
// inputs: src (n,) uint32. outputs: dst (n,) uint32.
const ulong n = ulong(src_shape[0]);
const ulong runs = n / 4;
const ulong step = ulong(threads_per_grid.x);
for (ulong r = thread_position_in_grid.x; r < runs; r += step) {
  uint32_t t[4];
  xk_load_w<4>(src + 4 * r, t);
  xk_store_w<4>(dst + 4 * r, t);
}
for (ulong i = 4 * runs + thread_position_in_grid.x; i < n; i += step) {
  dst[i] = src[i];
}
