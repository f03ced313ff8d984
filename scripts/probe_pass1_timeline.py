"""Probe (session 34): where decode pass 1's time goes inside each threadgroup, from clocks
read at five points of the kernel.

``probe_pass1_floor.py`` found pass 1 (``attention_partial_mma``) ~2.8 us slower than a
kernel that streams the same bytes with the same launch shape and no arithmetic, at every
cache length: a fixed cost. This probe builds pass 1 from its body with timer reads added
(text inserted into the Metal source given to the CUDA backend; the kernel is otherwise
unchanged) and has thread 0 of each threadgroup (lane 0 of each warp) overwrite its first
o_part words with them, then prints their spread over the 128 threadgroups of a
1 x 32 x 32 x 4096 x 128 fp16 decode (block 1024 keys, 4 warps, as planned):

    c0  kernel start (clock64, this SM's cycles) and g0 (%globaltimer, ns)
    c1  the first tiles' copies issued (params read: every address needs them)
    c2  q staged and its fragments loaded
    c3  each warp's first tile landed (after its first wait)
    c4  each warp's loop over its tiles done
    c5  the end: the warps' states merged, o_part and lse written; g5

    python3 scripts/probe_pass1_timeline.py [calls]     # on the GPU (backend cuda)
"""

from __future__ import annotations

import statistics
import sys

import mlx.core as mx

HEADS, KEYS, D, BLOCK = 32, 4096, 128, 1024

_T = 'asm volatile("mov.u64 %0, %%clock64;" : "=l"(xk_c{n}) :: "memory");'
_G = 'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(xk_g{n}) :: "memory");'
INSERTS = [  # (anchor text in the body, code inserted before it)
    ("const long Hq = ",
     "unsigned long long xk_c0, xk_g0, xk_c1, xk_c2, xk_c3 = 0, xk_c4, xk_c5, xk_g5;\n"
     + _T.format(n=0) + _G.format(n=0) + "\n"),
    ("// Q (zero-padded to NQ x DP) through the last stage", _T.format(n=1) + "\n"),
    ("if (D % 8 != 0 || DV % 8 != 0) {\n  // Zero columns", _T.format(n=2) + "\n"),
    ("  const int tl = ST > 1 ? t + ST - 1 : t;  // the tile copied now",
     "  if (t == 0) { " + _T.format(n=3) + " }\n"),
    ("// The block's normalised output and log-sum-exp per row", _T.format(n=4) + "\n"),
]
TAIL = (_T.format(n=5) + _G.format(n=5) + """
threadgroup_barrier(mem_flags::mem_device);
{
  float* xk_dst = o_part + (row0 * nb + blk) * DV;
  unsigned xk_sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(xk_sm));
  if (thread_index_in_threadgroup == 0) {
    xk_dst[0] = float(xk_c1 - xk_c0); xk_dst[1] = float(xk_c2 - xk_c0); xk_dst[2] = float(xk_c5 - xk_c0);
    xk_dst[3] = float(xk_g0 % (1ull << 24)); xk_dst[4] = float(xk_g5 - xk_g0); xk_dst[5] = float(xk_sm);
  }
  if (thread_index_in_simdgroup == 0) {
    xk_dst[8 + simdgroup_index_in_threadgroup] = float(xk_c3 - xk_c0);
    xk_dst[16 + simdgroup_index_in_threadgroup] = float(xk_c4 - xk_c0);
  }
}
""")


def _instrument(source: str) -> str:
    for anchor, code in INSERTS:
        if source.count(anchor) != 1:
            raise SystemExit(f"probe_pass1_timeline: anchor not found once in the body: {anchor!r}")
        source = source.replace(anchor, code + anchor)
    return source + "\n" + TAIL


def _patch_factory() -> None:
    import xlstm_kernels.cuda as cuda_pkg

    plain = cuda_pkg.metal_kernel

    def factory(name, input_names, output_names, source, *args, **kwargs):
        if "attention_partial_mma" in name:
            source = _instrument(source)
        return plain(name, input_names, output_names, source, *args, **kwargs)

    cuda_pkg.metal_kernel = factory


def _spread(label: str, values: list[float], per_us: float) -> None:
    us = sorted(v / per_us for v in values)
    q = statistics.quantiles(us, n=10)
    print(f"  {label:44s} min {us[0]:6.2f}  p10 {q[0]:6.2f}  median {statistics.median(us):6.2f}  "
          f"p90 {q[-1]:6.2f}  max {us[-1]:6.2f} us")


def main(argv: list[str]) -> int:
    if not mx.cuda.is_available():
        print("probe_pass1_timeline: needs MLX's CUDA backend (a GPU machine)", file=sys.stderr)
        return 2
    calls = int(argv[0]) if argv else 10
    _patch_factory()
    from xlstm_kernels.ops.attention import attention_partial

    q = mx.random.normal((1, HEADS, 1, D)).astype(mx.float16)
    k, v = (mx.random.normal((1, HEADS, KEYS, D)).astype(mx.float16) for _ in range(2))
    mx.eval(q, k, v)
    for _ in range(calls):
        o_part, _lse = attention_partial(q, k, v, scale=D**-0.5, block_size=BLOCK)
        mx.eval(o_part)
    words = o_part.reshape(HEADS * (KEYS // BLOCK), D)   # one row of DV words a threadgroup (R = 1)
    w = [[float(x) for x in row] for row in words.tolist()]
    ghz = statistics.median(r[2] / r[4] for r in w if r[4] > 0)  # cycles per ns, end to end
    per_us = ghz * 1e3
    g0 = [r[3] for r in w]
    base = min(g0)
    print(f"128 threadgroups on {len(set(r[5] for r in w))} SMs; clock {ghz:.3f} GHz (clock64 over globaltimer)")
    _spread("start (globaltimer, after the first)", [(g - base) * ghz for g in g0], per_us)
    _spread("c1: first copies issued (params in)", [r[0] for r in w], per_us)
    _spread("c2: q staged", [r[1] for r in w], per_us)
    _spread("c3: first tile landed (per warp)", [x for r in w for x in r[8:12]], per_us)
    _spread("c4: loop done (per warp)", [x for r in w for x in r[16:20]], per_us)
    _spread("c4 spread in a threadgroup (last - first)", [max(r[16:20]) - min(r[16:20]) for r in w], per_us)
    _spread("c5 - last c4: merge and writes", [r[2] - max(r[16:20]) for r in w], per_us)
    _spread("c5: end", [r[2] for r in w], per_us)
    _spread("end (after the first start)", [(g - base) * ghz + r[2] for g, r in zip(g0, w)], per_us)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
