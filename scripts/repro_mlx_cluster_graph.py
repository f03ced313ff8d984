#!/usr/bin/env python3
"""A minimal reproduction (for MLX upstream) of why xlstm_kernels runs threadgroup clusters
on cuda only with MLX_USE_CUDA_GRAPHS=0 (session 38).

Two ``mx.fast.cuda_kernel``s with the same signature, both computing ``y = x + 1``:

* ``plain``: one thread per element;
* ``cluster2`` / ``cluster4`` / ``cluster8``: compiled with ``__cluster_dims__(C, 1, 1)``; each
  block stages its 256 inputs in shared memory, the cluster syncs (``barrier.cluster``), and
  block r writes the outputs of block r ^ 1 (in its cluster) from that block's shared memory
  (``mapa``), then the cluster syncs again before exiting.

Each call is evaluated on its own, so every MLX CUDA graph holds one kernel node and has
the same key ("K"): MLX updates the cached graph in place (cudaGraphExecUpdate) from one
kernel to the other. Each round runs the four kernels in a random order and counts wrong outputs.

    python3 scripts/repro_mlx_cluster_graph.py                          # graphs on (MLX's default)
    MLX_USE_CUDA_GRAPHS=0 python3 scripts/repro_mlx_cluster_graph.py    # graphs off

Needs an sm_90 GPU and MLX's CUDA build. Prints the count of wrong calls of each kernel.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

N = 256 * 64  # 64 blocks of 256 threads: 32 pairs

PLAIN = "unsigned i = blockIdx.x * blockDim.x + threadIdx.x; y[i] = x[i] + 1.0f;"

# The attribute rides on MLX's `__global__` (the kernel's declaration starts with it).
def cluster_header(c: int) -> str:
    return f"#undef __global__\n#define __global__ __location__(global) __cluster_dims__({c}, 1, 1)\n"

PAIR = """
__shared__ float stage[256];
unsigned rank;
asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
stage[threadIdx.x] = x[i];
asm volatile("barrier.cluster.arrive.release.aligned;\\n\\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
unsigned long long mine = reinterpret_cast<unsigned long long>(&stage[threadIdx.x]), peer;
asm volatile("mapa.u64 %0, %1, %2;" : "=l"(peer) : "l"(mine), "r"(rank ^ 1u));
unsigned j = (blockIdx.x ^ 1u) * blockDim.x + threadIdx.x;  // the partner's element
y[j] = *reinterpret_cast<const float*>(peer) + 1.0f;
asm volatile("barrier.cluster.arrive.release.aligned;\\n\\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    plain = mx.fast.cuda_kernel(name="repro_plain", input_names=["x"], output_names=["y"], source=PLAIN)
    kernels = {"plain": plain}
    for c in (2, 4, 8):
        kernels[f"cluster{c}"] = mx.fast.cuda_kernel(name=f"repro_cluster{c}", input_names=["x"], output_names=["y"],
                                                     source=PAIR, header=cluster_header(c))
    wrong = {name: 0 for name in kernels}
    rng = np.random.default_rng(0)
    for r in range(args.rounds):
        x = mx.random.normal((N,))
        mx.eval(x)
        want = np.asarray(x) + 1.0
        for name in rng.permutation(list(kernels)):
            k = kernels[name]
            (y,) = k(inputs=[x], output_shapes=[(N,)], output_dtypes=[mx.float32], grid=(N, 1, 1),
                     threadgroup=(256, 1, 1))
            try:
                mx.eval(y)
                ok = np.allclose(np.asarray(y), want)
            except Exception as e:  # noqa: BLE001  (a CUDA error: the context is gone, stop here)
                print(f"round {r}, {name}: {type(e).__name__}: {e}")
                print(f"wrong calls before it {wrong}")
                return
            wrong[name] += not ok
    print(f"one kernel a graph, {args.rounds} rounds: wrong calls {wrong}")
    # then all four in one graph (independent nodes), in a random order each round
    wrong = {name: 0 for name in kernels}
    for r in range(args.rounds):
        x = mx.random.normal((N,))
        mx.eval(x)
        want = np.asarray(x) + 1.0
        names = list(rng.permutation(list(kernels)))
        ys = [kernels[n](inputs=[x], output_shapes=[(N,)], output_dtypes=[mx.float32], grid=(N, 1, 1),
                         threadgroup=(256, 1, 1))[0] for n in names]
        try:
            mx.eval(*ys)
        except Exception as e:  # noqa: BLE001
            print(f"round {r}: {type(e).__name__}: {e}")
            return
        for n, y in zip(names, ys):
            wrong[n] += not np.allclose(np.asarray(y), want)
    print(f"four kernels a graph, {args.rounds} rounds: wrong calls {wrong}")
    # then the cluster kernel (64 blocks) and the plain kernel on 3 blocks, a graph each: a plain
    # node updated from a cluster node keeps the cluster shape, and 3 blocks are no multiple of it
    wrong = {"cluster4": 0, "plain on 3 blocks": 0}
    for r in range(args.rounds):
        x = mx.random.normal((N,))
        mx.eval(x)
        want = np.asarray(x) + 1.0
        for name in ("cluster4", "plain on 3 blocks"):
            n = N if name == "cluster4" else 3 * 256
            k = kernels["cluster4" if name == "cluster4" else "plain"]
            (y,) = k(inputs=[x], output_shapes=[(n,)], output_dtypes=[mx.float32], grid=(n, 1, 1),
                     threadgroup=(256, 1, 1))
            try:
                mx.eval(y)
            except Exception as e:  # noqa: BLE001
                print(f"round {r}, {name}: {type(e).__name__}: {e}")
                return
            wrong[name] += not np.allclose(np.asarray(y), want[:n])
    print(f"a cluster kernel, then a plain one on 3 blocks, {args.rounds} rounds: wrong calls {wrong}")


if __name__ == "__main__":
    main()
