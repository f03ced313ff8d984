"""The bench's copy-bandwidth instrument: the copy_words kernel and the target view of rows."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels.benchmarks import copy_rate


def _random(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype == mx.uint32:
        return mx.array(rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32))
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("shape,dtype", [
    ((1,), mx.float32),             # one word: no whole run, the tail only
    ((33, 29), mx.float32),         # 957 words: 239 runs and a tail of 1
    ((2, 3, 5), mx.float32),
    ((6, 7), mx.float16),           # 21 words
    ((17, 4), mx.bfloat16),
    ((4 * 300 + 3,), mx.uint32),    # 300 runs (two threadgroups) and a tail of 3
])
def test_copy_words_copies_every_bit(backend, shape, dtype):
    x = _random(shape, dtype, seed=len(shape) * 100 + shape[0])
    y = copy_rate.copy_words(x, backend)
    mx.eval(y)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert np.array_equal(np.asarray(y.view(mx.uint8) if dtype != mx.uint32 else y),
                          np.asarray(x.view(mx.uint8) if dtype != mx.uint32 else x))


def test_copy_words_grid_stride(backend, monkeypatch):
    """A grid smaller than the runs: each thread copies several runs (as at 1 GiB)."""
    monkeypatch.setattr(copy_rate, "_MAX_THREADS", 256)
    x = _random((4 * 1000 + 2,), mx.uint32, seed=7)
    y = copy_rate.copy_words(x, backend)
    assert np.array_equal(np.asarray(y), np.asarray(x))


def test_copy_words_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        copy_rate.copy_words(mx.zeros((3,), dtype=mx.float16))
    with pytest.raises(TypeError, match="mx.array"):
        copy_rate.copy_words(np.zeros(4, dtype=np.float32))


def test_no_copy_rate_without_a_gpu():
    assert copy_rate.measure_copy_rate("emulate") is None
    assert copy_rate.measure_copy_rate("reference") is None


def test_annotate_rows_and_summary():
    rows = [
        # 100 MB moved: ours 25 us pipelined (4000 GB/s), MLX 30 us (3333 GB/s)
        {"op": "rms_norm", "shape": "1x1", "dtype": "bfloat16", "metric": "GB/s", "gbps": 2000.0, "ours_ms": 0.05,
         "baseline_ms": 0.06, "extra": {"ours_pipelined_ms": 0.025, "mlx_pipelined_ms": 0.030}},
        # chained times come first where a row has them (here: ours 50 us, MLX 40 us)
        {"op": "attention_decode", "shape": "3x3", "dtype": "float16", "metric": "GB/s", "gbps": 2000.0,
         "ours_ms": 0.05, "baseline_ms": 0.06, "extra": {"ours_pipelined_ms": 0.025, "mlx_pipelined_ms": 0.030,
                                                         "ours_chained_ms": 0.05, "mlx_chained_ms": 0.04}},
        # no pipelined times: the synchronised ones (1000 GB/s, MLX faster)
        {"op": "rope", "shape": "2x2", "dtype": "float16", "metric": "GB/s", "gbps": 1000.0, "ours_ms": 0.1,
         "baseline_ms": 0.08, "extra": {}},
        {"op": "gemm_av", "metric": "GFLOP/s", "gbps": 10.0, "ours_ms": 1.0, "extra": {}},  # not memory-bound
        # memory-bound, but no op of the target (a recurrence): rates and ratio, no verdict
        {"op": "slstm", "shape": "2x512x4x64", "dtype": "float32", "metric": "GB/s", "gbps": 10.0, "ours_ms": 1.0,
         "baseline_ms": 100.0, "extra": {}},
    ]
    copy_rate.annotate_rows(rows, 4000.0)
    a, d, b, c, s = (r["extra"] for r in rows)
    assert math.isclose(s["ratio_steady"], 100.0) and "pct_copy" in s
    assert "meets_copy" not in s and "meets_ratio" not in s
    assert d["steady"] == "chained" and math.isclose(d["pct_copy"], 50.0) and math.isclose(d["ratio_steady"], 0.8)
    assert d["meets_copy"] is False and d["meets_ratio"] is False
    assert a["steady"] == "pipelined" and math.isclose(a["pct_copy"], 100.0)
    assert math.isclose(a["mlx_pct_copy"], 100.0 * 25 / 30) and math.isclose(a["ratio_steady"], 1.2)
    assert a["meets_copy"] and a["meets_ratio"]
    assert b["steady"] == "synchronised" and math.isclose(b["pct_copy"], 25.0)
    assert not b["meets_copy"] and not b["meets_ratio"] and math.isclose(b["ratio_steady"], 0.8)
    assert "pct_copy" not in c
    kept = {"op": "rms_norm", "shape": "4x4", "dtype": "bfloat16", "metric": "GB/s", "gbps": 1000.0, "ours_ms": 0.1,
            "baseline_ms": 0.1, "extra": {"ours_chained_ms": 0.05, "mlx_chained_ms": 0.04,
                                          "ours_kept_ms": 0.04, "mlx_kept_ms": 0.05}}
    copy_rate.annotate_rows([kept], 4000.0)
    assert kept["extra"]["steady"] == "kept" and math.isclose(kept["extra"]["ratio_steady"], 1.25)
    lines = copy_rate.target_summary(rows, {"gbps": 4000.0, "kernel_gbps": 4000.0, "mlx_gbps": 3900.0,
                                            "bytes": 1 << 30, "chain": 8})
    assert "4,000 GB/s" in lines[0]
    assert lines[-3].rstrip().endswith(" met") and "not met: bandwidth, ratio" in lines[-1]
    assert "chained" in lines[-2] and "pipelined" in lines[-3] and "synchronised" in lines[-1]
    assert not any("slstm" in line for line in lines)
    assert [copy_rate.targeted({"op": op}) for op in ("rms_norm_vjp", "attention_decode_cache", "rope_transposed",
                                                       "multihead_layer_norm", "attention_prefill", "mlstm_step",
                                                       "gemm_av")] == [True, True, True, True, False, False, False]
    assert copy_rate.target_summary(rows, None) == []


def test_same_bytes_copy_annotation():
    """Each target row gets the share of the copy bandwidth a copy of its bytes reaches,
    measured once per (size, kept) and timed as the row's steady state; the verdict stays
    against the device's copy bandwidth; the summary prints the column."""
    rows = [
        # 100 MB moved (50 MB buffer), chained
        {"op": "rope", "shape": "a", "dtype": "float16", "metric": "GB/s", "gbps": 2000.0, "ours_ms": 0.05,
         "baseline_ms": 0.06, "extra": {"ours_chained_ms": 0.05, "mlx_chained_ms": 0.06}},
        {"op": "rope_traditional", "shape": "a", "dtype": "float16", "metric": "GB/s", "gbps": 2000.0,
         "ours_ms": 0.05, "baseline_ms": 0.06, "extra": {"ours_chained_ms": 0.04, "mlx_chained_ms": 0.06}},
        # the same bytes, kept: measured apart
        {"op": "rms_norm", "shape": "b", "dtype": "float16", "metric": "GB/s", "gbps": 2000.0, "ours_ms": 0.05,
         "baseline_ms": 0.06, "extra": {"ours_kept_ms": 0.05, "mlx_kept_ms": 0.06}},
        # not a target op: no column
        {"op": "mlstm_step", "shape": "c", "dtype": "float16", "metric": "GB/s", "gbps": 10.0, "ours_ms": 1.0,
         "baseline_ms": 2.0, "extra": {}},
    ]
    copy_rate.annotate_rows(rows, 4000.0)
    calls = []

    def fake(backend, nbytes, keep=False):
        calls.append((backend, nbytes, keep))
        return 3000.0 if keep else 2000.0

    copy_rate.annotate_same_bytes(rows, 4000.0, "cuda", measure=fake, readings=1)
    assert calls == [("cuda", 50_000_000, False), ("cuda", 50_000_000, True)]
    e = [r["extra"] for r in rows]
    assert math.isclose(e[0]["copy_same_bytes_pct"], 50.0) and math.isclose(e[1]["copy_same_bytes_pct"], 50.0)
    assert math.isclose(e[2]["copy_same_bytes_pct"], 75.0) and "copy_same_bytes_pct" not in e[3]
    assert e[0]["meets_copy"] is False  # 50% of 4000 GB/s: the verdict is unchanged
    lines = copy_rate.target_summary(rows, {"gbps": 4000.0, "kernel_gbps": 4000.0, "mlx_gbps": 3900.0,
                                            "bytes": 1 << 30, "chain": 8})
    assert any("copy@size" in line for line in lines)
    assert "  75.0 " in lines[-1] and lines[-1].rstrip().endswith("not met: bandwidth")
    copy_rate.annotate_same_bytes(rows, None, "cuda", measure=fake)  # no copy bandwidth: nothing measured
    assert len(calls) == 2
    assert copy_rate.measure_copy_at("emulate", 1 << 20) is None


