"""Probe: where RMSNorm's per-call time goes outside the kernel (MLX's eval path), on CUDA.

    PROBES=evalcost bash scripts/cuda_device_run.sh stage2 probes     # on the GPU
    XLSTM_KERNELS_BACKEND=emulate python3 scripts/probe_evalcost.py --tiny   # logic check here

The same RMSNorm launch, wrapped in fewer and fewer layers, queued Q at a time and evaluated
once ("eval us" = eval time / Q: what the GPU and MLX's eval do per call; "host us" = the
graph building in Python, apart):

  mlx          mx.fast.rms_norm (MLX's own kernel: no custom-kernel path)
  ours         xk.rms_norm as shipped (call memo, mx.compile replay, mx.custom_function)
  ours_noreplay  the same with XLSTM_KERNELS_REPLAY=0
  ours_memo_fn ours' memoised function called directly (no key, no memo lookup)
  raw          the cuda_kernel object that ours launches, called directly (same inputs, grid),
               with the text inline
  raw_cf       raw inside an mx.custom_function
  raw_compiled mx.compile(raw)
  raw_inc      raw's exact text moved into two files that a short text #includes: MLX hashes
               the kernel text on every eval (the JIT module's name), so this is raw with
               ~100 bytes to hash instead of several KB
  inc_cf_compiled     mx.compile(mx.custom_function(raw_inc)): ours' graph without its Python
  inc_compiled_in_cf  mx.custom_function(mx.compile(raw_inc)): the custom function outside
  inc_cfvjp[_compiled] raw_inc in a custom function with a Python vjp (as ours has), [compiled]
  raw_pad      raw + 64 KiB of comment in the text: the slope of that hash
  copy_raw     a bare cuda_kernel copying x to y (16 bytes a thread, short text): the floor of
               a custom kernel moving the same bytes
  mlx_mul      x * w with MLX's op (the same bytes through a built-in elementwise kernel)

ratio = mlx eval / variant eval (> 1: faster than MLX's op).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np

import xlstm_kernels as xk
from xlstm_kernels.ops import norm as norm_mod
from xlstm_kernels.runtime import backends
from xlstm_kernels.runtime import kernels as rk

try:
    from xlstm_kernels.cuda import kernel as ck
except ImportError:  # no cuda module (older checkout)
    ck = None

EPS = 1e-5


class Recorder:
    """Wraps mx.fast.cuda_kernel: keeps each object's construction keywords and last call."""

    def __init__(self):
        self.made = []
        self.real = getattr(mx.fast, "cuda_kernel", None)

    def __enter__(self):
        def factory(**kw):
            obj = self.real(**kw)
            entry = {"kw": kw, "obj": obj, "calls": []}
            self.made.append(entry)

            def call(**ckw):
                entry["calls"].append(ckw)
                return obj(**ckw)

            return call

        mx.fast.cuda_kernel = factory
        return self

    def __exit__(self, *exc):
        mx.fast.cuda_kernel = self.real


def fresh(inline: bool) -> None:
    """New kernel objects and call memos from here on; `inline`: kernel texts pasted into the
    cuda_kernel text (as before session 10) instead of #included from content-named files."""
    ck.INCLUDE_HEADERS = not inline
    norm_mod._CALLS.clear()
    rk._cache.clear()


def record_rms_launch(x, w):
    """(construction keywords, call keywords) of the cuda_kernel launch behind xk.rms_norm(x, w)."""
    os.environ["XLSTM_KERNELS_REPLAY"] = "0"
    fresh(inline=True)  # fresh kernel objects (their cuda_kernel made and recorded again), texts inline
    with Recorder() as rec:
        mx.eval(xk.rms_norm(x, w, EPS))
    os.environ.pop("XLSTM_KERNELS_REPLAY")
    fresh(inline=False)
    launches = [(e["kw"], c) for e in rec.made for c in e["calls"]]
    if len(launches) != 1:
        raise RuntimeError(f"expected one cuda_kernel launch behind rms_norm, recorded {len(launches)} "
                           "(kernel objects cached elsewhere? run this probe in a fresh process)")
    return launches[0]


