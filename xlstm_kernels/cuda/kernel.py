"""``metal_kernel``: MLX's ``mx.fast.metal_kernel`` API on NVIDIA GPUs, through
``mx.fast.cuda_kernel``, running the unchanged Metal bodies of ``metal_src/``.

``mx.fast.cuda_kernel`` wraps a body as::

    <MLX prelude: utils.cuh, cooperative_groups> <header>
    namespace mlx::core::cu {
    __global__ void custom_kernel_<name><template hash>(const T* a, const __grid_constant__ Shape a_shape,
                                                         ..., T* out) {
      constexpr int TM = 64; using T = float; ...      // the template arguments
      <source>
    }}

This factory turns a Metal kernel into that form without touching the body's text
beyond two line-preserving rewrites:

* ``header`` = ``compat.h`` (the MSL subset for CUDA: vector types, ``metal::`` math,
  simd collectives over warp shuffles, ``simdgroup_matrix`` 8x8, atomics, barriers)
  followed by the kernel's own header inside ``namespace mlx::core::cu`` (its
  ``#include <metal_*>`` lines blanked);
* ``threadgroup T a[..];`` declarations in the body become ``__shared__ T a[..];``
  (``threadgroup`` elsewhere, e.g. in pointer types, is an empty macro), and half
  literals ``1.5h`` become ``((half)1.5f)``;
* ``source`` = a prologue, then ``#line 1 "<name>.metal"`` and the body. The prologue
  defines every Metal attribute the body names (``thread_position_in_grid``,
  ``simdgroup_index_in_threadgroup``, ...; substring search as MLX's Metal wrapper) from
  CUDA's indices, references for 0-d inputs (Metal passes ``const constant T& x``,
  cuda_kernel a pointer), ``device atomic<T>*`` views of the outputs with
  ``atomic_outputs``, and makes the threads of the rounded-up CUDA grid that lie
  outside Metal's grid return before the body (Metal dispatches partial edge
  threadgroups; CUDA launches whole blocks).

Launch: the true grid and the threadgroup counts travel in a small int32 input
(``xk_grid``). The blocks form CUDA's own 3-D grid when it fits (<= 65535 blocks in y
and z; then the prologue reads ``blockIdx``), else they are launched along x only and the
prologue recovers the 3-D threadgroup position with two divisions. Each kernel is
compiled with ``__launch_bounds__(threads per threadgroup)`` so that a 1024-thread
threadgroup cannot fail to launch for lack of registers.

Differences from Metal (documented, none used by metal_src/):
* in a partial edge threadgroup of a 2-D / 3-D threadgroup, ``thread_index_in_threadgroup``
  and the simdgroup / lane numbers follow CUDA's warps (linear index over the full
  threadgroup shape), not Metal's compacted numbering;
* ``compile_options`` (math mode) is accepted and ignored: ``metal::`` and
  ``metal::precise::`` use CUDA's accurate functions, ``metal::fast::`` intrinsics;
* float ``simdgroup_matrix`` products run in float32 on the CUDA cores (warp shuffles),
  not on TF32 tensor cores, so they keep Metal's float32 accuracy.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from importlib import resources
from typing import Any, Sequence

import mlx.core as mx

from ..emulate.kernel import _as_array, check_counts, launch_shape
from ..emulate.translate import _TG_DECL, _blank_comments, _c_string, rewrite_half_literals
from . import limits
from .constants import device_array
from .text_files import as_include

__all__ = ["CudaKernel", "CudaKernelError", "metal_kernel", "compat_header", "rewrite_threadgroup_decls",
           "MAX_THREADS_PER_THREADGROUP", "ATTRIBUTES"]

MAX_THREADS_PER_THREADGROUP = 1024
_MAX_GRID_X_THREADS = 2**31 - 1  # MLX's grid argument counts threads, as int32

# Metal attribute -> (type, C++ expression over the prologue's helpers). Emitted when the
# attribute's name occurs in the body (MLX's Metal wrapper does the same search).
ATTRIBUTES: dict[str, tuple[str, str]] = {
    "dispatch_quadgroups_per_threadgroup": ("uint", "(xk_ndisp_ + 3u) / 4u"),
    "dispatch_simdgroups_per_threadgroup": ("uint", "(xk_ndisp_ + 31u) / 32u"),
    "dispatch_threads_per_threadgroup": ("uint3", "uint3(blockDim.x, blockDim.y, blockDim.z)"),
    "grid_origin": ("uint3", "uint3(0u, 0u, 0u)"),
    "grid_size": ("uint3", "xk_g3_"),
    "quadgroup_index_in_threadgroup": ("uint", "xk_tid_ / 4u"),
    "quadgroups_per_threadgroup": ("uint", "(xk_nact_ + 3u) / 4u"),
    "simdgroup_index_in_threadgroup": ("uint", "xk_tid_ / 32u"),
    "simdgroups_per_threadgroup": ("uint", "(xk_nact_ + 31u) / 32u"),
    "thread_execution_width": ("uint", "32u"),
    "thread_index_in_quadgroup": ("uint", "xk_tid_ % 4u"),
    "thread_index_in_simdgroup": ("uint", "xk_tid_ % 32u"),
    "thread_index_in_threadgroup": ("uint", "xk_tid_"),
    "thread_position_in_grid": ("uint3", "xk_tpig_"),
    "thread_position_in_threadgroup": ("uint3", "uint3(threadIdx.x, threadIdx.y, threadIdx.z)"),
    "threadgroup_position_in_grid": ("uint3", "xk_tgp_"),
    "threadgroups_per_grid": ("uint3", "uint3(uint(xk_grid[3]), uint(xk_grid[4]), uint(xk_grid[5]))"),
    "threads_per_grid": ("uint3", "xk_g3_"),
    "threads_per_simdgroup": ("uint", "32u"),
    "threads_per_threadgroup": ("uint3", "xk_tptg_"),
}

# The threadgroup position: the launch's own 3-D block index when the grid fits CUDA's
# limits (y, z <= 65535 blocks), else recovered from a linear block index along x.
_TGP_NATIVE = "const uint3 xk_tgp_ = uint3(blockIdx.x, blockIdx.y, blockIdx.z);"
_TGP_LINEAR = """\
const uint xk_bid_ = blockIdx.x + gridDim.x * blockIdx.y;
const uint3 xk_tgp_ = uint3(xk_bid_ % uint(xk_grid[3]), (xk_bid_ / uint(xk_grid[3])) % uint(xk_grid[4]),
                            xk_bid_ / (uint(xk_grid[3]) * uint(xk_grid[4])));"""
_MAX_GRID_YZ_BLOCKS = 65535

# An exact grid (native 3-D blocks, every dimension a multiple of the threadgroup): every
# CUDA thread is one of Metal's, so the sizes come from CUDA's own registers and the
# prologue neither loads xk_grid nor checks bounds (no global load before the body).
_PROLOGUE_EXACT = """\
const uint3 xk_tgp_ = uint3(blockIdx.x, blockIdx.y, blockIdx.z);
const uint3 xk_tptg_ = uint3(blockDim.x, blockDim.y, blockDim.z);
const uint3 xk_g3_ = uint3(gridDim.x * blockDim.x, gridDim.y * blockDim.y, gridDim.z * blockDim.z);
const uint3 xk_tpig_ = uint3(xk_tgp_.x * blockDim.x + threadIdx.x, xk_tgp_.y * blockDim.y + threadIdx.y,
                             xk_tgp_.z * blockDim.z + threadIdx.z);
