"""The device's measured copy bandwidth, and the memory-bound rows' share of it.

Issue 8's bar for memory-bound ops (norms, RoPE, decode attention) is ">= 80% of the
measured device-to-device copy bandwidth and >= 1.0x MLX". A datasheet peak is not that
bandwidth (an H200's 4.8 TB/s HBM3e copies at ~4 TB/s), so the bench measures it in the
same run, two ways, and keeps the higher:

* ``kernel``: ``copy_words`` (``metal_src/copy.metal``), a grid-stride copy of 16-byte
  runs launched through this package's runtime (``mx.fast.metal_kernel`` /
  ``cuda_kernel``), as our ops are;
* ``mlx``: MLX's own elementwise kernel copying the buffer (``x + 0`` in float32: one
  read, one write).

Each is timed as the rows' ``chained`` times are (``timing.measure_chained``: CHAIN
dependent copies, each reading the last one's output, built first and then evaluated) and
as their ``marginal`` times are (``timing.measure_marginal``: the chain's steady state) on
a buffer far larger than the last-level cache, so no copy is served from cache; the
highest of the four rates is the bar.

    rate = measure_copy_rate("cuda")        # {"gbps": 4012.3, "kernel_gbps": ..., ...}
    annotate_rows(rows, rate["gbps"])       # rows' extra: pct_copy, mlx_pct_copy, meets_*
"""

from __future__ import annotations

import math

from typing import Sequence

import mlx.core as mx
import numpy as np

from .. import runtime
from ..runtime.kernels import KernelSpec, launch
from .timing import measure_chained, measure_marginal

__all__ = ["COPY_SPEC", "COPY_TARGET_PCT", "TARGET_OPS", "annotate_rows", "annotate_same_bytes", "copy_words",
           "measure_copy_at", "measure_copy_rate", "miss_reasons", "target_summary", "targeted"]

COPY_SPEC = KernelSpec("copy", "copy_words", ("src",), ("dst",))
COPY_TARGET_PCT = 80.0  # issue 8: memory-bound ops >= 80% of the measured copy bandwidth
DEFAULT_BYTES = {"cuda": 1 << 30, "metal": 1 << 28}  # >> the last-level cache (H200 L2: 60 MB)
CHAIN = 8
MARGINAL_COPY_CALLS = 16  # the large copy's marginal chains: 16 and 32 copies (MLX's graphs hold 4 of them)
STEADY_ORDER = ("marginal", "kept", "chained", "pipelined")  # the times annotate_rows reads, first found
# The ops issue 8's bandwidth target names ("memory-bound ops (norms, RoPE, decode
# attention)"), by row op prefix. Other GB/s rows (GEMV, the mLSTM step, sLSTM) get their
# share of the copy bandwidth as information, with no verdict: a recurrence or a GEMV is
# measured against the speedups or the GEMM target asked of it instead.
TARGET_OPS = ("rms_norm", "layer_norm", "multihead_layer_norm", "rope", "attention_decode")
# copy@size (annotate_same_bytes): the best of this many readings a size. One reading inside
# a long bench process can fall far below the copy's rate (H100, session 33: a copy of 32 MiB
# read 57.7% in one run, 72.8-86.3% in the next, 74.6-90.4% in a fresh process), and a low
# reading would excuse a row below the copy bar as 'unreachable'.
COPY_AT_READINGS = 3
_THREADGROUP = 256
_MAX_THREADS = 1 << 21  # grid-stride beyond this


