"""Fused norm family (``xlstm_kernels.ops.fused``) vs the unfused sequences, in the same run.

    python -m xlstm_kernels.benchmarks.ops_fused [--backend metal|emulate]
                                                 [--dtypes float32,float16,bfloat16] [--quick]

Two ops, two baselines each (one row per (op, case, dtype, baseline)):

* ``fused_norm_linear``  vs  ``unfused-ours``: ``linear(rms_norm(x, g), W, b)`` (this
  package's kernels, two launches) and ``unfused-mx``: ``mx.fast.rms_norm`` then
  ``mx.addmm`` (MLX's built-ins).
* ``fused_norm_qkv_rope``  vs  ``unfused-ours``: rms_norm, linear, split into heads and
  transpose, ``rope`` on q and on k (this package's kernels) and ``unfused-mx``:
  ``mx.fast.rms_norm``, ``matmul``, reshape/transpose, ``mx.fast.rope`` on q and k.
  v is returned as the (strided) view in both baselines, not copied.

Knob ``single_kernel`` off (the NVIDIA presets): ``ours`` is the op as shipped, i.e. the
unfused sequence (path "sequence"), and one more baseline, ``fused-kernel``, times the
fused kernel itself (``knobs={"single_kernel": True}``).

``run(backend, dtypes, quick)`` returns dicts with op, shape, dtype, baseline, path (the
fused kernel's path: simd or gemv, or "sequence"), ours_ms, mlx_ms (the baseline's ms; each
pair timed interleaved and pipelined, so ours_ms is measured again for every baseline), ratio
(mlx_ms / ours_ms: > 1 = the op faster; where the op runs the sequence its row against
``unfused-ours`` is the sequence against itself, i.e. the op's own host cost), tflops (2*M*N*K / ours), gbps (compulsory bytes:
x, norm weight, W, bias read and the outputs written once), pct_roofline (100 x the
roofline lower bound max(flops / peak, bytes / bandwidth) over ours, from
``tiles.roofline()``), max_rel_err (vs float64 NumPy on the first <= 64 rows) and
baseline_rel_err. On the emulator there is no GPU to time: rows report correctness and
``emulated_s`` (wall time of one emulated fused call) only.

Design target: fused faster than the unfused sequence on Apple GPUs (not measured here:
no Apple GPU in this environment). What the design relies on:
* The fused op is ONE launch that reads x once per column tile (as the GEMM alone does)
  and never writes or re-reads the normalised activations: against ``unfused-ours`` it
  removes the rms_norm kernel's full read + write of x and one launch (QKV: also the two
  rope launches, their q/k read + write, and the copies ``rope`` makes of the
  transposed q and k). The extra work inside the GEMM is one fma per loaded x element
  (sum of squares), one multiply per loaded W element (norm weight) and a per-row scale
  in the epilogue: nothing on the MMA critical path.
* Decode (M == 1) runs a gemv kernel whose x loads feed both the dot product and the
  statistics; the unfused sequence pays two or four launches for a few KiB of
  activations, so the launch savings dominate there.
Risks: against ``unfused-mx`` at large M the GEMM core matters more than the fusion, and
this family's simdgroup-matrix main loop (scalar loads, no double buffering, like
gemm_simd) is simpler than MLX's steel GEMM, so expect ratios below 1 there until the
main loop is tuned; the QKV epilogue stages a BM x (heads per tile * D) float tile in
threadgroup memory (16 KiB for BM = 32, D = 128), which can lower occupancy.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from xlstm_kernels.benchmarks.kind import bench_kind
from xlstm_kernels import runtime, tiles
from xlstm_kernels.benchmarks.timing import measure_pipelined_pair
from xlstm_kernels.ops import fused as fused_ops

EPS = 1e-5
CHECK_ROWS = 64  # rows of the output compared with float64 (the norm is per row)

# norm_linear: (M, K, N, bias)
LINEAR_METAL = [
    (1, 4096, 4096, False),      # decode (gemv)
    (8, 4096, 4096, False),      # batched decode
    (512, 4096, 4096, False),
    (2048, 2048, 8192, True),    # FFN up-projection style
    (4096, 1024, 4096, False),
]
LINEAR_METAL_QUICK = [LINEAR_METAL[0], LINEAR_METAL[2]]
LINEAR_EMULATE = [(33, 29, 31, True), (1, 64, 96, False), (64, 96, 80, False)]
LINEAR_EMULATE_QUICK = [LINEAR_EMULATE[0], LINEAR_EMULATE[1]]

# qkv_rope: (B, L, E, H, HKV, D, traditional)
QKV_METAL = [
    (1, 1, 4096, 32, 8, 128, False),      # decode (gemv), Llama-style GQA
    (8, 1, 4096, 32, 8, 128, False),      # batched decode
    (1, 2048, 2048, 16, 4, 128, False),   # prefill
    (4, 512, 1024, 16, 16, 64, True),     # MHA, traditional pairing
]
QKV_METAL_QUICK = [QKV_METAL[0], QKV_METAL[2]]
QKV_EMULATE = [(2, 17, 29, 4, 2, 16, False), (1, 1, 48, 4, 1, 16, True), (1, 33, 64, 4, 2, 64, True)]
QKV_EMULATE_QUICK = [QKV_EMULATE[0], QKV_EMULATE[1]]


# ---------------------------------------------------------------------------------------
# float64 references
# ---------------------------------------------------------------------------------------


def _f64(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32), dtype=np.float64)


def _rel(out, ref: np.ndarray) -> float | None:
    o = _f64(out)
    if not np.all(np.isfinite(o)):
        return None
    return float(np.max(np.abs(o - ref)) / np.max(np.abs(ref)))


def _np_norm(x, g):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * g


def _np_rope(t, traditional, offset=0, base=10000.0):
    seq, d = t.shape[-2:]
    half = d // 2
    theta = (np.arange(seq) + offset)[:, None] * base ** (-np.arange(half) / half)
    c, s = np.cos(theta), np.sin(theta)
    if traditional:
        x0, x1 = t[..., 0::2], t[..., 1::2]
        out = np.empty_like(t)
        out[..., 0::2], out[..., 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
        return out
    x0, x1 = t[..., :half], t[..., half:]
    return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)


# ---------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------


def _rand(rng, shape, dtype, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _mx_linear(x, g, w, b):
    xn = mx.fast.rms_norm(x, g, EPS)
    return mx.addmm(b, xn, w.T) if b is not None else xn @ w.T


def _mx_qkv(x, g, w, h, hkv, traditional, offset):
    bsz, seq, _ = x.shape
    heads = h + 2 * hkv
    d = w.shape[0] // heads
    t = (mx.fast.rms_norm(x, g, EPS) @ w.T).reshape(bsz, seq, heads, d).transpose(0, 2, 1, 3)
    q, k, v = t[:, :h], t[:, h : h + hkv], t[:, h + hkv :]
    kw = dict(traditional=traditional, base=10000.0, scale=1.0, offset=offset)
    return mx.fast.rope(q, d, **kw), mx.fast.rope(k, d, **kw), v


SINGLE = {"single_kernel": True}
#: each pair is timed interleaved and pipelined (timing.measure_pipelined_pair): batches of
#: PAIR_CALLS queued calls, PAIR_BATCHES a run, `repeats` runs a side (the order alternating)
PAIR_CALLS, PAIR_BATCHES = 10, 4


def _kernel_forced(m, dtype, call) -> dict:
    """Where the presets run the unfused sequence (knob single_kernel off: NVIDIA), the
    fused kernel itself as one more baseline, so every run re-measures that choice."""
    if fused_ops.knob_values(m, dtype)["single_kernel"]:
        return {}
    return {"fused-kernel: the one fused kernel (single_kernel=true)": call}


def _linear_case(m, k, n, has_bias, dtype, rng):
    x, g = _rand(rng, (m, k), dtype), _rand(rng, (k,), dtype)
    w = _rand(rng, (n, k), dtype, 1.0 / np.sqrt(k))
    b = _rand(rng, (n,), dtype) if has_bias else None
    r = min(m, CHECK_ROWS)
    ref = _np_norm(_f64(x[:r]), _f64(g)) @ _f64(w).T + (_f64(b) if has_bias else 0.0)
    item = x.itemsize
    nbytes = (m * k + k + n * k + m * n + (n if has_bias else 0)) * item
    return {
        "op": "fused_norm_linear",
        "shape": [m, k, n],
        "path": fused_ops.fused_path(m, n, k, dtype),
        "flops": 2.0 * m * n * k,
        "bytes": nbytes,
        "ours": lambda: fused_ops.fused_norm_linear(x, g, w, b, EPS),
        "baselines": {
            "unfused-ours: rms_norm + linear": lambda: fused_ops.unfused_norm_linear(x, g, w, b, EPS),
            "unfused-mx: mx.fast.rms_norm + addmm": lambda: _mx_linear(x, g, w, b),
            **_kernel_forced(m, dtype, lambda: fused_ops.fused_norm_linear(x, g, w, b, EPS, knobs=SINGLE)),
        },
        "check": lambda out: _rel(out[:r], ref),
    }


def _qkv_case(bsz, seq, e, h, hkv, d, trad, dtype, rng):
    offset = 7
    x, g = _rand(rng, (bsz, seq, e), dtype), _rand(rng, (e,), dtype)
    w = _rand(rng, ((h + 2 * hkv) * d, e), dtype, 1.0 / np.sqrt(e))
    ls = min(seq, CHECK_ROWS)
    qkv = (_np_norm(_f64(x[:1, :ls]), _f64(g)) @ _f64(w).T).reshape(1, ls, h + 2 * hkv, d).transpose(0, 2, 1, 3)
    refs = (_np_rope(qkv[:, :h], trad, offset), _np_rope(qkv[:, h : h + hkv], trad, offset), qkv[:, h + hkv :])
    m, n = bsz * seq, (h + 2 * hkv) * d
    kw = dict(eps=EPS, traditional=trad, offset=offset)

    def check(outs):
        errs = [_rel(o[:1, :, :ls], r) for o, r in zip(outs, refs)]
        return None if any(v is None for v in errs) else max(errs)

    return {
        "op": "fused_norm_qkv_rope",
        "shape": [bsz, seq, e, h, hkv, d],
        "traditional": trad,
        "path": fused_ops.fused_path(m, n, e, dtype, head_dim=d),
        "flops": 2.0 * m * n * e,
        "bytes": (m * e + e + n * e + m * n) * x.itemsize,
        "ours": lambda: fused_ops.fused_norm_qkv_rope(x, g, w, h, hkv, **kw),
        "baselines": {
            "unfused-ours: rms_norm + linear + rope(q), rope(k)": lambda: fused_ops.unfused_norm_qkv_rope(
                x, g, w, h, hkv, **kw
            ),
            "unfused-mx: mx.fast.rms_norm + matmul + mx.fast.rope": lambda: _mx_qkv(x, g, w, h, hkv, trad, offset),
            **_kernel_forced(m, dtype, lambda: fused_ops.fused_norm_qkv_rope(x, g, w, h, hkv, **kw, knobs=SINGLE)),
        },
        "check": check,
    }


def _peak_tflops(roof: dict, dtype) -> float:
    return roof[{"float32": "fp32_tflops", "float16": "fp16_tflops", "bfloat16": "bf16_tflops"}[_name(dtype)]]


def _name(dtype) -> str:
    return str(dtype).split(".")[-1]


def _bench_case(case: dict, dtype, emulated: bool, repeats: int, roof: dict) -> list[dict]:
    out = case["ours"]()
    mx.eval(out)
    err = case["check"](out)
    base = {k: case[k] for k in ("op", "shape", "path") if k in case}
    if "traditional" in case:
        base["traditional"] = case["traditional"]
    base["dtype"] = _name(dtype)
    rows = []
    if emulated:
        t0 = time.perf_counter()
        mx.eval(case["ours"]())
        emulated_s = time.perf_counter() - t0
    for label, fn in case["baselines"].items():
        b_out = fn()
        mx.eval(b_out)
        row = dict(base, baseline=label, max_rel_err=err, baseline_rel_err=case["check"](b_out))
        if emulated:
            row["emulated_s"] = emulated_s
            print(f"{row['op']:<22} {row['dtype']:<9} {str(row['shape']):<28} {label.split(':')[0]:<13} "
                  f"emulated {emulated_s:7.3f} s  err {err}")
        else:
            t_ours, t_base = measure_pipelined_pair(case["ours"], fn, calls=PAIR_CALLS, batches=PAIR_BATCHES,
                                                    repeats=repeats)
            lower = max(case["flops"] / (_peak_tflops(roof, dtype) * 1e12), case["bytes"] / (roof["bandwidth_gbs"] * 1e9))
            row.update({
                "ours_ms": t_ours * 1e3, "mlx_ms": t_base * 1e3, "ratio": t_base / t_ours,
                "tflops": case["flops"] / t_ours / 1e12, "gbps": case["bytes"] / t_ours / 1e9,
                "pct_roofline": 100.0 * lower / t_ours,
            })
            print(f"{row['op']:<22} {row['dtype']:<9} {str(row['shape']):<28} {label.split(':')[0]:<13} "
                  f"{row['ours_ms']:8.3f} ms {row['mlx_ms']:8.3f} ms x{row['ratio']:5.2f} "
                  f"{row['tflops']:6.2f} TFLOP/s {row['pct_roofline']:5.1f}%  err {err}")
        rows.append(row)
    return rows


def run(backend: str, dtypes: list, quick: bool) -> list[dict]:
    """Benchmark rows for `backend` ("metal" or "emulate") and `dtypes` (mx dtypes or names)."""
    emulated = backend == "emulate"
    if bench_kind(backend) != "gpu":  # the emulator, or reference ops on a CPU: small cases
        lin, qkv = (LINEAR_EMULATE_QUICK, QKV_EMULATE_QUICK) if quick else (LINEAR_EMULATE, QKV_EMULATE)
    else:
        lin, qkv = (LINEAR_METAL_QUICK, QKV_METAL_QUICK) if quick else (LINEAR_METAL, QKV_METAL)
    repeats = 3 if quick else 5
    roof = tiles.roofline()
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    with runtime.use_backend(backend):
        for dtype in dtypes:
            dtype = getattr(mx, dtype) if isinstance(dtype, str) else dtype
            for m, k, n, has_bias in lin:
                rows.extend(_bench_case(_linear_case(m, k, n, has_bias, dtype, rng), dtype, emulated, repeats, roof))
            for c in qkv:
                rows.extend(_bench_case(_qkv_case(*c, dtype, rng), dtype, emulated, repeats, roof))
    return rows