const uint xk_tid_ = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
const uint xk_nact_ = blockDim.x * blockDim.y * blockDim.z;
const uint xk_ndisp_ = xk_nact_;
(void)xk_tid_; (void)xk_nact_; (void)xk_ndisp_; (void)xk_tptg_; (void)xk_g3_; (void)xk_tpig_;
"""

_PROLOGUE_HEAD = """\
const uint3 xk_g3_ = uint3(uint(xk_grid[0]), uint(xk_grid[1]), uint(xk_grid[2]));
@TGP@
const uint3 xk_tpig_ = uint3(xk_tgp_.x * blockDim.x + threadIdx.x, xk_tgp_.y * blockDim.y + threadIdx.y,
                             xk_tgp_.z * blockDim.z + threadIdx.z);
if (xk_tpig_.x >= xk_g3_.x || xk_tpig_.y >= xk_g3_.y || xk_tpig_.z >= xk_g3_.z) {
  return;  // outside Metal's grid: this thread does not exist there
}
const uint3 xk_tptg_ = uint3(min(uint(blockDim.x), xk_g3_.x - xk_tgp_.x * blockDim.x),
                             min(uint(blockDim.y), xk_g3_.y - xk_tgp_.y * blockDim.y),
                             min(uint(blockDim.z), xk_g3_.z - xk_tgp_.z * blockDim.z));