@pytest.mark.parametrize("extra,want", [
    ({"meets_copy": True, "meets_ratio": True, "ratio_steady": 1.3, "copy_same_bytes_pct": 90.0}, ("met", "met")),
    ({"meets_copy": False, "meets_ratio": True, "ratio_steady": 1.3, "copy_same_bytes_pct": 62.0},
     ("unreachable", "met")),
    ({"meets_copy": False, "meets_ratio": False, "ratio_steady": 0.985, "copy_same_bytes_pct": 85.0},
     ("below", "parity")),
    ({"meets_copy": True, "meets_ratio": False, "ratio_steady": 0.87}, ("met", "below")),
    ({"meets_copy": False, "meets_ratio": False, "ratio_steady": 0.5}, ("below", "below")),  # no copy@size
    # a copy of the row's bytes beats the large copy: its chain runs from the cache
    ({"meets_copy": True, "meets_ratio": True, "ratio_steady": 2.1, "copy_same_bytes_pct": 124.7}, ("cached", "met")),
    ({"meets_copy": False, "meets_ratio": True, "ratio_steady": 1.1, "copy_same_bytes_pct": 100.5},
     ("cached", "met")),
    # the row itself beats the large copy (its input still in the cache), whatever its copy@size
    ({"meets_copy": True, "meets_ratio": True, "ratio_steady": 1.2, "pct_copy": 113.6, "copy_same_bytes_pct": 86.4},
     ("cached", "met")),
    ({"meets_copy": True, "meets_ratio": True, "ratio_steady": 1.2, "pct_copy": 99.9, "copy_same_bytes_pct": 86.4},
     ("met", "met")),
])
def test_miss_reasons_names_what_a_row_misses(extra, want):
    assert copy_rate.miss_reasons(extra) == want


