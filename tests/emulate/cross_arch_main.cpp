// Driver for test_cross_arch.py: launches a translated kernel (xk_entry) through the
// runtime with every schedule and 1-2 workers, and checks per-threadgroup sums.
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include "xk_abi.h"
struct Region { const char* lo; const char* hi; const char* glo; const char* ghi; const char* name; uint32_t es, pad; };
struct LaunchDesc { xk_entry_fn entry; void* const* buffers; uint32_t grid[3]; uint32_t group[3]; uint32_t schedule, workers; uint64_t seed, tg_bytes, stack_bytes; uint32_t n_regions, pad; const Region* regions; };
extern "C" int xk_launch(const LaunchDesc*, char*, size_t);
extern "C" void xk_entry(void* const*, const xk_thread_attrs*);
extern "C" unsigned xk_tg_total(void);
int main() {
  static float in[1000], out[1000];
  for (int i = 0; i < 1000; ++i) in[i] = float(i % 7);
  void* bufs[2] = {in, out};
  for (int sched = 0; sched < 3; ++sched) for (int w = 1; w <= 2; ++w) {
    LaunchDesc d; memset(&d, 0, sizeof d);
    d.entry = xk_entry; d.buffers = bufs; d.grid[0] = 1000; d.grid[1] = d.grid[2] = 1;
    d.group[0] = 96; d.group[1] = d.group[2] = 1; d.schedule = sched; d.workers = w; d.seed = 5;
    d.tg_bytes = xk_tg_total(); d.stack_bytes = 65536;
    char err[512] = {0};
    int rc = xk_launch(&d, err, sizeof err);
    int bad = 0;
    for (int gi = 0; gi * 96 < 1000; ++gi) {
      float s = 0; int hi = gi*96+96 > 1000 ? 1000 : gi*96+96;
      for (int i = gi*96; i < hi; ++i) s += in[i];
      for (int i = gi*96; i < hi; ++i) bad += out[i] != s;
    }
    printf("sched %d workers %d rc %d bad %d %s\n", sched, w, rc, bad, err);
  }
}
