"""``metal_kernel``: MLX's ``mx.fast.metal_kernel`` API, executed on the CPU.

The returned object builds the same kernel text MLX builds, compiles it against the
MSL shim, and runs every Metal thread as a fiber (see ``csrc/runtime.cpp``), so
barriers and simd collectives behave as on the GPU and the classic kernel bugs are
reported instead of returning plausible numbers:

* outputs and threadgroup memory start poisoned (NaN bytes) unless ``init_value``;
  an output element that no thread wrote raises :class:`EmulatorError`;
* threads that return while others wait at a barrier, or that wait at different
  barriers, raise (never hang);
* more than 32 KiB of threadgroup memory, or more than 1024 threads per
  threadgroup, raise before launch;
* ``check_bounds=True`` puts every buffer against a guard page and checks indexes
  of fixed-size arrays, so out-of-bounds reads and writes name the buffer, the
  element and the thread;
* ``schedule=`` runs threads in sequential, reverse or seeded random order;
  :func:`check_schedules` runs them all and demands bit-identical outputs;
* a kernel whose template list has the int ``XK_CLUSTER`` = C (1..8) runs in
  threadgroup clusters of C consecutive threadgroups along x, as CUDA's
  ``__cluster_dims__(C, 1, 1)`` on Hopper: ``xk_cluster_sync()`` and
  ``xk_cluster_peer(p, rank)`` (``metal_src/_cluster.metal``) work natively; the
  schedules let one threadgroup run ahead of its peers up to a cluster sync, a peer's
  memory read after its threads returned faults, and a grid whose threadgroup count
  along x is not a multiple of C raises ``ValueError`` before launch.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from . import signature as sig
from .compiler import EmulatorCompileError, compile_shared, csrc_dir
from .translate import translate

__all__ = ["EmulatorError", "EmulatedKernel", "metal_kernel", "check_schedules", "MAX_THREADGROUP_MEMORY"]

MAX_THREADGROUP_MEMORY = 32 * 1024
# A launch given `shared_memory` models a CUDA launch (the body's buffer is the launch's
# dynamic shared memory there): its limit is that many bytes, up to sm_90's 227 KiB.
MAX_CUDA_SHARED_MEMORY = 232448
MAX_THREADS_PER_THREADGROUP = 1024
SCHEDULES = {"sequential": 0, "reverse": 1, "random": 2}
#: The template argument that makes a launch one of threadgroup clusters, and the most
#: threadgroups a cluster may have (XK_CLUSTER_MAX of csrc/msl_sync.h; CUDA's portable limit).
CLUSTER_TEMPLATE = "XK_CLUSTER"
MAX_CLUSTER = 8
#: xk_abi_version() of csrc/runtime.cpp, whose LaunchDesc _LaunchDesc mirrors.
_RUNTIME_ABI = 2
_MATH_MODES = {"safe": (), "relaxed": ("-fno-math-errno", "-fno-trapping-math"), "fast": ("-ffast-math",)}


class EmulatorError(RuntimeError):
    """A kernel misbehaved in the emulator (race symptom, divergence, out-of-bounds...)."""


# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------
_NP_DTYPES = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,  # raw bits; NumPy has no bfloat16
    mx.int8: np.int8,
    mx.int16: np.int16,
    mx.int32: np.int32,
    mx.int64: np.int64,
    mx.uint8: np.uint8,
    mx.uint16: np.uint16,
    mx.uint32: np.uint32,
    mx.uint64: np.uint64,
    mx.bool_: np.bool_,
}
_FLOATING = (mx.float32, mx.float16, mx.bfloat16)
_CANARY = 0xA5


def _np_dtype(dtype: mx.Dtype, what: str) -> Any:
    try:
        return _NP_DTYPES[dtype]
    except KeyError:
        raise TypeError(
            f"{what}: dtype {dtype} is not supported by the Metal emulator "
            f"(supported: {', '.join(str(d) for d in _NP_DTYPES)})"
        ) from None


def _to_host(x: mx.array, contiguous: bool) -> np.ndarray:
    """The array's data as NumPy (bfloat16 as uint16 bits), sharing layout semantics."""
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    a = np.asarray(x)
    if contiguous or a.size == 0 or a.flags.c_contiguous:
        a = _aligned(a)
    return a


