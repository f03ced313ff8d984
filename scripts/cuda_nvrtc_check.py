#!/usr/bin/env python3
"""Compile the CUDA backend's kernels with NVRTC without a GPU (no device time).

1. ``record``: runs pytest on the emulator backend and records every kernel launch
   (body, header, buffer names, input dtypes / ranks, output dtypes, template,
   threadgroup) to a JSON file.
2. ``compile``: builds, for every distinct launch, the exact text that
   ``mx.fast.cuda_kernel`` would build (MLX 0.32's ``build_kernel``: its prelude, our
   header, the ``__global__`` signature, the template lines, our source) and compiles it
   with NVRTC using MLX's options (``--device-as-default-execution-space``,
   ``--gpu-architecture=compute_90a``) to PTX. Compile errors are printed with the
   kernel's own file/line names.

Needs libnvrtc (``pip download nvidia-cuda-nvrtc==13.0.*`` and unzip; pass
``--nvrtc``; ``XK_PTX_DIR=dir`` keeps each kernel's PTX), the CUDA headers (``--cuda-include``, default /usr/local/cuda/include),
MLX's JIT headers ``mlx/backend/cuda/device/{utils.cuh,complex.cuh,config.h}``
(``--mlx-jit``: a folder holding that tree) and CCCL (``--cccl``).

    python scripts/cuda_nvrtc_check.py record /tmp/launches.json -- tests/test_norm.py -q
    python scripts/cuda_nvrtc_check.py compile /tmp/launches.json --nvrtc .../libnvrtc.so.13 ...
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_CUDA_TYPES = {
    "bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
    "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double",
}
_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'


def _dtype_name(d) -> str:
    return str(d).split(".")[-1]


# ---------------------------------------------------------------------------- record
def record(out: str, pytest_args: list[str]) -> int:
    import pytest

    from xlstm_kernels.emulate import kernel as ek

    seen: dict[str, dict] = {}
    orig = ek.EmulatedKernel.__call__

    def spy(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, **kw):
        import mlx.core as mx

        arrays = [ek._as_array(v) for v in inputs]
        tmpl = []
        for k, v in template or []:
            if isinstance(v, mx.Dtype):
                tmpl.append([k, "dtype", _dtype_name(v)])
            elif isinstance(v, bool):
                tmpl.append([k, "bool", bool(v)])
            else:
                tmpl.append([k, "int", int(v)])
        rec = {
            "name": self.name, "input_names": self.input_names, "output_names": self.output_names,
            "source": self.source, "header": self.header, "ensure_row_contiguous": self.ensure_row_contiguous,
            "atomic_outputs": self.atomic_outputs,
            "inputs": [[_dtype_name(a.dtype), a.ndim] for a in arrays],
            "output_dtypes": [_dtype_name(d) for d in output_dtypes], "template": tmpl,
            "threads": int(threadgroup[0]) * int(threadgroup[1]) * int(threadgroup[2]),
            # the prologue the cuda backend picks: no bounds check when every grid dimension
            # is a multiple of the threadgroup's
            "exact": all(int(g) % int(t) == 0 for g, t in zip(grid, threadgroup)),
        }
        key = hashlib.sha1(json.dumps(rec, sort_keys=True).encode()).hexdigest()
        seen.setdefault(key, rec)
        return orig(self, inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes, grid=grid,
                    threadgroup=threadgroup, template=template, **kw)

    ek.EmulatedKernel.__call__ = spy
    try:
        rc = pytest.main(["--backend", "emulate", "-p", "no:cacheprovider", *pytest_args])
    finally:
        ek.EmulatedKernel.__call__ = orig
    Path(out).write_text(json.dumps(list(seen.values())))
    print(f"recorded {len(seen)} distinct launches to {out} (pytest exit {int(rc)})")
    return 0


# ---------------------------------------------------------------------------- compile
def mlx_source(rec: dict) -> tuple[str, str]:
    """(kernel name, full text) as mx.fast.cuda_kernel builds it for this launch."""
    from xlstm_kernels.cuda.kernel import CudaKernel, _cluster_size, _min_blocks

    k = CudaKernel(rec["name"], rec["input_names"], rec["output_names"], rec["source"], rec["header"],
                   rec["ensure_row_contiguous"], rec["atomic_outputs"])
    zero_d = [nd == 0 for _, nd in rec["inputs"]]
    exact = bool(rec.get("exact", False))
    ins, outs = k.cuda_names(zero_d, exact_grid=exact)
    source = k.cuda_source(zero_d, tuple(tuple(t) for t in rec["template"]), native_grid=True,
                           exact_grid=exact)
    key = tuple(tuple(t) for t in rec["template"])
    header = k.cuda_header(rec["threads"], _min_blocks(key), _cluster_size(key))
    in_info = [*rec["inputs"]] + ([] if exact else [["int32", 1]])  # + xk_grid on ragged grids
    func = "custom_kernel_" + rec["name"]  # the factory passes no template= (see template_lines)
    text = _DEFAULT_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    text += f"__global__ void {func}(\n"
    for n, (dt, nd) in zip(ins, in_info):
        text += f"    const {_CUDA_TYPES[dt]}* {n},\n"
        if nd > 0:
            if n + "_shape" in source:
                text += f"    const __grid_constant__ Shape {n}_shape,\n"
            if n + "_strides" in source:
                text += f"    const __grid_constant__ Strides {n}_strides,\n"
            if n + "_ndim" in source:
                text += f"    const __grid_constant__ int {n}_ndim,\n"
    for i, (n, dt) in enumerate(zip(outs, rec["output_dtypes"])):
        text += f"    {_CUDA_TYPES[dt]}* {n}" + (",\n" if i < len(outs) - 1 else ") {\n")
    text += source + "\n}\n\n} // namespace mlx::core::cu\n"
    return "mlx::core::cu::" + func, text


class Nvrtc:
    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def compile(self, text: str, name: str, kernel: str, options: list[str]) -> tuple[bool, str]:
        lib = self.lib
        prog = ctypes.c_void_p()
        rc = lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), (name + ".cu").encode(), 0, None, None)
        if rc:
            return False, f"nvrtcCreateProgram: {lib.nvrtcGetErrorString(rc).decode()}"
        lib.nvrtcAddNameExpression(prog, kernel.encode())
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        ptx_dir = os.environ.get("XK_PTX_DIR")
        if rc == 0 and ptx_dir:  # keep the PTX (e.g. to check which instructions a kernel uses)
            n = ctypes.c_size_t()
            lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
            ptx = ctypes.create_string_buffer(n.value + 1)
            lib.nvrtcGetPTX(prog, ptx)
            Path(ptx_dir).mkdir(parents=True, exist_ok=True)
            Path(ptx_dir, name + ".ptx").write_bytes(ptx.value)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return rc == 0, log.value.decode(errors="replace")


_WORKER: dict = {}


def _compile_one(job):
    h, name, kernel, text = job
    nv = _WORKER.get("nv")
    if nv is None:
        nv = _WORKER["nv"] = Nvrtc(_WORKER["path"])
    ok, log = nv.compile(text, f"{name}_{h[:8]}", kernel, _WORKER["opts"])
    return h, name, text, ok, log


def compile_all(path: str, nvrtc: str, includes: list[str], arch: str, limit: int | None, dump: str | None,
                jobs: int = 1) -> int:
    import multiprocessing

    recs = json.loads(Path(path).read_text())
    if limit:
        recs = recs[:limit]
    opts = ["--device-as-default-execution-space", f"--gpu-architecture={arch}",
            *[f"--include-path={p}" for p in includes]]
    texts: dict[str, tuple[str, str, str]] = {}
    for rec in recs:
        kernel, text = mlx_source(rec)
        texts.setdefault(hashlib.sha1(text.encode()).hexdigest(), (rec["name"], kernel, text))
    _WORKER.update(path=nvrtc, opts=opts)
    work = [(h, n, k, t) for h, (n, k, t) in sorted(texts.items(), key=lambda kv: kv[1][0])]
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            results = pool.map(_compile_one, work, chunksize=1)
    else:
        results = [_compile_one(w) for w in work]
    failed = 0
    for h, name, text, ok, log in results:
        if not ok:
            failed += 1
            print(f"FAIL {name} ({h[:8]}):\n{log[:6000]}")
            if dump:
                Path(dump).mkdir(parents=True, exist_ok=True)
                Path(dump, f"{name}_{h[:8]}.cu").write_text(text)
        elif log.strip() and os.environ.get("XK_SHOW_WARNINGS"):
            print(f"warnings {name}:\n{log[:3000]}")
    print(f"{len(texts) - failed} compiled, {failed} failed (of {len(texts)} distinct kernel texts)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out")
    r.add_argument("pytest_args", nargs="*")
    c = sub.add_parser("compile")
    c.add_argument("launches")
    c.add_argument("--nvrtc", required=True)
    c.add_argument("--mlx-jit", required=True, help="folder with mlx/backend/cuda/device/*.cuh")
    c.add_argument("--cuda-include", default="/usr/local/cuda/include")
    c.add_argument("--cccl", default=None)
    c.add_argument("--arch", default="compute_90a")
    c.add_argument("--limit", type=int, default=None)
    c.add_argument("--dump", default=None, help="write failing texts here")
    c.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    if a.cmd == "record":
        return record(a.out, a.pytest_args)
    includes = [a.mlx_jit, *([a.cccl] if a.cccl else []), a.cuda_include]
    return compile_all(a.launches, a.nvrtc, includes, a.arch, a.limit, a.dump, a.jobs)


if __name__ == "__main__":
    raise SystemExit(main())
