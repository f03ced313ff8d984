"""Probe (session 39): one-sequence decode in ONE launch, a threadgroup a key/value head, its K and
V streamed through Hopper's bulk copies (TMA, ``cp.async.bulk``) and reduced by lanes.

Sessions 28-38 kept the 64 MiB one-sequence decode rows at 69-74% of the copy rate: a split-KV
pass pair pays pass 2 (3.5-3.9 us) and pass 1's fixed ~2.8 us over its streaming skeleton, and
one threadgroup a head could not stream (32 threadgroups of cp.async: 37 us for 64 MiB). Bulk
copies change the last point: ``probe_pass1_floor.py bulk`` streams the 64 MiB with 32
threadgroups in 25.0-26.4 us (4-32 KiB a copy), against 24.4 for a bare read. But only as whole
tiles (rows unpadded): a copy a padded row, as pass 1's fragment loads need, runs 62-122 us at
32 threadgroups. So this kernel reads the unpadded tiles by lanes: 8 lanes a key (two 16-byte
words each, conflict-free), four keys a warp at a time, fp32 dot products reduced over the 8
lanes, an online softmax a tile, and the warps' states merged at the end into the output (fp16):
no pass 2. Variants ``st_tb<keys a tile>_w<warps>_s<stages>``; K and V of 1 x 32 x 32 x 4096 x
128 fp16 (64 MiB), q the previous call's output in chains.

    python3 scripts/probe_decode_stream.py check      # max |error| against MLX's attention
    python3 scripts/probe_decode_stream.py chains     # marginal chains, us a call, with ours and MLX's
    ncu --metrics gpu__time_duration.sum --print-units base --cache-control all --clock-control none \\
        --csv python3 scripts/probe_decode_stream.py kernels > out.csv
    python3 scripts/probe_pass1_floor.py summary out.csv
    python3 scripts/probe_decode_stream.py shapes     # check + chains of the best variants over the bench's shapes
    ncu --metrics gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread ... \
        python3 scripts/probe_decode_stream.py op     # the probe's kernel against the op's attention_decode_stream

H100 (bench/results/probe-decode-stream-cuda-h100-session39.txt): the best variant (16-key
tiles, 12 warps, 2 stages) 27.2-27.9 us a call against the pair's 30.0-31.3; the op's kernel
built on it (attention_decode_stream) first ran 35.0 us under Nsight Compute (4.62M
instructions against the probe's 3.61M: a branch around every key's loads, which kept the
four keys' products apart, and simd_shuffle_xor's divergence test around every shuffle), then
30.3 us (3.90M) against the probe's 29.1.
"""

from __future__ import annotations

import math
import os
import statistics
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe_pass1_floor  # noqa: E402  (the bulk-copy setup and wait, shared)

HEADS, KEYS, D = 32, 4096, 128
LAUNCHES = 7

# A threadgroup per (batch, kv head): its K / V, each warp's stages, the first copies issued
# (needs lane and warp; shared with probe_decode_mma_qk.py).
STAGES = """\
const int hk = blockIdx.x;           // (batch, kv head), flat
const size_t base = size_t(hk) * {KEYS} * {ROW};
const unsigned char* kb = reinterpret_cast<const unsigned char*>(k) + base;
const unsigned char* vb = reinterpret_cast<const unsigned char*>(v) + base;
unsigned char* st = smem + size_t(warp) * {ST} * 2 * {TB} * {ROW};
const int ntiles = {KEYS} / {TB};
""" + probe_pass1_floor.BULK_SETUP + """\
#pragma unroll
for (int s = 0; s < {ST}; ++s) issue(warp + s * {NW}, s);
"""