BUFFER_ALIGNMENT = 64  # Metal buffers are at least this aligned; MLX's CPU arrays may be only 8


def _aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a BUFFER_ALIGNMENT boundary."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(nbytes + BUFFER_ALIGNMENT, dtype=np.uint8)
    off = (-raw.__array_interface__["data"][0]) % BUFFER_ALIGNMENT
    return raw[off : off + nbytes].view(dt).reshape(shape)


def _aligned(a: np.ndarray) -> np.ndarray:
    """`a` itself if contiguous and aligned like a Metal buffer, else an aligned copy."""
    if a.flags.c_contiguous and a.__array_interface__["data"][0] % BUFFER_ALIGNMENT == 0:
        return a
    out = _aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def _from_host(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    if dtype == mx.bfloat16:
        out = out.view(mx.bfloat16)
    return out


# ---------------------------------------------------------------------------
# The runtime library
# ---------------------------------------------------------------------------
class _Region(ctypes.Structure):
    _fields_ = [
        ("lo", ctypes.c_void_p),
        ("hi", ctypes.c_void_p),
        ("guard_lo", ctypes.c_void_p),
        ("guard_hi", ctypes.c_void_p),
        ("name", ctypes.c_char_p),
        ("elem_size", ctypes.c_uint32),
        ("pad_", ctypes.c_uint32),
    ]


class _LaunchDesc(ctypes.Structure):
    _fields_ = [
        ("entry", ctypes.c_void_p),
        ("buffers", ctypes.POINTER(ctypes.c_void_p)),
        ("grid", ctypes.c_uint32 * 3),
        ("group", ctypes.c_uint32 * 3),
        ("schedule", ctypes.c_uint32),
        ("workers", ctypes.c_uint32),
        ("seed", ctypes.c_uint64),
        ("tg_bytes", ctypes.c_uint64),
        ("stack_bytes", ctypes.c_uint64),
        ("n_regions", ctypes.c_uint32),
        ("cluster", ctypes.c_uint32),  # threadgroups per cluster along x (XK_CLUSTER); 0 or 1: none
        ("regions", ctypes.POINTER(_Region)),
    ]


@functools.lru_cache(maxsize=None)
def _runtime() -> ctypes.CDLL:
    source = (csrc_dir() / "runtime.cpp").read_text()
    path = compile_shared(source, name="xk_runtime", opt="-O2", extra_flags=("-pthread",))
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    lib.xk_abi_version.restype = ctypes.c_int
    if lib.xk_abi_version() != _RUNTIME_ABI:
        raise EmulatorCompileError(
            f"the emulator runtime {path} has ABI version {lib.xk_abi_version()}, expected {_RUNTIME_ABI} "
            "(a stale build: clear the emulator cache, XLSTM_KERNELS_EMULATE_CACHE)"
        )
    lib.xk_launch.argtypes = [ctypes.POINTER(_LaunchDesc), ctypes.c_char_p, ctypes.c_size_t]
    lib.xk_launch.restype = ctypes.c_int
    lib.xk_guarded_alloc.argtypes = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    lib.xk_guarded_alloc.restype = ctypes.c_void_p
    lib.xk_guarded_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.xk_guarded_free.restype = None
    lib.xk_page_size.restype = ctypes.c_size_t
    return lib


@dataclass
class _Compiled:
    lib: ctypes.CDLL
    entry: int
    tg_bytes: int
    tu: Any


_compiled: dict[tuple, _Compiled] = {}
_compiled_lock = threading.Lock()


def _build(gen: sig.GeneratedKernel, display: str, math_mode: str, check_bounds: bool) -> _Compiled:
    key = (gen.source, math_mode, check_bounds)
    with _compiled_lock:
        hit = _compiled.get(key)
    if hit is not None:
        return hit
    _runtime()  # its symbols must be global before a kernel library is loaded
    tu = translate(gen, display)
    flags = list(_MATH_MODES[math_mode])
    if check_bounds:
        flags += ["-DXK_CHECK_BOUNDS", "-fsanitize=bounds", "-fno-sanitize-recover=bounds"]
    path = compile_shared(
        tu.text,
        name=gen.name,
        opt="-O0" if check_bounds else "-O1",
        extra_flags=tuple(flags),
        # Link without the sanitizer runtime, and without crtfastmath.o: a -ffast-math
        # shared library would otherwise switch the whole process to flush-to-zero.
        two_step=check_bounds or math_mode == "fast",
    )
    lib = ctypes.CDLL(str(path))
    lib.xk_tg_total.restype = ctypes.c_uint
    lib.xk_tg_size.restype = ctypes.c_uint
    lib.xk_tg_size.argtypes = [ctypes.c_int]
    entry = ctypes.cast(lib.xk_entry, ctypes.c_void_p).value
    compiled = _Compiled(lib, entry, int(lib.xk_tg_total()), tu)
    with _compiled_lock:
        _compiled.setdefault(key, compiled)
    return compiled


def _threadgroup_report(c: _Compiled) -> str:
    rows = [
        f"  {d.name}: {d.type}{d.dims} = {c.lib.xk_tg_size(d.id)} bytes (line {d.line})"
        for d in c.tu.threadgroup_decls
    ]
    return "\n".join(rows)


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a positive integer") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r}: expected a positive integer")
    return value


