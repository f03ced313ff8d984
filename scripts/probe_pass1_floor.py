"""Probe (session 34): how fast decode pass 1's *geometry* can stream K and V when it does no
arithmetic, against a bare grid-stride read of the same bytes and against pass 1 itself.

Session 32 measured a bare read of 64 MiB at 24.4-25.1 us and pass 1 at 29.4-29.8 us. This
probe says which part of that gap is the launch shape (128 threadgroups of 4 warps, each warp
walking every 4th 16-key tile of its block through 3 cp.async stages) and which part is
pass 1's work. Each variant reads K and V of a 1 x 32 x 32 x L x 128 fp16 cache (L = 4096:
64 MiB) once; a threadgroup takes one (head, key block); a warp copies its tiles into its
own stages (16-byte cp.async, rows padded by 16 bytes as in pass 1) and XORs one word of
each landed tile (``cp``), or loads them into registers (``ldg``), or also spins N clocks on
each landed tile (``spinN``: pass 1's work as a delay), or first reads its block size from
a device array (``par...``: pass 1 reads its params so). Run under Nsight Compute:

    ncu --metrics gpu__time_duration.sum --cache-control all --clock-control none --csv \\
        python3 scripts/probe_pass1_floor.py [sizes] > out.csv
    python3 scripts/probe_pass1_floor.py summary out.csv       # median / min us per kernel

Each launch's name carries its variant (``custom_kernel_p1f_L<keys>_<mode>_w<warps>_s<stages>_b<keys>``);
``sizes`` runs the plain geometry at L = 2048 ... 16384 (128 threadgroups each).

H100 (bench/results/probe-pass1-floor-cuda-h100-session34.txt), L = 4096, median us: bare
read 24.1-24.5; the geometry 25.5-25.9 (any of 2-6 stages, 4 or 8 warps, 512 or 1024 keys a
block); with the block size read first from device memory 26.1 (from MLX's managed memory:
34.9); pass 1 28.3-28.7, pass 2 3.8-4.2. Over L, pass 1 - geometry = 2.6-3.0 us at every
size: a fixed cost (scripts/probe_pass1_timeline.py shows where), not a per-byte one.
"""

from __future__ import annotations

import sys

import mlx.core as mx

HEADS, KEYS, D = 32, 4096, 128
ROW = D * 2                # bytes of one key row
PAD_ROW = ROW + 16         # a staged row, padded as pass 1 pads it
TILE_KEYS = 16
LAUNCHES = 7

# A lane's share of one 16-key tile (8 of its 256 16-byte words of K, 8 of V): rows from kb + off
# and vb + off into stage s of the warp's stages `st` (probe_pass1_dynamic.py uses it too).
COPY_TILE = """\
    unsigned char* dk = st + size_t(s) * 2 * {TK} * {PAD_ROW};
    unsigned char* dv = dk + {TK} * {PAD_ROW};
#pragma unroll
    for (int j = 0; j < 8; ++j) {{
      const int w = j * 32 + lane, r = w >> 4, c = (w & 15) * 16;
      unsigned sk = unsigned(__cvta_generic_to_shared(dk + r * {PAD_ROW} + c));
      unsigned sv = unsigned(__cvta_generic_to_shared(dv + r * {PAD_ROW} + c));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sk), "l"(kb + off + r * {ROW} + c));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sv), "l"(vb + off + r * {ROW} + c));
    }}
"""

# A landed tile of stage s: one word of its K and one of its V XORed into acc.
TOUCH_TILE = """\
  const unsigned char* dk = st + size_t(s) * 2 * {TK} * {PAD_ROW};
  acc ^= reinterpret_cast<const unsigned*>(dk + (lane >> 1) * {PAD_ROW})[lane & 1];
  acc ^= reinterpret_cast<const unsigned*>(dk + ({TK} + (lane >> 1)) * {PAD_ROW})[lane & 1];
"""

CPASYNC = """
extern __shared__ __align__(16) unsigned char smem[];
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const long bk = {PARAMS} ? params[0] : {BK};   // "par": the block size from a device array (pass 1's params)
const int blocks_per_head = {KEYS} / bk;
const int head = blockIdx.x / blocks_per_head, blk = blockIdx.x % blocks_per_head;
const size_t base = (size_t(head) * {KEYS} + size_t(blk) * bk) * {ROW};
const unsigned char* kb = reinterpret_cast<const unsigned char*>(k) + base;
const unsigned char* vb = reinterpret_cast<const unsigned char*>(v) + base;
unsigned char* st = smem + size_t(warp) * {ST} * 2 * {TK} * {PAD_ROW};
const int ntiles = {BK} / {TK};
auto issue = [&](int t, int s) {{
  if (t < ntiles) {{
    const size_t off = size_t(t) * {TK} * {ROW};
""" + COPY_TILE + """  }}
  asm volatile("cp.async.commit_group;" ::: "memory");
}};
unsigned acc = 0;
int t = warp;
#pragma unroll
for (int s = 0; s < {ST}; ++s) issue(t + s * {NW}, s);
for (int i = 0; t < ntiles; ++i, t += {NW}) {{
  const int s = i % {ST};
  asm volatile("cp.async.wait_group %0;" ::"n"({ST} - 1) : "memory");
  __syncwarp();
""" + TOUCH_TILE + """  {SPIN}
  __syncwarp();
  issue(t + {ST} * {NW}, s);
}}
asm volatile("cp.async.wait_group 0;" ::: "memory");
out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
"""

