"""Timing MLX work: warm-up, then the median of repeated runs, each synchronised with ``mx.eval``.

MLX is lazy: a call only builds a graph. Every timed run therefore ends in
``mx.eval(result)``, which waits for the device (on Metal, for the command buffer to
complete). The first runs compile kernels (Metal pipelines, or the emulator's C++
build) and are not timed.

    t = measure(lambda: xk.gemm_av(a, b), warmup=2, repeats=10)
    t.median_s, t.min_s, t.output   # output: the first warm-up's result (for a correctness check)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx

__all__ = ["Timing", "measure", "chained_repeats", "marginal_calls", "measure_chained", "measure_chained_pair",
           "marginal_fields", "measure_marginal", "measure_marginal_pair", "measure_pipelined", "measure_pipelined_pair", "measure_queued",
           "measure_step_loop", "sync", "throughput"]


def sync(out: Any) -> Any:
    """Evaluate an op's result (an array, or a tuple/list/dict of arrays); returns it."""
    if out is None:
        return out
    if isinstance(out, mx.array):
        mx.eval(out)
    elif isinstance(out, dict):
        mx.eval(*[v for v in out.values() if isinstance(v, mx.array)])
    elif isinstance(out, (list, tuple)):
        mx.eval(*[v for v in out if isinstance(v, mx.array)])
    return out


@dataclass
class Timing:
    """Seconds per run of one callable (after warm-up)."""

    median_s: float
    min_s: float
    max_s: float
    times_s: list[float]
    warmup: int
    output: Any = field(default=None, repr=False)  # the first warm-up's (evaluated) result

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    def to_dict(self) -> dict[str, Any]:
        return {"median_s": self.median_s, "min_s": self.min_s, "max_s": self.max_s,
                "repeats": len(self.times_s), "warmup": self.warmup}


def measure(fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 10, max_seconds: float | None = None) -> Timing:
    """Run `fn` `warmup` times untimed (at least once: compiles), then `repeats` timed runs.

    Each run is ``mx.eval(fn())``. Returns the median, min and max over the timed runs.
    `max_seconds`: stop repeating once this much time was spent on timed runs (at least
    one timed run always happens), so a slow case does not hold up a sweep.
    """
    if repeats < 1:
        raise ValueError(f"measure: repeats must be >= 1, got {repeats}")
    first = sync(fn())
    for _ in range(max(0, warmup - 1)):
        sync(fn())
    times: list[float] = []
    spent = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(fn())
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
        if max_seconds is not None and spent >= max_seconds:
            break
    return Timing(statistics.median(times), min(times), max(times), times, max(1, warmup), first)


def measure_queued(fn: Callable[[], Any], *, calls: int = 20, repeats: int = 5) -> float:
    """Seconds per call when `calls` calls are queued and evaluated together (median of
    `repeats` batches, after a warm-up batch): the throughput a model's forward sees,
    where the host builds the next ops while the GPU runs (no per-call sync)."""
    if calls < 1 or repeats < 1:
        raise ValueError(f"measure_queued: calls and repeats must be >= 1, got {calls}, {repeats}")
    mx.eval([fn() for _ in range(calls)])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def measure_step_loop(step: Callable[[int], Any], n: int) -> tuple[float, float]:
    """(us per step of the whole loop, us per step of building alone) of ``step(i)`` for i
    in range(n), as a decode loop (mlx-lm's generate) runs its steps: step i is built, handed
    to ``mx.async_eval``, then step i - 1 is waited for, so the next step's building
    overlaps this one's GPU work."""
    if n < 1:
        raise ValueError(f"measure_step_loop: n must be >= 1, got {n}")
    t_host = 0.0
    prev = None
    t0 = time.perf_counter()
    for i in range(n):
        h0 = time.perf_counter()
        out = step(i)
        t_host += time.perf_counter() - h0
        mx.async_eval(out)
        if prev is not None:
            mx.eval(prev)
        prev = out
    mx.eval(prev)
    return (time.perf_counter() - t0) / n * 1e6, t_host / n * 1e6


def measure_pipelined(fn: Callable[[], Any], *, calls: int = 20, batches: int = 8, repeats: int = 3) -> float:
    """Seconds per call with evaluation pipelined: while the device runs one batch of `calls`
    queued calls (``mx.async_eval``), the host builds the next batch. This is how a model
    loop with asynchronous evaluation (mlx-lm's generate) overlaps its Python with the GPU:
    once steady, a call costs max(host time, device time), where ``measure_queued``
    (build, then evaluate) costs their sum. Median over `repeats` runs of `batches` batches
    (the first batch of a run is built before anything runs), after a warm-up batch."""
    if calls < 1 or batches < 1 or repeats < 1:
        raise ValueError(f"measure_pipelined: calls, batches and repeats must be >= 1, got {calls}, {batches}, "
                         f"{repeats}")
    mx.eval([fn() for _ in range(calls)])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        prev = [fn() for _ in range(calls)]
        mx.async_eval(prev)
        for _ in range(batches - 1):
            cur = [fn() for _ in range(calls)]
            mx.async_eval(cur)
            mx.eval(prev)
            prev = cur
        mx.eval(prev)
        times.append((time.perf_counter() - t0) / (calls * batches))
    return statistics.median(times)


