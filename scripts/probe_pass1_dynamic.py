"""Probe (session 36): would decode pass 1 with *dynamic* work (warps taking key blocks from a
counter) and a *fused* merge (the last warp of a head merges its blocks) reach the copy bar at
one sequence, where the static split of sessions 27-35 and its pass 2 do not?

Session 34 (``probe_pass1_floor.py``) put the static launch shape at 25.5-25.9 us for 64 MiB
against a bare read's 24.1-24.5, with threadgroups ending 20.7-25.9 us after the start (the
slowest SMs set the end), and pass 2 at 3.5-3.9 us more. Both fixes need counters that start
at zero on every call: here an output filled by MLX (``init_value=0``), whose fill kernels
the CUDA graph runs before the kernel. So the probe times both the kernels (Nsight Compute)
and chains (each call's output the next call's input, ``timing.measure_marginal``), where
the fills show.

Variants (no arithmetic: each warp copies its 16-key tiles of K and V through its own
cp.async stages and XORs a word of each, as ``probe_pass1_floor.py``'s skeleton):

* ``static``: pass 1's shape, 128 threadgroups of 4 warps, a threadgroup one (head, 1024-key block);
* ``dyn_u<keys>_w<warps>``: 132 threadgroups (one an SM), each warp taking (head, block of
  <keys>) units from a counter, one unit ahead, its stages running on across units;
* ``dynf_...``: the same, and each unit writes a 128-float partial; the warp that finishes
  a head's last unit (a second counter per head) reads the head's partials in order and
  writes the head's result: pass 2 inside pass 1;
* ``attention``: our scaled_dot_product_attention (pass 1 + pass 2) on the same K and V;
  ``mlx``: MLX's.

    python3 scripts/probe_pass1_dynamic.py chains            # marginal chains, us a call
    ncu --metrics gpu__time_duration.sum --print-units base --cache-control none --clock-control none \\
        --csv python3 scripts/probe_pass1_dynamic.py kernels > out.csv
    python3 scripts/probe_pass1_floor.py summary out.csv     # median / min us per kernel

H100, two runs (bench/results/probe-pass1-dynamic-cuda-h100-session36.txt), kernel durations,
median us: static 25.95-25.98; dyn 26.53 (u128) to 30.66 (u256); dynf 30.59-34.56; pass 1
28.90-29.12 + pass 2 3.58; each ``init_value`` fill 3.3-3.8. Chains, median us a call: static
24.94-25.10, dyn 29.98-34.07, dynf 33.48-36.91, ours (pass 1 + 2) 29.75-30.28, MLX 31.99-32.13.
With 512-1024 units for 528 warps a warp takes one or two: nothing to balance, and the counter's
round trip comes before the first copy; the fused merge waits for a second round trip after
every unit. Not built.
"""

from __future__ import annotations

import os
import statistics
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe_pass1_floor  # noqa: E402  (the skeleton's tile copy, shared)

HEADS, KEYS, D = 32, 4096, 128
ROW = D * 2
PAD_ROW = ROW + 16
TK = 16
ST = 3
SMS = 132

# the static skeleton: probe_pass1_floor's, its result folded with the chain's input (read by
# every threadgroup: the dependency on the last call)
STATIC = probe_pass1_floor.CPASYNC.replace("out[blockIdx.x * blockDim.x + threadIdx.x] = acc;", """\
__shared__ unsigned red[{NW} * 32];
red[threadIdx.x] = acc;
__syncthreads();
if (warp == 0) {{
  for (int w = 1; w < {NW}; ++w) acc ^= red[w * 32 + lane];
  out[size_t(blockIdx.x) * 32 + lane] = float(acc & 0xffu) + x[lane];
}}""")