def _triple(value: Any, what: str) -> tuple[int, int, int]:
    try:
        t = tuple(int(v) for v in value)
    except TypeError:
        raise TypeError(f"[metal_kernel] `{what}` must be a 3-tuple of ints, got {value!r}") from None
    if len(t) != 3 or any(v < 0 for v in t):
        raise ValueError(f"[metal_kernel] `{what}` must be a 3-tuple of non-negative ints, got {value!r}")
    return t  # type: ignore[return-value]


def check_counts(input_names, output_names, inputs, output_shapes, output_dtypes) -> None:
    """MLX's errors for a launch with the wrong number of inputs / output shapes / dtypes."""
    for what, actual, expected in (
        ("inputs", len(inputs), len(input_names)),
        ("output_shapes", len(output_shapes), len(output_names)),
        ("output_dtypes", len(output_dtypes), len(output_names)),
    ):
        if actual != expected:
            raise ValueError(f"[metal_kernel] Expected `{what}` to have size {expected} but got size {actual}.")


def launch_shape(grid: Any, threadgroup: Any) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """(grid, threadgroup, threads per threadgroup) checked as MLX's Metal wrapper does."""
    g = _triple(grid, "grid")
    t = _triple(threadgroup, "threadgroup")
    if 0 in t:
        raise ValueError(f"[metal_kernel] `threadgroup` must be positive, got {tuple(threadgroup)!r}")
    n_threads = t[0] * t[1] * t[2]
    if n_threads > MAX_THREADS_PER_THREADGROUP:
        raise ValueError(
            f"Thread group size ({n_threads}) is greater than the maximum allowed threads per "
            f"threadgroup ({MAX_THREADS_PER_THREADGROUP})."
        )
    return g, t, n_threads


