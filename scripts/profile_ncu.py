#!/usr/bin/env python3
"""One op call per process, for Nsight Compute (`ncu`) on the GPU machine.

    python3 scripts/profile_ncu.py list                 # the cases and their kernel regexes
    python3 scripts/profile_ncu.py run CASE             # warm-up calls, then the profiled ones
    python3 scripts/profile_ncu.py timed decode:ours,B,HQ,HKV,LK,D[,BS] CALLS   # (cuda_device_run.sh ncutime)
    python3 scripts/profile_ncu.py timed CASE CALLS     # any case, CALLS evals (ncu's kernel durations)
    python3 scripts/profile_ncu.py timed rope:ours,B,H,L,D CALLS   # RoPE (ours | mlx | copy) at any shape
    bash scripts/cuda_device_run.sh stage2 ncu          # every case under ncu (NCU_CASES to pick)

A case is (what runs, the regex of the kernel(s) to profile): ours and MLX's op at the same
shape, so the two reports sit side by side (duration, DRAM throughput, occupancy, registers,
warp stall reasons). The op runs WARM times first (JIT compile, memo), then PROFILED times;
`cuda_device_run.sh` passes ``--launch-skip`` so that ncu profiles the last calls only.
"""

from __future__ import annotations

import sys

WARM = 3
PROFILED = 1