# a warp's stream of tiles runs across the units it takes; `cu` the unit it consumes, `nu` the
# one after (taken when cu starts, its index shuffled only where the first tile of nu is issued)
DYNAMIC = """
extern __shared__ __align__(16) unsigned char smem[];
const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
unsigned* ctr = reinterpret_cast<unsigned*>(scratch + {PARTS});   // [0]: next unit; [1 + h]: units done of head h
const int units = {HEADS} * ({KEYS} / {BU}), tpu = {BU} / {TK}, upb = {KEYS} / {BU};
unsigned char* st = smem + size_t(warp) * {ST} * 2 * {TK} * {PAD_ROW};
const unsigned char* kb = reinterpret_cast<const unsigned char*>(k);
const unsigned char* vb = reinterpret_cast<const unsigned char*>(v);
auto issue = [&](int u, int t, int s) {{
  if (u < units) {{
    const size_t off = (size_t(u) * {BU} + size_t(t) * {TK}) * {ROW};   // unit u = (head u / upb, block u % upb)
""" + probe_pass1_floor.COPY_TILE + """  }}
  asm volatile("cp.async.commit_group;" ::: "memory");
}};
unsigned raw = lane == 0 ? atomicAdd(ctr, 1u) : 0u;
int cu = __shfl_sync(0xffffffffu, int(raw), 0);
raw = lane == 0 ? atomicAdd(ctr, 1u) : 0u;    // nu, read where first needed
int nu = -1;
#pragma unroll
for (int s = 0; s < {ST}; ++s) issue(cu, s, s);
unsigned acc = 0;
int ct = 0, s = 0;
while (cu < units) {{
  asm volatile("cp.async.wait_group %0;" ::"n"({ST} - 1) : "memory");
  __syncwarp();
""" + probe_pass1_floor.TOUCH_TILE + """  __syncwarp();
  const int it = ct + {ST};
  if (it < tpu) {{
    issue(cu, it, s);
  }} else {{
    if (nu < 0) nu = __shfl_sync(0xffffffffu, int(raw), 0);
    issue(nu, it - tpu, s);
  }}
  s = s + 1 == {ST} ? 0 : s + 1;
  if (++ct == tpu) {{
    {UNIT_END}
    cu = nu < 0 ? __shfl_sync(0xffffffffu, int(raw), 0) : nu;
    ct = 0;
    nu = -1;
    raw = lane == 0 ? atomicAdd(ctr, 1u) : 0u;
  }}
}}
asm volatile("cp.async.wait_group 0;" ::: "memory");
{TAIL}
"""

# dyn: every warp writes its XOR (and the chain's input) once; 132 x warps x 32 floats of out
DYN_UNIT_END = ""
DYN_TAIL = "out[(size_t(blockIdx.x) * {NW} + warp) * 32 + lane] = float(acc & 0xffu) + x[lane];"

# dynf: a 128-float partial a unit (lane: 4 floats), then the head's done count; the last warp merges
FUSED_UNIT_END = """
{{
  float4 p = make_float4(float(acc & 0xffu), float(cu), 1.f, float(lane));
  reinterpret_cast<float4*>(scratch)[size_t(cu) * 32 + lane] = p;
  __threadfence();
  const int head = cu / upb;
  unsigned done = lane == 0 ? atomicAdd(ctr + 1 + head, 1u) : 0u;
  done = __shfl_sync(0xffffffffu, done, 0);
  if (done == unsigned(upb - 1)) {{
    __threadfence();
    float4 sum = make_float4(x[lane], 0.f, 0.f, 0.f);
    for (int b = 0; b < upb; ++b) {{
      const float4 q = __ldcg(reinterpret_cast<const float4*>(scratch) + (size_t(head) * upb + b) * 32 + lane);
      sum.x += q.x; sum.y += q.y; sum.z += q.z; sum.w += q.w;
    }}
    reinterpret_cast<float4*>(out)[size_t(head) * 32 + lane] = sum;
  }}
}}
"""


def _kernels():
    """name -> (kernel, grid threads, threadgroup threads, smem bytes, output shapes, init)."""
    consts = dict(KEYS=KEYS, ROW=ROW, PAD_ROW=PAD_ROW, TK=TK, ST=ST, HEADS=HEADS)
    out = {}
    bk, nw = 1024, 4
    src = STATIC.format(BK=bk, NW=nw, PARAMS=0, SPIN="", **consts)
    blocks = HEADS * KEYS // bk
    out["static"] = (mx.fast.cuda_kernel(name="p1d_static", input_names=["k", "v", "x", "params"], output_names=["out"],
                                         source=src, shared_memory=nw * ST * 2 * TK * PAD_ROW),
                     blocks * nw * 32, nw * 32, [(blocks * 32,)], None)
    for fused in (False, True):
        for bu, nw in ((256, 4), (512, 4), (128, 4), (256, 8)):
            units = HEADS * KEYS // bu
            parts = units * 128 if fused else 0
            unit_end = (FUSED_UNIT_END if fused else DYN_UNIT_END).format()
            src = DYNAMIC.format(BU=bu, NW=nw, PARTS=parts, UNIT_END=unit_end,
                                 TAIL="" if fused else DYN_TAIL.format(NW=nw), **consts)
            name = f"{'dynf' if fused else 'dyn'}_u{bu}_w{nw}"
            outs = [(HEADS * 128,), (parts + 1 + HEADS,)] if fused else [(SMS * nw * 32,), (1 + HEADS,)]
            kern = mx.fast.cuda_kernel(name=f"p1d_{name}", input_names=["k", "v", "x", "params"],
                                       output_names=["out", "scratch"], source=src,
                                       shared_memory=nw * ST * 2 * TK * PAD_ROW)
            out[name] = (kern, SMS * nw * 32, nw * 32, outs, 0)
    return out