def cluster_size(name: str, template_args: Sequence[tuple[str, Any]], grid: Sequence[int],
                 group: Sequence[int]) -> int:
    """Threadgroups per cluster of a launch: the template int ``XK_CLUSTER`` (1 without it).

    Args:
        name: the kernel's name, for messages.
        template_args: the launch's template arguments.
        grid, group: the launch's grid (threads) and threadgroup size.

    Raises:
        ValueError: ``XK_CLUSTER`` is not an int in 1..MAX_CLUSTER, or the launch's number
            of threadgroups along x is not a multiple of it.
    """
    value = dict(template_args).get(CLUSTER_TEMPLATE)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CLUSTER:
        raise ValueError(
            f"[{name}] template {CLUSTER_TEMPLATE}={value!r}: expected an int in 1..{MAX_CLUSTER} "
            f"(threadgroups per cluster; XK_CLUSTER_MAX is {MAX_CLUSTER} in the emulator)"
        )
    groups_x = -(-grid[0] // group[0]) if group[0] else 0
    if groups_x % value:
        raise ValueError(
            f"[{name}] template {CLUSTER_TEMPLATE}={value}: the grid {tuple(grid)} (threads) with threadgroup "
            f"{tuple(group)} has {groups_x} threadgroups along x, not a multiple of {value}; expected "
            f"threadgroups_per_grid.x to be a multiple of {CLUSTER_TEMPLATE} (clusters of {value} consecutive "
            "threadgroups along x)"
        )
    return value



# ---------------------------------------------------------------------------
# The kernel object
# ---------------------------------------------------------------------------
class EmulatedKernel:
    """A callable with ``mx.fast.metal_kernel``'s call signature, run on the CPU."""

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
    ):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = bool(ensure_row_contiguous)
        self.atomic_outputs = bool(atomic_outputs)
        self.math_mode = _parse_compile_options(compile_options)

    def generate(self, inputs: Sequence[Any], output_dtypes: Sequence[mx.Dtype], template=None) -> sig.GeneratedKernel:
        """The kernel text MLX would build for these inputs (no compilation)."""
        arrays = [_as_array(v) for v in inputs]
        specs = [sig.InputSpec(n, a.dtype, a.ndim, a.size) for n, a in zip(self.input_names, arrays)]
        return sig.generate(
            self.name,
            self.input_names,
            self.output_names,
            self.source,
            self.header,
            specs,
            list(output_dtypes),
            template or None,
            self.atomic_outputs,
        )

    def __call__(
        self,
        *,
        inputs: Sequence[Any],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: Sequence[tuple[str, Any]] | None = None,
        init_value: float | None = None,
        verbose: bool = False,
        stream: Any = None,
        schedule: str = "sequential",
        seed: int = 0,
        check_bounds: bool = False,
        check_unwritten: bool = True,
        workers: int | None = None,
        shared_memory: int = 0,
    ) -> list[mx.array]:
        """Run the kernel; MLX's keywords plus the emulator-only ones.

        Args:
            inputs, output_shapes, output_dtypes, grid, threadgroup, template,
                init_value, verbose, stream: as for ``mx.fast.metal_kernel``
                (``grid`` counts threads; ``stream`` is accepted and ignored). An int
                ``XK_CLUSTER`` = C in ``template`` runs the launch in threadgroup clusters
                of C (1..8) consecutive threadgroups along x (see the module docstring).
            schedule: ``"sequential"``, ``"reverse"`` or ``"random"`` thread order.
            seed: seeds the ``"random"`` schedule (per threadgroup).
            check_bounds: guard pages behind every buffer and index checks on
                fixed-size arrays (slower: builds at -O0).
            check_unwritten: raise if a floating-point output element keeps the
                poison bit pattern (no thread wrote it); only without ``init_value``.
            shared_memory: bytes of dynamic threadgroup memory of the CUDA launch this
                one models (``mx.fast.cuda_kernel``'s keyword; the body declares the
                buffer statically here): the threadgroup memory limit is then
                max(32 KiB, shared_memory), at most 227 KiB (sm_90); 0: Apple's 32 KiB.
            workers: CPU threads running threadgroups in parallel
                (default ``XLSTM_EMULATE_WORKERS`` or the CPU count).

        Returns:
            One ``mx.array`` per output.
        """
        inputs = list(inputs)
        check_counts(self.input_names, self.output_names, inputs, output_shapes, output_dtypes)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        grid, group, n_threads = launch_shape(grid, threadgroup)

        arrays = [_as_array(v) for v in inputs]
        out_dtypes = list(output_dtypes)
        for n, a in zip(self.input_names, arrays):
            _np_dtype(a.dtype, f"input {n!r}")
        for n, dt in zip(self.output_names, out_dtypes):
            _np_dtype(dt, f"output {n!r}")
        out_shapes = [tuple(int(d) for d in s) for s in output_shapes]
        gen = self.generate(arrays, out_dtypes, template)
        cluster = cluster_size(self.name, gen.template_args, grid, _clipped_group(group, grid))
        if verbose:
            print(sig.format_verbose(self.name, gen), end="", flush=True)

        shared_memory = int(shared_memory)
        if not 0 <= shared_memory <= MAX_CUDA_SHARED_MEMORY:
            raise ValueError(f"[{self.name}] shared_memory={shared_memory}: expected 0 to {MAX_CUDA_SHARED_MEMORY} "
                             "bytes (the dynamic shared memory of a CUDA launch on sm_90)")
        compiled = _build(gen, self.name, self.math_mode, bool(check_bounds))
        if compiled.tg_bytes > max(MAX_THREADGROUP_MEMORY, shared_memory):
            if shared_memory:
                raise EmulatorError(
                    f"[{self.name}] threadgroup memory of {compiled.tg_bytes} bytes exceeds the launch's "
                    f"shared_memory={shared_memory} (the CUDA launch it models):\n{_threadgroup_report(compiled)}"
                )
            raise EmulatorError(
                f"[{self.name}] threadgroup memory of {compiled.tg_bytes} bytes exceeds the "
                f"{MAX_THREADGROUP_MEMORY}-byte (32 KiB) limit of Apple GPUs:\n{_threadgroup_report(compiled)}"
            )

        hosts = []
        for n, a in zip(self.input_names, arrays):
            _np_dtype(a.dtype, f"input {n!r}")
            hosts.append(_to_host(a, self.ensure_row_contiguous))
        outs = []
        for n, shape, dt in zip(self.output_names, out_shapes, out_dtypes):
            npdt = _np_dtype(dt, f"output {n!r}")
            o = _aligned_empty(shape, npdt)
            if init_value is None:
                o.view(np.uint8).fill(0xFF)
            elif dt == mx.bfloat16:
                o[...] = np.asarray(mx.array(init_value, dtype=mx.bfloat16).view(mx.uint16))
            else:
                o[...] = init_value
            outs.append(o)

        _launch(self, gen, compiled, hosts, outs, grid, group, schedule, seed, check_bounds, workers, cluster)

        if check_unwritten and init_value is None:
            for n, o, dt in zip(self.output_names, outs, out_dtypes):
                if dt in _FLOATING and o.size:
                    _check_written(self.name, n, o)
        return [_from_host(o, dt) for o, dt in zip(outs, out_dtypes)]