def test_miss_reasons_parity_threshold():
    extra = {"meets_copy": True, "meets_ratio": False, "ratio_steady": 0.96}
    assert copy_rate.miss_reasons(extra, parity=0.95) == ("met", "parity")
    assert copy_rate.miss_reasons(extra, parity=0.98) == ("met", "below")


# ---------------------------------------------------------------------------------------
# Marginal chains: a chain's steady state (timing.measure_marginal, session 26)
# ---------------------------------------------------------------------------------------


def test_marginal_calls_rule():
    """n1 = MARGINAL_CALLS, capped where a kept chain of 2 * n1 outputs would pass
    MARGINAL_KEPT_BYTES, never below MARGINAL_MIN_CALLS; n2 = 2 * n1."""
    from xlstm_kernels.benchmarks import timing

    assert timing.marginal_calls(4 << 20, keep=False) == (100, 200)
    assert timing.marginal_calls(1 << 30, keep=False) == (100, 200)  # nothing held: no cap
    assert timing.marginal_calls(4 << 20, keep=True) == (100, 200)  # 800 MiB held
    assert timing.marginal_calls(64 << 20, keep=True) == (96, 192)  # 12 GiB / 128 MiB
    assert timing.marginal_calls(1 << 30, keep=True) == (8, 16)  # at least MARGINAL_MIN_CALLS
    assert timing.marginal_calls(0, keep=True) == (100, 200)
    with pytest.raises(ValueError, match="marginal_calls"):
        timing.marginal_calls(-1, keep=False)