STREAM = """
extern __shared__ __align__(128) unsigned char smem[];
__shared__ __align__(8) unsigned long long bars[{NW} * {ST}];
__shared__ float mred[{NW} * 4 * {G}], lred[{NW} * 4 * {G}];
constexpr int WPL = {D} / 64;        // 16-byte words of a row a lane reads (8 lanes a row)
constexpr int NE = 8 * WPL;          // elements of a row a lane holds
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = lane >> 3, l8 = lane & 7;
""" + STAGES + """\
const {T}* qh = reinterpret_cast<const {T}*>(q) + size_t(hk) * {G} * {D};
float qv[{G}][NE];
#pragma unroll
for (int g = 0; g < {G}; ++g)
#pragma unroll
  for (int w = 0; w < WPL; ++w)
#pragma unroll
    for (int e = 0; e < 8; ++e) qv[g][w * 8 + e] = float(qh[g * {D} + w * 64 + l8 * 8 + e]) * {QS}f;
float m[{G}], l[{G}], acc[{G}][NE];
#pragma unroll
for (int g = 0; g < {G}; ++g) {{
  m[g] = -INFINITY;
  l[g] = 0.0f;
#pragma unroll
  for (int e = 0; e < NE; ++e) acc[g][e] = 0.0f;
}}
int t = warp;
for (int i = 0; t < ntiles; ++i, t += {NW}) {{
  const int s = i % {ST};
  const unsigned parity = (i / {ST}) & 1;
""" + probe_pass1_floor.BULK_WAIT + """\
  const unsigned char* ks = st + size_t(s) * 2 * {TB} * {ROW};
  const unsigned char* vs = ks + {TB} * {ROW};
  float sc[{TB} / 4][{G}];
#pragma unroll
  for (int j = 0; j < {TB} / 4; ++j) {{
    const unsigned char* kr = ks + (j * 4 + grp) * {ROW} + l8 * 16;
    float dsum[{G}];
#pragma unroll
    for (int g = 0; g < {G}; ++g) dsum[g] = 0.0f;
#pragma unroll
    for (int w = 0; w < WPL; ++w) {{
      const uint4 a = *reinterpret_cast<const uint4*>(kr + w * 128);
      const {T2}* ha = reinterpret_cast<const {T2}*>(&a);
#pragma unroll
      for (int u = 0; u < 4; ++u) {{
        const float2 fa = {CVT2}(ha[u]);
#pragma unroll
        for (int g = 0; g < {G}; ++g)
          dsum[g] = fmaf(fa.x, qv[g][w * 8 + 2 * u], fmaf(fa.y, qv[g][w * 8 + 2 * u + 1], dsum[g]));
      }}
    }}
#pragma unroll
    for (int g = 0; g < {G}; ++g) {{
      float x = dsum[g];
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 2);
      x += __shfl_xor_sync(0xffffffffu, x, 1);
      sc[j][g] = x;
    }}
  }}
  float p[{TB} / 4][{G}];
#pragma unroll
  for (int g = 0; g < {G}; ++g) {{
    float mt = sc[0][g];
#pragma unroll
    for (int j = 1; j < {TB} / 4; ++j) mt = fmaxf(mt, sc[j][g]);
    const float mn = fmaxf(m[g], mt);
    const float al = exp2f(m[g] - mn);
    l[g] *= al;
#pragma unroll
    for (int e = 0; e < NE; ++e) acc[g][e] *= al;
#pragma unroll
    for (int j = 0; j < {TB} / 4; ++j) {{
      p[j][g] = exp2f(sc[j][g] - mn);
      l[g] += p[j][g];
    }}
    m[g] = mn;
  }}
#pragma unroll
  for (int j = 0; j < {TB} / 4; ++j) {{
    const unsigned char* vr = vs + (j * 4 + grp) * {ROW} + l8 * 16;
#pragma unroll
    for (int w = 0; w < WPL; ++w) {{
      const uint4 a = *reinterpret_cast<const uint4*>(vr + w * 128);
      const {T2}* ha = reinterpret_cast<const {T2}*>(&a);
#pragma unroll
      for (int u = 0; u < 4; ++u) {{
        const float2 fa = {CVT2}(ha[u]);
#pragma unroll
        for (int g = 0; g < {G}; ++g) {{
          acc[g][w * 8 + 2 * u] = fmaf(p[j][g], fa.x, acc[g][w * 8 + 2 * u]);
          acc[g][w * 8 + 2 * u + 1] = fmaf(p[j][g], fa.y, acc[g][w * 8 + 2 * u + 1]);
        }}
      }}
    }}
  }}
  __syncwarp();
  issue(t + {ST} * {NW}, s);
}}
__syncthreads();   // every warp is done with its stages (every copy it issued was waited for)
float* ored = reinterpret_cast<float*>(smem);   // NW * 4 * G rows of D floats over the stages
const int gs = warp * 4 + grp;
#pragma unroll
for (int g = 0; g < {G}; ++g) {{
  if (l8 == 0) {{ mred[gs * {G} + g] = m[g]; lred[gs * {G} + g] = l[g]; }}
#pragma unroll
  for (int w = 0; w < WPL; ++w)
#pragma unroll
    for (int e = 0; e < 8; ++e) ored[(gs * {G} + g) * {D} + w * 64 + l8 * 8 + e] = acc[g][w * 8 + e];
}}
__syncthreads();
for (int x = threadIdx.x; x < {G} * {D}; x += {NW} * 32) {{
  const int g = x / {D}, d = x % {D};
  float mall = -INFINITY;
  for (int h = 0; h < {NW} * 4; ++h) mall = fmaxf(mall, mred[h * {G} + g]);
  float lsum = 0.0f, num = 0.0f;
  for (int h = 0; h < {NW} * 4; ++h) {{
    const float w = exp2f(mred[h * {G} + g] - mall);
    lsum += w * lred[h * {G} + g];
    num += w * ored[(h * {G} + g) * {D} + d];
  }}
  out[(size_t(hk) * {G} + g) * {D} + d] = {T}(num / lsum);
}}
"""