def copy_words(x: mx.array, backend: str | None = None) -> mx.array:
    """A copy of `x` made by the ``copy_words`` kernel.

    Args:
        x: any shape and dtype whose byte size is a multiple of 4 (read as 32-bit words).
        backend: metal | cuda | emulate (default: the active backend).

    Returns:
        An array equal to `x` (same shape and dtype), in a new buffer.
    """
    if not isinstance(x, mx.array):
        raise TypeError(f"copy_words: x must be an mx.array, got {type(x).__name__}")
    if x.nbytes % 4:
        raise ValueError(f"copy_words: x must hold a multiple of 4 bytes, got {x.nbytes} ({x.shape}, {x.dtype})")
    if x.nbytes == 0:
        return mx.array(np.zeros(x.shape, dtype=np.float32)).astype(x.dtype)
    words = x.reshape(-1).view(mx.uint32) if x.dtype != mx.uint32 else x.reshape(-1)
    n = words.shape[0]
    runs = max(1, n // 4)
    threads = min(-(-runs // _THREADGROUP) * _THREADGROUP, _MAX_THREADS)
    (out,) = launch(COPY_SPEC, inputs=[words], output_shapes=[(n,)], output_dtypes=[mx.uint32],
                    grid=(threads, 1, 1), threadgroup=(_THREADGROUP, 1, 1), backend=backend)
    return (out.view(x.dtype) if x.dtype != mx.uint32 else out).reshape(x.shape)


def _chained_seconds(step, x: mx.array, repeats: int) -> float:
    """Median seconds per call of CHAIN dependent calls y = step(y) per evaluation."""
    return measure_chained(step, x, calls=CHAIN, repeats=repeats)


def measure_copy_rate(backend: str | None = None, nbytes: int | None = None, repeats: int = 5) -> dict | None:
    """The device-to-device copy bandwidth on `backend` (metal or cuda), GB/s of bytes read
    plus bytes written; None on backends without a GPU (emulate, reference).

    Returns:
        {"gbps": the highest of the four, "kernel_gbps": copy_words, "mlx_gbps": MLX's
        elementwise copy, chained; "kernel_marginal_gbps", "mlx_marginal_gbps": the same in
        the chains' steady state (``timing.measure_marginal``, MARGINAL_COPY_CALLS);
        "bytes": buffer size, "chain": CHAIN}; the bandwidth the memory-bound rows'
        ``pct_copy`` is read against.
    """
    backend = backend or runtime.current_backend()
    if backend not in ("cuda", "metal"):
        return None
    nbytes = int(nbytes or DEFAULT_BYTES[backend])
    if nbytes <= 0 or nbytes % 16:
        raise ValueError(f"measure_copy_rate: nbytes must be a positive multiple of 16, got {nbytes}")
    x = mx.random.uniform(shape=(nbytes // 4,), dtype=mx.float32)
    mx.eval(x)
    moved = 2.0 * nbytes
    t_kernel = _chained_seconds(lambda y: copy_words(y, backend), x, repeats)
    check = copy_words(x, backend)
    if not mx.array_equal(check, x).item():
        raise RuntimeError(f"measure_copy_rate: copy_words on {backend!r} did not copy its input")
    del check
    t_mlx = _chained_seconds(lambda y: y + 0.0, x, repeats)
    kernel_gbps, mlx_gbps = moved / t_kernel / 1e9, moved / t_mlx / 1e9
    # and in the chains' steady state, as the rows' marginal times (the higher rate is the bar)
    calls = (MARGINAL_COPY_CALLS, 2 * MARGINAL_COPY_CALLS)
    m_kernel = moved / measure_marginal(lambda y: copy_words(y, backend), x, repeats=repeats, calls=calls) / 1e9
    m_mlx = moved / measure_marginal(lambda y: y + 0.0, x, repeats=repeats, calls=calls) / 1e9
    return {"gbps": max(kernel_gbps, mlx_gbps, m_kernel, m_mlx), "kernel_gbps": kernel_gbps, "mlx_gbps": mlx_gbps,
            "kernel_marginal_gbps": m_kernel, "mlx_marginal_gbps": m_mlx, "bytes": nbytes, "chain": CHAIN}


def measure_copy_at(backend: str | None, nbytes: int, keep: bool = False, calls: int = 20,
                    repeats: int = 5, marginal: bool = False) -> float | None:
    """GB/s (read + write) of `calls` chained ``copy_words`` copies of an `nbytes` buffer,
    timed as the bench's rows are (``keep``: every output stays referenced, as the
    ``kept`` rows; else the ``chained`` rows' chain; `marginal`: the chain's steady state,
    ``timing.measure_marginal``, as the ``marginal`` rows); None on backends without a GPU.

    A small op's chained call costs a fixed few microseconds on top of its bytes (H100,
    session 17: a chained copy of 16 MiB reaches ~60% of the 1 GiB copy's rate, 64 MiB
    ~77%, 256 MiB ~91%), so this says how much of the copy bandwidth an op of that size
    could reach at best."""
    backend = backend or runtime.current_backend()
    if backend not in ("cuda", "metal"):
        return None
    words = max(4, (int(nbytes) // 16) * 4)
    x = mx.random.uniform(shape=(words,), dtype=mx.float32)
    mx.eval(x)
    step = lambda y: copy_words(y, backend)  # noqa: E731
    if marginal:
        seconds = measure_marginal(step, x, repeats=repeats, keep=keep)
    else:
        seconds = measure_chained(step, x, calls=calls, repeats=repeats, keep=keep)
    return 2.0 * 4 * words / seconds / 1e9


def annotate_same_bytes(rows: Sequence[dict], copy_gbps: float | None, backend: str | None,
                        measure=measure_copy_at, readings: int = COPY_AT_READINGS) -> None:
    """Add ``copy_same_bytes_pct`` to the target rows (TARGET_OPS) annotate_rows gave a
    ``pct_copy``: the share of the copy bandwidth that a copy of the row's bytes (half of
    what it moves, read once and written once, rounded to 16 bytes) reaches, timed as the
    row's steady state (marginal rows: marginal chains, kept where the row's were; kept
    rows: kept chains; else chains). Information beside the verdict, which stays against
    `copy_gbps`. Each size and timing is measured once per bench (`measure`:
    measure_copy_at), as the best of `readings` readings (COPY_AT_READINGS): the most a
    copy of that size reached, not one slow reading."""
    if readings < 1:
        raise ValueError(f"annotate_same_bytes: readings must be >= 1, got {readings}")
    if not copy_gbps:
        return
    seen: dict[tuple[int, bool, bool], float | None] = {}
    for row in rows:
        extra = row.get("extra") or {}
        moved = _bytes_moved(row)
        if not targeted(row) or "pct_copy" not in extra or moved is None:
            continue
        marginal = extra.get("steady") == "marginal"
        kept = bool(extra.get("marginal_kept")) if marginal else extra.get("steady") == "kept"
        # rows of the same nominal bytes share a key (moved is GB/s x ms: off by a few bytes)
        key = (max(16, round(moved / 32) * 16), kept, marginal)
        if key not in seen:
            seen[key] = _best_reading(measure, backend, key[0], kept, marginal, readings)
        if seen[key]:
            extra["copy_same_bytes_pct"] = 100.0 * seen[key] / copy_gbps


def _best_reading(measure, backend, nbytes: int, kept: bool, marginal: bool, readings: int) -> float | None:
    """The highest of `readings` GB/s readings of measure(backend, nbytes, ...), or None
    where the backend has no GPU to time (its first reading is None)."""
    best = None
    for _ in range(readings):
        got = measure(backend, nbytes, keep=kept, marginal=True) if marginal else measure(backend, nbytes, keep=kept)
        if got is None:
            return None
        best = got if best is None else max(best, got)
    return best


def _bytes_moved(row: dict) -> float | None:
    """Bytes a row's op moves (its GB/s times its ms), or None."""
    gbps, ms = row.get("gbps"), row.get("ours_ms")
    if not gbps or not ms:
        return None
    return float(gbps) * float(ms) * 1e6



def targeted(row: dict) -> bool:
    """Whether a bench row's op is one the copy-bandwidth target applies to (TARGET_OPS)."""
    return str(row.get("op", "")).startswith(TARGET_OPS)


def miss_reasons(extra: dict, parity: float = 0.98) -> tuple[str, str]:
    """(copy bar, ratio bar) of one row that annotate_rows judged (its ``extra``), each
    ``met`` or why not. Copy: ``cached`` where the row itself or a chained copy of its own
    bytes (``copy_same_bytes_pct``) beats the large copy's rate (above 100%: the chain is
    served from the last-level cache in part, so the row's share says nothing about device
    memory);
    ``unreachable`` where that copy reaches less than COPY_TARGET_PCT, so no kernel can meet
    the bar at that size; else ``met`` or ``below``. Ratio: ``parity`` from `parity` up;
    else ``below``."""
    same = extra.get("copy_same_bytes_pct")
    if (same is not None and same > 100.0) or extra.get("pct_copy", 0.0) > 100.0:
        copy = "cached"
    elif extra["meets_copy"]:
        copy = "met"
    elif same is not None and same < COPY_TARGET_PCT:
        copy = "unreachable"
    else:
        copy = "below"
    ratio = "met" if extra["meets_ratio"] else ("parity" if extra["ratio_steady"] >= parity else "below")
    return copy, ratio


def annotate_rows(rows: Sequence[dict], copy_gbps: float | None) -> None:
    """Add the copy-bandwidth view to each memory-bound row's ``extra`` (in place).

    The steady-state time is the first a row has of: ``marginal`` (the row's steady chain,
    kept or not, timed by ``timing.measure_marginal``: what a chain of 2n calls takes beyond
    one of n, so that neither MLX's first CUDA graph, which waits for up to 100 encoded calls,
    nor the final wait counts), ``kept`` (norms: chained with every
    output kept referenced, as a transformer's residual stream stays alive past its norm,
    so that MLX cannot write in place either; their backward rows: the compiled VJP chained
    through dx, as backprop through a stack of norms), ``chained`` (each call takes the last one's
    output, as the layers of a model or the steps of a decode loop do; graph building not
    counted, as with asynchronous evaluation), ``pipelined`` (independent calls, the next
    ones built while the GPU runs the last; calls may overlap on the GPU), the synchronised
    time:

    * ``pct_copy`` / ``mlx_pct_copy``: 100 * ours / MLX's rate over `copy_gbps`;
    * ``ratio_steady``: MLX's time over ours at that rate (> 1: ours faster);
    * ``meets_copy``: pct_copy >= COPY_TARGET_PCT; ``meets_ratio``: ratio_steady >= 1.0,
      on the rows of TARGET_OPS only (the others get the rates and the ratio, no verdict).
    """
    if not copy_gbps:
        return
    for row in rows:
        if row.get("metric") != "GB/s" or row.get("emulated"):
            continue
        extra = row.setdefault("extra", {})
        moved = _bytes_moved(row)
        if moved is None:
            continue
        kind = next((k for k in STEADY_ORDER if extra.get(f"ours_{k}_ms")), None)
        ours_ms = extra[f"ours_{kind}_ms"] if kind else row.get("ours_ms")
        mlx_ms = extra.get(f"mlx_{kind}_ms") if kind else row.get("baseline_ms")
        extra["steady"] = kind or "synchronised"
        extra["pct_copy"] = 100.0 * moved / (ours_ms * 1e6) / copy_gbps
        if mlx_ms:
            extra["mlx_pct_copy"] = 100.0 * moved / (mlx_ms * 1e6) / copy_gbps
            extra["ratio_steady"] = mlx_ms / ours_ms
            if targeted(row):
                extra["meets_ratio"] = extra["ratio_steady"] >= 1.0
        if targeted(row):
            extra["meets_copy"] = extra["pct_copy"] >= COPY_TARGET_PCT


def target_summary(rows: Sequence[dict], copy: dict | None) -> list[str]:
    """Lines for the end of a bench run: the copy bandwidth and, per row the target
    applies to (TARGET_OPS), ours and MLX's share of it, the steady-state ratio and the
    verdict."""
    if not copy:
        return []
    lines = [f"copy bandwidth {copy['gbps']:,.0f} GB/s (copy_words {copy['kernel_gbps']:,.0f}, MLX elementwise "
             f"{copy['mlx_gbps']:,.0f}; {copy['bytes'] >> 20} MiB, {copy['chain']} chained copies)",
             "norm, RoPE and decode-attention rows at their steady state (marginal, else kept, else chained, else "
             f"pipelined, else synchronised): target >= {COPY_TARGET_PCT:.0f}% of copy bandwidth and >= 1.0x MLX",
             "(copy@size: a chained copy of the row's bytes, as a share of the copy bandwidth: the most an op of that "
             f"size reaches, best of {COPY_AT_READINGS} readings)",
             f"  {'op':<26} {'shape':<20} {'dtype':<9} {'timed':<12} {'%copy':>6} {'mlx %copy':>9} {'copy@size':>9} "
             f"{'ratio':>6}  target"]
    for r in rows:
        e = r.get("extra") or {}
        if "meets_copy" not in e:
            continue
        both = e.get("meets_copy") and e.get("meets_ratio")
        why = "met" if both else "not met: " + ", ".join(
            w for w, bad in (("bandwidth", not e.get("meets_copy")), ("ratio", not e.get("meets_ratio"))) if bad)
        if e.get("copy_same_bytes_pct", 0.0) > 100.0 or e["pct_copy"] > 100.0:
            why += " (cached: this row or a copy of its bytes beats the large copy)"
        ratio = e.get("ratio_steady")
        lines.append(f"  {str(r.get('op')):<26} {str(r.get('shape')):<20} {str(r.get('dtype')):<9} "
                     f"{e.get('steady', '-'):<12} {e['pct_copy']:6.1f} {e.get('mlx_pct_copy', float('nan')):9.1f} "
                     f"{e.get('copy_same_bytes_pct', float('nan')):9.1f} "
                     f"{(ratio if ratio is not None else float('nan')):6.2f}  {why}")
    return lines