# Session 39: the same walk through Hopper's bulk copies (TMA, `cp.async.bulk`): lane 0 of each warp copies a
# tile of TB keys of K and of V (each one contiguous run of TB * 256 bytes) into its stage and arms the stage's
# mbarrier with the bytes; the warp waits on the barrier's phase, XORs a word, and lane 0 refills the stage.
# The bulk-copy machinery (also probe_decode_stream.py's): given lane, warp, st (the warp's ST
# stages of 2 * TB rows of SROW bytes), kb / vb and ntiles, bar0 (the warp's bars) and
# issue(t, s), which copies tile t into stage s (ROWS: a copy a row; else one a tile);
# BULK_WAIT waits for stage s's phase `parity`.
BULK_SETUP = """
const unsigned bar0 = unsigned(__cvta_generic_to_shared(bars + warp * {ST}));
if (lane == 0) {{
  for (int s = 0; s < {ST}; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * s));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}}
__syncwarp();
auto issue = [&](int t, int s) {{
  if (t >= ntiles) return;
  const unsigned b = bar0 + 8 * s;
  const unsigned dk = unsigned(__cvta_generic_to_shared(st + size_t(s) * 2 * {TB} * {SROW}));
  if ({ROWS}) {{   // one copy a row (lane r: row r of K and of V) into rows of SROW bytes
    if (lane == 0)
      asm volatile("{{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }}"
                   ::"r"(b), "r"(2 * {TB} * {ROW}) : "memory");
    __syncwarp();
    for (int r = lane; r < {TB}; r += 32) {{
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(dk + r * {SROW}), "l"(kb + (size_t(t) * {TB} + r) * {ROW}), "r"({ROW}), "r"(b) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(dk + ({TB} + r) * {SROW}), "l"(vb + (size_t(t) * {TB} + r) * {ROW}), "r"({ROW}), "r"(b)
                   : "memory");
    }}
  }} else if (lane == 0) {{
    asm volatile("{{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }}"
                 ::"r"(b), "r"(2 * {TB} * {ROW}) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dk), "l"(kb + size_t(t) * {TB} * {ROW}), "r"({TB} * {ROW}), "r"(b) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dk + {TB} * {ROW}), "l"(vb + size_t(t) * {TB} * {ROW}), "r"({TB} * {ROW}), "r"(b) : "memory");
  }}
}};
"""
BULK_WAIT = """\
  {{
    unsigned done = 0;
    while (!done)
      asm volatile("{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }}"
                   : "=r"(done) : "r"(bar0 + 8 * s), "r"(parity) : "memory");
  }}
"""

BULK = """
extern __shared__ __align__(128) unsigned char smem[];
__shared__ __align__(8) unsigned long long bars[{NW} * {ST}];
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const size_t base = size_t(blockIdx.x) * {BK} * {ROW};   // K and V are contiguous: blocks may span heads
const unsigned char* kb = reinterpret_cast<const unsigned char*>(k) + base;
const unsigned char* vb = reinterpret_cast<const unsigned char*>(v) + base;
unsigned char* st = smem + size_t(warp) * {ST} * 2 * {TB} * {SROW};
const int ntiles = {BK} / {TB};
""" + BULK_SETUP + """
unsigned acc = 0;
int t = warp;
#pragma unroll
for (int s = 0; s < {ST}; ++s) issue(t + s * {NW}, s);
for (int i = 0; t < ntiles; ++i, t += {NW}) {{
  const int s = i % {ST};
  const unsigned parity = (i / {ST}) & 1;
""" + BULK_WAIT + """\
  const unsigned char* dk = st + size_t(s) * 2 * {TB} * {SROW};
  acc ^= reinterpret_cast<const unsigned*>(dk)[lane];
  acc ^= reinterpret_cast<const unsigned*>(dk + {TB} * {SROW})[lane];
  __syncwarp();
  issue(t + {ST} * {NW}, s);
}}
out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
"""