def test_measure_marginal_is_the_longer_chains_extra_time(monkeypatch):
    """Per repeat, one chain of n2 calls and one of n1, each fed its last output (the first
    call x0); the result is their time difference over n2 - n1 (median of the repeats)."""
    from xlstm_kernels.benchmarks import timing

    x0 = mx.array(np.random.default_rng(8).standard_normal(16).astype(np.float32))
    seen = []

    def step(x):
        seen.append(x)
        return x * 0.5 + 1.0

    t = timing.measure_marginal(step, x0, repeats=2, calls=(2, 5))
    assert isinstance(t, float) and len(seen) == 1 + 2 * (5 + 2)
    for start, n in ((1, 5), (6, 2), (8, 5), (13, 2)):
        chain = seen[start:start + n]
        assert chain[0] is x0
        for prev, cur in zip(chain, chain[1:]):
            np.testing.assert_allclose(np.asarray(cur), np.asarray(prev) * 0.5 + 1.0, rtol=1e-6)
    # the arithmetic, with chains of a fixed cost (30 us) plus 7 us a call
    monkeypatch.setattr(timing, "_chain_seconds", lambda step, x0, calls, keep: 30e-6 + 7e-6 * calls)
    assert math.isclose(timing.measure_marginal(step, x0, repeats=3, calls=(10, 30)), 7e-6)
    assert math.isclose(timing.measure_marginal(step, x0, repeats=1), 7e-6)  # marginal_calls' (n1, n2)
    for bad in ({"repeats": 0}, {"calls": (5, 5)}, {"calls": (0, 4)}):
        with pytest.raises(ValueError, match="measure_marginal"):
            timing.measure_marginal(step, x0, **bad)


def test_measure_marginal_pair_interleaves_and_shares_the_calls(monkeypatch):
    """Per repeat one marginal pair of chains of each side, the side that goes first
    alternating; both sides take the (n1, n2) of our output's size; kept chains pass keep."""
    from xlstm_kernels.benchmarks import timing

    x0 = mx.array(np.random.default_rng(9).standard_normal(8).astype(np.float32))
    runs = []

    def fake_chain(step, x, calls, keep):
        runs.append((step.tag, calls, keep))
        return (2e-6 if step.tag == "o" else 3e-6) * calls + 1e-3

    def make(tag):
        def step(x):
            return x + 1.0
        step.tag = tag
        return step

    monkeypatch.setattr(timing, "_chain_seconds", fake_chain)
    monkeypatch.setattr(timing, "marginal_calls", lambda nbytes, keep: (3, 6) if nbytes == x0.nbytes else None)
    ours, theirs = timing.measure_marginal_pair(make("o"), make("t"), x0, repeats=3, keep=True)
    assert math.isclose(ours, 2e-6) and math.isclose(theirs, 3e-6)
    assert [r[0] for r in runs] == list("oottttoooott")
    assert {r[1] for r in runs} == {3, 6} and all(r[2] is True for r in runs)
    with pytest.raises(ValueError, match="measure_marginal_pair"):
        timing.measure_marginal_pair(make("o"), make("t"), x0, repeats=0)
    fields = timing.marginal_fields(ours, theirs, 6e6, keep=True)
    assert math.isclose(fields["ratio_marginal"], 1.5) and math.isclose(fields["gbps_marginal"], 3000.0)
    assert math.isclose(fields["ours_marginal_ms"], 2e-3) and fields["marginal_kept"] is True