def _as_array(v: Any) -> mx.array:
    if isinstance(v, mx.array):
        return v
    if isinstance(v, (bool, int, float, np.generic)):
        return mx.array(v)
    if isinstance(v, np.ndarray):
        return mx.array(v)
    raise TypeError(f"[metal_kernel] inputs must be mx.array or Python scalars, got {type(v).__name__}")


def _parse_compile_options(options: dict | None) -> str:
    if options is None:
        return "safe"
    if not isinstance(options, dict):
        raise ValueError("[metal_kernel] Expected `compile_options` to be a dict.")
    mode = "safe"
    for key, value in options.items():
        if key != "math_mode":
            raise ValueError(f"[metal_kernel] Unknown compile option `{key}`.")
        if value not in _MATH_MODES:
            raise ValueError("[metal_kernel] Expected math_mode to be 'safe', 'relaxed', or 'fast'.")
        mode = value
    return mode


def _check_written(kernel: str, name: str, o: np.ndarray) -> None:
    raw = o.view(np.uint8).reshape(o.size, o.itemsize)
    unwritten = np.all(raw == 0xFF, axis=1)
    count = int(unwritten.sum())
    if count:
        first = np.unravel_index(int(np.argmax(unwritten)), o.shape)
        raise EmulatorError(
            f"[{kernel}] output '{name}': {count} of {o.size} elements still hold the poison bit pattern "
            f"(first at index {tuple(int(i) for i in first)}): no thread wrote them, or they were computed "
            "from poisoned memory (threadgroup memory or an output read before any thread wrote it: a "
            "missing barrier? an asynchronous copy's destination read before its xk_async_wait?). Outputs "
            "are uninitialised on Metal: check that the grid, counted in threads, covers every output "
            "element, or pass init_value."
        )


