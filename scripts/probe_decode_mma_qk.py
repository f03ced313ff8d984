"""Probe (session 40): one-launch decode with Q K^T on the tensor cores (``mma.m16n8k16``),
against session 39's lane kernel (``probe_decode_stream.py``'s STREAM) on the same schedule.

The lane kernel spends a lane's 64 FMAs, 64 conversions and 12 shuffles a 16-key tile on
Q K^T. Here a warp's 16 keys x 8 query columns (one used: one query row a kv head) are 8
``mma.m16n8k16`` products over D = 128. The K fragments come from the unpadded rows by
LDS.128 with the d axis permuted (a dot product allows any order of d, the same for q):
lane (r = lane / 4, g = lane % 4) reads 16-byte words 4 s + g (s = 0..3) of keys r and r + 8,
odd rows in the order s ^ 1 so that the 8 lanes of a quarter-warp hit 8 different bank groups,
then swapped back. Word 4 s + g feeds products 2 s (its halves 0-3) and 2 s + 1 (halves 4-7);
q's B fragments are the same words of the query row. Scores land in lanes g = 0 (keys r and
r + 8); the softmax keeps a warp-wide running max; P V stays on lanes as in STREAM (8 lanes a
key, p passed by shuffles). 1 x 32 x 32 x 4096 x 128, fp16 and bf16.

    python3 scripts/probe_decode_mma_qk.py check     # max |error| against MLX's attention
    python3 scripts/probe_decode_mma_qk.py chains    # marginal chains, us a call
    ncu --metrics gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread --print-units base \\
        --cache-control all --clock-control none --csv python3 scripts/probe_decode_mma_qk.py kernels > out.csv
    python3 scripts/probe_pass1_floor.py summary out.csv
"""

from __future__ import annotations

import math
import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe_decode_stream as pds  # noqa: E402
import probe_pass1_floor  # noqa: E402