def _cases():
    import mlx.core as mx

    import xlstm_kernels as xk

    def rnd(shape, dtype):
        x = mx.random.normal(shape).astype(dtype)
        mx.eval(x)
        return x

    def decode(ours: bool, b=8, hq=32, hkv=8, lk=8192, d=128, dtype=mx.float16, knobs=None):
        q, k, v = rnd((b, hq, 1, d), dtype), rnd((b, hkv, lk, d), dtype), rnd((b, hkv, lk, d), dtype)
        if ours:
            return lambda: xk.scaled_dot_product_attention(q, k, v, scale=d**-0.5, knobs=knobs)
        return lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5)

    def prefill(ours: bool, b=2, hq=32, hkv=8, lq=2048, lk=2048, d=128, dtype=mx.float16, knobs=None):
        q, k, v = rnd((b, hq, lq, d), dtype), rnd((b, hkv, lk, d), dtype), rnd((b, hkv, lk, d), dtype)
        if ours:
            return lambda: xk.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask="causal", knobs=knobs)
        return lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask="causal")

    def rms(ours: bool, dtype, rows=16384, n=4096):
        x, w = rnd((rows, n), dtype), rnd((n,), dtype)
        if ours:
            return lambda: xk.rms_norm(x, w, 1e-5)
        return lambda: mx.fast.rms_norm(x, w, 1e-5)

    def rms_vjp(ours: bool, dtype, rows=4096, n=4096, stage_l1=False):
        from xlstm_kernels.ops import norm as norm_ops

        norm_ops.RMS_VJP_STAGE_L1 = stage_l1
        x, w, g = rnd((rows, n), dtype), rnd((n,), dtype), rnd((rows, n), dtype)
        f = xk.rms_norm if ours else mx.fast.rms_norm
        return lambda: mx.vjp(lambda a, b: f(a, b, 1e-5), [x, w], [g])[1]

    def ln(ours: bool, dtype, rows=2048, n=8192):
        x, w, b = rnd((rows, n), dtype), rnd((n,), dtype), rnd((n,), dtype)
        if ours:
            return lambda: xk.layer_norm(x, w, b, 1e-5)
        return lambda: mx.fast.layer_norm(x, w, b, 1e-5)

    def rope(ours: bool, shape=(2, 32, 4096, 128), dtype=mx.bfloat16):
        x = rnd(shape, dtype)
        off = mx.array([7 * i + 3 for i in range(shape[0])], dtype=mx.int32)
        if ours:
            return lambda: xk.rope(x, shape[-1], traditional=False, base=10000.0, offset=off)
        return lambda: mx.fast.rope(x, shape[-1], traditional=False, base=10000.0, scale=1.0, offset=off)

    def ln_vjp(ours: bool, dtype, rows=2048, n=8192):
        x, w, b, g = rnd((rows, n), dtype), rnd((n,), dtype), rnd((n,), dtype), rnd((rows, n), dtype)
        f = xk.layer_norm if ours else mx.fast.layer_norm
        return lambda: mx.vjp(lambda a, c, d: f(a, c, d, 1e-5), [x, w, b], [g])[1]

    def mhln_vjp(dtype, rows=8192, nh=4, dh=64):
        """Our multi-head LayerNorm backward (dx, dw, db; session 30)."""
        x, g = rnd((rows, nh * dh), dtype), rnd((rows, nh * dh), dtype)
        w, b = rnd((nh * dh,), dtype), rnd((nh * dh,), dtype)
        return lambda: mx.vjp(lambda a, c, d: xk.multihead_layer_norm(a, c, d, nh, 1e-5), [x, w, b], [g])[1]

    def mhln(dtype, rows=8192, nh=4, dh=64):
        """Our multi-head LayerNorm forward (session 30)."""
        x, w, b = rnd((rows, nh * dh), dtype), rnd((nh * dh,), dtype), rnd((nh * dh,), dtype)
        return lambda: xk.multihead_layer_norm(x, w, b, nh, 1e-5)

    def scale_copy(shape, dtype):
        """x * 2 by MLX's elementwise kernel: a read and a write of x's bytes (a copy's traffic)."""
        x = rnd(shape, dtype)
        return lambda: x * 2

    def add_pair(shape, dtype):
        """a + b by MLX's elementwise kernel: two reads and a write of x's bytes (a norm backward's
        traffic: x and g in, dx out)."""
        a, b = rnd(shape, dtype), rnd(shape, dtype)
        return lambda: a + b

    def gemm(op: str, dtype=mx.float16, m=4096, n=4096, k=4096):
        a = rnd((m, k), dtype)
        if op == "gemm_at_b":
            a = rnd((k, m), dtype)
        bb = rnd((k, n), dtype)
        if op == "mlx":
            return lambda: a @ bb
        fn = getattr(xk, op)
        return lambda: fn(a, bb)

    return {
        # name: (factory, kernel regex)
        "decode_ours": (lambda: decode(True), "attention_partial"),  # the default pass 1 (tiles for fp16)
        "decode_ours_lane": (lambda: decode(True, knobs={"split_kv_mma": False}), "attention_partial"),
        "decode_mlx": (lambda: decode(False), "sdpav_2pass_1|sdpav_1pass"),
        # one sequence, a long cache (session 14: 0.61x of MLX's op at 1x32x8x16384 fp16)
        "decode_b1_ours": (lambda: decode(True, b=1, lk=16384), "attention_partial"),
        "decode_b1_ours_reduce": (lambda: decode(True, b=1, lk=16384), "attention_reduce"),
        "decode_b1_mlx": (lambda: decode(False, b=1, lk=16384), "sdpav_2pass_1|sdpav_1pass"),
        "decode_b1_mlx_2": (lambda: decode(False, b=1, lk=16384), "sdpav_2pass_2"),
        # MLX 0.32.4 runs this decode on cuDNN (a flash fprop kernel and a lean reduction; session 26)
        "decode_b1_mlx_cudnn": (lambda: decode(False, b=1, lk=16384), "cudnn|lean_reduction"),
        # prefill attention (causal, 2x32x2048x128 fp16, GQA 4): the tile prefill
        # (attention_prefill_mma, session 8) and the 8x8 kernel it replaced on CUDA
        "prefill_ours": (lambda: prefill(True), "attention_prefill"),
        "prefill_ours_simd8": (lambda: prefill(True, knobs={"prefill_mma": False}), "attention_prefill"),
        "prefill_mlx": (lambda: prefill(False), "attention|sdpa|flash|fmha|cudnn"),
        "rms_f32_ours": (lambda: rms(True, mx.float32), "custom_kernel_rms_norm"),
        "rms_f32_mlx": (lambda: rms(False, mx.float32), "rms_norm"),
        "rms_bf16_ours": (lambda: rms(True, mx.bfloat16), "custom_kernel_rms_norm"),
        "rms_bf16_mlx": (lambda: rms(False, mx.bfloat16), "rms_norm"),
        # 4096 rows: about 3 waves of blocks (the probe's worst ratio, session 7)
        # session 30: rows of one simdgroup (per-head norms of 128)
        "rms_bf16_h128_ours": (lambda: rms(True, mx.bfloat16, rows=65536, n=128), "custom_kernel_rms_norm"),
        "rms_bf16_h128_mlx": (lambda: rms(False, mx.bfloat16, rows=65536, n=128), "rms_norm"),
        "rms_f32_h128_ours": (lambda: rms(True, mx.float32, rows=65536, n=128), "custom_kernel_rms_norm"),
        "rms_f32_h128_mlx": (lambda: rms(False, mx.float32, rows=65536, n=128), "rms_norm"),
        "rms_vjp_bf16_h128_ours": (lambda: rms_vjp(True, mx.bfloat16, rows=65536, n=128), "custom_kernel_rms_norm_vjp|norm_partials"),
        "rms_vjp_bf16_h128_mlx": (lambda: rms_vjp(False, mx.bfloat16, rows=65536, n=128), "rms_norm_vjp"),
        "rms_vjp_f32_h128_ours": (lambda: rms_vjp(True, mx.float32, rows=65536, n=128), "custom_kernel_rms_norm_vjp|norm_partials"),
        "rms_vjp_f32_h128_mlx": (lambda: rms_vjp(False, mx.float32, rows=65536, n=128), "rms_norm_vjp"),
        "copy_h128_vjp_bf16": (lambda: scale_copy((65536, 192), mx.bfloat16), "binary|multiply"),
        "copy_h128_vjp_f32": (lambda: scale_copy((65536, 192), mx.float32), "binary|multiply"),
        "copy_h128_bf16": (lambda: scale_copy((65536, 128), mx.bfloat16), "binary|multiply"),
        "copy_h128_f32": (lambda: scale_copy((65536, 128), mx.float32), "binary|multiply"),
        "rms_bf16_4k_ours": (lambda: rms(True, mx.bfloat16, rows=4096), "custom_kernel_rms_norm"),
        "rms_bf16_4k_mlx": (lambda: rms(False, mx.bfloat16, rows=4096), "rms_norm"),
        # rows of 8192 (session 11): float32 rows run the looped kernels, LayerNorm's 16-bit
        # cached rows held 64 floats a thread (a 256-byte stack frame)
        "rms_f32_8k_ours": (lambda: rms(True, mx.float32, rows=2048, n=8192), "custom_kernel_rms_norm"),
        "rms_f32_8k_mlx": (lambda: rms(False, mx.float32, rows=2048, n=8192), "rms_norm"),
        "ln_bf16_8k_ours": (lambda: ln(True, mx.bfloat16), "custom_kernel_layer_norm"),
        "ln_bf16_8k_mlx": (lambda: ln(False, mx.bfloat16), "layer_norm"),
        # the RMSNorm backward, 4096x4096 bfloat16 (session 12: 0.78-0.87x of MLX's on an H200)
        "rms_vjp_bf16_ours": (lambda: rms_vjp(True, mx.bfloat16), "custom_kernel_rms_norm_vjp"),
        "rms_vjp_bf16_mlx": (lambda: rms_vjp(False, mx.bfloat16), "rms_norm_vjp"),
        # session 13: the stage copies through L1 (cp.async.ca, as MLX's kernel) instead of .cg
        "rms_vjp_bf16_ours_l1": (lambda: rms_vjp(True, mx.bfloat16, stage_l1=True), "custom_kernel_rms_norm_vjp"),
        # session 28: kernel durations with warm caches (timed), beside a copy of the same bytes
        "ln_vjp_bf16_8k_ours": (lambda: ln_vjp(True, mx.bfloat16), "custom_kernel_layer_norm_vjp|norm_partials"),
        "ln_vjp_bf16_8k_mlx": (lambda: ln_vjp(False, mx.bfloat16), "layer_norm|vjp"),
        "copy_bf16_2kx8k": (lambda: scale_copy((2048, 8192), mx.bfloat16), "binary|multiply"),
        "copy_rope_bf16": (lambda: scale_copy((2, 32, 4096, 128), mx.bfloat16), "binary|multiply"),
        "rope_ours": (lambda: rope(True), "custom_kernel_rope"),
        "rope_mlx": (lambda: rope(False), "rope"),
        # session 29: the same kernels at 4x the bytes (4x32x8192x128, 256 MiB each way)
        "copy_rope_big_bf16": (lambda: scale_copy((4, 32, 8192, 128), mx.bfloat16), "binary|multiply"),
        "rope_big_ours": (lambda: rope(True, shape=(4, 32, 8192, 128)), "custom_kernel_rope"),
        "rope_big_mlx": (lambda: rope(False, shape=(4, 32, 8192, 128)), "rope"),
        # RoPE's decode step (32 sequences x 32 heads, one position each; session 12)
        "rope_dec_ours": (lambda: rope(True, shape=(32, 32, 1, 128)), "custom_kernel_rope"),
        "rope_dec_mlx": (lambda: rope(False, shape=(32, 32, 1, 128)), "rope"),
        # session 30: the multi-head LayerNorm backward of 8192 rows of 4 heads of 64 (x, g read,
        # dx written: 24 MiB in float32) and a copy of those bytes (x * 2 of 12 MiB)
        "mhln_vjp_f32_ours": (lambda: mhln_vjp(mx.float32), "custom_kernel_layer_norm_vjp|norm_partials"),
        "mhln_vjp_bf16_ours": (lambda: mhln_vjp(mx.bfloat16), "custom_kernel_layer_norm_vjp|norm_partials"),
        "mhln_f32_ours": (lambda: mhln(mx.float32), "custom_kernel_layer_norm"),
        "mhln_bf16_ours": (lambda: mhln(mx.bfloat16), "custom_kernel_layer_norm"),
        "copy_mhln_fwd_f32": (lambda: scale_copy((8192, 256), mx.float32), "binary|multiply"),
        "copy_mhln_fwd_bf16": (lambda: scale_copy((8192, 256), mx.bfloat16), "binary|multiply"),
        "copy_mhln_f32": (lambda: scale_copy((8192, 384), mx.float32), "binary|multiply"),
        "copy_mhln_bf16": (lambda: scale_copy((8192, 384), mx.bfloat16), "binary|multiply"),
        # session 31: the LayerNorm bf16 16384x1024 forward (a row near the copy bar) and the
        # LayerNorm bf16 2048x8192 backward's copy of its bytes (x, g read, dx written: 96 MiB)
        "ln_bf16_16k1k_ours": (lambda: ln(True, mx.bfloat16, rows=16384, n=1024), "custom_kernel_layer_norm"),
        "ln_bf16_16k1k_mlx": (lambda: ln(False, mx.bfloat16, rows=16384, n=1024), "layer_norm"),
        "copy_bf16_16kx1k": (lambda: scale_copy((16384, 1024), mx.bfloat16), "binary|multiply"),
        "copy_ln_vjp_bf16_8k": (lambda: scale_copy((3072, 8192), mx.bfloat16), "binary|multiply"),
        # session 46: the short-row backward rows below the copy bar on the H200 (x, g read, dx written:
        # 96 MiB; the copy: x * 2 of 48 MiB)
        "rms_vjp_bf16_16k1k_ours": (lambda: rms_vjp(True, mx.bfloat16, rows=16384, n=1024),
                                    "custom_kernel_rms_norm_vjp|norm_partials"),
        "rms_vjp_bf16_16k1k_mlx": (lambda: rms_vjp(False, mx.bfloat16, rows=16384, n=1024), "rms_norm_vjp|reduce"),
        "ln_vjp_bf16_16k1k_ours": (lambda: ln_vjp(True, mx.bfloat16, rows=16384, n=1024),
                                   "custom_kernel_layer_norm_vjp|norm_partials"),
        "copy_vjp_bf16_16k1k": (lambda: scale_copy((16384, 1536), mx.bfloat16), "binary|multiply"),
        "add_vjp_bf16_16k1k": (lambda: add_pair((16384, 1024), mx.bfloat16), "binary|add"),
        "rms_vjp_f32_16k1k_ours": (lambda: rms_vjp(True, mx.float32, rows=16384, n=1024),
                                   "custom_kernel_rms_norm_vjp|norm_partials"),
        "mhln_vjp_bf16_4k8x512_ours": (lambda: mhln_vjp(mx.bfloat16, rows=4096, nh=8, dh=512),
                                       "custom_kernel_layer_norm_vjp|norm_partials"),
        # multi-head LayerNorm 4096x8x512 forward against LayerNorm 32768x512: the same kernel, plan
        # and bytes, one weight slice against eight (session 49)
        "mhln_bf16_4k8x512_ours": (lambda: mhln(mx.bfloat16, rows=4096, nh=8, dh=512), "custom_kernel_layer_norm"),
        "ln_bf16_32k512_ours": (lambda: ln(True, mx.bfloat16, rows=32768, n=512), "custom_kernel_layer_norm"),
        "copy_bf16_32k512": (lambda: scale_copy((32768, 512), mx.bfloat16), "binary|multiply"),
        "ln_vjp_bf16_2k8k_ours": (lambda: ln_vjp(True, mx.bfloat16, rows=2048, n=8192),
                                  "custom_kernel_layer_norm_vjp|norm_partials"),
        "gemm_av_ours": (lambda: gemm("gemm_av"), "gemm_simd"),
        "gemm_at_b_ours": (lambda: gemm("gemm_at_b"), "gemm_simd"),
        "gemm_mlx": (lambda: gemm("mlx"), "gemm|nvjet|xmma|cutlass|sm90"),
    }