class _Guarded:
    """Copies of the buffers placed against guard pages, for check_bounds."""

    def __init__(self) -> None:
        self.maps: list[tuple[int, int]] = []
        self.slacks: list[tuple[str, np.ndarray]] = []

    def place(self, a: np.ndarray, name: str) -> tuple[int, np.ndarray]:
        rt = _runtime()
        base, size = ctypes.c_void_p(), ctypes.c_size_t()
        nbytes = a.nbytes
        ptr = rt.xk_guarded_alloc(nbytes, ctypes.byref(base), ctypes.byref(size))
        if not ptr:
            raise MemoryError("could not map guarded memory for check_bounds")
        self.maps.append((base.value, size.value))
        slack = base.value + size.value - rt.xk_page_size() - (ptr + nbytes)
        whole = np.ctypeslib.as_array((ctypes.c_uint8 * (nbytes + slack)).from_address(ptr))
        view = whole[:nbytes]
        view[:] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        whole[nbytes:] = _CANARY
        self.slacks.append((name, whole[nbytes:]))
        return ptr, view

    def check_canaries(self, kernel: str) -> None:
        for name, slack in self.slacks:
            if np.any(slack != _CANARY):
                raise EmulatorError(
                    f"[{kernel}] out-of-bounds write past the end of buffer '{name}' "
                    f"(into the {slack.size} bytes after it)"
                )

    def free(self) -> None:
        rt = _runtime()
        for base, size in self.maps:
            rt.xk_guarded_free(base, size)
        self.maps.clear()
        self.slacks.clear()


def _clipped_group(group: Sequence[int], grid: Sequence[int]) -> tuple[int, int, int]:
    """The threadgroup size a launch runs with: no larger than a non-empty grid."""
    return tuple(min(t, g) if g else t for t, g in zip(group, grid))  # type: ignore[return-value]