# (keys a tile, warps, stages): up to 192 KiB of stages; the warps' states merge over them at the end
VARIANTS = ((32, 4, 3), (16, 8, 3), (16, 12, 2), (8, 16, 3), (16, 16, 1), (8, 24, 2), (8, 32, 1), (16, 6, 4),
            (8, 12, 4))
# run 6 ("shapes"): the best variants of runs 4-5 over the bench's decode shapes (B, Hq, Hkv, Lk, D, dtype)
SHAPES = ((1, 32, 32, 4096, 128, "float16"), (1, 32, 32, 4096, 128, "bfloat16"), (1, 32, 8, 16384, 128, "float16"),
          (8, 32, 8, 8192, 128, "float16"), (1, 32, 32, 16384, 64, "float16"), (1, 32, 8, 4096, 128, "float16"))
SHAPE_VARIANTS = ((16, 8, 3), (16, 12, 2), (8, 16, 3))
SHAPE_VARIANTS_GQA = ((16, 8, 3), (16, 4, 6), (32, 4, 3))   # G > 1: more registers a thread (12 warps do not launch)
_TYPES = {"float16": ("__half", "__half2", "__half22float2"),
          "bfloat16": ("__nv_bfloat16", "__nv_bfloat162", "__bfloat1622float2")}


def _kernel(tb: int, nw: int, st: int, b: int, hq: int, hkv: int, keys: int, d: int, dtype: str):
    t, t2, cvt2 = _TYPES[dtype]
    row = d * 2
    src = STREAM.format(TB=tb, NW=nw, ST=st, KEYS=keys, ROW=row, SROW=row, ROWS=0, D=d, G=hq // hkv, T=t, T2=t2, CVT2=cvt2,
                        QS=repr(d**-0.5 / math.log(2)))
    return _launch_step(f"st_tb{tb}_w{nw}_s{st}_{b}x{hq}x{hkv}x{keys}x{d}_{dtype}", src, tb, nw, st, row, b * hkv)