def _decode_case(spec: str):
    """``decode:ours|mlx,b,hq,hkv,lk,d[,block_size]`` (fp16): a decode case by its shape,
    ours with an optional split-KV block size (the knob)."""
    import mlx.core as mx

    import xlstm_kernels as xk

    who, *vals = spec.split(":", 1)[1].split(",")
    b, hq, hkv, lk, d = (int(v) for v in vals[:5])
    knobs = {"split_kv_block_size": int(vals[5])} if len(vals) > 5 else None
    q, k, v = (mx.random.normal(s).astype(mx.float16) for s in ((b, hq, 1, d), (b, hkv, lk, d), (b, hkv, lk, d)))
    mx.eval(q, k, v)
    if who == "ours":
        return (lambda: lambda: xk.scaled_dot_product_attention(q, k, v, scale=d**-0.5, knobs=knobs)), "attention"
    return (lambda: lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5)), "sdpa|cudnn|flash"


def _rope_case(spec: str):
    """``rope:WHO,B,H,L,D`` (WHO = ours | mlx | copy: MLX's x * 2 on the same bytes), bf16,
    per-sequence offsets (session 29: kernel time against size)."""
    import mlx.core as mx

    import xlstm_kernels as xk

    who, *vals = spec.split(":", 1)[1].split(",")
    b, h, seq, d = (int(v) for v in vals[:4])
    x = mx.random.normal((b, h, seq, d)).astype(mx.bfloat16)
    off = mx.array([7 * i + 3 for i in range(b)], dtype=mx.int32)
    mx.eval(x, off)
    if who == "ours":
        return (lambda: lambda: xk.rope(x, d, offset=off)), "custom_kernel_rope"
    if who == "copy":
        return (lambda: lambda: x * 2), "binary|multiply"
    return (lambda: lambda: mx.fast.rope(x, d, traditional=False, base=10000.0, scale=1.0, offset=off)), "rope"