def _launch(kernel, gen, compiled, hosts, outs, grid, group, schedule, seed, check_bounds, workers,
            cluster: int = 1) -> None:
    keep: list[Any] = []  # everything the C side points at stays alive here
    slots: list[int] = []
    regions: list[tuple[int, int, int, int, bytes, int]] = []
    guarded = _Guarded() if check_bounds else None
    page = _runtime().xk_page_size()
    out_views: list[tuple[np.ndarray, np.ndarray]] = []

    def buffer(a: np.ndarray, name: str) -> int:
        if guarded is not None:
            ptr, view = guarded.place(a, name)
            end = ptr + a.nbytes
            regions.append((ptr, end, end, end + 2 * page, name.encode(), a.itemsize))
            return ptr
        keep.append(a)
        if a.size == 0:
            return 0
        return a.__array_interface__["data"][0]

    try:
        for p in gen.params:
            if p.kind == "input":
                a = hosts[p.index]
                if guarded is None and a.ndim and not a.flags.c_contiguous:
                    # Strided view: point at its first element; strides go in `<name>_strides`.
                    keep.append(a)
                    slots.append(a.__array_interface__["data"][0])
                else:
                    slots.append(buffer(np.ascontiguousarray(a) if guarded is not None else a, p.name))
            elif p.kind in ("shape", "strides", "ndim"):
                a = hosts[p.index]
                if p.kind == "shape":
                    meta = np.array(a.shape, dtype=np.int32)
                elif p.kind == "strides":
                    if guarded is not None:
                        a = np.ascontiguousarray(a)
                    meta = np.array([s // a.itemsize for s in a.strides], dtype=np.int64)
                else:
                    meta = np.array(a.ndim, dtype=np.int32)
                keep.append(meta)
                slots.append(meta.__array_interface__["data"][0] if meta.size else 0)
            elif p.kind == "output":
                o = outs[p.index]
                if guarded is not None:
                    ptr, view = guarded.place(o, p.name)
                    end = ptr + o.nbytes
                    regions.append((ptr, end, end, end + 2 * page, p.name.encode(), o.itemsize))
                    out_views.append((o, view))
                    slots.append(ptr)
                else:
                    keep.append(o)
                    slots.append(o.__array_interface__["data"][0] if o.size else 0)

        buf_arr = (ctypes.c_void_p * max(len(slots), 1))(*slots)
        reg_arr = (_Region * max(len(regions), 1))()
        for i, (lo, hi, glo, ghi, name, es) in enumerate(regions):
            reg_arr[i] = _Region(lo, hi, glo, ghi, name, es, 0)
        stack_kb = _int_env("XLSTM_EMULATE_STACK_KB", 128 if check_bounds else 64)
        n_workers = workers if workers is not None else _int_env("XLSTM_EMULATE_WORKERS", os.cpu_count() or 1)
        desc = _LaunchDesc()
        desc.entry = compiled.entry
        desc.buffers = ctypes.cast(buf_arr, ctypes.POINTER(ctypes.c_void_p))
        desc.grid = (ctypes.c_uint32 * 3)(*grid)
        desc.group = (ctypes.c_uint32 * 3)(*_clipped_group(group, grid))
        desc.schedule = SCHEDULES[schedule]
        desc.workers = max(1, int(n_workers))
        desc.seed = int(seed) & (2**64 - 1)
        desc.tg_bytes = compiled.tg_bytes
        desc.stack_bytes = stack_kb * 1024
        desc.n_regions = len(regions)
        desc.cluster = cluster
        desc.regions = ctypes.cast(reg_arr, ctypes.POINTER(_Region))
        err = ctypes.create_string_buffer(4096)
        rc = _runtime().xk_launch(ctypes.byref(desc), err, len(err))
        if rc != 0:
            raise EmulatorError(f"[{kernel.name}] {err.value.decode(errors='replace')}")
        if guarded is not None:
            guarded.check_canaries(kernel.name)
        for o, view in out_views:
            o.view(np.uint8).reshape(-1)[:] = view
    finally:
        if guarded is not None:
            guarded.free()


def metal_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
    compile_options: dict | None = None,
) -> EmulatedKernel:
    """Drop-in for ``mx.fast.metal_kernel`` that runs the kernel on the CPU.

    Same arguments as MLX. The returned callable takes MLX's call keywords plus
    ``schedule``, ``seed``, ``check_bounds``, ``check_unwritten`` and ``workers``
    (see :meth:`EmulatedKernel.__call__`).
    """
    return EmulatedKernel(
        name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs, compile_options
    )


def check_schedules(
    kernel: EmulatedKernel,
    *,
    schedules: Sequence[str] = ("sequential", "reverse", "random"),
    seeds: Sequence[int] = (1, 2),
    **call_kwargs: Any,
) -> list[mx.array]:
    """Run `kernel` under several thread orders and demand bit-identical outputs.

    A kernel with a missing barrier or another intra-threadgroup race usually gives
    different bits when threads run in another order. Runs use one worker so that
    only the schedule changes. Returns the outputs of the first run.

    Raises:
        EmulatorError: naming the schedules, the output and the first differing element.
    """
    runs: list[tuple[str, list[np.ndarray]]] = []
    for s in schedules:
        for seed in seeds if s == "random" else (0,):
            outs = kernel(**call_kwargs, schedule=s, seed=seed, workers=1)
            label = f"{s}(seed={seed})" if s == "random" else s
            runs.append((label, [np.asarray(o.view(mx.uint16) if o.dtype == mx.bfloat16 else o) for o in outs]))
            if len(runs) == 1:
                first = outs
    base_label, base = runs[0]
    for label, outs in runs[1:]:
        for name, a, b in zip(kernel.output_names, base, outs):
            same = a.view(np.uint8) == b.view(np.uint8)
            if not np.all(same):
                bad = np.argwhere(~np.all(same.reshape(a.size, a.itemsize), axis=1)).ravel()
                idx = np.unravel_index(int(bad[0]), a.shape)
                raise EmulatorError(
                    f"[{kernel.name}] output '{name}' differs between schedules {base_label} and {label}: "
                    f"{bad.size} of {a.size} elements, first at {tuple(int(i) for i in idx)} "
                    f"({a[idx]!r} vs {b[idx]!r}). The kernel has a race: a missing threadgroup_barrier "
                    "(or xk_cluster_sync, in a kernel of threadgroup clusters) or threads sharing a cell "
                    "without synchronisation."
                )
    return first