def include_text(kw, tmp):
    """kw with source and header moved into content-named files that short texts #include."""
    out = dict(kw)
    for part in ("source", "header"):
        text = kw.get(part, "")
        h = hashlib.sha1(text.encode()).hexdigest()[:16]
        path = os.path.join(tmp, f"xk_{part}_{h}.cuh")
        with open(path, "w") as f:
            f.write(text)
        out[part] = f'#include "{path}"\n'
    out["name"] = kw["name"] + "_inc"
    return out


COPY_SRC = """\
const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
if (i < n_vec[0]) {
  reinterpret_cast<uint4*>(y)[i] = reinterpret_cast<const uint4*>(x)[i];
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    backend = backends.current_backend()
    print(f"backend {backend}, MLX {mx.__version__}")
    shapes = [(64, 4096), (4096, 4096), (16384, 4096)]
    rounds, queues = 7, (20, 200)
    if args.tiny:
        shapes, rounds, queues = [(8, 256)], 2, (2,)
    cuda = hasattr(mx, "cuda") and mx.cuda.is_available() and not args.tiny
    tmp = tempfile.mkdtemp(prefix="xk_evalcost_")
    rows = []
    dt = mx.bfloat16
    print(f"{'shape':11s} {'Q':>4s} {'variant':14s} {'eval us':>8s} {'best us':>8s} {'host us':>8s} {'ratio':>6s} "
          f"{'GB/s':>6s} {'err':>8s}")
    for shape in shapes:
        rng = np.random.default_rng(1)
        x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)
        w = mx.array(rng.standard_normal(shape[-1:]).astype(np.float32)).astype(dt)
        mx.eval(x, w)
        want = mx.fast.rms_norm(x, w, EPS).astype(mx.float32)
        variants = {"mlx": lambda: mx.fast.rms_norm(x, w, EPS), "ours": lambda: xk.rms_norm(x, w, EPS)}

        def noreplay():
            os.environ["XLSTM_KERNELS_REPLAY"] = "0"
            try:
                return xk.rms_norm(x, w, EPS)
            finally:
                os.environ.pop("XLSTM_KERNELS_REPLAY")

        variants["ours_noreplay"] = noreplay
        setups = {}
        if cuda:
            kw, ckw = record_rms_launch(x, w)
            names = kw["input_names"]
            fixed = list(ckw["inputs"])
            slot = {n: i for i, n in enumerate(names)}
            call = {k: v for k, v in ckw.items() if k != "inputs"}

            def inputs_for(a, b):
                ins = list(fixed)
                ins[slot["x"]] = a
                if "w" in slot:
                    ins[slot["w"]] = b
                return ins

            raw = mx.fast.cuda_kernel(**kw)
            raw_inc = mx.fast.cuda_kernel(**include_text(kw, tmp))
            pad = dict(kw, name=kw["name"] + "_pad", source=kw["source"] + "\n/*" + "x" * 65536 + "*/\n")
            raw_pad = mx.fast.cuda_kernel(**pad)
            run = lambda obj, a, b: obj(inputs=inputs_for(a, b), **call)[0]  # noqa: E731
            variants["raw"] = lambda: run(raw, x, w)
            cf = mx.custom_function(lambda a, b: run(raw, a, b))
            variants["raw_cf"] = lambda: cf(x, w)
            comp = mx.compile(lambda a, b: run(raw, a, b))
            variants["raw_compiled"] = lambda: comp(x, w)
            variants["raw_inc"] = lambda: run(raw_inc, x, w)
            cf_inc = mx.custom_function(lambda a, b: run(raw_inc, a, b))
            comp_cf_inc = mx.compile(lambda a, b: cf_inc(a, b))
            variants["inc_cf_compiled"] = lambda: comp_cf_inc(x, w)  # what ours records, minus Python
            comp_inc = mx.compile(lambda a, b: run(raw_inc, a, b))
            cf_of_comp = mx.custom_function(lambda a, b: comp_inc(a, b))
            variants["inc_compiled_in_cf"] = lambda: cf_of_comp(x, w)  # the custom function outside
            cfv_inc = mx.custom_function(lambda a, b: run(raw_inc, a, b))

            @cfv_inc.vjp
            def _cfv_vjp(primals, cotangent, output):
                return mx.zeros_like(primals[0]), mx.zeros_like(primals[1])

            comp_cfv_inc = mx.compile(lambda a, b: cfv_inc(a, b))
            variants["inc_cfvjp"] = lambda: cfv_inc(x, w)  # a Python vjp on the custom function
            variants["inc_cfvjp_compiled"] = lambda: comp_cfv_inc(x, w)
            mx.eval(xk.rms_norm(x, w, EPS))  # memoised now
            key = ("rms_norm", x.shape, x.dtype, (w.shape, w.dtype), None, EPS, 1)
            memo_fn = norm_mod._CALLS.get(key)
            if memo_fn is None:
                raise RuntimeError("no memo entry for rms_norm: has ops.norm's call key changed?")
            else:
                variants["ours_memo_fn"] = lambda: memo_fn(x, w, None)  # ours without _call's key and lookup
            variants["raw_pad"] = lambda: run(raw_pad, x, w)
            copy = mx.fast.cuda_kernel(name="xk_evalcost_copy", input_names=["x", "n_vec"], output_names=["y"],
                                       source=COPY_SRC)
            n_vec = x.nbytes // 16
            nv = mx.array(n_vec, dtype=mx.uint32)
            copy_kw = dict(output_shapes=[x.shape], output_dtypes=[x.dtype],
                           grid=(-(-n_vec // 256) * 256, 1, 1), threadgroup=(256, 1, 1))
            variants["copy_raw"] = lambda: copy(inputs=[x, nv], **copy_kw)[0]
            print(f"# rms_norm kernel text: source {len(kw['source'])} B, header {len(kw['header'])} B; "
                  f"inputs {names}; grid {call['grid']} block {call['threadgroup']}")
        variants["mlx_mul"] = lambda: x * w
        errs = {}
        for v, fn in variants.items():
            if v in ("copy_raw", "mlx_mul"):
                continue
            if v in setups:
                setups[v]()
            errs[v] = (mx.abs(fn().astype(mx.float32) - want).max() / mx.abs(want).max()).item()
        for q in queues:
            times = {v: [] for v in variants}
            host = {v: [] for v in variants}
            names = list(variants)
            for r in range(rounds):  # each round starts at another variant: no order bias
                for v in names[r % len(names):] + names[:r % len(names)]:
                    fn = variants[v]
                    if v in setups:
                        setups[v]()
                    mx.eval([fn() for _ in range(2)])
                    t0 = time.perf_counter()
                    outs = [fn() for _ in range(q)]
                    t1 = time.perf_counter()
                    mx.eval(outs)
                    times[v].append((time.perf_counter() - t1) / q)
                    host[v].append((t1 - t0) / q)
                    del outs
            ref = statistics.median(times["mlx"])
            for v in variants:
                med, best = statistics.median(times[v]), min(times[v])
                print(f"{'x'.join(map(str, shape)):11s} {q:4d} {v:14s} {med * 1e6:8.2f} {best * 1e6:8.2f} "
                      f"{statistics.median(host[v]) * 1e6:8.2f} {ref / med:6.3f} {2 * x.nbytes / med / 1e9:6.0f} "
                      f"{errs.get(v, float('nan')):8.1e}", flush=True)
                rows.append({"shape": list(shape), "queue": q, "variant": v, "eval_us": med * 1e6,
                             "best_us": best * 1e6, "host_us": statistics.median(host[v]) * 1e6,
                             "ratio": ref / med, "relerr": errs.get(v)})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