def _launch_step(name: str, src: str, tb: int, nw: int, st: int, row: int, groups: int):
    """step(k, v) -> (q -> out) of a raw kernel `src` on (q, k, v): `groups` threadgroups of
    `nw` warps, each warp `st` stages of `tb` K and V rows of `row` bytes (dynamic shared memory)."""
    kern = mx.fast.cuda_kernel(name=name, input_names=["q", "k", "v"], output_names=["out"], source=src,
                               shared_memory=nw * st * 2 * tb * row)

    def step(k, v):
        return lambda q: kern(inputs=[q, k, v], grid=(groups * nw * 32, 1, 1), threadgroup=(nw * 32, 1, 1),
                              output_shapes=[q.shape], output_dtypes=[q.dtype])[0]

    return step


def _steps(shape, variants):
    import xlstm_kernels as xk

    b, hq, hkv, keys, d, dtype = shape
    dt = getattr(mx, dtype)
    k, v = (mx.random.normal((b, hkv, keys, d)).astype(dt) for _ in range(2))
    q0 = mx.random.normal((b, hq, 1, d)).astype(dt)
    mx.eval(k, v, q0)
    steps = {f"st_tb{tb}_w{nw}_s{st}": _kernel(tb, nw, st, *shape)(k, v) for tb, nw, st in variants}
    steps["attention"] = lambda q: xk.scaled_dot_product_attention(q, k, v, scale=d**-0.5)
    steps["mlx"] = lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5)
    return steps, (q0, k, v)


def _check(steps, q0, k, v) -> None:
    d = q0.shape[-1]
    ref = mx.fast.scaled_dot_product_attention(q0.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32),
                                               scale=d**-0.5)
    for name, step in steps.items():
        err = mx.max(mx.abs(step(q0).astype(mx.float32) - ref)).item()
        print(f"check {name:18s} max |error| {err:.2e} (max |ref| {mx.max(mx.abs(ref)).item():.2e})", flush=True)


def _chains(steps, q0, label: str) -> None:
    from xlstm_kernels.benchmarks import timing

    times = timing.measure_chained_variants([(n, lambda s=s: s) for n, s in steps.items()], q0, repeats=9,
                                            marginal=True)
    print(f"{label}: marginal chains, us a call (median / min of 9)")
    for name, ts in times.items():
        print(f"  {name:18s} {statistics.median(ts) * 1e6:8.2f} {min(ts) * 1e6:8.2f}", flush=True)


def main(argv: list[str]) -> int:
    if not mx.cuda.is_available():
        print("probe_decode_stream: needs MLX's CUDA backend (a GPU machine)", file=sys.stderr)
        return 2
    mode = argv[0] if argv else "chains"
    if mode == "shapes":   # check and chains of SHAPE_VARIANTS over SHAPES
        for shape in SHAPES:
            steps, (q0, k, v) = _steps(shape, SHAPE_VARIANTS if shape[1] == shape[2] else SHAPE_VARIANTS_GQA)
            label = "x".join(str(n) for n in shape[:5]) + " " + shape[5]
            print(f"== {label} ({shape[0] * shape[2]} threadgroups)")
            _check(steps, q0, k, v)
            _chains(steps, q0, label)
        return 0
    if mode == "op":   # under Nsight Compute: the probe's best variant, the op's one-launch decode, the pair
        import xlstm_kernels as xk

        steps, (q0, k, v) = _steps((1, HEADS, HEADS, KEYS, D, "float16"), ((16, 12, 2),))
        steps["op_stream"] = lambda q: xk.scaled_dot_product_attention(q, k, v, scale=D**-0.5,
                                                                       knobs={"split_kv_stream": True})
        for name in ("st_tb16_w12_s2", "op_stream", "attention"):
            for _ in range(5):
                mx.eval(steps[name](q0))
        mx.synchronize()
        return 0
    steps, (q0, k, v) = _steps((1, HEADS, HEADS, KEYS, D, "float16"), VARIANTS)
    if mode == "check":
        _check(steps, q0, k, v)
        return 0
    if mode == "kernels":
        for step in steps.values():
            for _ in range(LAUNCHES):
                mx.eval(step(q0))
        mx.synchronize()
        return 0
    _chains(steps, q0, "1x32x32x4096x128 float16 (the bench's bar for 64 MiB is 28.0 us on the H100)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
