"""Probe (session 32): how long a bare read of N bytes takes on the GPU, the floor under any
kernel that streams them once (decode pass 1 reads K and V once; its bench rows are judged
against a copy of the same bytes, which also writes).

A grid-stride loop over 16-byte words (each thread XORs what it reads and writes one word)
through ``mx.fast.cuda_kernel``, launched with several grids; meant to run under Nsight
Compute on the GPU machine, which gives each launch's device time:

    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum --cache-control all \\
        --clock-control none --csv python3 scripts/probe_read_floor.py [MiB]    # default 64

H100 80GB HBM3, 64 MiB, caches flushed (bench/results/probe-read-floor-cuda-h100-session32.txt):
24.4-25.1 us for 264-2112 threadgroups (2.67-2.74 TB/s), 26.8 us for 16384 of 256 threads;
decode pass 1 (1x32x8x16384x128 fp16, the same 64 MiB) 29.8 us, cuDNN's 36.3 us.
"""

from __future__ import annotations

import sys

import mlx.core as mx

SOURCE = """
unsigned tid = blockIdx.x * blockDim.x + threadIdx.x;
unsigned nthreads = gridDim.x * blockDim.x;
const uint4* p = reinterpret_cast<const uint4*>(x);
unsigned acc = 0;
size_t n = x_shape[0] / 4;
for (size_t i = tid; i < n; i += nthreads) { uint4 v = p[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
out[tid] = acc;
"""
# (threadgroups, threads a threadgroup): 4, 8, 16 and 2 threadgroups an SM of an H100's 132, and two oversized grids
GRIDS = ((132 * 4, 512), (132 * 8, 256), (132 * 16, 256), (132 * 2, 1024), (4096, 256), (16384, 256))
LAUNCHES = 5


def main(argv: list[str]) -> int:
    if not mx.cuda.is_available():
        print("probe_read_floor: needs MLX's CUDA backend (a GPU machine)", file=sys.stderr)
        return 2
    mib = int(argv[0]) if argv else 64
    if mib < 1:
        raise ValueError(f"probe_read_floor: MiB must be >= 1, got {mib}")
    kernel = mx.fast.cuda_kernel(name="readonly", input_names=["x"], output_names=["out"], source=SOURCE)
    x = mx.random.randint(0, 1 << 30, (mib * (1 << 18),), dtype=mx.uint32)
    mx.eval(x)
    for blocks, threads in GRIDS:
        for _ in range(LAUNCHES):
            (out,) = kernel(inputs=[x], grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
                            output_shapes=[(blocks * threads,)], output_dtypes=[mx.uint32])
            mx.eval(out)
    mx.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