def _timed(spec: str, calls: int) -> int:
    """Run a decode case (``decode:...``) or a named case `calls` times after WARM, one eval
    per call (for ncu's kernel durations with ``--metrics gpu__time_duration.sum``;
    cuda_device_run.sh ncutime)."""
    import mlx.core as mx

    case = _decode_case if spec.startswith("decode:") else _rope_case if spec.startswith("rope:") else None
    fn = (case(spec) if case else _cases()[spec])[0]()
    for _ in range(WARM + calls):
        mx.eval(fn())
    mx.synchronize()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "timed":
        return _timed(argv[1], int(argv[2]))
    if not argv or argv[0] not in ("list", "run"):
        print(__doc__)
        return 2
    if argv[0] == "list":
        import os

        os.environ.setdefault("XLSTM_KERNELS_BACKEND", "reference")
        for name, (_, regex) in _cases().items():
            print(f"{name} {regex} {WARM}")
        return 0
    import mlx.core as mx

    cases = _cases()
    if len(argv) >= 2 and argv[1].startswith("decode:"):
        cases[argv[1]] = _decode_case(argv[1])
    if len(argv) < 2 or argv[1] not in cases:
        print(f"unknown case; one of {', '.join(cases)}", file=sys.stderr)
        return 2
    fn = cases[argv[1]][0]()
    for _ in range(WARM + PROFILED):
        mx.eval(fn())
    mx.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