_PARAMS = []   # a block size for the static skeleton's params input (which reads it only with PARAMS=1)


def _params() -> mx.array:
    if not _PARAMS:
        _PARAMS.append(mx.array([1024, 0], dtype=mx.int64))
    return _PARAMS[0]


def _step(entry, k, v):
    kern, grid, tg, shapes, init = entry
    params = _params()

    def step(x):
        res = kern(inputs=[k, v, x, params], grid=(grid, 1, 1), threadgroup=(tg, 1, 1), output_shapes=shapes,
                   output_dtypes=[mx.float32] * len(shapes), **({} if init is None else {"init_value": init}))
        return res[0][:32]   # the next call reads 32 floats of this one's result

    return step


def _check(entries, k, v) -> None:
    """The fused variants' results: every head's partials summed once (x = 0)."""
    x = mx.zeros((32,), mx.float32)
    for name, (kern, grid, tg, shapes, init) in entries.items():
        if not name.startswith("dynf"):
            continue
        res, scratch = kern(inputs=[k, v, x, _params()], grid=(grid, 1, 1), threadgroup=(tg, 1, 1),
                            output_shapes=shapes,
                            output_dtypes=[mx.float32] * 2, init_value=0)
        r = res.reshape(HEADS, 32, 4)
        upb = int(name.split("_u")[1].split("_")[0])
        upb = KEYS // upb
        ok = bool(mx.all(r[:, :, 2] == upb).item())
        ctr = mx.view(scratch[-(1 + HEADS):], mx.uint32)
        print(f"check {name}: every head merged {upb} units once: {ok}; units taken {int(ctr[0].item())}, "
              f"done counts {sorted(set(ctr[1:].tolist()))}", flush=True)


def main(argv: list[str]) -> int:
    if not mx.cuda.is_available():
        print("probe_pass1_dynamic: needs MLX's CUDA backend (a GPU machine)", file=sys.stderr)
        return 2
    import xlstm_kernels as xk
    from xlstm_kernels.benchmarks import timing

    mode = argv[0] if argv else "chains"
    k, v = (mx.random.normal((1, HEADS, KEYS, D)).astype(mx.float16) for _ in range(2))
    mx.eval(k, v)
    entries = _kernels()
    if mode == "kernels":
        x = mx.random.normal((32,))
        for name, entry in entries.items():
            step = _step(entry, k, v)
            for _ in range(7):
                mx.eval(step(x))
        q = mx.random.normal((1, HEADS, 1, D)).astype(mx.float16)
        for _ in range(7):
            mx.eval(xk.scaled_dot_product_attention(q, k, v, scale=D**-0.5))
        mx.synchronize()
        return 0
    _check(entries, k, v)
    variants = [(name, (lambda e=e: _step(e, k, v))) for name, e in entries.items()]
    q0 = mx.random.normal((1, HEADS, 1, D)).astype(mx.float16)
    variants.append(("attention", lambda: (lambda q: xk.scaled_dot_product_attention(q, k, v, scale=D**-0.5))))
    variants.append(("mlx", lambda: (lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5))))
    big = mx.random.normal((KEYS * HEADS * D,)).astype(mx.float16)   # 32 MiB: x * 2 moves 64 MiB
    mx.eval(big)
    x0 = mx.random.normal((32,))
    times = timing.measure_chained_variants(
        [(n, p) for n, p in variants if n not in ("attention", "mlx")], x0, repeats=9, marginal=True)
    times.update(timing.measure_chained_variants([(n, p) for n, p in variants if n in ("attention", "mlx")], q0,
                                                 repeats=9, marginal=True))
    times.update(timing.measure_chained_variants([("copy 64 MiB", lambda: (lambda b: b * 2))], big, repeats=9,
                                                 marginal=True))
    # the chained copy of 32 MiB runs partly from L2: its time / 0.8 is not the bench's bar (28.0 us on the H100,
    # from the bench's large copy), only a reference read in the same process
    bar = statistics.median(times["copy 64 MiB"]) / 0.8
    print(f"marginal chains, us a call (median / min of 9); the chained copy's time / 0.8: {bar * 1e6:.2f} us")
    for name, ts in times.items():
        print(f"  {name:16s} {statistics.median(ts) * 1e6:8.2f} {min(ts) * 1e6:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