LDG = """
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
const int blocks_per_head = {KEYS} / {BK};
const int head = blockIdx.x / blocks_per_head, blk = blockIdx.x % blocks_per_head;
const size_t base = (size_t(head) * {KEYS} + size_t(blk) * {BK}) * {ROW};
const uint4* kb = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(k) + base);
const uint4* vb = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(v) + base);
const int ntiles = {BK} / {TK};
const int words = {TK} * {ROW} / 16;   // 16-byte words of one tile of K (or V)
unsigned acc = 0;
for (int t = warp; t < ntiles; t += {NW}) {{
  uint4 a[8], b[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {{ a[j] = __ldg(kb + size_t(t) * words + j * 32 + lane); b[j] = __ldg(vb + size_t(t) * words + j * 32 + lane); }}
#pragma unroll
  for (int j = 0; j < 8; ++j) acc ^= a[j].x ^ a[j].w ^ b[j].y ^ b[j].z;
}}
out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
"""

GRIDSTRIDE = """
unsigned tid = blockIdx.x * blockDim.x + threadIdx.x, nthreads = gridDim.x * blockDim.x;
const uint4* pk = reinterpret_cast<const uint4*>(k);
const uint4* pv = reinterpret_cast<const uint4*>(v);
unsigned acc = 0;
size_t n = size_t({HEADS}) * {KEYS} * {ROW} / 16;
for (size_t i = tid; i < n; i += nthreads) {{ uint4 a = pk[i], b = pv[i]; acc ^= a.x ^ a.w ^ b.y ^ b.z; }}
out[tid] = acc;
"""

# (mode, warps a threadgroup, stages, keys a block); pass 1 ships ("cp", 4, 3, 1024) at this shape
VARIANTS = (
    ("cp", 4, 3, 1024), ("cp", 4, 2, 1024), ("cp", 4, 4, 1024), ("cp", 8, 3, 1024), ("cp", 4, 3, 512),
    ("cp", 8, 3, 512), ("cp", 4, 6, 1024), ("ldg", 16, 0, 1024),
    ("spin500", 4, 3, 1024), ("spin1000", 4, 3, 1024), ("spin2000", 4, 3, 1024), ("spin4000", 4, 3, 1024),
    ("spin1000", 8, 3, 1024), ("spin2000", 8, 3, 1024),
    # session 34, part 2: a block size read from a device array first; the per-tile work against the stages
    ("parcp", 4, 3, 1024), ("parspin1500", 4, 3, 1024), ("spin1500", 4, 3, 1024), ("spin1500", 4, 2, 1024),
    ("spin1500", 4, 4, 1024), ("spin1500", 4, 6, 1024), ("spin750", 4, 3, 1024), ("spin750", 4, 6, 1024),
    ("spin1500", 8, 2, 1024), ("spin1500", 8, 3, 1024),
)

# Session 39: can one threadgroup a head (32 threadgroups on 32 SMs; 64 with two) stream the 64 MiB as fast?
# If so, one-sequence decode at 32 KV heads needs no pass 2. Stages fill up to ~204 KiB of shared memory.
FEW_VARIANTS = (
    ("cp", 4, 3, 1024), ("cp", 8, 3, 4096), ("cp", 4, 6, 4096), ("cp", 12, 2, 4096), ("cp", 6, 4, 4096),
    ("ldg", 32, 0, 4096), ("ldg", 16, 0, 4096), ("cp", 8, 3, 2048), ("cp", 4, 6, 2048), ("cp", 4, 3, 2048),
    ("ldg", 32, 0, 2048),
)
# The same through bulk copies (``bulk<keys a copy>``), up to 192 KiB of stages.
BULK_VARIANTS = (
    ("bulk16", 4, 3, 1024), ("bulk32", 4, 3, 1024), ("bulk16", 8, 3, 4096), ("bulk32", 4, 3, 4096),
    ("bulk64", 2, 3, 4096), ("bulk64", 1, 6, 4096), ("bulk32", 2, 6, 4096), ("bulk128", 1, 3, 4096),
    ("bulk32", 4, 3, 2048), ("bulk64", 2, 3, 2048), ("bulk16", 4, 3, 2048),
    # a copy a padded row (pass 1's tile layout), and fewer threadgroups than heads (16, 8)
    ("bulkrow16", 4, 3, 1024), ("bulkrow32", 4, 3, 1024), ("bulkrow16", 8, 3, 4096), ("bulkrow32", 4, 3, 4096),
    ("bulkrow32", 2, 6, 4096), ("bulkrow64", 2, 3, 4096), ("bulkrow32", 4, 2, 4096), ("bulk128", 1, 3, 8192),
    ("bulk128", 1, 3, 16384), ("bulkrow32", 4, 3, 8192),
)


