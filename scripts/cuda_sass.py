#!/usr/bin/env python3
"""SASS of the CUDA backend's kernels for one op call, without a GPU (no device time).

    python scripts/cuda_sass.py "xk.rms_norm(rnd(16384, 4096), rnd(4096), 1e-5)" [--out DIR]

The expression runs as on the cuda backend of an H100 (preset family nvidia_hopper,
``XLSTM_KERNELS_DEVICE`` to change it) with ``mx.fast.cuda_kernel`` replaced by a
recorder (nothing is executed: each launch is recorded and answered with zero outputs;
`xk`, `mx` and `rnd(*shape, dtype=mx.float32)` are in scope). For every distinct launch
the text that ``mx.fast.cuda_kernel`` builds from our source and header is compiled with NVRTC to PTX, then with ptxas for
sm_90a (registers, spills, shared memory: ``ptxas -v``) and disassembled (nvdisasm).
Printed per kernel: resources (registers, spills, static shared memory from ptxas; the
dynamic shared memory the launch asks for), instruction counts by opcode (whole kernel),
the loop with the most HMMA instructions (GEMM: the fast K loop, all its unrolled stages:
HMMA, LDSM, LDGSTS, BAR, local memory accesses, other instructions per HMMA), and the
paths of the .cu / .ptx / .sass files under --out.

Tools (found on PATH or by flag / environment): libnvrtc.so.13 (``--nvrtc`` /
``XK_NVRTC``; ``pip download nvidia-cuda-nvrtc==13.0.*`` and unzip), ptxas (CUDA
toolkit), nvdisasm (``--nvdisasm`` / ``XK_NVDISASM``; the toolkit or ``pip download
nvidia-cuda-nvdisasm``), MLX's JIT headers (``--mlx-jit`` / ``XK_MLX_JIT``: a folder
holding mlx/backend/cuda/device/{utils.cuh,complex.cuh,config.h} from the MLX source
tree) and CCCL (``--cccl``, default /usr/local/cuda/include/cccl).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def record_launches(expr: str) -> list[dict]:
    """Run `expr` as on the cuda backend of an H100 (preset family nvidia_hopper), with
    ``mx.fast.cuda_kernel`` replaced by a recorder: every launch is recorded with the exact
    source and header our factory hands MLX, and answered with zero outputs."""
    os.environ["XLSTM_KERNELS_BACKEND"] = "cuda"
    os.environ.setdefault("XLSTM_KERNELS_DEVICE", "nvidia_hopper")
    os.environ["XLSTM_KERNELS_REPLAY"] = "0"
    import mlx.core as mx

    import xlstm_kernels as xk
    from xlstm_kernels.runtime import backends
    from xlstm_kernels.tiles.presets import detect_device

    family = detect_device().family_key
    if not family.startswith("nvidia"):  # a name no preset matches falls back to Apple's plans (session 51)
        raise SystemExit(f"cuda_sass: XLSTM_KERNELS_DEVICE={os.environ['XLSTM_KERNELS_DEVICE']!r} selects the preset family "
                         f"{family!r}, not an NVIDIA one: give an NVIDIA family key (nvidia_hopper: H100 / H200 / GH200) "
                         "or an sm_* architecture")

    from cuda_nvrtc_check import _CUDA_TYPES, _DEFAULT_HEADER, _dtype_name

    recs: list[dict] = []

    class Recorder:
        def __init__(self, **kw):
            self.kw = kw

        def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, **kw):
            k = self.kw
            arrays = [v if isinstance(v, mx.array) else mx.array(v) for v in inputs]
            src = k["source"]
            text = _DEFAULT_HEADER + k.get("header", "") + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            func = "custom_kernel_" + k["name"]
            text += f"__global__ void {func}(\n"
            params = []
            for n, a in zip(k["input_names"], arrays):
                params.append(f"    const {_CUDA_TYPES[_dtype_name(a.dtype)]}* {n}")
                if a.ndim > 0:
                    for suffix, typ in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                        if n + suffix in src:
                            params.append(f"    const __grid_constant__ {typ} {n}{suffix}")
            for n, d in zip(k["output_names"], output_dtypes):
                params.append(f"    {_CUDA_TYPES[_dtype_name(d)]}* {n}")
            text += ",\n".join(params) + ") {\n" + src + "\n}\n\n} // namespace mlx::core::cu\n"
            recs.append({"name": k["name"], "kernel": "mlx::core::cu::" + func, "text": text,
                         "grid": [int(g) for g in grid], "threadgroup": [int(t) for t in threadgroup],
                         "shared_memory": int(k.get("shared_memory", 0))})
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

    mx.fast.cuda_kernel = lambda **kw: Recorder(**kw)
    backends._cuda_available = lambda: True

    def rnd(*shape, dtype=mx.float32):
        return mx.random.normal(shape).astype(dtype)

    out = eval(expr, {"xk": xk, "mx": mx, "rnd": rnd})  # noqa: S307 - a developer's command line
    mx.eval(out)
    return recs


_SASS_LINE = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?(.*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def hot_loop(sass: str) -> tuple[int, collections.Counter] | None:
    """(instructions, opcode counts) of the loop with the most HMMA instructions: the code
    from a label to the last backward branch to it (a loop's whole body, inner unrolled
    trips included), or None if no loop holds an HMMA."""
    labels: dict[str, int] = {}
    insts: list[tuple[str, str]] = []  # (opcode with modifiers, rest of the line)
    for line in sass.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(insts)
            continue
        m = _SASS_LINE.match(line)
        if m:
            insts.append((m.group(2) + (m.group(3) or ""), m.group(4)))
    best = None
    for end, (op, rest) in enumerate(insts):
        if not op.startswith("BRA"):
            continue
        t = re.search(r"\(?(\.L_x_\d+)\)?", rest)
        start = labels.get(t.group(1)) if t else None
        if start is None or start > end:
            continue
        ops = collections.Counter(o for o, _ in insts[start : end + 1])
        hmma = sum(v for k, v in ops.items() if k.startswith("HMMA"))
        if hmma and (best is None or hmma > best[2] or (hmma == best[2] and end - start < best[0])):
            best = (end - start + 1, ops, hmma)
    return None if best is None else (best[0], best[1])


def loop_summary(sass: str) -> str:
    """One line on the hottest loop: instructions, HMMA, the other kinds that matter, and
    non-HMMA instructions per HMMA."""
    found = hot_loop(sass)
    if found is None:
        return "no loop with HMMA"
    n, ops = found
    def count(prefix: str) -> int:
        return sum(v for k, v in ops.items() if k.startswith(prefix))
    hmma = count("HMMA")
    parts = [f"HMMA {hmma}", f"LDSM {count('LDSM')}", f"LDGSTS {count('LDGSTS')}", f"BAR {count('BAR')}",
             f"LDL/STL {count('LDL') + count('STL')}"]
    return f"hot loop: {n} instructions ({', '.join(parts)}); {(n - hmma) / hmma:.2f} other instructions per HMMA"


def _tool(flag: str | None, env: str, name: str) -> str:
    path = flag or os.environ.get(env) or shutil.which(name)
    if not path:
        sys.exit(f"{name} not found: pass it with --{name.lower()} or set {env}")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("expr")
    ap.add_argument("--out", default="/tmp/xk-sass")
    ap.add_argument("--nvrtc")
    ap.add_argument("--nvdisasm")
    ap.add_argument("--mlx-jit", default=os.environ.get("XK_MLX_JIT"))
    ap.add_argument("--cccl", default="/usr/local/cuda/include/cccl")
    ap.add_argument("--cuda-include", default="/usr/local/cuda/include")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--top", type=int, default=14, help="opcodes listed per kernel")
    args = ap.parse_args(argv)

    from cuda_nvrtc_check import Nvrtc

    nvrtc = Nvrtc(_tool(args.nvrtc, "XK_NVRTC", "libnvrtc.so.13"))
    nvdisasm = _tool(args.nvdisasm, "XK_NVDISASM", "nvdisasm")
    ptxas = _tool(None, "XK_PTXAS", "ptxas")
    if not args.mlx_jit:
        sys.exit("--mlx-jit (or XK_MLX_JIT): a folder holding mlx/backend/cuda/device/utils.cuh")
    includes = [args.mlx_jit, args.cccl, args.cuda_include]
    opts = ["--device-as-default-execution-space", f"--gpu-architecture={args.arch.replace('sm_', 'compute_')}",
            *[f"--include-path={p}" for p in includes]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ptx_dir = out / "ptx"
    os.environ["XK_PTX_DIR"] = str(ptx_dir)

    seen = set()
    for rec in record_launches(args.expr):
        kernel, text = rec["kernel"], rec["text"]
        h = hashlib.sha1(text.encode()).hexdigest()[:8]
        if h in seen:
            continue
        seen.add(h)
        stem = f"{rec['name']}_{h}"
        (out / f"{stem}.cu").write_text(text)
        ok, log = nvrtc.compile(text, stem, kernel, opts)
        tmpl = " ".join(re.findall(r"^\s*(?:constexpr \w+|using) (\w+ = [^;]+);", text, flags=re.M)[:16])
        dyn = f" dynamic smem {rec['shared_memory']} bytes" if rec.get("shared_memory") else ""
        print(f"== {rec['name']} [{tmpl}] grid {rec['grid']} threadgroup {rec['threadgroup']}{dyn}")
        if not ok:
            print(log[:4000])
            continue
        cubin = out / f"{stem}.cubin"
        res = subprocess.run([ptxas, f"-arch={args.arch}", "-v", "-o", str(cubin), str(ptx_dir / f"{stem}.ptx")],
                             capture_output=True, text=True)
        older = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", res.stderr)
        if older:  # NVRTC newer than ptxas (pip's nvrtc 13.x beside a 13.0 toolkit): its PTX, relabelled
            ptx_file = ptx_dir / f"{stem}.ptx"
            ptx_file.write_text(re.sub(r"^\.version [\d.]+", f".version {older.group(1)}", ptx_file.read_text(), flags=re.M))
            print(f"  (PTX relabelled .version {older.group(1)} for this ptxas)")
            res = subprocess.run([ptxas, f"-arch={args.arch}", "-v", "-o", str(cubin), str(ptx_file)],
                                 capture_output=True, text=True)
        info = " ".join(line.split("info    : ")[-1].strip() for line in res.stderr.splitlines()
                        if "Used" in line or "spill" in line or "stack" in line)
        print("  ptxas:", info or res.stderr.strip()[:2000])
        if res.returncode:
            continue
        sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True).stdout
        (out / f"{stem}.sass").write_text(sass)
        ops = collections.Counter()
        for line in sass.splitlines():
            m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", line)
            if m:
                ops[m.group(1) + (m.group(2) or "")] += 1
        total = sum(ops.values())
        print(f"  {total} instructions; " + ", ".join(f"{k} {v}" for k, v in ops.most_common(args.top)))
        print("  " + loop_summary(sass))
        print(f"  files: {out / stem}.{{cu,sass}}, {ptx_dir / stem}.ptx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