MQ = """
extern __shared__ __align__(128) unsigned char smem[];
__shared__ __align__(8) unsigned long long bars[{NW} * {ST}];
__shared__ float mred[{NW} * 4], lred[{NW} * 4];
constexpr int NE = 16;               // elements of a V row a lane holds (8 lanes a row, D = 128)
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = lane >> 3, l8 = lane & 7;
const int r8 = lane >> 2, g4 = lane & 3;
const bool odd = (r8 & 1) != 0;
""" + pds.STAGES + """\
uint4 qb[4];                         // B fragments: the query row's words 4 s + g (column 0 only)
const uint4* qh = reinterpret_cast<const uint4*>(q) + size_t(hk) * 16;
#pragma unroll
for (int s = 0; s < 4; ++s) qb[s] = r8 == 0 ? qh[4 * s + g4] : make_uint4(0u, 0u, 0u, 0u);
float m = -INFINITY, l = 0.0f, acc[NE];
#pragma unroll
for (int e = 0; e < NE; ++e) acc[e] = 0.0f;
int t = warp;
for (int i = 0; t < ntiles; ++i, t += {NW}) {{
  const int s = i % {ST};
  const unsigned parity = (i / {ST}) & 1;
""" + probe_pass1_floor.BULK_WAIT + """\
  const unsigned char* ks = st + size_t(s) * 2 * {TB} * {ROW};
  const unsigned char* vs = ks + {TB} * {ROW};
  uint4 ka[4], kc[4];                // keys r8 and r8 + 8: words 4 u + g4
#pragma unroll
  for (int u = 0; u < 4; ++u) {{
    const int w = 4 * (u ^ int(odd)) + g4;
    ka[u] = *reinterpret_cast<const uint4*>(ks + r8 * {ROW} + w * 16);
    kc[u] = *reinterpret_cast<const uint4*>(ks + (r8 + 8) * {ROW} + w * 16);
  }}
#pragma unroll
  for (int u = 0; u < 4; u += 2) {{
    const uint4 a0 = ka[u], a1 = ka[u + 1], c0 = kc[u], c1 = kc[u + 1];
    ka[u] = odd ? a1 : a0; ka[u + 1] = odd ? a0 : a1;
    kc[u] = odd ? c1 : c0; kc[u + 1] = odd ? c0 : c1;
  }}
  float c[4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
  for (int u = 0; u < 4; ++u) {{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{PT}.{PT}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(ka[u].x), "r"(kc[u].x), "r"(ka[u].y), "r"(kc[u].y), "r"(qb[u].x), "r"(qb[u].y));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{PT}.{PT}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(ka[u].z), "r"(kc[u].z), "r"(ka[u].w), "r"(kc[u].w), "r"(qb[u].z), "r"(qb[u].w));
  }}
  // scores (log2 domain) in lanes g4 == 0: key r8 (c[0]) and key r8 + 8 (c[2]); a warp-wide max
  const float s0 = g4 == 0 ? c[0] * {QS}f : -INFINITY, s1 = g4 == 0 ? c[2] * {QS}f : -INFINITY;
  float mt = fmaxf(s0, s1);
  mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 16));
  mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 8));
  mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 4));
  mt = __shfl_sync(0xffffffffu, mt, lane & ~3);
  const float mn = fmaxf(m, mt);
  const float al = exp2f(m - mn);
  m = mn;
  const float p0 = exp2f(s0 - mn), p1 = exp2f(s1 - mn);
  float pj[4];                       // lane group grp takes keys grp, 4 + grp, 8 + grp, 12 + grp
  pj[0] = __shfl_sync(0xffffffffu, p0, 4 * grp);
  pj[1] = __shfl_sync(0xffffffffu, p0, 16 + 4 * grp);
  pj[2] = __shfl_sync(0xffffffffu, p1, 4 * grp);
  pj[3] = __shfl_sync(0xffffffffu, p1, 16 + 4 * grp);
  l = l * al + ((pj[0] + pj[1]) + (pj[2] + pj[3]));
#pragma unroll
  for (int e = 0; e < NE; ++e) acc[e] *= al;
#pragma unroll
  for (int j = 0; j < {TB} / 4; ++j) {{
    const unsigned char* vr = vs + (j * 4 + grp) * {ROW} + l8 * 16;
#pragma unroll
    for (int w = 0; w < 2; ++w) {{
      const uint4 a = *reinterpret_cast<const uint4*>(vr + w * 128);
      const {T2}* ha = reinterpret_cast<const {T2}*>(&a);
#pragma unroll
      for (int u = 0; u < 4; ++u) {{
        const float2 fa = {CVT2}(ha[u]);
        acc[w * 8 + 2 * u] = fmaf(pj[j], fa.x, acc[w * 8 + 2 * u]);
        acc[w * 8 + 2 * u + 1] = fmaf(pj[j], fa.y, acc[w * 8 + 2 * u + 1]);
      }}
    }}
  }}
  __syncwarp();
  issue(t + {ST} * {NW}, s);
}}
__syncthreads();   // every warp is done with its stages (every copy it issued was waited for)
float* ored = reinterpret_cast<float*>(smem);   // NW * 4 rows of D floats over the stages
const int gs = warp * 4 + grp;
if (l8 == 0) {{ mred[gs] = m; lred[gs] = l; }}
#pragma unroll
for (int w = 0; w < 2; ++w)
#pragma unroll
  for (int e = 0; e < 8; ++e) ored[gs * {D} + w * 64 + l8 * 8 + e] = acc[w * 8 + e];
__syncthreads();
for (int x = threadIdx.x; x < {D}; x += {NW} * 32) {{
  float mall = -INFINITY;
  for (int h = 0; h < {NW} * 4; ++h) mall = fmaxf(mall, mred[h]);
  float lsum = 0.0f, num = 0.0f;
  for (int h = 0; h < {NW} * 4; ++h) {{
    const float w = exp2f(mred[h] - mall);
    lsum += w * lred[h];
    num += w * ored[h * {D} + x];
  }}
  out[size_t(hk) * {D} + x] = {T}(num / lsum);
}}
"""

_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}


def _mq_kernel(nw: int, st: int, b: int, heads: int, keys: int, d: int, dtype: str):
    t, t2, cvt2 = pds._TYPES[dtype]
    tb, row = 16, d * 2
    src = MQ.format(TB=tb, NW=nw, ST=st, KEYS=keys, ROW=row, SROW=row, ROWS=0, D=d, T=t, T2=t2, CVT2=cvt2,
                    PT=_PTX_TYPE[dtype], QS=repr(d**-0.5 / math.log(2)))
    return pds._launch_step(f"mq_tb{tb}_w{nw}_s{st}_{b}x{heads}x{keys}x{d}_{dtype}", src, tb, nw, st, row, b * heads)


def main(argv: list[str]) -> int:
    if not mx.cuda.is_available():
        print("probe_decode_mma_qk: needs MLX's CUDA backend (a GPU machine)", file=sys.stderr)
        return 2
    mode = argv[0] if argv else "chains"
    for dtype in ("float16", "bfloat16"):
        shape = (1, pds.HEADS, pds.HEADS, pds.KEYS, pds.D, dtype)
        steps, (q0, k, v) = pds._steps(shape, ((16, 12, 2),))
        for nw, st in ((12, 2), (8, 3)):
            steps[f"mq_tb16_w{nw}_s{st}"] = _mq_kernel(nw, st, 1, pds.HEADS, pds.KEYS, pds.D, dtype)(k, v)
        if mode == "check":
            pds._check(steps, q0, k, v)
        elif mode == "kernels":
            for step in steps.values():
                for _ in range(pds.LAUNCHES):
                    mx.eval(step(q0))
            mx.synchronize()
        else:
            pds._chains(steps, q0, f"1x32x32x4096x128 {dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