def measure_pipelined_pair(ours: Callable[[], Any], theirs: Callable[[], Any], *, calls: int = 20,
                           batches: int = 8, repeats: int = 3) -> tuple[float, float]:
    """(ours, theirs): seconds per call as :func:`measure_pipelined` times them, the two
    interleaved (one run of `batches` batches of each per repeat, the order alternating),
    medians of `repeats`. A pipelined call whose host work nearly matches its device time
    moves with the host's state: the eager bfloat16 RMSNorm VJP at 4096x4096 read 0.57x and
    0.83x MLX in two back-to-back runs on one H100 with each side timed apart (session 20).
    Interleaved, drift during the measurement falls on both sides alike."""
    if calls < 1 or batches < 1 or repeats < 1:
        raise ValueError(f"measure_pipelined_pair: calls, batches and repeats must be >= 1, got {calls}, {batches}, "
                         f"{repeats}")
    a, b = [], []
    for i in range(repeats):
        first, second = ((ours, a), (theirs, b)) if i % 2 == 0 else ((theirs, b), (ours, a))
        for fn, out in (first, second):
            out.append(measure_pipelined(fn, calls=calls, batches=batches, repeats=1))
    return statistics.median(a), statistics.median(b)


def measure_chained(step: Callable[[Any], Any], x0: Any, *, calls: int = 20, repeats: int = 5,
                    keep: bool = False) -> float:
    """Seconds per call of `calls` calls that each take the last call's output as input
    (``x = step(x)``, starting from `x0`), built first, then evaluated together (median of
    `repeats`, after a warm-up call). A decode loop's shape: no call can start before the
    last one ends, where ``measure_queued``'s independent calls may overlap on the GPU (a
    CUDA graph runs independent kernels concurrently), which flatters kernels that leave
    most of the GPU idle. The graph building does not count; the evaluation's own host time
    (encoding kernels) does where the GPU waits for it: on MLX's CUDA backend a chain of 20
    calls of up to ~50 MB each is one CUDA graph, launched only after every call is encoded,
    so its time is the host's encoding plus the GPU's (session 26). :func:`measure_marginal`
    times the steady state instead.

    `keep`: every call's output stays referenced until the end, as a transformer's residual
    stream stays alive past the norm that reads it. Without it MLX may donate a call's
    input buffer to its output (an op of its own writes in place; a custom kernel always
    writes a new buffer), and an array that fits the last-level cache then stays there
    from call to call."""
    if calls < 1 or repeats < 1:
        raise ValueError(f"measure_chained: calls and repeats must be >= 1, got {calls}, {repeats}")
    mx.eval(step(x0))
    return statistics.median(_chain_once(step, x0, calls, keep) for _ in range(repeats))


def _chain_once(step: Callable[[Any], Any], x0: Any, calls: int, keep: bool) -> float:
    """Seconds per call of one evaluated chain of `calls` calls (see measure_chained)."""
    x = x0
    kept = []
    for _ in range(calls):
        x = step(x)
        if keep:
            kept.append(x)
    t0 = time.perf_counter()
    mx.eval(x)
    dt = (time.perf_counter() - t0) / calls
    del kept
    return dt


