"""GEMM tile configurations: one frozen record per launch, its limits and its geometry.

Notation (the kernels' own, ``metal_src/gemm.metal``): the output C has M rows and N
columns and the reduction runs over K, whatever the op's operand layout.

Three kernel paths share one record, :class:`GemmConfig`; each path reads its own fields:

    scalar  TM x TN output tile, TK deep, RM x RN outputs per thread, PAD extra float
            columns in the threadgroup tiles, DB double buffering, VEC4 vector loads,
            ALIGN_EXECW (TN := 32 * RN, so one row of threads is one simdgroup).
    simd    BM x BN block, BK deep, WM x WN simdgroups of 8x8 simdgroup_matrix fragments,
            STAGES K tiles in flight (0 = as many as fit the backend's budget),
            SPLIT_K partitions of K (1 = off).
    gemv    M == 1, GEMV_THREADS threads per threadgroup: on B as (N, K) rows a simdgroup per
            1-4 output columns (each 16-byte run of A read once for them), on a row-major B
            column blocks of COLS threads x one 16-byte run a row (GemmConfig.gemv_cols).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import TileConfigError

__all__ = [
    "DTYPES",
    "FIELDS",
    "MAX_THREADGROUP_BYTES",
    "MAX_THREADS",
    "MAX_SIMD_STAGES",
    "SIMD_AUTO_STAGES",
    "THREADGROUP_LIMITS",
    "OPS",
    "PATHS",
    "SIMD_WIDTH",
    "GemmConfig",
    "check_field",
    "dtype_name",
    "dtype_size",
    "parse_tile",
]

OPS = ("gemm_av", "gemm_at_b", "gemm_a_bt")
DTYPES = ("float32", "float16", "bfloat16")
PATHS = ("simd", "scalar", "gemv")

MAX_THREADS = 1024  # threads per threadgroup on every Apple GPU
MAX_THREADGROUP_BYTES = 32768  # 32 KiB of threadgroup memory on every Apple GPU
SIMD_WIDTH = 32  # thread execution width
# The gemv kernel on a row-major B (GemmConfig.gemv_cols): threadgroups wanted (two per SM
# of an H100 / H200) and the most threadgroup memory for its partial sums. Before (one
# simdgroup per column reading a strided column), H200 1x4096x4096 pipelined: 72-74 us a
# call against mx.matmul's 17.5 (bench session 13).
GEMV_TARGET_GROUPS = 264
GEMV_PART_BYTES = 16384
# ... and on B as (N, K) rows: up to GEMV_MAX_ROWS_SHARED output columns a simdgroup share
# each run of A (read once per simdgroup instead of once per column), while at least
# GEMV_ROW_TARGET_GROUPS threadgroups (one per SM) remain.
GEMV_MAX_ROWS_SHARED = 4
GEMV_ROW_TARGET_GROUPS = 132


def gemv_run(dtype: Any) -> int:
    """Elements of one 16-byte run of `dtype` (the gemv kernel's W = XK_RUN(T, 8))."""
    return min(8, 16 // dtype_size(dtype))

# gemm_simd's pipeline (metal_src/gemm.metal, template STAGES) per kernel backend:
# * THREADGROUP_LIMITS: the threadgroup memory its stages may take with an explicit
#   `stages`: Apple's 32 KiB (metal, and the emulator, which enforces it), or on cuda the
#   227 KiB of dynamic shared memory a block may have on sm_90 (the body takes its buffer
#   from dynamic shared memory there; sm_80 allows 163 KiB and sm_86 / sm_89 99 KiB, so
#   larger requests fail at launch on those GPUs);
# * SIMD_AUTO_STAGES: with `stages` = 0, as many stages as fit in `budget` bytes, at most
#   `most` (cuda: CUDA's 48 KiB of static shared memory, 4; Apple: 32 KiB, 3).
# Any other name (a backend that runs no kernels) gets Apple's.
THREADGROUP_LIMITS = {"cuda": 232448}
SIMD_AUTO_STAGES = {"cuda": (49152, 4)}
_APPLE_AUTO_STAGES = (MAX_THREADGROUP_BYTES, 3)
MAX_SIMD_STAGES = 8  # the fast K loop unrolls STAGES tiles per trip

# field -> kind; kinds are checked by check_field.
FIELDS: dict[str, str] = {
    "path": "path",
    "tm": "pos",
    "tn": "pos",
    "tk": "pos",
    "rm": "pos",
    "rn": "pos",
    "pad": "nonneg",
    "double_buffer": "bool",
    "vec4": "bool",
    "align_execw": "bool",
    "bm": "pos",
    "bn": "pos",
    "bk": "pos",
    "wm": "pos",
    "wn": "pos",
    "split_k": "pos",
    "stages": "stages",
    "gemv_threads": "gemv",
    "warpgroup": "bool",
}
SCALAR_FIELDS = ("tm", "tn", "tk", "rm", "rn", "pad", "double_buffer", "vec4", "align_execw")
SIMD_FIELDS = ("bm", "bn", "bk", "wm", "wn", "stages", "warpgroup")
# Warpgroup products (``warpgroup``: gemm_simd's WG, CUDA's wgmma on sm_90a): K tiles of
# this depth, B tiles of these widths, at least WG_MIN_STAGES stages (their pipeline keeps
# one K tile's products in flight while another is copied); CUDA-sized shared memory, so
# they run on the cuda backend and on the emulator (as the CUDA launch it models), never
# on Apple GPUs.
WG_BK = 64
WG_BN = (64, 128, 256)
WG_MIN_STAGES = 3
WG_BACKENDS = ("cuda", "emulate")

_ACCEPTED = {
    "path": "one of 'simd', 'scalar', 'gemv'",
    "pos": "a positive integer",
    "nonneg": "a non-negative integer",
    "bool": "true or false",
    "gemv": "a multiple of 32 from 32 to 1024",
    "stages": f"an integer from 0 (as many as fit) to {MAX_SIMD_STAGES}",
}


def accepted_form(field: str) -> str:
    """What `field` accepts, in words."""
    return _ACCEPTED[FIELDS[field]]


def check_field(field: str, value: Any) -> str | None:
    """None if `value` is acceptable for `field`, else a message (without the source)."""
    kind = FIELDS.get(field)
    if kind is None:
        return f"unknown field '{field}'; fields are {', '.join(FIELDS)}"
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = {
        "path": isinstance(value, str) and value in PATHS,
        "pos": is_int and value >= 1,
        "nonneg": is_int and value >= 0,
        "bool": isinstance(value, bool),
        "gemv": is_int and 32 <= value <= MAX_THREADS and value % 32 == 0,
        "stages": is_int and 0 <= value <= MAX_SIMD_STAGES,
    }[kind]
    if ok:
        return None
    return f"{field} must be {_ACCEPTED[kind]}, got {value!r} ({type(value).__name__})"


_DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
_DTYPE_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_DTYPE_CACHE: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """'float32' | 'float16' | 'bfloat16' for an mx dtype, a numpy dtype or a name."""
    try:
        return _DTYPE_CACHE[dtype]
    except (KeyError, TypeError):
        pass
    text = str(dtype).lower()
    for prefix in ("mlx.core.", "<class 'numpy.", "numpy."):
        text = text.removeprefix(prefix)
    text = text.rstrip("'>")
    name = _DTYPE_NAMES.get(text)
    if name is None:
        raise TileConfigError(
            f"dtype {dtype!r}: GEMM kernels take float32, float16 or bfloat16"
        )
    try:
        _DTYPE_CACHE[dtype] = name
    except TypeError:
        pass
    return name


def dtype_size(dtype: Any) -> int:
    """Bytes per element of a GEMM dtype."""
    return _DTYPE_SIZE[dtype_name(dtype)]


def parse_tile(text: str, source: str) -> tuple[int, ...]:
    """'TMxTN' or 'TMxTNxTK' (positive ints; 'x' or 'X', spaces allowed) -> 2 or 3 ints."""
    form = "expected 'TMxTN' or 'TMxTNxTK' with positive integers, e.g. '32x32' or '64x64x16'"
    if not isinstance(text, str):
        raise TileConfigError(f"{source}: {text!r} is not a tile; {form}")
    parts = [p.strip() for p in text.strip().lower().split("x")]
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        raise TileConfigError(f"{source}: {text!r} is not a tile; {form}")
    sizes = tuple(int(p) for p in parts)
    if min(sizes) < 1:
        raise TileConfigError(f"{source}: {text!r} has a zero size; {form}")
    return sizes


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM launch configuration (final: exactly what is dispatched).

    Geometry (threadgroup and grid both count threads, as ``mx.fast.metal_kernel`` does):

        scalar  threadgroup (TN/RN, TM/RM, 1)
                grid        (ceil(N/TN) * TN/RN, ceil(M/TM) * TM/RM, batch)
                threadgroup memory 4 * (TK*(TM+PAD) + TK*(TN+PAD)) * (2 if DB else 1) bytes
                (tiles are float whatever the dtype)
        simd    threadgroup (32*WN, WM, 1): WM x WN simdgroups, each (BM/WM) x (BN/WN)
                grid        (32*WN * ceil(N/BN), WM * ceil(M/BM), batch * SPLIT_K)
                threadgroup memory per stage sizeof(T) * (BM*(BK+p) + BK*(BN+p)),
                p = 16 // sizeof(T) (gemm_av's layout; simd_stage_bytes for the others),
                times simd_stages(...) stages
        gemv    threadgroup (32, GEMV_THREADS/32, 1): a simdgroup per 1-4 output columns (B as
                (N, K) rows) or column blocks (row-major B; see gemv_cols)
                grid        (32, rows * ceil(N / columns a threadgroup), batch), rows = GEMV_THREADS/32
                no threadgroup memory

    With ``align_execw`` the scalar tile width is fixed at construction: TN = 32 * RN, so
    a row of threads is one simdgroup; the stored ``tn`` is the adjusted, dispatched one.
    ``split_k`` > 1 splits K on the simd path (float partial sums, then a reduce pass).

    Limits (every Apple GPU): <= 1024 threads and <= 32 KiB threadgroup memory. On the simd
    path the threadgroup memory limit depends on the backend (THREADGROUP_LIMITS: 32 KiB
    unless it is cuda, 227 KiB there): one stage of tiles, in every operand layout, must fit,
    and so must an explicit ``stages`` count of them (checked when the backend is known;
    without one, Apple's 32 KiB for one stage, the portable rule).
    """

    path: str = "simd"
    tm: int = 32
    tn: int = 32
    tk: int = 16
    rm: int = 4
    rn: int = 4
    pad: int = 0
    double_buffer: bool = False
    vec4: bool = False
    align_execw: bool = False
    bm: int = 32
    bn: int = 32
    bk: int = 16
    wm: int = 2
    wn: int = 2
    split_k: int = 1
    stages: int = 0
    gemv_threads: int = 128
    warpgroup: bool = False

    def __post_init__(self):
        if self.align_execw is True and isinstance(self.rn, int) and not isinstance(self.rn, bool):
            object.__setattr__(self, "tn", SIMD_WIDTH * self.rn)

    # -- geometry -------------------------------------------------------------------
    def threads(self) -> tuple[int, int, int]:
        """Threadgroup size (x, y, z) in threads for this config's path."""
        if self.path == "scalar":
            return (self.tn // self.rn, self.tm // self.rm, 1)
        if self.path == "gemv":
            return (SIMD_WIDTH, self.gemv_threads // SIMD_WIDTH, 1)
        return (SIMD_WIDTH * self.wn, self.wm, 1)

    def gemv_cols(self, n: int, dtype: Any, trans_b: bool) -> int:
        """The gemv kernel's COLS for N = n output columns. On B as (N, K) rows (`trans_b`):
        output columns a simdgroup (1 to GEMV_MAX_ROWS_SHARED, each 16-byte run of A read once
        for all of them), doubled while at least GEMV_ROW_TARGET_GROUPS threadgroups remain.
        On a row-major B (K, N): column blocks of COLS threads x one 16-byte run,
        COLS a power of two from 2 (whole 32-byte sectors for 16-bit T; 1 where the
        threadgroup is too small), grown while at least GEMV_TARGET_GROUPS threadgroups
        remain, with at most a run per thread and GEMV_PART_BYTES of partial sums (ROWS x
        COLS runs of floats) a threadgroup."""
        rows = self.gemv_threads // SIMD_WIDTH
        if trans_b:  # columns a simdgroup, reusing each run of A: while a wave of groups remains
            cps = 1
            while cps < GEMV_MAX_ROWS_SHARED and _ceil_div(n, rows * cps * 2) >= GEMV_ROW_TARGET_GROUPS:
                cps *= 2
            return cps
        w = gemv_run(dtype)
        cols = 1

        def fits(c: int) -> bool:
            return c <= SIMD_WIDTH and c * w <= SIMD_WIDTH * rows and rows * c * w * 4 <= GEMV_PART_BYTES

        while fits(cols * 2) and (cols < 2 or _ceil_div(n, cols * 2 * w) >= GEMV_TARGET_GROUPS):
            cols *= 2
        return cols

    def grid(self, m: int, n: int, batch: int = 1, *, dtype: Any = None, trans_b: bool = True) -> tuple[int, int, int]:
        """Grid (x, y, z) in threads for an M x N output (see the class docstring); the gemv
        path's depends on B's layout (`trans_b`) and, on a row-major B, the `dtype`."""
        if self.path == "scalar":
            return (
                _ceil_div(n, self.tn) * (self.tn // self.rn),
                _ceil_div(m, self.tm) * (self.tm // self.rm),
                batch,
            )
        if self.path == "gemv":
            rows = self.gemv_threads // SIMD_WIDTH
            cols = self.gemv_cols(n, dtype if dtype is not None else "float32", trans_b)
            per_group = rows * cols if trans_b else cols * gemv_run(dtype)
            return (SIMD_WIDTH, rows * _ceil_div(n, per_group), batch)
        return (
            SIMD_WIDTH * self.wn * _ceil_div(n, self.bn),
            self.wm * _ceil_div(m, self.bm),
            batch * self.split_k,
        )

    def scalar_bytes(self) -> int:
        return 4 * (self.tk * (self.tm + self.pad) + self.tk * (self.tn + self.pad)) * (2 if self.double_buffer else 1)

    def simd_bytes(self, dtype: Any) -> int:
        size = dtype_size(dtype)
        p = 16 // size
        return size * (self.bm * (self.bk + p) + self.bk * (self.bn + p))

    def simd_bytes_any_layout(self, dtype: Any) -> int:
        """One stage of gemm_simd's tiles in the larger of each operand's orders: it keeps
        op(A) as BM x (BK+p) or, transposed (gemm_at_b), BK x (BM+p), and op(B) as
        BK x (BN+p) or, transposed (gemm_a_bt), BN x (BK+p); further stages only where they fit."""
        size = dtype_size(dtype)
        p = 16 // size
        a = max(self.bm * (self.bk + p), self.bk * (self.bm + p))
        b = max(self.bk * (self.bn + p), self.bn * (self.bk + p))
        return size * (a + b)

    def uses_warpgroup(self, dtype: Any) -> bool:
        """Whether a simd launch of this config for `dtype` runs warpgroup products (WG):
        ``warpgroup`` set and a 2-byte dtype (float32 runs the simd path's own products)."""
        return bool(self.warpgroup) and dtype_size(dtype) == 2

    def simd_stage_bytes(self, dtype: Any, trans_a: bool, trans_b: bool) -> int:
        """Bytes of one stage of gemm_simd's tiles in one operand layout: op(A) as
        BM x (BK+p), or BK x (BM+p) when `trans_a` (gemm_at_b); op(B) as BK x (BN+p), or
        BN x (BK+p) when `trans_b` (gemm_a_bt); p = 16 // sizeof(T). Warpgroup tiles
        (uses_warpgroup) are unpadded: BM x BK and BK x BN in every layout."""
        size = dtype_size(dtype)
        if self.uses_warpgroup(dtype):
            return size * (self.bm * self.bk + self.bk * self.bn)
        p = 16 // size
        a = self.bk * (self.bm + p) if trans_a else self.bm * (self.bk + p)
        b = self.bn * (self.bk + p) if trans_b else self.bk * (self.bn + p)
        return size * (a + b)

    def simd_stages(self, dtype: Any, trans_a: bool, trans_b: bool, backend: str | None = None) -> int:
        """K tiles in flight in gemm_simd (its template STAGES) on `backend`: the config's
        ``stages``, or with 0 as many stages as fit in the backend's SIMD_AUTO_STAGES
        budget (at least 1). The stage count changes the schedule, never the results."""
        if self.stages:
            return self.stages
        if self.uses_warpgroup(dtype):  # CUDA's shared memory: up to 4 stages, at least 3
            fit = THREADGROUP_LIMITS["cuda"] // self.simd_stage_bytes(dtype, trans_a, trans_b)
            return max(WG_MIN_STAGES, min(4, fit))
        budget, most = SIMD_AUTO_STAGES.get(backend or "", _APPLE_AUTO_STAGES)
        return max(1, min(most, budget // self.simd_stage_bytes(dtype, trans_a, trans_b)))

    def simd_threadgroup_bytes(self, dtype: Any, trans_a: bool, trans_b: bool, backend: str | None = None) -> int:
        """gemm_simd's threadgroup buffer in bytes (all its stages, rounded up to 16-byte
        words, as the body declares it): the dynamic shared memory a cuda launch needs."""
        total = self.simd_stages(dtype, trans_a, trans_b, backend) * self.simd_stage_bytes(dtype, trans_a, trans_b)
        return -(-total // 16) * 16

    def threadgroup_bytes(self, dtype: Any) -> int:
        """Static threadgroup memory of this config's kernel for `dtype`."""
        if self.path == "scalar":
            return self.scalar_bytes()
        if self.path == "gemv":
            return 0
        return self.simd_bytes(dtype)

    def template_args(self, dtype: Any = None) -> list[tuple[str, Any]]:
        """Template arguments (name, value) of this path's kernel, without T."""
        if self.path == "scalar":
            return [
                ("TM", self.tm), ("TN", self.tn), ("TK", self.tk), ("RM", self.rm), ("RN", self.rn),
                ("PAD", self.pad), ("DB", bool(self.double_buffer)), ("VEC4", bool(self.vec4)),
            ]
        if self.path == "gemv":
            return [("ROWS", self.gemv_threads // SIMD_WIDTH)]
        # (the simd kernel's STAGES depends on the layout and backend too: simd_stages)
        return [("BM", self.bm), ("BN", self.bn), ("BK", self.bk), ("WM", self.wm), ("WN", self.wn)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> GemmConfig:
        return dataclasses.replace(self, **changes)

    # -- limits ---------------------------------------------------------------------
    def problems(self, dtype: Any, backend: str | None = None) -> list[tuple[tuple[str, ...], str]]:
        """Every violated limit as (fields involved, message); empty when valid.

        Both the scalar and the simd fields are checked whatever the path, so a bad
        setting fails where it is made, not when a shape happens to pick its path.
        `backend` (the kernel backend that will run it) adds its own limits: an explicit
        simd ``stages`` count against its threadgroup memory; None skips that check.
        """
        out: list[tuple[tuple[str, ...], str]] = []
        for f in FIELDS:
            msg = check_field(f, getattr(self, f))
            if msg:
                out.append(((f,), msg))
        if out:
            return out  # the relations below need well-typed fields
        out += self._scalar_problems()
        out += self._simd_problems(dtype, backend)
        return out

    def _scalar_problems(self) -> list[tuple[tuple[str, ...], str]]:
        out = []
        tile = f"scalar tile TM={self.tm} TN={self.tn} TK={self.tk}"
        if self.tm % self.rm:
            out.append((("tm", "rm"), f"{tile}: TM={self.tm} is not a multiple of RM={self.rm} (rows per thread)"))
        if self.tn % self.rn:
            out.append((("tn", "rn"), f"{tile}: TN={self.tn} is not a multiple of RN={self.rn} (columns per thread)"))
        if not out:
            t = (self.tn // self.rn) * (self.tm // self.rm)
            if t > MAX_THREADS:
                out.append((
                    ("tm", "tn", "rm", "rn"),
                    (
                        f"{tile} with RM={self.rm} RN={self.rn} needs (TN/RN)*(TM/RM) = {t} threads per "
                        f"threadgroup, more than the {MAX_THREADS} Apple GPUs allow; use a smaller tile or larger RMxRN"
                    ),
                ))
        need = self.scalar_bytes()
        if need > MAX_THREADGROUP_BYTES:
            out.append((
                ("tm", "tn", "tk", "pad", "double_buffer"),
                (
                    f"{tile} PAD={self.pad} DB={int(self.double_buffer)} needs {need} bytes of threadgroup memory, "
                    f"more than the 32 KiB ({MAX_THREADGROUP_BYTES} bytes) Apple GPUs have; "
                    f"use a smaller TMxTNxTK{' or turn double buffering off' if self.double_buffer else ''}"
                ),
            ))
        if self.vec4 and (self.tk % 4 or self.tn % 4):
            out.append((
                ("vec4", "tk", "tn"),
                f"{tile}: VEC4 needs TK and TN to be multiples of 4; turn VEC4 off or change the tile",
            ))
        if self.align_execw and self.tn != SIMD_WIDTH * self.rn:
            out.append((("align_execw", "tn", "rn"), f"{tile}: ALIGN_EXECW needs TN = 32*RN = {SIMD_WIDTH * self.rn}"))
        return out

    def _simd_problems(self, dtype: Any, backend: str | None = None) -> list[tuple[tuple[str, ...], str]]:
        out = []
        tile = f"simd tile BM={self.bm} BN={self.bn} BK={self.bk} WM={self.wm} WN={self.wn}"
        if self.bm % (8 * self.wm):
            out.append((("bm", "wm"), f"{tile}: BM={self.bm} is not a multiple of 8*WM={8 * self.wm} (8x8 fragments per simdgroup)"))
        if self.bn % (8 * self.wn):
            out.append((("bn", "wn"), f"{tile}: BN={self.bn} is not a multiple of 8*WN={8 * self.wn} (8x8 fragments per simdgroup)"))
        if self.bk % 8:
            out.append((("bk",), f"{tile}: BK={self.bk} is not a multiple of 8"))
        t = SIMD_WIDTH * self.wm * self.wn
        if t > MAX_THREADS:
            out.append((
                ("wm", "wn"),
                f"{tile} needs 32*WM*WN = {t} threads per threadgroup, more than the {MAX_THREADS} Apple GPUs allow",
            ))
        if self.warpgroup:
            out += self._warpgroup_problems(tile, backend)
        if dtype is not None:
            # warpgroup tiles are CUDA-sized wherever they run (cuda, the emulator)
            cuda = backend == "cuda" or self.uses_warpgroup(dtype)
            limit = THREADGROUP_LIMITS["cuda"] if cuda else THREADGROUP_LIMITS.get(backend or "", MAX_THREADGROUP_BYTES)
            where = ("the 227 KiB of dynamic shared memory a CUDA threadgroup may have on sm_90"
                     if cuda else "the 32 KiB Apple GPUs have")
            # one stage (every backend: at least one stage runs), in gemm_av's layout first, then
            # in the largest one (a config must run for every op)
            need, layouts = self.simd_bytes(dtype), ""
            if need <= limit:
                need, layouts = self.simd_bytes_any_layout(dtype), " in a transposed operand layout (gemm_at_b / gemm_a_bt)"
            if need > limit:
                out.append((
                    ("bm", "bn", "bk"),
                    (
                        f"{tile} needs {need} bytes of threadgroup memory for {dtype_name(dtype)}{layouts}, more than "
                        f"{where} ({limit} bytes{f', backend {backend!r}' if backend else ''}); use a smaller BMxBNxBK"
                    ),
                ))
            elif self.stages and backend is not None:  # an explicit stage count, on a known backend
                layouts = ((False, False), (True, False), (False, True))
                need = max(self.simd_threadgroup_bytes(dtype, ta, tb, backend) for ta, tb in layouts)
                if need > limit:
                    fit = limit // max(self.simd_stage_bytes(dtype, ta, tb) for ta, tb in layouts)
                    out.append((
                        ("stages", "bm", "bn", "bk"),
                        (
                            f"{tile} with STAGES={self.stages} needs {need} bytes of threadgroup memory for "
                            f"{dtype_name(dtype)} in its largest operand layout, more than {where} "
                            f"({limit} bytes, backend '{backend}'); use stages <= {fit}, or stages=0 (as many as fit)"
                        ),
                    ))
        return out

    def _warpgroup_problems(self, tile: str, backend: str | None) -> list[tuple[tuple[str, ...], str]]:
        out = []
        what = f"{tile} with warpgroup products"
        if self.wn != 1:
            out.append((("warpgroup", "wn"), f"{what} needs WN=1 (a warpgroup spans every column of the tile)"))
        if self.wm % 4:
            out.append((("warpgroup", "wm"), f"{what} needs WM to be a multiple of 4 (4 simdgroups per warpgroup)"))
        elif self.bm != 16 * self.wm:
            out.append((("warpgroup", "bm", "wm"), f"{what} needs BM = 16*WM = {16 * self.wm} (16 rows per simdgroup)"))
        if self.bk != WG_BK:
            out.append((("warpgroup", "bk"), f"{what} needs BK={WG_BK} (rows of 128 bytes, the products' swizzle)"))
        if self.bn not in WG_BN:
            out.append((("warpgroup", "bn"), f"{what} needs BN in {WG_BN} (the widths of one product)"))
        if self.stages and self.stages < WG_MIN_STAGES:
            out.append((("warpgroup", "stages"), f"{what} needs stages >= {WG_MIN_STAGES} (or 0: as many as fit)"))
        if backend is not None and backend not in WG_BACKENDS:
            out.append((
                ("warpgroup",),
                f"{what}: backend {backend!r} cannot run them (they need CUDA's shared memory, at least "
                f"{WG_MIN_STAGES} stages of 16 KiB; backends {', '.join(WG_BACKENDS)})",
            ))
        return out

    def validate(self, dtype: Any = None, source: str = "argument", backend: str | None = None) -> GemmConfig:
        """Raise :class:`TileConfigError` naming `source` if this config cannot run.

        `dtype` (float32/float16/bfloat16) sizes the simd path's threadgroup tiles; with
        None that one check is skipped; `backend` adds its limits (see problems).
        Returns self.
        """
        probs = self.problems(dtype, backend)
        if probs:
            raise TileConfigError(f"{source}: " + "; ".join(msg for _, msg in probs))
        return self