def _launch(name: str, source: str, k, v, blocks: int, threads: int, smem: int = 0, params=None):
    kern = mx.fast.cuda_kernel(name=name, input_names=["k", "v", "params"], output_names=["out"], source=source,
                               **({"shared_memory": smem} if smem else {}))
    for _ in range(LAUNCHES):
        (out,) = kern(inputs=[k, v, params], grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
                      output_shapes=[(blocks * threads,)], output_dtypes=[mx.uint32])
        mx.eval(out)


def _at(keys: int, variants) -> None:
    """Every variant, then pass 1 (+ pass 2) itself, on a 1 x 32 x 32 x keys x 128 fp16 cache."""
    import xlstm_kernels as xk

    k, v = (mx.random.normal((1, HEADS, keys, D)).astype(mx.float16) for _ in range(2))
    mx.eval(k, v)
    consts = dict(KEYS=keys, ROW=ROW, PAD_ROW=PAD_ROW, TK=TILE_KEYS, HEADS=HEADS)
    for blocks, threads in ((1056, 256),):
        _launch(f"p1f_L{keys}_gridstride_g{blocks}_t{threads}", GRIDSTRIDE.format(**consts), k, v, blocks, threads,
                params=mx.array([0], dtype=mx.int64))
    for mode, nw, st, bk in variants:
        bk = bk or keys // 4   # 0: 128 threadgroups, as pass 1 plans it at 32 heads
        from xlstm_kernels.cuda.constants import device_array

        params = device_array([bk, 0], mx.int64)   # in device memory, as pass 1's params are
        mx.eval(params)
        par = mode.startswith("par")
        mode = mode[3:] if par else mode
        blocks = HEADS * keys // bk   # bk > keys (bulk only): a threadgroup reads bk / keys heads
        # "spinN": the cp.async walk with a warp busy for N clocks on each landed tile (pass 1's work)
        spin = int(mode[4:]) if mode.startswith("spin") else 0
        spin_code = f"{{ long long t0 = clock64(); while (clock64() - t0 < {spin}) {{ }} }}" if spin else ""
        if mode.startswith("bulk"):   # "bulk<TB>": TB keys a bulk copy; "bulkrow<TB>": a copy a padded row
            rows = mode.startswith("bulkrow")
            tb = int(mode[7:] if rows else mode[4:])
            srow = PAD_ROW if rows else ROW
            src = BULK.format(NW=nw, ST=st, BK=bk, TB=tb, SROW=srow, ROWS=int(rows), **consts)
            smem = nw * st * 2 * tb * srow
        else:
            src = (LDG if mode == "ldg" else CPASYNC).format(NW=nw, ST=st, BK=bk, SPIN=spin_code, PARAMS=int(par),
                                                              **consts)
            smem = 0 if mode == "ldg" else nw * st * 2 * TILE_KEYS * PAD_ROW
        _launch(f"p1f_L{keys}_{'par' if par else ''}{mode}_w{nw}_s{st}_b{bk}", src, k, v, blocks, nw * 32, smem,
                params=params)
    q = mx.random.normal((1, HEADS, 1, D)).astype(mx.float16)
    for _ in range(LAUNCHES):
        mx.eval(xk.scaled_dot_product_attention(q, k, v, scale=D**-0.5))
    mx.synchronize()


def _summary(path: str) -> int:
    """Median / minimum us per kernel name of an Nsight Compute --csv file of this probe."""
    import collections
    import csv
    import statistics

    with open(path) as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    if not rows:
        print(f"probe_pass1_floor: no Nsight Compute rows in {path}", file=sys.stderr)
        return 1
    head = rows[0]
    ki, mi, vi = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
    times = collections.defaultdict(list)
    for r in rows[1:]:
        if r[mi] == "gpu__time_duration.sum":
            times[r[ki].split("(")[0]].append(float(r[vi].replace(",", "")) / 1e3)  # ns (--print-units base)
    for name, us in times.items():
        print(f"{name[:60]:60s} n={len(us):3d} med {statistics.median(us):7.2f} min {min(us):7.2f} us")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["summary"] and len(argv) == 2:
        return _summary(argv[1])
    if not mx.cuda.is_available():
        print("probe_pass1_floor: needs MLX's CUDA backend (a GPU machine)", file=sys.stderr)
        return 2
    if argv and argv[0] == "sizes":   # the same geometry over sizes: intercept (fixed cost) and slope
        for keys in (int(a) for a in argv[1:] or ("2048", "4096", "8192", "16384")):
            _at(keys, (("cp", 4, 3, 0), ("cp", 8, 3, 0), ("spin1000", 4, 3, 0)))
        return 0
    if argv[:1] == ["few"]:   # session 39: one threadgroup a head (32) or two (64), no key split to merge
        _at(KEYS, FEW_VARIANTS)
        return 0
    if argv[:1] == ["bulk"]:
        _at(KEYS, BULK_VARIANTS)
        return 0
    _at(KEYS, VARIANTS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