const uint xk_tid_ = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
const uint xk_nact_ = xk_tptg_.x * xk_tptg_.y * xk_tptg_.z;
const uint xk_ndisp_ = blockDim.x * blockDim.y * blockDim.z;
(void)xk_tid_; (void)xk_nact_; (void)xk_ndisp_; (void)xk_tptg_;
"""

# mx.Dtype -> the CUDA type MLX's cuda_kernel uses for it (dtype_to_cuda_type).
_CUDA_TYPES = {
    "bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
    "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double",
    "complex64": "mlx::core::cu::complex64_t",
}

_METAL_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<metal_\w+>[^\n]*$", re.M)
_NAME = re.compile(r"^[A-Za-z_]\w*$")


class CudaKernelError(RuntimeError):
    """A kernel that the CUDA backend cannot build or launch as asked."""


# compat.h is always part of a kernel's header; the other parts only when the kernel's text
# (family header + body, comments ignored) matches their pattern. vector_io.h is small and
# always included (the shared metal_src header refers to its helpers).
HEADER_PARTS: tuple[tuple[str, "re.Pattern[str] | None"], ...] = (
    ("compat.h", None),
    ("vector_io.h", None),
    ("simdgroup_matrix.h", re.compile(r"\b(simdgroup_matrix|simdgroup_load|simdgroup_store|simdgroup_multiply"
                                      r"|make_filled_simdgroup_matrix|simdgroup_float8x8|simdgroup_half8x8"
                                      r"|simdgroup_bfloat8x8)\b")),
    ("atomics.h", re.compile(r"\b(atomic|atomic_\w+)\b|\bmemory_order")),
)

# A body calling the asynchronous or bulk copies (the shared header's fallbacks mention the
# asynchronous ones in every family) takes simdgroup_matrix.h too: cp.async(.bulk) there.
_ASYNC_COPY = re.compile(r"\bxk_(async|bulk)_\w+")

# C/C++ comments (removed) or string / char literals (kept, so asm("...") survives).
_COMMENT_OR_LITERAL = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def strip_comments(text: str) -> str:
    """C++ text without comments, blank lines and indentation (same meaning, fewer bytes).

    MLX hashes the whole kernel text on every launch (the JIT module's name), so every
    byte of header costs host time per call."""
    text = _COMMENT_OR_LITERAL.sub(lambda m: m.group(0) if m.group(0)[0] in "\"'" else " ", text)
    lines = (ln.strip() for ln in text.split("\n"))
    return "\n".join(ln for ln in lines if ln) + "\n"


def compact_keep_lines(text: str) -> str:
    """`text` without comments and without each line's outer whitespace, every line kept
    (so that ``#line`` numbering and compiler messages still point at the .metal source):
    the family header and the body, which MLX copies and hashes on every launch."""
    text = _COMMENT_OR_LITERAL.sub(lambda m: m.group(0) if m.group(0)[0] in "\"'" else "\n" * m.group(0).count("\n"),
                                   text)
    return "\n".join(ln.strip() for ln in text.split("\n"))


@functools.lru_cache(maxsize=None)
def header_part(name: str, stripped: bool = True) -> str:
    """The text of one header file of this package (``compat.h``, ...), comments stripped."""
    text = resources.files(__package__).joinpath(name).read_text()
    return strip_comments(text) if stripped else text


# Header parts are passed as `#include "<absolute path>"` lines when the package's files
# are on disk (NVRTC reads them itself), and the rest of a launch's header and source (the
# family header, the prologue and the body) as one include line each of a content-named
# file (text_files.as_include): the kernel text that MLX copies and hashes on every launch
# is then a few hundred bytes (~60 KB inline, ~12 KB with the parts included).
# INCLUDE_HEADERS = False (or XLSTM_KERNELS_CUDA_INLINE_HEADERS=1) pastes every text instead.
INCLUDE_HEADERS = os.environ.get("XLSTM_KERNELS_CUDA_INLINE_HEADERS", "").strip() not in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def _include_line(name: str) -> str | None:
    """``#include "<path>"`` of a header part, or None when it is not a plain file on disk."""
    try:
        path = os.path.abspath(os.fspath(resources.files(__package__).joinpath(name)))
    except TypeError:  # not a filesystem resource (zip import)
        return None
    if not os.path.isfile(path) or any(c in path for c in '"\\\n'):
        return None
    return f'#include "{path}"\n'


def header_part_text(name: str) -> str:
    """What the kernel text carries for one header part: an include line, else its text."""
    if INCLUDE_HEADERS:
        line = _include_line(name)
        if line is not None:
            return line
    return header_part(name)


def compat_header(stripped: bool = False) -> str:
    """Every header part, in order (the full MSL subset; `stripped`: without comments)."""
    return "".join(header_part(name, stripped) for name, _ in HEADER_PARTS)


def rewrite_threadgroup_decls(body: str) -> str:
    """``threadgroup T a[..], b;`` declarations -> ``__shared__ T a[..], b;`` (same lines).

    Uses the emulator's declaration pattern (comments and strings ignored); pointer
    declarations (``threadgroup float* p = ...``) are left to the empty macro.
    """
    masked = _blank_comments(body)
    out, last = [], 0
    for m in _TG_DECL.finditer(masked):
        if not _TG_DECL.match(body, m.start(), m.end()):
            continue
        out.append(body[last : m.start()])
        out.append("__shared__")
        last = m.start() + len("threadgroup")
    out.append(body[last:])
    return "".join(out)




def _blank_metal_includes(header: str) -> str:
    return _METAL_INCLUDE.sub("", header)


def _blank_comments_only(text: str) -> str:
    """`text` with its comments blanked (string literals kept): what header patterns search."""
    return _COMMENT_OR_LITERAL.sub(lambda m: m.group(0) if m.group(0)[0] in "\"'" else " ", text)






class CudaKernel:
    """A Metal kernel body compiled for CUDA; call it like ``mx.fast.metal_kernel``'s result."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
        compile_options: dict | None = None,
    ) -> None:
        if not _NAME.match(name):
            raise ValueError(f"[metal_kernel] kernel name {name!r} is not an identifier")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        if not self.output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        for n in [*self.input_names, *self.output_names]:
            if not _NAME.match(n) or n.startswith("xk_"):
                raise ValueError(f"[metal_kernel] buffer name {n!r} is not an identifier (or uses the xk_ prefix)")
        self.source = source
        self.header = header
        self.ensure_row_contiguous = bool(ensure_row_contiguous)
        self.atomic_outputs = bool(atomic_outputs)
        if compile_options is not None and not isinstance(compile_options, dict):
            raise ValueError("[metal_kernel] Expected `compile_options` to be a dict.")
        self.compile_options = dict(compile_options or {})
        self._body = compact_keep_lines(rewrite_half_literals(rewrite_threadgroup_decls(source)))
        self._family_header = compact_keep_lines(rewrite_half_literals(_blank_metal_includes(header)))
        self._objects: dict[tuple, Any] = {}
        self._plans: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    # -- generated text ------------------------------------------------------------
    def cuda_names(self, zero_d: Sequence[bool], exact_grid: bool = False) -> tuple[list[str], list[str]]:
        """Buffer names handed to cuda_kernel (0-d inputs and atomic outputs renamed).
        `exact_grid`: an exact native grid, whose prologue reads only CUDA's registers,
        takes no ``xk_grid`` input (one array less to make and hand over per launch)."""
        ins = [f"xk_s_{n}" if z else n for n, z in zip(self.input_names, zero_d)]
        if not exact_grid:
            ins.append("xk_grid")
        outs = [f"xk_a_{n}" if self.atomic_outputs else n for n in self.output_names]
        return ins, outs

    def cuda_header(self, threads: int, min_blocks: int = 0, cluster: int = 1) -> str:
        """The ``header`` given to cuda_kernel; `min_blocks` > 0 (the template's
        ``XK_MIN_BLOCKS``) adds the occupancy hint of ``__launch_bounds__``, `cluster` > 1
        (the template's ``XK_CLUSTER``) the kernel's ``__cluster_dims__(cluster, 1, 1)``."""
        parts = [f"#define XK_MAX_THREADS {int(threads)}\n"]
        if min_blocks > 0:
            parts.append(f"#define XK_LAUNCH_MIN_BLOCKS {int(min_blocks)}\n")
        if cluster > 1:
            parts.append(f"#define XK_CLUSTER_DIMS {int(cluster)}\n")
        code = _blank_comments_only(self._family_header + "\n" + self._body)
        body = _blank_comments_only(self._body)
        for name, pattern in HEADER_PARTS:
            if (pattern is None or pattern.search(code) or (name == "atomics.h" and self.atomic_outputs)
                    or (name == "simdgroup_matrix.h" and _ASYNC_COPY.search(body))):
                parts.append(header_part_text(name))
        parts.append("namespace mlx::core::cu {\n")
        if self._family_header:
            parts += [f"#line 1 {_c_string(self.name + '.header.metal')}\n", self._family_header]
            if not self._family_header.endswith("\n"):
                parts.append("\n")
        parts.append("}  // namespace mlx::core::cu\n")
        return "".join(parts)

    def cuda_source(self, zero_d: Sequence[bool], template_key: tuple = (), native_grid: bool = False,
                    exact_grid: bool = False) -> str:
        """The ``source`` given to cuda_kernel: template definitions, prologue, body.
        `native_grid`: launched with a 3-D grid of blocks (else blocks along x only)."""
        lines = template_lines(template_key)
        if exact_grid and native_grid:
            head = _PROLOGUE_EXACT
        else:
            head = _PROLOGUE_HEAD.replace("@TGP@", _TGP_NATIVE if native_grid else _TGP_LINEAR)
        lines += ["// xlstm_kernels.cuda prologue: Metal attributes from CUDA indices", head]
        for n, z in zip(self.input_names, zero_d):
            if z:
                lines.append(f"const auto {n} = xk_s_{n}[0];")
        if self.atomic_outputs:
            for n in self.output_names:
                lines.append(f"auto* {n} = xk_as_atomic(xk_a_{n});")
        for attr, (ty, expr) in ATTRIBUTES.items():
            if attr in self.source:
                if attr == "threadgroups_per_grid" and native_grid:  # the launch's own block counts
                    expr = "uint3(gridDim.x, gridDim.y, gridDim.z)"
                lines.append(f"{ty} {attr} = {expr}; (void){attr};")
        lines.append(f"#line 1 {_c_string(self.name + '.metal')}")
        return "\n".join(lines) + "\n" + self._body + "\n"

    def _object(self, zero_d: tuple[bool, ...], threads: int, template: tuple, native_grid: bool,
                exact_grid: bool = False, shared_memory: int = 0) -> Any:
        key = (zero_d, threads, template, native_grid, exact_grid, shared_memory)
        with self._lock:
            obj = self._objects.get(key)
        if obj is not None:
            return obj
        ins, outs = self.cuda_names(zero_d, exact_grid and native_grid)
        source = self.cuda_source(zero_d, template, native_grid, exact_grid)
        header = self.cuda_header(threads, _min_blocks(template), _cluster_size(template))
        if INCLUDE_HEADERS:  # MLX hashes the text per launch: hand it one #include line each
            # cuda_kernel passes an input's shape / strides / ndim when its name + "_shape"
            # (...) occurs in the source text: the short text names the ones the body uses
            uses = [n + suffix for n in ins for suffix in ("_shape", "_strides", "_ndim") if n + suffix in source]
            short = as_include(source, f"{self.name}.source")
            if short is not source:
                source = (f"// uses {' '.join(uses)}\n" if uses else "") + short
            header = as_include(header, f"{self.name}.header")
        obj = mx.fast.cuda_kernel(
            name=self.name,
            input_names=ins,
            output_names=outs,
            source=source,
            header=header,
            ensure_row_contiguous=self.ensure_row_contiguous,
            # dynamic shared memory of every launch (XK_THREADGROUP_DYNAMIC); MLX raises the
            # kernel's limit (cudaFuncAttributeMaxDynamicSharedMemorySize) above 48 KB itself
            **({"shared_memory": int(shared_memory)} if shared_memory else {}),
        )
        with self._lock:
            return self._objects.setdefault(key, obj)

    # -- launch ----------------------------------------------------------------------
    def __call__(
        self,
        *,
        inputs: Sequence[Any],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        grid: Sequence[int],
        threadgroup: Sequence[int],
        template: Sequence[tuple[str, Any]] | None = None,
        init_value: float | None = None,
        verbose: bool = False,
        stream: Any = None,
        shared_memory: int = 0,
    ) -> list[mx.array]:
        """Run the kernel; the keywords of ``mx.fast.metal_kernel``'s callable (``grid``
        counts threads), plus `shared_memory`: bytes of dynamic shared memory (the buffer
        a body takes through ``XK_THREADGROUP_DYNAMIC``; 0: none)."""
        inputs = list(inputs)
        check_counts(self.input_names, self.output_names, inputs, output_shapes, output_dtypes)
        arrays = [v if isinstance(v, mx.array) else _as_array(v) for v in inputs]
        zero_d = tuple([a.ndim == 0 for a in arrays])
        try:  # the launch plan of this (grid, threadgroup, template, 0-d inputs), if seen before
            key = (tuple(grid), tuple(threadgroup), zero_d,
                   tuple([(k, v, v.__class__) for k, v in template]) if template else (), shared_memory)
            plan = self._plans.get(key)
        except TypeError:  # unhashable arguments: checked (and refused) by _plan below
            key, plan = None, None
        if plan is None:
            plan = self._plan(grid, threadgroup, template, zero_d, shared_memory)
            if key is not None:
                with self._lock:
                    if len(self._plans) > 4096:
                        self._plans.clear()
                    self._plans[key] = plan
        shapes = [tuple(int(d) for d in s) for s in output_shapes]
        dtypes = list(output_dtypes)
        if plan is _EMPTY:  # Metal dispatches nothing: outputs keep init_value (else undefined)
            fill = 0.0 if init_value is None else init_value
            return [mx.full(s, fill, dtype=d) for s, d in zip(shapes, dtypes)]
        obj, grid_arg, launch_grid, block = plan
        kwargs: dict[str, Any] = {}
        if init_value is not None:
            kwargs["init_value"] = init_value
        if stream is not None:
            kwargs["stream"] = stream
        return obj(
            inputs=arrays if grid_arg is None else [*arrays, grid_arg],
            output_shapes=shapes,
            output_dtypes=dtypes,
            grid=launch_grid,
            threadgroup=block,
            verbose=bool(verbose),
            **kwargs,
        )

    def prepare(self, *, zero_d: Sequence[bool], output_shapes: Sequence[Sequence[int]],
                output_dtypes: Sequence[mx.Dtype], grid: Sequence[int], threadgroup: Sequence[int],
                template: Sequence[tuple[str, Any]] | None = None, init_value: float | None = None,
                shared_memory: int = 0):
        """A function ``run(inputs) -> outputs`` for repeated launches of one signature
        (`zero_d[i]`: input i is 0-d); the arguments are checked once, here."""
        if len(zero_d) != len(self.input_names):
            raise ValueError(f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)} "
                             f"but got size {len(zero_d)}.")
        if not (len(output_shapes) == len(output_dtypes) == len(self.output_names)):
            raise ValueError(f"[metal_kernel] Expected `output_shapes` and `output_dtypes` to have size "
                             f"{len(self.output_names)}.")
        plan = self._plan(grid, threadgroup, template, tuple(bool(z) for z in zero_d), shared_memory)
        shapes = [tuple(int(d) for d in s) for s in output_shapes]
        dtypes = list(output_dtypes)
        if plan is _EMPTY:
            fill = 0.0 if init_value is None else init_value
            return lambda inputs: [mx.full(s, fill, dtype=d) for s, d in zip(shapes, dtypes)]
        obj, grid_arg, launch_grid, block = plan
        kwargs: dict[str, Any] = {"output_shapes": shapes, "output_dtypes": dtypes, "grid": launch_grid,
                                  "threadgroup": block}
        if init_value is not None:
            kwargs["init_value"] = init_value

        if grid_arg is None:  # an exact grid: the inputs as they are
            def run(inputs: Sequence[mx.array]) -> list[mx.array]:
                return obj(inputs=inputs, **kwargs)
        else:
            def run(inputs: Sequence[mx.array]) -> list[mx.array]:
                return obj(inputs=[*inputs, grid_arg], **kwargs)

        return run

    def _plan(self, grid: Sequence[int], threadgroup: Sequence[int], template, zero_d: tuple[bool, ...],
              shared_memory: int = 0):
        """(cuda_kernel object, xk_grid input (None for an exact grid), CUDA grid in threads, block) of one launch
        signature, or _EMPTY for an empty grid; checks the arguments as Metal's wrapper does."""
        shared_memory = int(shared_memory)
        most = limits.shared_bytes_per_block()
        if not 0 <= shared_memory <= most:
            raise CudaKernelError(f"[{self.name}] shared_memory={shared_memory}: expected 0 to {most} bytes (the "
                                  f"dynamic shared memory a block may have on this GPU, {limits.architecture()})")
        g, t, n_threads = launch_shape(grid, threadgroup)
        template_key = _template_key(template)
        if 0 in g:
            return _EMPTY
        block = tuple(min(a, b) for a, b in zip(t, g))
        counts = tuple(-(-gg // bb) for gg, bb in zip(g, block))
        total = counts[0] * counts[1] * counts[2]
        native = counts[1] <= _MAX_GRID_YZ_BLOCKS and counts[2] <= _MAX_GRID_YZ_BLOCKS
        if native and counts[0] * block[0] > _MAX_GRID_X_THREADS:
            native = False
        if native:
            launch_grid = tuple(c * b for c, b in zip(counts, block))
        else:
            # the threadgroups as one linear index (xk_bid_ in the prologue) over blocks along x,
            # then y: MLX's grid counts threads in int32, so x holds at most 2**31 - 1 threads;
            # blocks past the last threadgroup decompose beyond Metal's grid and return
            bx = min(total, _MAX_GRID_X_THREADS // block[0])
            by = -(-total // bx)
            if by > _MAX_GRID_YZ_BLOCKS or bx * by >= 2**32:
                raise CudaKernelError(f"[{self.name}] grid {g} with threadgroup {t} needs {total} threadgroups: "
                                      f"more than CUDA can launch ({_MAX_GRID_X_THREADS // block[0]} x "
                                      f"{_MAX_GRID_YZ_BLOCKS} blocks of {block[0]} x {block[1]} x {block[2]})")
            launch_grid = (bx * block[0], by * block[1], block[2])
        cluster = _cluster_size(template_key)
        if cluster > 1:
            if not native:
                raise CudaKernelError(f"[{self.name}] grid {g} with threadgroup {t}: template {CLUSTER_TEMPLATE}="
                                      f"{cluster} needs CUDA's own 3-D grid of blocks (at most "
                                      f"{_MAX_GRID_YZ_BLOCKS} threadgroups in y and z)")
            if counts[0] % cluster:
                raise ValueError(f"[metal_kernel] template {CLUSTER_TEMPLATE}={cluster}: the threadgroups along x "
                                 f"({counts[0]}, grid {g}, threadgroup {t}) must be a multiple of the cluster size")
            if not limits.has_clusters():
                raise CudaKernelError(f"[{self.name}] template {CLUSTER_TEMPLATE}={cluster}: threadgroup clusters "
                                      f"need sm_90 or newer, this GPU is {limits.architecture()}")
        exact = native and all(gg % bb == 0 for gg, bb in zip(g, block))
        obj = self._object(zero_d, n_threads, template_key, native, exact, shared_memory)
        grid_arg = None if exact else device_array([*g, *counts], mx.int32)
        return obj, grid_arg, launch_grid, block


_EMPTY = object()  # the plan of a launch with an empty grid


MIN_BLOCKS_TEMPLATE = "XK_MIN_BLOCKS"


def _min_blocks(key: tuple) -> int:
    """The occupancy hint of a template key: the int ``XK_MIN_BLOCKS`` (resident blocks
    per SM that ``__launch_bounds__`` asks of ptxas), 0 when absent. A template argument
    so that it reaches every backend unchanged; bodies never read it (on Metal and in the
    emulator it is an unused constant)."""
    for name, kind, v in key:
        if name == MIN_BLOCKS_TEMPLATE:
            if kind != "int" or not 1 <= v <= 32:
                raise ValueError(f"[metal_kernel] template {MIN_BLOCKS_TEMPLATE}={v!r}: expected an int from 1 to 32 "
                                 "(resident threadgroups per SM)")
            return v
    return 0


CLUSTER_TEMPLATE = "XK_CLUSTER"
#: The largest cluster CUDA launches without an opt-in (cudaFuncAttributeNonPortableClusterSizeAllowed,
#: which MLX's launch does not set).
MAX_CLUSTER = 8


def _cluster_size(key: tuple) -> int:
    """The cluster size of a template key: the int ``XK_CLUSTER`` (threadgroups along x that
    run together and share their threadgroup memory, ``metal_src/_cluster.metal``), 1 when
    absent. Bodies read it (they sync and merge across the cluster)."""
    for name, kind, v in key:
        if name == CLUSTER_TEMPLATE:
            if kind != "int" or not 1 <= v <= MAX_CLUSTER:
                raise ValueError(f"[metal_kernel] template {CLUSTER_TEMPLATE}={v!r}: expected an int from 1 to "
                                 f"{MAX_CLUSTER} (threadgroups a cluster)")
            return v
    return 1


def _template_key(template: Sequence[tuple[str, Any]] | None) -> tuple:
    out = []
    for k, v in template or ():
        if isinstance(v, mx.Dtype):
            out.append((str(k), "dtype", str(v).split(".")[-1]))
        elif isinstance(v, bool):
            out.append((str(k), "bool", bool(v)))
        elif isinstance(v, int):
            out.append((str(k), "int", int(v)))
        else:
            raise ValueError(f"[metal_kernel] template argument {k!r} must be a bool, int or Dtype, got {v!r}")
        if not _NAME.match(str(k)):
            raise ValueError(f"[metal_kernel] template argument name {k!r} is not an identifier")
    return tuple(out)


def template_lines(key: tuple) -> list[str]:
    """Body-local definitions of the template arguments (what cuda_kernel would emit).

    `key` is ``_template_key(template)``. The factory emits these lines itself instead
    of passing ``template=`` to cuda_kernel:
    MLX names the CUDA function after the values (``_-2`` for -2 is no identifier),
    while here they only change the source, which MLX hashes into the module name.
    """
    lines = []
    for name, kind, v in key:
        if kind == "int":
            lines.append(f"constexpr int {name} = {v};")
        elif kind == "bool":
            lines.append(f"constexpr bool {name} = {'true' if v else 'false'};")
        else:
            if v not in _CUDA_TYPES:
                raise ValueError(f"[metal_kernel] template dtype {v} has no CUDA type")
            lines.append(f"using {name} = {_CUDA_TYPES[v]};")
    return lines


def metal_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
    compile_options: dict | None = None,
) -> CudaKernel:
    """Drop-in for ``mx.fast.metal_kernel`` that runs the Metal body on an NVIDIA GPU
    through ``mx.fast.cuda_kernel`` (same arguments; ``compile_options`` is ignored)."""
    return CudaKernel(name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs,
                      compile_options)