def chained_repeats(repeats: int) -> int:
    """Chains per side of a bench row with `repeats` (the CLI's --repeats): at least 5, odd."""
    n = max(5, repeats // 2)
    return n if n % 2 else n + 1


def measure_chained_pair(ours: Callable[[Any], Any], theirs: Callable[[Any], Any], x0: Any, *, calls: int = 20,
                         repeats: int = 7, keep: bool = False) -> tuple[float, float]:
    """(ours, theirs): seconds per call of chains as :func:`measure_chained` times them,
    the two interleaved (one chain of each per repeat, the order alternating), medians of
    `repeats`. A chain's time moves with the machine's state (clocks, the host's other
    work): RoPE's chained ratios at 16 MB, each side timed apart (3 repeats), moved by up
    to 0.8 between bench runs on the H200 (session 15). Interleaved, drift during the
    measurement falls on both sides alike."""
    if calls < 1 or repeats < 1:
        raise ValueError(f"measure_chained_pair: calls and repeats must be >= 1, got {calls}, {repeats}")
    mx.eval(ours(x0))
    mx.eval(theirs(x0))
    a, b = [], []
    for i in range(repeats):
        if i % 2 == 0:
            a.append(_chain_once(ours, x0, calls, keep))
            b.append(_chain_once(theirs, x0, calls, keep))
        else:
            b.append(_chain_once(theirs, x0, calls, keep))
            a.append(_chain_once(ours, x0, calls, keep))
    return statistics.median(a), statistics.median(b)


# Marginal chains (measure_marginal): MLX's CUDA backend records kernels into a CUDA graph and
# launches it only once the graph holds more than 100 nodes or about 1000 Mi input elements
# (H100 and newer; 20 nodes elsewhere: mlx/backend/cuda/device.cpp, get_graph_limits), or when
# the evaluation ends. A 20-call chain of a norm or RoPE row is one graph: the GPU starts only
# after the host has encoded every call, so the chain's time is host encoding plus GPU time,
# not the steady state, where the host encodes the next graph while the GPU runs this one.
MARGINAL_CALLS = 100  # the shorter chain (n1); the longer is 2 * n1
MARGINAL_MIN_CALLS = 8  # n1 at least this, whatever the memory cap
MARGINAL_KEPT_BYTES = 12 << 30  # kept chains: outputs of the longer chain held at once, at most


def marginal_calls(out_bytes: int, keep: bool) -> tuple[int, int]:
    """(n1, n2 = 2 * n1) calls of the two chains :func:`measure_marginal` takes the difference
    of, for a step whose output takes `out_bytes`: MARGINAL_CALLS, fewer where `keep` would
    hold more than MARGINAL_KEPT_BYTES of outputs (such calls are large, so MLX's graphs hold
    few of them), never fewer than MARGINAL_MIN_CALLS."""
    if out_bytes < 0:
        raise ValueError(f"marginal_calls: out_bytes must be >= 0, got {out_bytes}")
    n1 = MARGINAL_CALLS
    if keep and out_bytes > 0:
        n1 = min(n1, MARGINAL_KEPT_BYTES // (2 * out_bytes))
    n1 = max(MARGINAL_MIN_CALLS, n1)
    return n1, 2 * n1


def _out_bytes(out: Any) -> int:
    """Bytes of a step's output (an array, or a list / tuple of arrays)."""
    if isinstance(out, mx.array):
        return out.nbytes
    if isinstance(out, (list, tuple)):
        return sum(o.nbytes for o in out if isinstance(o, mx.array))
    return 0


def _chain_seconds(step: Callable[[Any], Any], x0: Any, calls: int, keep: bool) -> float:
    """Seconds of one evaluated chain of `calls` calls (the evaluation only, as _chain_once)."""
    return _chain_once(step, x0, calls, keep) * calls


def _marginal_once(step: Callable[[Any], Any], x0: Any, calls: tuple[int, int], keep: bool) -> float:
    """Seconds per call that the longer chain of `calls` takes beyond the shorter one."""
    n1, n2 = calls
    return (_chain_seconds(step, x0, n2, keep) - _chain_seconds(step, x0, n1, keep)) / (n2 - n1)


def measure_marginal(step: Callable[[Any], Any], x0: Any, *, repeats: int = 5, keep: bool = False,
                     calls: tuple[int, int] | None = None) -> float:
    """Seconds per call of a chain (``x = step(x)``, as :func:`measure_chained`) in its steady
    state: the time a chain of n2 calls takes beyond one of n1 (:func:`marginal_calls`; both
    built first, then evaluated), over n2 - n1; median of `repeats`, after a warm-up call.

    What the difference removes: the evaluation's start (MLX's CUDA backend launches its
    first graph only after encoding up to 100 calls, see MARGINAL_CALLS) and its end (the
    last graph's completion, the wait). What it keeps: each call's device time and the gaps
    between calls, or the host's encoding per call where that is longer (a small op's
    steady state is the host's). `calls`: (n1, n2) instead of marginal_calls'."""
    if repeats < 1:
        raise ValueError(f"measure_marginal: repeats must be >= 1, got {repeats}")
    out = step(x0)
    mx.eval(out)
    calls = calls or marginal_calls(_out_bytes(out), keep)
    if not (0 < calls[0] < calls[1]):
        raise ValueError(f"measure_marginal: calls must be (n1, n2) with 0 < n1 < n2, got {calls}")
    return statistics.median(_marginal_once(step, x0, calls, keep) for _ in range(repeats))


def measure_marginal_pair(ours: Callable[[Any], Any], theirs: Callable[[Any], Any], x0: Any, *,
                          repeats: int = 5, keep: bool = False) -> tuple[float, float]:
    """(ours, theirs): seconds per call as :func:`measure_marginal` times them, the two sides
    interleaved (one pair of chains of each per repeat, the order alternating, as
    :func:`measure_chained_pair`), medians of `repeats`; both sides take the (n1, n2) that
    our output's size gives."""
    if repeats < 1:
        raise ValueError(f"measure_marginal_pair: repeats must be >= 1, got {repeats}")
    out = ours(x0)
    mx.eval(out)
    mx.eval(theirs(x0))
    calls = marginal_calls(_out_bytes(out), keep)
    del out
    a, b = [], []
    for i in range(repeats):
        sides = ((ours, a), (theirs, b)) if i % 2 == 0 else ((theirs, b), (ours, a))
        for fn, acc in sides:
            acc.append(_marginal_once(fn, x0, calls, keep))
    return statistics.median(a), statistics.median(b)


def marginal_fields(ours_s: float, mlx_s: float, nbytes: float, keep: bool = False) -> dict[str, Any]:
    """A bench row's fields of a :func:`measure_marginal_pair` result: ours_marginal_ms,
    mlx_marginal_ms, ratio_marginal (MLX / ours), gbps_marginal (`nbytes` a call) and
    marginal_kept (`keep`, as the chains ran: the copy of the row's bytes is timed alike)."""
    return {"ours_marginal_ms": ours_s * 1e3, "mlx_marginal_ms": mlx_s * 1e3, "ratio_marginal": mlx_s / ours_s,
            "gbps_marginal": nbytes / ours_s / 1e9, "marginal_kept": bool(keep)}


def measure_chained_variants(variants: Sequence[tuple[str, Callable[[], Callable[[Any], Any]]]], x0: Any, *,
                             calls: int = 20, repeats: int = 11, keep: bool = False,
                             marginal: bool = False) -> dict[str, list[float]]:
    """Seconds per call of chains (as :func:`measure_chained` times them) of several
    variants, interleaved: every repeat runs one chain of each variant, the order rotated
    by one place per repeat, so that the machine's drift falls on all of them alike (the
    probes' form of :func:`measure_chained_pair`).

    `variants`: (name, prepare) pairs. ``prepare()`` sets its variant up (module constants,
    cleared memos) and returns the step; it runs before each of the variant's chains,
    followed by one call and a two-call chain that are not timed (they compile kernels and
    record any replayed graph). Returns name -> the `repeats` times, in repeat order (a
    caller picks the statistic: :func:`fastest_quarter` is the steadiest on a GPU).
    `marginal`: each time is :func:`measure_marginal`'s (the chain's steady state; its
    (n1, n2) from the step's output size) instead of a `calls`-call chain's."""
    if calls < 1 or repeats < 1 or not variants:
        raise ValueError(f"measure_chained_variants: calls and repeats must be >= 1 and variants not empty, got "
                         f"{calls}, {repeats}, {len(variants)}")
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for r in range(repeats):
        shift = r % len(variants)
        for name, prepare in list(variants[shift:]) + list(variants[:shift]):
            step = prepare()
            mx.eval(step(x0))
            out = step(step(x0))
            mx.eval(out)
            if marginal:
                times[name].append(_marginal_once(step, x0, marginal_calls(_out_bytes(out), keep), keep))
            else:
                times[name].append(_chain_once(step, x0, calls, keep))
    return times


def fastest_quarter(times: Sequence[float]) -> float:
    """The first quartile of `times` (the fastest quarter's upper end): on a GPU, repeats
    of one plan agree within a few percent there while their medians move by up to 15%
    (session 17)."""
    if not times:
        raise ValueError("fastest_quarter: no times")
    return sorted(times)[len(times) // 4]


def throughput(ours: Callable[[], Any], base: Callable[[], Any], *, repeats: int = 10, calls: int = 20) -> dict:
    """Queued and pipelined seconds per call of our op and MLX's (`base`), in ms, with the
    ratios (MLX / ours; > 1: ours faster):

    * queued: `calls` calls built, then evaluated together (host build + device time);
    * pipelined: the next batch built while the device runs the last (``mx.async_eval``):
      what a model loop with asynchronous evaluation sees (max of host and device time).
    """
    n = max(3, repeats // 4)
    q_ours, q_base = measure_queued(ours, calls=calls, repeats=n), measure_queued(base, calls=calls, repeats=n)
    p_ours, p_base = measure_pipelined_pair(ours, base, calls=calls, repeats=n)
    ratio = lambda b, o: b / o if o > 0 else None  # noqa: E731
    return {"ours_queued_ms": q_ours * 1e3, "mlx_queued_ms": q_base * 1e3, "ratio_queued": ratio(q_base, q_ours),
            "ours_pipelined_ms": p_ours * 1e3, "mlx_pipelined_ms": p_base * 1e3,
            "ratio_pipelined": ratio(p_base, p_ours)}