def test_marginal_rows_are_the_steady_state_and_their_copy_is_timed_alike():
    """A row with marginal times is judged at them (before kept / chained); its copy of the
    same bytes is measured marginal, kept where the row's chains were."""
    rows = [
        {"op": "rms_norm", "shape": "a", "dtype": "float16", "metric": "GB/s", "gbps": 2000.0, "ours_ms": 0.05,
         "baseline_ms": 0.06, "extra": {"ours_marginal_ms": 0.04, "mlx_marginal_ms": 0.05, "marginal_kept": True,
                                        "ours_kept_ms": 0.05, "mlx_kept_ms": 0.045}},
        {"op": "rope", "shape": "a", "dtype": "float16", "metric": "GB/s", "gbps": 2000.0, "ours_ms": 0.05,
         "baseline_ms": 0.06, "extra": {"ours_marginal_ms": 0.05, "mlx_marginal_ms": 0.04, "marginal_kept": False,
                                        "ours_chained_ms": 0.06, "mlx_chained_ms": 0.06}},
    ]
    copy_rate.annotate_rows(rows, 4000.0)
    a, b = rows[0]["extra"], rows[1]["extra"]
    assert a["steady"] == "marginal" and math.isclose(a["ratio_steady"], 1.25) and math.isclose(a["pct_copy"], 62.5)
    assert b["steady"] == "marginal" and math.isclose(b["ratio_steady"], 0.8) and not b["meets_ratio"]
    calls = []

    def fake(backend, nbytes, keep=False, marginal=False):
        calls.append((nbytes, keep, marginal))
        return 3600.0

    copy_rate.annotate_same_bytes(rows, 4000.0, "cuda", measure=fake)
    n = copy_rate.COPY_AT_READINGS
    assert calls == [(50_000_000, True, True)] * n + [(50_000_000, False, True)] * n
    assert math.isclose(a["copy_same_bytes_pct"], 90.0)
    assert copy_rate.miss_reasons(a) == ("below", "met") and copy_rate.miss_reasons(b) == ("below", "below")


def test_copy_at_size_is_the_best_reading_of_one_nominal_size():
    """copy@size is the highest of its readings (one slow reading must not excuse a row as
    'unreachable'), measured once for rows whose bytes differ only by the float error of
    GB/s x ms, and None readings (no GPU) leave the rows without the column."""
    def row(op, gbps, ms):
        return {"op": op, "shape": "a", "dtype": "float16", "metric": "GB/s", "gbps": gbps, "ours_ms": ms,
                "baseline_ms": 0.06, "extra": {"ours_marginal_ms": 0.031, "mlx_marginal_ms": 0.034,
                                               "marginal_kept": True}}  # 72% of 3000 GB/s, 1.1x

    nbytes = 67_108_864.0  # 64 MiB moved: a copy of 32 MiB
    rows = [row("attention_decode", nbytes / ms / 1e6, ms) for ms in (0.02531, 0.02008)]
    moved = [r["gbps"] * r["ours_ms"] * 1e6 for r in rows]
    assert moved[0] < nbytes < moved[1]  # the float error of GB/s x ms, which the size rounds away
    copy_rate.annotate_rows(rows, 3000.0)
    readings = iter([1731.0, 2586.0, 2184.0])
    calls = []

    def fake(backend, nbytes, keep=False, marginal=False):
        calls.append((nbytes, keep, marginal))
        return next(readings)

    copy_rate.annotate_same_bytes(rows, 3000.0, "cuda", measure=fake, readings=3)
    assert calls == [(33_554_432, True, True)] * 3
    assert all(math.isclose(r["extra"]["copy_same_bytes_pct"], 86.2) for r in rows)
    assert copy_rate.miss_reasons(rows[0]["extra"]) == ("below", "met")  # 57.7% alone would say 'unreachable'

    fresh = [row("rms_norm", 2000.0, 0.05)]
    copy_rate.annotate_rows(fresh, 3000.0)
    copy_rate.annotate_same_bytes(fresh, 3000.0, "emulate", measure=lambda *a, **k: None)
    assert "copy_same_bytes_pct" not in fresh[0]["extra"]
    with pytest.raises(ValueError, match="readings must be >= 1, got 0"):
        copy_rate.annotate_same_bytes(fresh, 3000.0, "cuda", measure=fake, readings=0)
