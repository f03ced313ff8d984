"""Attention family (metal_src/attention.metal, xlstm_kernels/ops/attention.py).

Oracles: a float64 NumPy attention (and its analytic gradients) computed from the
dtype-rounded inputs, and mx.fast.scaled_dot_product_attention (MLX's CPU path) for the
float32 semantics (masked rows, NaN rows, causal alignment). Shapes stay small: the
emulator runs about 1M threads/s and compiles each template once.
"""

from __future__ import annotations

import zlib

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels import emulate, runtime
from xlstm_kernels.runtime import current_backend
from xlstm_kernels.ops import attention as att

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
MASKS = ("none", "causal", "bool", "additive")


# ---------------------------------------------------------------------------------------
# Inputs and references
# ---------------------------------------------------------------------------------------


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def rand(rng, shape, dtype, scale=1.0) -> mx.array:
    x = rng.standard_normal(shape).astype(np.float32) * scale
    x[x == 0] = 0.5
    return mx.array(x).astype(dtype)


def f64(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32)).astype(np.float64)


def make_qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed):
    rng = np.random.default_rng(seed)
    return rand(rng, (b, hq, lq, d), dtype), rand(rng, (b, hkv, lk, d), dtype), rand(rng, (b, hkv, lk, dv), dtype)


def make_mask(kind: str, b, hq, lq, lk, dtype, seed, layout: str = "default"):
    """None, "causal", a boolean (B, 1, Lq, Lk) mask with row 1 fully masked, or an
    additive mask ((Lq, Lk), or (Hq, 1, Lk) with layout="head") with some -inf entries
    (key 0 always finite, so no row is all -inf)."""
    rng = np.random.default_rng(seed + 1)
    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    if kind == "bool":
        m = rng.random((b, 1, lq, lk)) < 0.7
        if lq > 1:
            m[:, :, 1, :] = False  # a row with every key masked: uniform average, as in MLX
        return mx.array(m)
    shape = (hq, 1, lk) if layout == "head" else (lq, lk)
    a = rng.standard_normal(shape).astype(np.float32)
    a[rng.random(shape) < 0.15] = -np.inf
    a[..., 0] = 0.25
    return mx.array(a).astype(dtype)


def np_mask4(mask, b, hq, lq, lk):
    """(kind, float64/bool array broadcast to (B, Hq, Lq, Lk) or None)."""
    if mask is None:
        return "none", None
    if isinstance(mask, str):
        allowed = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq)
        return "bool", np.broadcast_to(allowed, (b, hq, lq, lk))
    arr = np.asarray(mask) if mask.dtype == mx.bool_ else f64(mask)
    return ("bool" if mask.dtype == mx.bool_ else "add"), np.broadcast_to(arr, (b, hq, lq, lk))


def np_attention(q, k, v, scale, mask, with_probs=False):
    """float64 attention of mx inputs; masked scores -> finfo(float64).min like MLX."""
    qd, kd, vd = f64(q), f64(k), f64(v)
    b, hq, lq, _ = qd.shape
    lk = kd.shape[2]
    g = hq // kd.shape[1]
    kk, vv = np.repeat(kd, g, axis=1), np.repeat(vd, g, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", qd, kk) * scale
    kind, m = np_mask4(mask, b, hq, lq, lk)
    if kind == "bool":
        s = np.where(m, s, np.finfo(np.float64).min)
    elif kind == "add":
        s = s + m
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = p @ vv
    return (o, p, kk, vv, qd) if with_probs else o


def np_attention_grads(q, k, v, scale, mask, do):
    """Analytic float64 (dq, dk, dv, d(additive mask) summed to the mask's shape)."""
    _, p, kk, vv, qd = np_attention(q, k, v, scale, mask, with_probs=True)
    b, hq, lq, _ = qd.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    dv_full = np.einsum("bhqk,bhqd->bhkd", p, do)
    dp = np.einsum("bhqd,bhkd->bhqk", do, vv)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    kind, m = np_mask4(mask, b, hq, lq, lk)
    if kind == "bool":
        ds = np.where(m, ds, 0.0)  # a masked score is a constant: no gradient flows through it
    dq = scale * np.einsum("bhqk,bhkd->bhqd", ds, kk)
    dk_full = scale * np.einsum("bhqk,bhqd->bhkd", ds, qd)
    dk = dk_full.reshape(b, hkv, g, lk, -1).sum(axis=2)
    dv = dv_full.reshape(b, hkv, g, lk, -1).sum(axis=2)
    dm = None
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        shape4 = (1,) * (4 - mask.ndim) + tuple(mask.shape)
        axes = tuple(i for i, s in enumerate(shape4) if s == 1)
        dm = ds.sum(axis=axes, keepdims=True).reshape(mask.shape)
    return dq, dk, dv, dm


def tolerance(dtype) -> float:
    return 1e-5 if dtype == mx.float32 else 1e-2 if dtype == mx.float16 else 2e-2


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def assert_close(out: mx.array, ref: np.ndarray, dtype, what: str, tol: float | None = None) -> None:
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == dtype, f"{what}: dtype {out.dtype} != {dtype}"
    got = f64(out)
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    assert np.max(np.abs(ref)) > 0, f"{what}: degenerate reference"
    tol = tolerance(dtype) if tol is None else tol
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


class LaunchSpy:
    """Records the kernels the attention ops launch (and still runs them). The op's call memo
    is cleared first: a call replayed from an earlier recording (cuda) launches nothing here,
    and module settings a test patches are read when a call is built."""

    def __init__(self, monkeypatch):
        from launch_spies import clear_call_memos

        clear_call_memos(att)
        self.kernels: list[str] = []
        self.templates: list[dict] = []
        real = att.launch
        real_prepare = att.prepare_launch

        def spy(spec, **kwargs):
            self.kernels.append(spec.kernel)
            self.templates.append(dict(kwargs.get("template") or []))
            return real(spec, **kwargs)

        def spy_prepare(spec, **kwargs):  # prepared launches (split-KV plans): recorded per run
            run = real_prepare(spec, **kwargs)
            template = dict(kwargs.get("template") or [])

            def recorded(inputs):
                self.kernels.append(spec.kernel)
                self.templates.append(template)
                return run(inputs)

            return recorded

        monkeypatch.setattr(att, "launch", spy)
        monkeypatch.setattr(att, "prepare_launch", spy_prepare)


# split-KV pass 1: attention_partial (lane walk) / attention_partial_mma (tiles) / the tiles
# with their key blocks merged in threadgroup clusters (backends that have them) / one-launch
# decode, no split (attention_decode_stream)
WALKS = ("lane", "mma", "cluster", "stream")
PARTIAL_KERNEL = {"lane": "attention_partial", "mma": "attention_partial_mma", "cluster": "attention_partial_mma",
                  "stream": "attention_decode_stream"}


def set_walk(monkeypatch, walk: str) -> None:
    """Pin the split-KV pass 1 through its knobs' variables (the op's default: mma for 2-byte
    dtypes, lane for float32, no clusters, one-launch decode only by its automatic rule):
    "mma" without clusters, "cluster" with clusters of up to 8 blocks (the largest divisor of
    the block count; skipped where the backend runs no clusters: Apple GPUs, cuda before
    sm_90 or with MLX's CUDA graphs on), "stream" one-launch decode wherever it can run
    (ops.attention._stream_refusal; elsewhere the tile pair)."""
    if walk == "cluster" and not att._has_clusters(current_backend()):
        pytest.skip(att._cluster_support(current_backend()))
    monkeypatch.setenv("XLSTM_ATTENTION_SPLIT_KV_MMA", "0" if walk == "lane" else "1")
    monkeypatch.setenv("XLSTM_ATTENTION_SPLIT_KV_CLUSTER", "8" if walk == "cluster" else "0")
    monkeypatch.setenv("XLSTM_ATTENTION_SPLIT_KV_STREAM", "1" if walk == "stream" else "0")


def assert_split_kernels(spy, walk: str, n_blocks: int, backend: str) -> None:
    """The launches of one split-KV call on `walk`: pass 1 and pass 2, or pass 1 alone where
    a cluster merged all n_blocks key blocks. Walk "cluster" (which runs only where the
    backend has clusters) must run in clusters of the largest divisor of the block count up
    to 8 wherever the tile plan has several simdgroups a threadgroup."""
    t = spy.templates[0]
    if walk == "stream":
        assert spy.kernels == ["attention_decode_stream"]
        return
    if walk != "cluster":
        assert spy.kernels == [PARTIAL_KERNEL[walk], "attention_reduce"]
        assert t.get("XK_CLUSTER", 1) == 1
        return
    c = t["XK_CLUSTER"]
    assert c == (max(n for n in range(1, 9) if n_blocks % n == 0) if t["NW"] > 1 else 1), (c, n_blocks)
    assert spy.kernels == (["attention_partial_mma"] if c == n_blocks and c > 1
                           else ["attention_partial_mma", "attention_reduce"])


# (B, Hq, Hkv, Lq, Lk, D, DV, additive mask layout): GQA ratios 1/4/8, query lengths
# 1/3/8/33, key lengths 37/130 (not multiples of the KV tiles or blocks), head dims 64/128/80.
CASES = {
    "b2_gqa1_q33_k37_d64": (2, 2, 2, 33, 37, 64, 64, "default"),
    "b1_gqa4_q8_k130_d128": (1, 4, 1, 8, 130, 128, 128, "head"),
    "b1_gqa8_q3_k37_d64": (1, 8, 1, 3, 37, 64, 64, "default"),
    "b1_gqa4_q1_k130_d80": (1, 4, 1, 1, 130, 80, 80, "head"),
}


# ---------------------------------------------------------------------------------------
# Forward: prefill kernel and split-KV pair against float64
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_prefill_matches_float64(kernel_backend, case, mask_kind, dtype_name):
    b, hq, hkv, lq, lk, d, dv, layout = CASES[case]
    dtype = DTYPES[dtype_name]
    seed = seed_of("prefill", case, mask_kind, dtype_name)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, dtype, seed, layout)
    scale = d**-0.5
    out = att.attention_prefill(q, k, v, scale=scale, mask=mask)
    assert_close(out, np_attention(q, k, v, scale, mask), dtype, f"prefill {case} {mask_kind}")


SPLIT_CASES = {
    "b1_gqa4_q1_k130_d128_bs32": (1, 4, 1, 1, 130, 128, 128, "head", 32),
    "b2_gqa8_q3_k37_d64_bs16": (2, 8, 1, 3, 37, 64, 64, "default", 16),
    "b1_gqa1_q8_k130_d80_bs64": (1, 2, 2, 8, 130, 80, 80, "default", 64),
}


@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("case", list(SPLIT_CASES))
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_split_kv_matches_float64(kernel_backend, monkeypatch, case, mask_kind, dtype_name, walk):
    set_walk(monkeypatch, walk)
    b, hq, hkv, lq, lk, d, dv, layout, bs = SPLIT_CASES[case]
    dtype = DTYPES[dtype_name]
    seed = seed_of("split", case, mask_kind, dtype_name)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, dtype, seed, layout)
    scale = d**-0.5
    out = att.attention_decode_split_kv(q, k, v, scale=scale, mask=mask, block_size=bs)
    assert_close(out, np_attention(q, k, v, scale, mask), dtype, f"split-KV {case} {mask_kind}")


@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("block_size", [16, 48, 256])
def test_split_kv_equals_single_pass(kernel_backend, monkeypatch, mask_kind, block_size, walk):
    set_walk(monkeypatch, walk)  # float32: the tiles' products are exact float32 too
    b, hq, hkv, lq, lk, d = 1, 4, 1, 3, 130, 64
    seed = seed_of("split=single", mask_kind, block_size)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, mx.float32, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, mx.float32, seed)
    single = att.attention_prefill(q, k, v, scale=0.125, mask=mask)
    split = att.attention_decode_split_kv(q, k, v, scale=0.125, mask=mask, block_size=block_size)
    assert_close(split, f64(single), mx.float32, f"split-KV (block {block_size}) vs single pass", tol=2e-6)


@pytest.mark.parametrize(
    "d, dv, dtype_name, block_q, block_k",
    [
        (36, 20, "float32", None, None),  # head dims not multiples of 8 (zero-padded tiles), D != DV
        (96, 96, "bfloat16", 16, 32),
        (256, 256, "float32", 32, 16),  # K and V tiles share threadgroup memory (> 32 KiB apart)
        (64, 64, "float16", 64, 8),
        (128, 64, "float32", 8, 24),
    ],
)
def test_head_dims_and_tiles(kernel_backend, d, dv, dtype_name, block_q, block_k):
    dtype = DTYPES[dtype_name]
    b, hq, hkv, lq, lk = 1, 2, 1, 19, 45
    seed = seed_of("tiles", d, dv, dtype_name, block_q, block_k)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed)
    scale = d**-0.5
    ref = np_attention(q, k, v, scale, "causal")
    out = att.attention_prefill(q, k, v, scale=scale, mask="causal", block_q=block_q, block_k=block_k)
    assert_close(out, ref, dtype, f"prefill D={d} DV={dv} tiles {block_q}x{block_k}")
    out = att.attention_decode_split_kv(q, k, v, scale=scale, mask="causal", block_size=16)
    assert_close(out, ref, dtype, f"split-KV D={d} DV={dv}")


# Tensor-core prefill (2-byte dtypes): T fragments for Q, K^T, V and P, RM = 2 row
# fragments per simdgroup when BQ is a multiple of 16, P staged through threadgroup
# memory. Query lengths span several 64-query blocks, key lengths several BK tiles
# with a partial last one.
@pytest.mark.parametrize("mask_kind", ["none", "causal", "additive"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_prefill_tensor_core_tiles(kernel_backend, monkeypatch, dtype_name, d, mask_kind):
    monkeypatch.setenv("XLSTM_ATTENTION_PREFILL_MMA", "0")  # attention_prefill (the 16 x 16 tiles: below)
    dtype = DTYPES[dtype_name]
    b, hq, hkv, lq, lk = 1, 4, 2, 130, 150
    seed = seed_of("tc prefill", dtype_name, d, mask_kind)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, dtype, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, dtype, seed)
    spy = LaunchSpy(monkeypatch)
    out = att.attention_prefill(q, k, v, scale=d**-0.5, mask=mask)
    assert_close(out, np_attention(q, k, v, d**-0.5, mask), dtype, f"prefill {dtype_name} D={d} {mask_kind}")
    if kernel_backend != "reference":
        t = spy.templates[-1]
        assert (t["BQ"], t["BK"], t["RM"]) == (64, 64 if d == 64 else 32, 2)


@pytest.mark.parametrize(
    "dtype_name, d, dv, block_q, block_k, rm",
    [
        ("float16", 64, 64, 8, 16, 1),  # one row fragment per simdgroup
        ("bfloat16", 40, 24, 24, 8, 1),  # BQ not a multiple of 16; odd head dims, D != DV
        ("float16", 128, 128, 48, 64, 2),  # 3 simdgroups; K and V share one buffer
        ("bfloat16", 16, 16, 32, 128, 2),  # BK wider than the head dim (Q staged in one chunk)
        ("float32", 64, 64, 64, 32, 1),  # float: exact path, RM = 1
    ],
)
def test_prefill_tile_variants(kernel_backend, monkeypatch, dtype_name, d, dv, block_q, block_k, rm):
    dtype = DTYPES[dtype_name]
    b, hq, hkv, lq, lk = 1, 2, 1, 53, 75
    seed = seed_of("tile variants", dtype_name, d, dv, block_q, block_k)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed)
    spy = LaunchSpy(monkeypatch)
    out = att.attention_prefill(q, k, v, scale=d**-0.5, mask="causal", block_q=block_q, block_k=block_k)
    assert_close(out, np_attention(q, k, v, d**-0.5, "causal"), dtype, f"prefill {dtype_name} {block_q}x{block_k}")
    if kernel_backend != "reference":
        assert spy.templates[-1]["RM"] == rm


# The tile prefill (attention_prefill_mma, 2-byte dtypes): every simdgroup layout (WM x RB),
# key tile and stage count, over query lengths spanning several blocks (the last partial),
# key lengths spanning several tiles (the last partial), GQA, head dims that are not
# multiples of 16 (zero-padded tiles), odd ones (element copies), D != DV, every mask.
PREFILL_MMA_CASES = {
    # (B, Hq, Hkv, Lq, Lk, D, DV, (WM, RB, BK, ST))
    "w4r1_bk16_st1_d64": (1, 4, 2, 130, 150, 64, 64, (4, 1, 16, 1)),
    "w2r2_bk32_st2_d48": (1, 2, 1, 150, 130, 48, 48, (2, 2, 32, 2)),
    "w1r2_bk32_st3_d40_dv24": (2, 2, 2, 70, 90, 40, 24, (1, 2, 32, 3)),
    "w4r1_bk64_st2_d31_dv33": (1, 2, 1, 70, 100, 31, 33, (4, 1, 64, 2)),
    "w1r1_bk16_st2_d16_gqa4": (1, 8, 2, 19, 45, 16, 16, (1, 1, 16, 2)),
    "w2r1_bk48_st1_d96": (1, 2, 2, 33, 110, 96, 96, (2, 1, 48, 1)),
    "w2r1_bk32_st2_d64_dv128": (1, 4, 1, 66, 100, 64, 128, (2, 1, 32, 2)),  # swizzled tiles on cuda
    "w1r1_bk16_st1_d4_dv3": (2, 3, 1, 21, 35, 4, 3, (1, 1, 16, 1)),  # head dims below 8: element copies
}


def _check_tile_prefill(monkeypatch, shape, mask_kind, dtype_name, seed_label, case):
    """The tile prefill (knob prefill_mma on) of fresh (B, Hq, Hkv, Lq, Lk, D, DV) inputs and
    a `mask_kind` mask against the float64 reference; returns the launches' LaunchSpy."""
    b, hq, hkv, lq, lk, d, dv = shape
    dtype = DTYPES[dtype_name]
    monkeypatch.setenv("XLSTM_ATTENTION_PREFILL_MMA", "1")
    seed = seed_of(seed_label, case, mask_kind, dtype_name)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, dtype, seed, layout="head")
    spy = LaunchSpy(monkeypatch)
    out = att.attention_prefill(q, k, v, scale=d**-0.5, mask=mask)
    assert_close(out, np_attention(q, k, v, d**-0.5, mask), dtype, f"{seed_label} {case} {mask_kind}")
    return spy


@pytest.mark.parametrize("case", list(PREFILL_MMA_CASES))
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_prefill_mma_tiles(kernel_backend, monkeypatch, case, mask_kind, dtype_name):
    *shape, tiles = PREFILL_MMA_CASES[case]
    monkeypatch.setattr(att, "PREFILL_MMA_TILES", tiles)
    spy = _check_tile_prefill(monkeypatch, shape, mask_kind, dtype_name, "prefill mma", case)
    if kernel_backend != "reference":
        t = spy.templates[-1]
        assert spy.kernels == ["attention_prefill_mma"]
        assert (t["WM"], t["RB"], t["BK"], t["ST"]) == tiles


# The warpgroup prefill (template WG: CUDA's wgmma on sm_90, metal_src/_warpgroup.metal's
# portable form on the emulator): one or two warpgroups of 64 query rows, 64-key tiles; query lengths
# over several blocks (the last partial), key lengths over several tiles (the last partial),
# GQA, both head dims it takes, every mask.
PREFILL_WG_CASES = {
    # (B, Hq, Hkv, Lq, Lk, D)
    "d128_gqa2": (1, 4, 2, 130, 150, 128),
    "d64_b2": (2, 2, 2, 70, 200, 64),
    "d128_one_block": (1, 2, 1, 64, 64, 128),
    "d128_stages_reused": (1, 2, 1, 70, 300, 128),  # 5 key tiles: every stage refilled at ST 3 and 4
    "d128_rows_without_keys": (1, 2, 1, 200, 70, 128),  # Lq > Lk: causal rows that see no key
}


@pytest.mark.parametrize("case", list(PREFILL_WG_CASES))
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("tiles", [(4, 1, 64, 3), (8, 1, 64, 3), (4, 1, 64, 4), (8, 1, 128, 3)],
                         ids=["wg1_st3", "wg2_st3", "wg1_st4", "wg2_bk128"])
def test_prefill_warpgroup(kernel_backend, monkeypatch, case, mask_kind, dtype_name, tiles):
    b, hq, hkv, lq, lk, d = PREFILL_WG_CASES[case]
    monkeypatch.setattr(att, "PREFILL_MMA_WARPGROUP", True)
    monkeypatch.setattr(att, "PREFILL_WG_TILES", tiles)
    spy = _check_tile_prefill(monkeypatch, (b, hq, hkv, lq, lk, d, d), mask_kind, dtype_name, "prefill wg", case)
    if kernel_backend in ("emulate", "cuda"):
        t = spy.templates[-1]
        assert spy.kernels == ["attention_prefill_mma"]
        assert (t["WG"], t["WM"], t["RB"], t["BK"], t["ST"]) == (1, *tiles)


def test_prefill_warpgroup_plan(monkeypatch):
    """Which calls take the warpgroup tiles, and their threadgroup bytes."""
    h = mx.bfloat16
    monkeypatch.setattr(att, "PREFILL_MMA_WARPGROUP", True)
    assert att._prefill_wg(1024, 128, 128, h, "emulate") and att._prefill_wg(64, 64, 64, mx.float16, "emulate")
    assert not att._prefill_wg(63, 128, 128, h, "emulate")  # under one warpgroup's rows
    assert not att._prefill_wg(1024, 96, 96, h, "emulate") and not att._prefill_wg(1024, 64, 128, h, "emulate")
    assert not att._prefill_wg(1024, 128, 128, mx.float32, "emulate")
    assert not att._prefill_wg(1024, 128, 128, h, "metal")
    monkeypatch.setattr(att, "PREFILL_MMA_WARPGROUP", None)  # the default: unmasked or causal, D == 128
    assert att._prefill_wg(1024, 128, 128, h, "emulate")
    assert att._prefill_wg(1024, 128, 128, h, "cuda") == (att.cuda_limits.architecture() == "sm_90")
    assert att._prefill_wg(1024, 128, 128, h, "emulate", att._MASK_CAUSAL)
    assert not att._prefill_wg(1024, 128, 128, h, "emulate", att._MASK_BOOL)
    assert not att._prefill_wg(1024, 64, 64, h, "emulate")
    monkeypatch.setattr(att, "PREFILL_MMA_WARPGROUP", True)
    assert att._prefill_mma_bytes(4, 1, 64, 3, 128, 128, wg=True) == (64 * 128 + 3 * 64 * 256) * 2  # P: registers
    monkeypatch.setattr(att, "PREFILL_MMA_TILES", (4, 1, 16, 1))
    assert not att._prefill_wg(1024, 128, 128, h, "emulate")  # explicit tiles win
    monkeypatch.setattr(att, "PREFILL_MMA_TILES", None)
    monkeypatch.setattr(att, "PREFILL_MMA_WARPGROUP", False)
    assert not att._prefill_wg(1024, 128, 128, h, "emulate")
    assert att._prefill_wg_tiles(128, 128, "cuda") == att.PREFILL_WG_TILES
    for bad in ((8, 1, 64, 2), (6, 1, 64, 3), (4, 2, 64, 3), (4, 1, 32, 3), (8, 1, 96, 3)):
        monkeypatch.setattr(att, "PREFILL_WG_TILES", bad)
        with pytest.raises(ValueError, match=r"PREFILL_WG_TILES=.*expected \(WM, 1, BK, ST\)"):
            att._prefill_wg_tiles(128, 128, "cuda")
    monkeypatch.setattr(att, "PREFILL_WG_TILES", (8, 1, 64, 7))  # 256 KiB at D = 128
    with pytest.raises(ValueError, match=r"needs 262144 bytes of threadgroup memory"):
        att._prefill_wg_tiles(128, 128, "cuda")


@pytest.mark.parametrize("lq, lk", [(5, 300), (300, 40), (64, 64)])
def test_prefill_mma_causal_rows_without_keys(kernel_backend, monkeypatch, lq, lk):
    """Causal with Lq > Lk (leading rows see no key: every tile runs and they average V
    uniformly, as in MLX), Lq < Lk (skipped tiles right of the diagonal), Lq = Lk."""
    monkeypatch.setattr(att, "PREFILL_MMA_TILES", (2, 1, 16, 2))
    monkeypatch.setenv("XLSTM_ATTENTION_PREFILL_MMA", "1")
    q, k, v = make_qkv(1, 2, 1, lq, lk, 32, 32, mx.float16, seed_of("mma causal", lq, lk))
    out = att.attention_prefill(q, k, v, scale=0.2, mask="causal")
    assert_close(out, np_attention(q, k, v, 0.2, "causal"), mx.float16, f"prefill tiles causal {lq}x{lk}")


def test_prefill_mma_nan_like_prefill(kernel_backend, monkeypatch):
    """NaN inputs and a row whose additive mask is all -inf: NaN exactly where
    attention_prefill gives it (a NaN key poisons every row, a NaN query its row)."""
    if kernel_backend == "reference":
        pytest.skip("compares the two prefill kernels")
    b, hq, hkv, lq, lk, d = 1, 2, 1, 40, 70, 32
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, mx.float16, seed_of("mma nan"))
    qn, kn, vn = (np.asarray(x.astype(mx.float32)).copy() for x in (q, k, v))
    qn[0, 1, 7, 3] = np.nan
    vn[0, 0, 50, 9] = np.nan
    addm = np.zeros((lq, lk), dtype=np.float32)
    addm[20, :] = -np.inf
    args = [mx.array(x).astype(mx.float16) for x in (qn, kn, vn)]
    mask = mx.array(addm).astype(mx.float16)
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("XLSTM_ATTENTION_PREFILL_MMA", flag)
        outs[flag] = f64(att.attention_prefill(*args, scale=0.2, mask=mask))
    assert np.isnan(outs["0"]).any() and not np.isnan(outs["0"]).all()
    assert np.array_equal(np.isnan(outs["1"]), np.isnan(outs["0"]))
    fin = ~np.isnan(outs["0"])
    assert rel_err(outs["1"][fin], outs["0"][fin]) < 1e-2


def test_prefill_mma_plan(monkeypatch):
    """Layouts by query length, the budget per backend, fallbacks, and bad overrides."""
    h = mx.float16
    assert att._prefill_mma_plan(1024, 128, 128, h, "cuda") == (4, 2, 64, 2)  # 102 KiB: two blocks per SM
    assert att._prefill_mma_plan(1024, 64, 64, h, "cuda") == (4, 2, 128, 2)  # 128 keys: 192 accumulators
    assert att._prefill_mma_plan(100, 128, 128, h, "cuda") == (4, 1, 128, 2)
    assert att._prefill_mma_plan(20, 64, 64, h, "cuda") == (2, 1, 128, 2)
    assert att._prefill_mma_plan(3, 64, 64, h, "cuda") == (1, 1, 128, 2)
    assert att._prefill_mma_plan(1024, 256, 256, h, "cuda") == (4, 1, 64, 2)  # RB 2: too many registers
    assert att._prefill_mma_plan(1024, 64, 64, h, "emulate") == (4, 2, 16, 2)  # 32 KiB: 2 stages first
    assert att._prefill_mma_plan(1024, 128, 128, h, "emulate") == (4, 1, 16, 1)
    assert att._prefill_mma_plan(1024, 256, 256, h, "emulate") == (1, 1, 16, 1)
    assert att._prefill_mma_plan(1024, 64, 64, mx.float32, "cuda") is None
    q = mx.zeros((1, 2, 64, 256), dtype=h)
    assert att._use_prefill_mma(None, q, q, "cuda") and att._use_prefill_mma(None, q, q, "emulate")
    assert not att._use_prefill_mma(None, q, q, "metal") and att._use_prefill_mma(True, q, q, "metal")
    assert not att._use_prefill_mma(True, q.astype(mx.float32), q.astype(mx.float32), "cuda")
    monkeypatch.setattr(att, "PREFILL_MMA_TILES", (4, 2, 64, 2))
    with pytest.raises(ValueError, match=r"PREFILL_MMA_TILES=\(4, 2, 64, 2\).*needs \d+ bytes.*'emulate'"):
        att._prefill_mma_plan(64, 128, 128, h, "emulate")
    monkeypatch.setattr(att, "PREFILL_MMA_TILES", (4, 1, 24, 1))
    with pytest.raises(ValueError, match="BK a multiple of 16"):
        att._prefill_mma_plan(64, 64, 64, h, "cuda")


def test_prefill_block_arguments_select_prefill(kernel_backend, monkeypatch):
    """block_q= / block_k= name attention_prefill's tiles: such a call runs it."""
    if kernel_backend == "reference":
        pytest.skip("kernel selection")
    monkeypatch.setenv("XLSTM_ATTENTION_PREFILL_MMA", "1")
    q, k, v = make_qkv(1, 2, 1, 20, 30, 32, 32, mx.bfloat16, seed_of("block args"))
    spy = LaunchSpy(monkeypatch)
    att.attention_prefill(q, k, v, scale=0.2, block_q=16)
    att.attention_prefill(q, k, v, scale=0.2)
    assert spy.kernels == ["attention_prefill", "attention_prefill_mma"]


def test_prefill_threadgroup_memory_error(kernel_backend):
    q, k, v = make_qkv(1, 1, 1, 4, 8, 16, 16, mx.float16, 0)
    with pytest.raises(ValueError, match="block_q=256 with block_k=128.*32 KiB"):
        att.attention_prefill(q, k, v, scale=0.25, block_q=256, block_k=128)


# Split-KV pass 1, lane walk: 32-key chunks, simdgroup s taking chunks s, s + NSG, ...: a
# block of 300 keys has 10 chunks over 8 simdgroups (two simdgroups take 2, the last chunk
# is partial). Tiles: a block of 300 keys is 19 tiles of 16 keys through the stages (3 of
# them at D = 64 / 128 for 2-byte dtypes, 1 for float32 at D = 128), the last one partial.
# Lk = 1100 gives 4 blocks, the last one partial.
@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_split_kv_chunks(kernel_backend, monkeypatch, dtype_name, d, mask_kind, walk):
    set_walk(monkeypatch, walk)
    dtype = DTYPES[dtype_name]
    b, hq, hkv, lq, lk = 1, 4, 2, 2, 1100
    seed = seed_of("split chunks", dtype_name, d, mask_kind)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, dtype, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, dtype, seed)
    spy = LaunchSpy(monkeypatch)
    out = att.attention_decode_split_kv(q, k, v, scale=d**-0.5, mask=mask, block_size=300)
    assert_close(out, np_attention(q, k, v, d**-0.5, mask), dtype, f"split-KV chunks {dtype_name} D={d} {mask_kind}")
    if kernel_backend != "reference":
        assert_split_kernels(spy, walk, 4, kernel_backend)
        t = spy.templates[0]
        if walk == "stream":
            assert (t["TB"], t["NW"], t["ST"], t["R"]) == (*att._stream_plan(4, d, d, dtype, kernel_backend), 4)
        elif walk == "lane":
            assert t["NSG"] == 8
        else:
            assert (t["R"], t["RM"], t["KT"]) == (4, 1, 16)
            if kernel_backend == "emulate":  # 32 KiB: 4 simdgroups' stages of 4.5 KiB, else 2 or 1 of 8.5 / 16.5 KiB
                wide = (d == 128) + (dtype_name == "float32")
                assert (t["NW"], t["ST"]) == {0: (4, 1), 1: (2, 1), 2: (1, 1)}[wide]
            elif kernel_backend == "cuda":  # 48 KiB of stages per simdgroup: two of float32 D = 128 (16.5 KiB)
                wide = d == 128 and dtype_name == "float32"
                assert (t["NW"], t["ST"]) == (att.SPLIT_KV_MMA_WARPS, 2 if wide else att.SPLIT_KV_MMA_MAX_STAGES)


# Split-KV pass 1 over all the query rows of a key/value head: (Hq / Hkv) query heads x
# Lq queries share each K / V read, R rows per threadgroup (several row groups when they
# do not fit the registers, the last one partial), KC = 32 or 16 keys per chunk. GQA
# ratios 1/2/4/8, Lq 1 and > 1, head dims 64/128/256 and odd ones, several key blocks with
# a partial last one; the additive mask varies per head (a row's head decides its mask).
GQA_CASES = {
    # (B, Hq, Hkv, Lq, Lk, D, DV, dtype, block size, expected (R, KC, row groups per kv head)
    #  under the register budget 200, which picks up to R = 4: the kernels of every row-group
    #  size run here; the default budget (150) picks fewer rows: test_split_kv_default_rows)
    "gqa1_q1_d128": (2, 3, 3, 1, 200, 128, 128, "float16", 64, (1, 32, 1)),
    "gqa2_q1_d64": (1, 4, 2, 1, 300, 64, 64, "bfloat16", 128, (2, 32, 1)),
    "gqa2_q5_d128_f32": (1, 4, 2, 5, 150, 128, 128, "float32", 64, (3, 16, 4)),
    "gqa4_q1_d128": (1, 8, 2, 1, 333, 128, 128, "float16", 96, (4, 16, 1)),
    "gqa8_q1_d64": (1, 8, 1, 1, 260, 64, 64, "float16", 64, (4, 16, 2)),
    "gqa8_q8_d128": (1, 8, 1, 8, 100, 128, 128, "bfloat16", 32, (4, 16, 16)),
    "gqa4_q2_d256": (1, 8, 2, 2, 90, 256, 256, "bfloat16", 48, (2, 16, 4)),
    "gqa4_q3_d40_dv24": (1, 4, 1, 3, 77, 40, 24, "float32", 32, (4, 16, 3)),
}


@pytest.mark.parametrize("case", list(GQA_CASES))
@pytest.mark.parametrize("mask_kind", ["none", "causal", "additive"])
def test_split_kv_gqa_rows(kernel_backend, monkeypatch, case, mask_kind):
    set_walk(monkeypatch, "lane")
    b, hq, hkv, lq, lk, d, dv, dtype_name, bs, expect = GQA_CASES[case]
    dtype = DTYPES[dtype_name]
    seed = seed_of("gqa rows", case, mask_kind)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, dtype, seed, layout="head")
    monkeypatch.setattr(att, "_PARTIAL_REG_BUDGET", 200)
    spy = LaunchSpy(monkeypatch)
    out = att.attention_decode_split_kv(q, k, v, scale=d**-0.5, mask=mask, block_size=bs)
    assert_close(out, np_attention(q, k, v, d**-0.5, mask), dtype, f"split-KV {case} {mask_kind}")
    if kernel_backend != "reference":
        t = spy.templates[0]
        rows = hq // hkv * lq
        assert (t["R"], t["KC"], -(-rows // t["R"])) == expect


@pytest.mark.parametrize("case, expect", [("gqa2_q1_d64", (2, 16, 1)), ("gqa4_q1_d128", (2, 16, 2)),
                                          ("gqa8_q8_d128", (2, 16, 32)), ("gqa4_q2_d256", (1, 32, 8))])
def test_split_kv_default_rows(kernel_backend, monkeypatch, case, expect):
    """The default register budget: fewer query rows per threadgroup (more threadgroups per
    SM; H100 decode 1.3x faster than R = 4), same results."""
    set_walk(monkeypatch, "lane")
    b, hq, hkv, lq, lk, d, dv, dtype_name, bs, _ = GQA_CASES[case]
    dtype = DTYPES[dtype_name]
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed_of("gqa default rows", case))
    spy = LaunchSpy(monkeypatch)
    out = att.attention_decode_split_kv(q, k, v, scale=d**-0.5, block_size=bs)
    assert_close(out, np_attention(q, k, v, d**-0.5, None), dtype, f"split-KV {case} default rows")
    if kernel_backend != "reference":
        t = spy.templates[0]
        assert (t["R"], t["KC"], -(-(hq // hkv * lq) // t["R"])) == expect


# Split-KV tile pass 1 (attention_partial_mma): the query rows of a kv head are the
# columns of 8-row fragments, up to 16 rows per threadgroup (RM = 2), more in groups of
# even size; keys are tiles of 16 through the stages. GQA 1/2/4/8, Lq 1..8, odd head dims
# and D != DV (zero-padded tiles, an 8-wide last k-step / output block), several blocks
# and row groups, the last ones partial; the additive mask varies per head.
MMA_CASES = {
    # (B, Hq, Hkv, Lq, Lk, D, DV, dtype, block size, expected (R, RM, row groups per kv head))
    "gqa1_q1_d128": (2, 3, 3, 1, 200, 128, 128, "float16", 64, (1, 1, 1)),
    "gqa4_q1_d128": (1, 8, 2, 1, 333, 128, 128, "bfloat16", 96, (4, 1, 1)),
    "gqa8_q1_d64": (1, 8, 1, 1, 260, 64, 64, "float16", 100, (8, 1, 1)),
    "gqa4_q3_d80": (1, 8, 2, 3, 150, 80, 80, "float16", 64, (12, 2, 1)),
    "gqa8_q2_d40_dv24": (1, 8, 1, 2, 77, 40, 24, "bfloat16", 32, (16, 2, 1)),
    "gqa8_q8_d128": (1, 8, 1, 8, 100, 128, 128, "bfloat16", 48, (16, 2, 4)),
    "gqa4_q5_d72_f32": (1, 4, 1, 5, 90, 72, 56, "float32", 40, (10, 2, 2)),
    "gqa2_q1_d256": (1, 4, 2, 1, 90, 256, 256, "float16", 48, (2, 1, 1)),
    "gqa2_q3_d17_dv9": (1, 4, 2, 3, 45, 17, 9, "float16", 16, (6, 1, 1)),
}


@pytest.mark.parametrize("case", list(MMA_CASES))
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
def test_split_kv_mma_rows(kernel_backend, monkeypatch, case, mask_kind):
    b, hq, hkv, lq, lk, d, dv, dtype_name, bs, expect = MMA_CASES[case]
    dtype = DTYPES[dtype_name]
    seed = seed_of("mma rows", case, mask_kind)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, dtype, seed, layout="default" if mask_kind == "bool" else "head")
    set_walk(monkeypatch, "mma")
    spy = LaunchSpy(monkeypatch)
    out = att.attention_decode_split_kv(q, k, v, scale=d**-0.5, mask=mask, block_size=bs)
    assert_close(out, np_attention(q, k, v, d**-0.5, mask), dtype, f"split-KV tiles {case} {mask_kind}")
    if kernel_backend != "reference":
        t = spy.templates[0]
        assert spy.kernels == ["attention_partial_mma", "attention_reduce"]
        assert (t["R"], t["RM"], -(-(hq // hkv * lq) // t["R"])) == expect


def _split_kv_tiles(monkeypatch, shape, dtype, seed, mask_kind, block_size, layout="default"):
    """The split-KV decode on the tile pass 1 over fresh inputs of shape (B, Hq, Hkv, Lq, Lk,
    D = DV): (q, k, v, mask, the launch spy, the output)."""
    b, hq, hkv, lq, lk, d = shape
    set_walk(monkeypatch, "mma")
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, dtype, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, dtype, seed, layout=layout)
    spy = LaunchSpy(monkeypatch)
    out = att.attention_decode_split_kv(q, k, v, scale=d**-0.5, mask=mask, block_size=block_size)
    return q, k, v, mask, spy, out


@pytest.mark.parametrize("stages, tile", [(1, 16), (2, 16), (3, 16), (2, 32)])
@pytest.mark.parametrize("dtype_name, mask_kind", [("float16", "causal"), ("bfloat16", "bool"), ("float32", "none")])
@pytest.mark.parametrize("warps", [1, 2])
def test_split_kv_mma_stages(kernel_backend, monkeypatch, stages, tile, dtype_name, mask_kind, warps):
    """1, 2 and 3 stages in flight, each refilled several times (a block of 200 keys is 13
    tiles of 16 or 7 of 32, the last one partial; 3 blocks, the last one partial), Lq = 2
    with causal rows whose visible keys end at different tiles; one or two simdgroups a
    threadgroup (each with its own stages)."""
    monkeypatch.setattr(att, "SPLIT_KV_MMA_MAX_STAGES", stages)
    monkeypatch.setattr(att, "SPLIT_KV_MMA_TILE", tile)
    monkeypatch.setattr(att, "SPLIT_KV_MMA_WARPS", warps)
    dtype = DTYPES[dtype_name]
    d = 64
    q, k, v, mask, spy, out = _split_kv_tiles(monkeypatch, (1, 4, 2, 2, 530, d), dtype,
                                              seed_of("mma stages", stages, dtype_name), mask_kind, 200)
    assert_close(out, np_attention(q, k, v, d**-0.5, mask), dtype, f"split-KV tiles, {stages} stages")
    if kernel_backend != "reference":
        stage_bytes = tile * 2 * (d + 16 // dtype.size) * dtype.size  # K and V rows of D + 16 bytes
        if kernel_backend != "cuda" and 32 * 1024 // warps < stage_bytes:
            warps = 1  # float32 tiles of 32 keys: 17 KiB a stage, one simdgroup in 32 KiB
        fit = (48 * 1024 if kernel_backend == "cuda" else 32 * 1024 // warps) // stage_bytes  # per simdgroup
        t = spy.templates[0]
        assert (t["ST"], t["KT"], t["NW"]) == (min(stages, fit), tile, warps)


@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
def test_split_kv_mma_nan_like_lane_walk(kernel_backend, monkeypatch, dtype_name):
    """NaN in q, k or v: the tile pass gives NaN exactly where the lane walk does (a NaN key
    poisons every row of its block, a NaN query its own row)."""
    if kernel_backend == "reference":
        pytest.skip("compares the two pass-1 kernels")
    dtype = DTYPES[dtype_name]
    b, hq, hkv, lq, lk, d = 1, 4, 2, 2, 100, 32
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, dtype, seed_of("mma nan", dtype_name))
    qn = np.asarray(q.astype(mx.float32)).copy()
    kn = np.asarray(k.astype(mx.float32)).copy()
    vn = np.asarray(v.astype(mx.float32)).copy()
    qn[0, 3, 1, 5] = np.nan
    kn[0, 0, 40, 7] = np.nan
    vn[0, 1, 77, 2] = np.nan
    args = [mx.array(x).astype(dtype) for x in (qn, kn, vn)]
    outs = {}
    for walk in WALKS:
        set_walk(monkeypatch, walk)
        outs[walk] = f64(att.attention_decode_split_kv(*args, scale=0.2, mask="causal", block_size=32))
    assert np.isnan(outs["lane"]).any() and not np.isnan(outs["lane"]).all()
    fin = ~np.isnan(outs["lane"])
    for walk in ("mma", "stream"):
        assert np.array_equal(np.isnan(outs[walk]), np.isnan(outs["lane"])), walk
        assert rel_err(outs[walk][fin], outs["lane"][fin]) < tolerance(dtype), walk


@pytest.mark.parametrize("warps", [2, 3, 4])
@pytest.mark.parametrize("dtype_name, mask_kind", [("float16", "causal"), ("bfloat16", "additive"), ("float32", "bool")])
def test_split_kv_mma_warps(kernel_backend, monkeypatch, warps, dtype_name, mask_kind):
    """NW simdgroups per tile pass 1 threadgroup, each walking every NW-th tile of the block,
    merged in threadgroup memory: blocks of 200 keys (13 tiles of 16, uneven over the
    simdgroups), a last block of 20 keys (2 tiles: some simdgroups walk nothing), Lq = 3
    causal rows ending in different tiles, 12 query rows of a kv head (RM = 2)."""
    monkeypatch.setattr(att, "SPLIT_KV_MMA_WARPS", warps)
    dtype = DTYPES[dtype_name]
    d = 40
    q, k, v, mask, spy, out = _split_kv_tiles(monkeypatch, (2, 8, 2, 3, 420, d), dtype,
                                              seed_of("mma warps", warps, dtype_name), mask_kind, 200,
                                              layout="head" if mask_kind == "additive" else "default")
    assert_close(out, np_attention(q, k, v, d**-0.5, mask), dtype, f"split-KV tiles, {warps} simdgroups")
    if kernel_backend != "reference":
        t = spy.templates[0]
        assert spy.kernels == ["attention_partial_mma", "attention_reduce"]
        assert (t["NW"], t["R"], t["RM"]) == (warps, 12, 2)


def test_split_kv_mma_warps_plan(monkeypatch):
    """Stages per simdgroup within the backend's budget (48 KiB each and 227 KiB in all on
    cuda, 32 KiB in all elsewhere), the merge buffer counted, and fewer simdgroups where
    SPLIT_KV_MMA_WARPS' stages do not fit."""
    h = mx.float16
    assert att._mma_plan(4, 128, 128, h, "cuda", 4) == (4, 1, 16, 3)  # 4 x 3 x 8.5 KiB
    assert att._mma_plan(4, 128, 128, h, "cuda", 8) == (4, 1, 16, 3)  # 204 KiB
    assert att._mma_plan(4, 128, 128, h, "cuda", 16) == (4, 1, 16, 1)  # 14 KiB each
    assert att._mma_plan(4, 128, 128, h, "emulate", 2) == (4, 1, 16, 1)
    assert att._mma_plan(4, 128, 128, h, "emulate", 4) is None
    assert att._mma_plan(16, 64, 64, h, "emulate", 4) == (16, 2, 16, 1)  # stages 18 KiB, merge 16.5 KiB
    assert att._mma_plan(16, 64, 64, h, "emulate", 8) is None  # 8 x 4.5 KiB of stages
    assert att._mma_bytes(16, 16, 64, h, 1, 4) == 4 * 16 * 66 * 4  # narrow K: the merge buffer is the larger
    assert att._mma_plan(16, 8, 256, h, "emulate", 2) is None  # merge 2 x 16 x 258 floats > 32 KiB
    assert att._mma_bytes(4, 128, 128, h, 3, 1) == 3 * 16 * 272 * 2
    monkeypatch.setattr(att, "SPLIT_KV_MMA_WARPS", 4)
    assert att._mma_warps(4, 128, 128, h, "cuda") == 4
    assert att._mma_warps(4, 128, 128, h, "emulate") == 2
    assert att._mma_warps(4, 256, 256, mx.float32, "emulate") == 1  # the tile pass 1 does not run there
    q, k = mx.zeros((1, 32, 1, 128), dtype=h), mx.zeros((1, 8, 4096, 128), dtype=h)
    _, kw = att._partial_mma_launch(q, k, k, att._Mask(0), 0.1, 512, "cuda")
    assert (kw["grid"], kw["threadgroup"], kw["shared_memory"]) == ((128 * 8, 8, 1), (128, 1, 1), 4 * 3 * 16 * 272 * 2)
    _, kw = att._partial_mma_launch(q, k, k, att._Mask(0), 0.1, 512, "emulate")
    assert (kw["grid"], kw["threadgroup"], kw["shared_memory"]) == ((64 * 8, 8, 1), (64, 1, 1), 0)


def test_split_kv_mma_plan(monkeypatch):
    """Rows per group, stages per backend budget, the automatic block size, and the lane
    walk where one stage of tiles does not fit."""
    h = mx.float16
    assert att._mma_plan(4, 128, 128, h, "cuda") == (4, 1, 16, 3)  # 8.5 KiB per stage, SPLIT_KV_MMA_MAX_STAGES
    assert att._mma_plan(1, 128, 128, h, "emulate") == (1, 1, 16, 3)
    assert att._mma_plan(32, 128, 128, h, "cuda") == (16, 2, 16, 3)
    assert att._mma_plan(24, 64, 64, h, "cuda") == (12, 2, 16, 3)
    monkeypatch.setattr(att, "SPLIT_KV_MMA_MAX_STAGES", 5)
    assert att._mma_plan(4, 128, 128, h, "cuda") == (4, 1, 16, 5)  # 5 x 8.5 KiB within 48 KiB
    assert att._mma_plan(4, 128, 128, h, "emulate") == (4, 1, 16, 3)  # 32 KiB: 3 stages
    assert att._mma_plan(4, 128, 128, mx.float32, "emulate") == (4, 1, 16, 1)  # 16.5 KiB per stage
    monkeypatch.setattr(att, "SPLIT_KV_MMA_MAX_STAGES", 2)
    assert att._mma_plan(4, 256, 256, mx.float32, "cuda") == (4, 1, 16, 1)  # 32.5 KiB per stage
    assert att._mma_plan(4, 256, 256, mx.float32, "emulate") is None
    assert att._mma_plan(4, 256, 256, h, "emulate") == (4, 1, 16, 1)

    def plan(b, hq, hkv, lk, backend="cuda", d=128):
        q, k = mx.zeros((b, hq, 1, d), dtype=h), mx.zeros((b, hkv, lk, d), dtype=h)
        bs = att._auto_block_size_mma(q, k, k, backend)
        _, kw = att._partial_mma_launch(q, k, k, att._Mask(0), 0.1, bs, backend)
        assert kw["threadgroup"] == (32 * att.SPLIT_KV_MMA_WARPS, 1, 1)
        return bs, kw["grid"][0] // kw["threadgroup"][0] * kw["grid"][1] * kw["grid"][2]

    # SPLIT_KV_MMA_TARGET_GROUPS (128) threadgroups of SPLIT_KV_MMA_WARPS (4) simdgroups
    assert plan(64, 32, 8, 8192) == (4096, 1024)  # the largest block already gives >= 128 threadgroups
    assert plan(8, 32, 8, 8192) == (4096, 128)
    assert plan(4, 32, 8, 32768) == (4096, 256)
    assert plan(16, 32, 8, 4096) == (4096, 128)
    assert plan(1, 32, 32, 4096) == (1024, 128)  # halved until 128 threadgroups
    assert plan(1, 32, 32, 16384, d=64) == (4096, 128)  # every head width alike
    # one sequence of few kv heads
    assert plan(1, 32, 8, 4096) == (256, 128)
    assert plan(1, 32, 8, 16384) == (1024, 128)
    assert plan(1, 32, 8, 2048) == (128, 128)
    assert plan(1, 32, 8, 1 << 20) == (4096, 2048)  # never above SPLIT_KV_MMA_MAX_BLOCK
    assert plan(1, 32, 8, 100) == (64, 16)  # never below 64
    monkeypatch.setattr(att, "SPLIT_KV_MMA_TARGET_GROUPS", 2048)
    assert plan(1, 32, 8, 16384) == (512, 256)  # at most SPLIT_KV_MMA_MAX_BLOCKS (32) blocks
    q = mx.zeros((1, 4, 1, 256), dtype=mx.float32)
    k = mx.zeros((1, 2, 64, 256), dtype=mx.float32)
    assert att._use_mma(True, q, k, k, "emulate") is False and att._use_mma(True, q, k, k, "cuda") is True
    assert att._use_mma(None, q, k, k, "cuda") is False  # float32: the lane walk by default
    assert att._use_mma(None, q.astype(h), k.astype(h), k.astype(h), "emulate") is True
    assert att._use_mma(None, q.astype(h), k.astype(h), k.astype(h), "metal") is False  # unmeasured there
    assert att._use_mma(True, q.astype(h), k.astype(h), k.astype(h), "metal") is True


# Split-KV pass 1 in threadgroup clusters (XK_CLUSTER: cuda on sm_90, the emulator): the
# cluster's key blocks merge in one launch. (B, Hq, Hkv, Lq, Lk, D, dtype, block size,
# cluster knob, expected cluster size, blocks). One launch where the cluster holds every
# block; a cluster and pass 2 where the blocks make several clusters; none where the block
# count has no divisor from 2 to the knob. Lq > 1 puts 12 rows of a kv head in a
# threadgroup (RM = 2); Lk is never a multiple of the block or the tile.
CLUSTER_CASES = {
    "one_launch_c4_d128": (2, 4, 2, 1, 1000, 128, "float16", 256, 8, 4, 4),
    "one_launch_c3_d64_rows12": (1, 8, 2, 3, 301, 64, "bfloat16", 112, 8, 3, 3),
    "one_launch_c8_gqa8": (1, 8, 1, 1, 1015, 64, "float16", 128, 8, 8, 8),
    "two_clusters_and_reduce": (1, 4, 1, 2, 1001, 64, "bfloat16", 128, 4, 4, 8),
    "c2_of_6_and_reduce": (1, 4, 2, 1, 550, 40, "float16", 96, 2, 2, 6),
    "prime_blocks_no_cluster": (1, 4, 2, 1, 700, 64, "float16", 112, 4, 1, 7),
}


@pytest.mark.parametrize("case", list(CLUSTER_CASES))
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
def test_split_kv_cluster(kernel_backend, monkeypatch, case, mask_kind):
    b, hq, hkv, lq, lk, d, dtype_name, bs, knob, want, nb = CLUSTER_CASES[case]
    dtype = DTYPES[dtype_name]
    seed = seed_of("cluster", case, mask_kind)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, dtype, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, dtype, seed, layout="default" if mask_kind == "bool" else "head")
    set_walk(monkeypatch, "cluster")
    monkeypatch.setenv("XLSTM_ATTENTION_SPLIT_KV_CLUSTER", str(knob))
    spy = LaunchSpy(monkeypatch)
    out = att.attention_decode_split_kv(q, k, v, scale=d**-0.5, mask=mask, block_size=bs)
    assert tuple(out.shape) == (b, hq, lq, d) and out.dtype == dtype
    assert_close(out, np_attention(q, k, v, d**-0.5, mask), dtype, f"split-KV clusters {case} {mask_kind}")
    c = spy.templates[0]["XK_CLUSTER"]
    assert c == want and -(-lk // bs) == nb
    assert spy.kernels == (["attention_partial_mma"] if c == nb else ["attention_partial_mma", "attention_reduce"])


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_split_kv_cluster_like_two_passes(kernel_backend, monkeypatch, dtype_name):
    """Clusters against the pass pair on the same inputs: NaN in the same places (a NaN key
    poisons its block's rows, a NaN query its row), rows whose every key is masked averaged
    uniformly, the rest within the dtype's rounding."""
    if kernel_backend == "reference":
        pytest.skip("compares two kernel paths")
    dtype = DTYPES[dtype_name]
    b, hq, hkv, lq, lk, d = 1, 4, 2, 2, 500, 64
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, dtype, seed_of("cluster nan", dtype_name))
    qn = np.asarray(q.astype(mx.float32)).copy()
    kn = np.asarray(k.astype(mx.float32)).copy()
    qn[0, 3, 1, 5] = np.nan
    kn[0, 0, 140, 7] = np.nan
    args = [mx.array(qn).astype(dtype), mx.array(kn).astype(dtype), v]
    bool_mask = make_mask("bool", b, hq, lq, lk, dtype, 7)  # row 1: every key masked
    for inputs, mask in ((args, "causal"), ((q, k, v), bool_mask)):
        outs = {}
        for walk in ("mma", "cluster"):
            set_walk(monkeypatch, walk)
            outs[walk] = f64(att.attention_decode_split_kv(*inputs, scale=0.2, mask=mask, block_size=128))
        nan = np.isnan(outs["mma"])
        assert np.array_equal(np.isnan(outs["cluster"]), nan)
        assert nan.any() == isinstance(mask, str) and not nan.all()
        assert rel_err(outs["cluster"][~nan], outs["mma"][~nan]) < tolerance(dtype)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_decode_loop_in_clusters(kernel_backend, monkeypatch, dtype_name):
    """A decode loop whose growing cache crosses from blocks one cluster merges (one launch)
    to blocks that need pass 2 and back to clusters: each step matches float64."""
    dtype = getattr(mx, dtype_name)
    set_walk(monkeypatch, "cluster")
    monkeypatch.setattr(att, "_mma_block_for", lambda per_block, lk, target=None, clusters=False: 64)
    q, kc, vc = make_qkv(1, 4, 2, 1, 600, 64, 64, dtype, seed_of("cluster loop", dtype_name))
    spy = LaunchSpy(monkeypatch)
    for lk in (250, 256, 257, 449, 512, 513, 577):  # 4, 4, 5, 8, 8, 9 and 10 blocks of 64
        k, v = kc[:, :, :lk], vc[:, :, :lk]
        spy.kernels.clear()
        out = att.scaled_dot_product_attention(q, k, v, scale=0.125)
        assert_close(out, np_attention(q, k, v, 0.125, None), dtype, f"decode loop in clusters, Lk {lk}")


def test_split_kv_cluster_plan(monkeypatch):
    """Clusters are opt-in (the split_kv_cluster knob): the largest divisor of the block count
    up to the knob, where the backend runs clusters (the emulator; cuda on sm_90 with MLX's
    CUDA graphs off), the plan has more than one simdgroup and the cluster's buffer fits."""
    h = mx.float16
    assert [att._cluster_for(None, nb, 1, 128, 128, h, "emulate") for nb in (2, 4, 8)] == [1, 1, 1]  # off by default
    assert [att._cluster_for(8, nb, 1, 128, 128, h, "emulate") for nb in (12, 16, 9, 11, 4)] == [6, 8, 3, 1, 4]
    assert [att._cluster_for(k, 16, 1, 128, 128, h, "emulate") for k in (0, 1, 2, 3, 4)] == [1, 1, 2, 2, 4]
    assert att._cluster_for(4, 4, 1, 256, 256, mx.float32, "emulate") == 1  # one simdgroup: no cluster
    assert att._cluster_for(4, 4, 1, 128, 128, h, "metal") == 1
    assert "no threadgroup clusters" in att._cluster_support("metal")
    # cuda: sm_90 and MLX's CUDA graphs off (MLX_USE_CUDA_GRAPHS read as C's atoi, as MLX does)
    for env, graphs in ((None, True), ("1", True), (" 7x", True), ("0", False), ("false", False), ("", False)):
        if env is None:
            monkeypatch.delenv("MLX_USE_CUDA_GRAPHS", raising=False)
        else:
            monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", env)
        assert att._mlx_cuda_graphs() is graphs, env
        assert att._cluster_for(4, 4, 4, 128, 128, h, "cuda") == (1 if graphs else 4)
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "1")
    assert "MLX_USE_CUDA_GRAPHS=0" in att._cluster_support("cuda")
    q, k = mx.zeros((1, 32, 1, 128), dtype=h), mx.zeros((1, 8, 4096, 128), dtype=h)
    with pytest.raises(ValueError, match="cluster of 4 key blocks.*MLX_USE_CUDA_GRAPHS=0"):
        att._partial_mma_launch(q, k, k, att._Mask(0), 0.1, 1024, "cuda", cluster=4)
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "0")
    from xlstm_kernels.cuda import limits

    monkeypatch.setattr(limits, "_arch", ["sm_89"])
    assert att._cluster_for(4, 4, 4, 128, 128, h, "cuda") == 1 and "sm_90" in att._cluster_support("cuda")
    monkeypatch.setattr(limits, "_arch", ["sm_90"])
    _, kw = att._partial_mma_launch(q, k, k, att._Mask(0), 0.1, 1024, "cuda", cluster=4)
    assert kw["output_shapes"] == [(1, 32, 1, 1, 128), (1, 32, 1, 1)] and kw["output_dtypes"][0] == h
    assert dict(kw["template"])["XK_CLUSTER"] == 4
    assert kw["shared_memory"] == 4 * 3 * 16 * 272 * 2  # the stages hold the merge and cluster buffers too
    _, kw = att._partial_mma_launch(q, k, k, att._Mask(0), 0.1, 256, "cuda", cluster=8)
    assert kw["output_shapes"] == [(1, 32, 1, 2, 128), (1, 32, 1, 2)] and kw["output_dtypes"][0] == mx.float32
    with pytest.raises(ValueError, match="divisor of the 16 blocks"):
        att._partial_mma_launch(q, k, k, att._Mask(0), 0.1, 256, "cuda", cluster=3)

    def plan(b, hq, hkv, lk, cluster):
        q, k = mx.zeros((b, hq, 1, 128), dtype=h), mx.zeros((b, hkv, lk, 128), dtype=h)
        bs = att._auto_block_size_mma(q, k, k, "cuda", cluster)
        return bs, b * hkv * -(-lk // bs)

    # with clusters, one sequence aims for SPLIT_KV_CLUSTER_GROUPS (64) threadgroups where that
    # makes 2..8 blocks (one cluster); batches, and sequences needing more blocks, keep the rule
    assert plan(1, 32, 32, 4096, 8) == (2048, 64) and plan(1, 32, 32, 4096, None) == (1024, 128)
    assert plan(1, 32, 8, 16384, 8) == (2048, 64) and plan(1, 32, 8, 16384, 0) == (1024, 128)
    assert plan(1, 32, 8, 4096, 8) == (512, 64)
    assert plan(1, 32, 8, 1 << 20, 8) == (4096, 2048)
    assert plan(8, 32, 8, 8192, 8) == (4096, 128)


def test_split_kv_cluster_refused_where_not_run(kernel_backend, monkeypatch):
    """split_kv_cluster set where the backend runs no clusters: a clear error naming the knob
    and the reason, not a silent fallback."""
    if kernel_backend == "reference":
        pytest.skip("the reference backend runs no kernels")
    monkeypatch.setattr(att, "_cluster_support", lambda backend: "no clusters on this test's backend")
    q, k, v = make_qkv(1, 4, 2, 1, 600, 64, 64, mx.float16, seed_of("cluster refused"))
    monkeypatch.setenv("XLSTM_ATTENTION_SPLIT_KV_CLUSTER", "4")
    att._CALLS.clear()
    with pytest.raises(ValueError, match="split_kv_cluster=4: no clusters on this test's backend"):
        att.attention_decode_split_kv(q, k, v, scale=0.125, block_size=128)


@pytest.mark.emulator_only
@pytest.mark.parametrize("dtype_name, mask_kind, cluster", [("float16", "causal", 3), ("bfloat16", "bool", 2)])
def test_check_schedules_split_kv_cluster(backend, dtype_name, mask_kind, cluster):
    """The tile pass 1 in clusters under every schedule: a threadgroup's slot read by its
    peers after the cluster sync, kept until the second; 6 blocks of 64 keys, Lq = 2."""
    dtype = DTYPES[dtype_name]
    q, k, v = make_qkv(1, 4, 2, 2, 370, 64, 64, dtype, seed_of("sched-cluster", dtype_name))
    mask = make_mask(mask_kind, 1, 4, 2, 370, dtype, 4)
    spec, kwargs = att._partial_mma_launch(q, k, v, _mask_obj(mask, q, k), 0.125, 64, "emulate", cluster=cluster)
    assert dict(kwargs["template"])["XK_CLUSTER"] == cluster
    o_part, lse = emulate.check_schedules(runtime.get_kernel(spec, "emulate"), **kwargs)
    spec, kwargs = att._reduce_launch(o_part, lse, 64 * cluster, 370, dtype)
    (out,) = runtime.get_kernel(spec, "emulate")(**kwargs)
    assert_close(out.reshape(1, 4, 2, 64), np_attention(q, k, v, 0.125, mask), dtype, "split-KV clusters (schedules)")


# One-launch decode (attention_decode_stream): every key of a kv head in 16-key tiles over
# 12 simdgroups (one query row) or 8 (more rows) with 2 or 3 stages each (the cuda plan, which
# the emulator runs too): Lk = 1100 and 2087 give each simdgroup several tiles, so every
# stage's bar runs through both phase parities, and a partial last tile.
STREAM_CASES = {
    "b1_gqa1_q1_k2087_d128": (1, 3, 3, 1, 2087, 128, 128),
    "b2_gqa4_q1_k1100_d64": (2, 8, 2, 1, 1100, 64, 64),
    "b1_gqa2_q3_k1100_d128_dv64": (1, 4, 2, 3, 1100, 128, 64),  # 6 rows a kv head, D != DV
}


@pytest.mark.parametrize("case", list(STREAM_CASES))
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_split_kv_stream_matches_float64(kernel_backend, monkeypatch, case, mask_kind, dtype_name):
    set_walk(monkeypatch, "stream")
    b, hq, hkv, lq, lk, d, dv = STREAM_CASES[case]
    dtype = DTYPES[dtype_name]
    seed = seed_of("stream", case, mask_kind, dtype_name)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, dtype, seed)
    spy = LaunchSpy(monkeypatch)
    out = att.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask)
    assert_close(out, np_attention(q, k, v, d**-0.5, mask), dtype, f"one-launch decode {case} {mask_kind}")
    if kernel_backend != "reference":
        rows = hq // hkv * lq
        assert spy.kernels == ["attention_decode_stream"]
        t = spy.templates[0]
        assert (t["TB"], t["NW"], t["ST"], t["R"]) == (*att._stream_plan(rows, d, dv, dtype, kernel_backend), rows)


@pytest.mark.parametrize("case,dtype_name", [(c, d) for c in STREAM_CASES for d in ("bfloat16", "float32")]
                         + [("b1_gqa2_q1_k1100_d36", "float32")])  # D = 36: 144-byte rows in float32 only
def test_split_kv_stream_early_refill_same_bits(kernel_backend, monkeypatch, case, dtype_name):
    """STREAM_EARLY_REFILL (the kernel's ER: a lane's words of each tile in registers, the stage
    refilled before the arithmetic) adds the same products in the same order: ER = 0's bits,
    both within float64's tolerance; causal. D = 36 in float32 (nine 16-byte words a row) takes
    the lanes' partial last word."""
    if kernel_backend == "reference":
        pytest.skip("a kernel variant")
    set_walk(monkeypatch, "stream")
    b, hq, hkv, lq, lk, d, dv = STREAM_CASES.get(case, (1, 2, 1, 1, 1100, 36, 36))
    dtype = DTYPES[dtype_name]
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed_of("stream early", case, dtype_name))
    outs = []
    for early in (False, True):
        monkeypatch.setattr(att, "STREAM_EARLY_REFILL", early)
        spy = LaunchSpy(monkeypatch)
        outs.append(att.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask="causal"))
        assert spy.kernels == ["attention_decode_stream"] and spy.templates[0]["ER"] == int(early)
    assert_close(outs[1], np_attention(q, k, v, d**-0.5, "causal"), dtype, f"early refill {case}")
    assert np.array_equal(np.array(outs[0].astype(mx.float32)), np.array(outs[1].astype(mx.float32)))


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_split_kv_stream_decode_loop(kernel_backend, monkeypatch, dtype_name):
    """A decode loop over a growing cache (slices of one buffer: rows contiguous, so bulk
    copies) reuses one prepared launch; each step matches float64."""
    dtype = getattr(mx, dtype_name)
    set_walk(monkeypatch, "stream")
    q, kc, vc = make_qkv(1, 2, 2, 1, 1300, 128, 128, dtype, seed_of("stream loop", dtype_name))
    spy = LaunchSpy(monkeypatch)
    for lk in (1024, 1025, 1040, 1299):
        k, v = kc[:, :, :lk], vc[:, :, :lk]
        out = att.scaled_dot_product_attention(q, k, v, scale=0.125)
        assert_close(out, np_attention(q, k, v, 0.125, None), dtype, f"one-launch decode loop, Lk {lk}")
    if kernel_backend != "reference":
        assert set(spy.kernels) == {"attention_decode_stream"}


def test_split_kv_stream_apple_plan(kernel_backend, monkeypatch):
    """The tiles Apple GPUs get (32 KiB: 8-key tiles, 2 simdgroups, 2 stages at D = 128 in a
    2-byte dtype), run: the emulator with Apple's budget, or Metal itself."""
    if kernel_backend not in ("emulate", "metal"):
        pytest.skip("Apple's 32 KiB plan")
    monkeypatch.setattr(att, "_stream_budget", lambda backend: 32 * 1024)
    set_walk(monkeypatch, "stream")
    q, k, v = make_qkv(1, 2, 1, 1, 1100, 128, 128, mx.bfloat16, seed_of("stream apple"))
    spy = LaunchSpy(monkeypatch)
    out = att.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert_close(out, np_attention(q, k, v, 0.125, "causal"), mx.bfloat16, "one-launch decode, 32 KiB plan")
    t = spy.templates[0]
    assert spy.kernels == ["attention_decode_stream"] and (t["TB"], t["NW"], t["ST"], t["R"]) == (8, 2, 2, 2)


def test_split_kv_stream_plan():
    """Tiles: the first of STREAM_TILES whose buffer and bars fit (cuda, and the emulator that
    models it: 227 KiB; Apple GPUs: 32 KiB), at most 8 simdgroups with several query rows;
    none for rows that are not whole 16-byte words or more than STREAM_MAX_ROWS rows."""
    assert att._stream_plan(1, 128, 128, mx.float16, "cuda") == (16, 12, 2)
    assert att._stream_plan(1, 128, 128, mx.bfloat16, "emulate") == (16, 12, 2)
    assert att._stream_plan(4, 128, 128, mx.float16, "cuda") == (16, 8, 3)
    assert att._stream_plan(1, 128, 128, mx.float16, "metal") == (8, 2, 2)  # (8, 4, 2): 32 KiB + its bars
    assert att._stream_plan(1, 256, 256, mx.float32, "cuda") == (8, 4, 2)
    assert att._stream_plan(1, 36, 36, mx.float32, "cuda") == (16, 12, 2)  # 144-byte rows
    assert att._stream_plan(1, 36, 36, mx.float16, "cuda") is None  # 72-byte rows
    assert att._stream_plan(att.STREAM_MAX_ROWS + 1, 64, 64, mx.float16, "cuda") is None
    for rows, d, dv, dt in ((1, 128, 128, mx.float16), (2, 256, 256, mx.float32), (3, 64, 32, mx.bfloat16)):
        for backend in ("cuda", "metal"):
            tiles = att._stream_plan(rows, d, dv, dt, backend)
            budget = att._stream_budget(backend)
            assert att._stream_bytes(tiles, rows, d, dv, dt) + 8 * tiles[1] * tiles[2] <= budget


def test_split_kv_stream_auto_rule(monkeypatch):
    """split_kv_stream unset: one-launch decode on cuda with bulk copies, for 32 to 64 (batch,
    kv head) pairs of one query row, head dims 128, 2-byte dtypes and no mask array."""
    monkeypatch.setattr(att.cuda_limits, "has_bulk_copies", lambda arch=None: True)

    def use(b, hq, hkv, lq, d, dtype=mx.float16, mask=None, backend="cuda", knob=None):
        q = mx.ones((b, hq, lq, d), dtype)
        k = mx.ones((b, hkv, 16, d), dtype)
        return att._use_stream(knob, q, k, k, att._check_inputs(q, k, k, 1.0, mask), backend)

    assert use(1, 32, 32, 1, 128) and use(2, 32, 32, 1, 128, mx.bfloat16) and use(1, 32, 32, 1, 128, mask="causal")
    assert not use(1, 32, 8, 1, 128)  # 8 pairs
    assert not use(3, 32, 32, 1, 128)  # 96 pairs
    assert not use(1, 32, 32, 2, 128)  # two query rows per kv head
    assert not use(1, 32, 32, 1, 64)
    assert not use(1, 32, 32, 1, 128, mx.float32)
    assert not use(1, 32, 32, 1, 128, mask=mx.ones((1, 1, 1, 16), mx.bool_))
    assert not use(1, 32, 32, 1, 128, backend="emulate") and not use(1, 32, 32, 1, 128, backend="metal")
    assert not use(1, 32, 32, 1, 128, knob=False)
    assert use(1, 4, 1, 1, 64, backend="emulate", knob=True)  # the knob: wherever it can run
    assert not use(1, 4, 1, 1, 36, backend="emulate", knob=True)  # 72-byte rows
    monkeypatch.setattr(att.cuda_limits, "has_bulk_copies", lambda arch=None: False)
    assert not use(1, 32, 32, 1, 128)


def test_split_kv_stream_knob_fallback(kernel_backend, monkeypatch):
    """split_kv_stream on where one-launch decode cannot run (72-byte rows; more than
    STREAM_MAX_ROWS query rows a kv head): the split-KV pair, as split_kv_mma falls back to the
    lane walk."""
    set_walk(monkeypatch, "stream")
    for hq, lq, d, dtype in ((2, 1, 36, mx.float16), (8, 2, 64, mx.bfloat16)):
        q, k, v = make_qkv(1, hq, 1, lq, 40, d, d, dtype, seed_of("stream fallback", hq, d))
        spy = LaunchSpy(monkeypatch)
        out = att.attention_decode_split_kv(q, k, v, scale=0.2, block_size=16)
        assert_close(out, np_attention(q, k, v, 0.2, None), dtype, f"stream knob fallback D={d}")
        if kernel_backend != "reference":
            assert spy.kernels == ["attention_partial_mma", "attention_reduce"]


def test_split_kv_stream_refusal_names_the_reason(monkeypatch):
    """Where one-launch decode cannot run, the refusal names the condition the call fails:
    rows not whole 16-byte words, too many query rows a kv head, or no tile plan that fits
    (12 simdgroups asked with four rows a kv head)."""
    def why(hq, hkv, lq, d, dtype):
        q = mx.zeros((1, hq, lq, d), dtype=dtype)
        kv = mx.zeros((1, hkv, 64, d), dtype=dtype)
        return att._stream_refusal(q, kv, kv, "cuda")

    assert "whole 16-byte words" in why(2, 1, 1, 36, mx.float16)
    assert "at most 8 query rows" in why(16, 1, 1, 64, mx.bfloat16) and "16 / 1 * 1 = 16" in why(16, 1, 1, 64, mx.bfloat16)
    assert why(4, 1, 1, 128, mx.float16) is None
    monkeypatch.setattr(att, "STREAM_TILES", ((16, 12, 2),))
    msg = why(4, 1, 1, 128, mx.float16)
    assert "no tile plan of STREAM_TILES ((16, 12, 2),)" in msg and "at most 8 simdgroups" in msg, msg
    assert why(1, 1, 1, 128, mx.float16) is None  # one row: 12 simdgroups are allowed
    monkeypatch.setattr(att, "STREAM_TILES", ((16, 12, 64),))  # far past any threadgroup memory
    msg = why(1, 1, 1, 128, mx.float16)
    assert "no tile plan" in msg and "simdgroups" not in msg, msg


@pytest.mark.emulator_only
@pytest.mark.parametrize("dtype_name, mask_kind, layout, early", [
    ("float16", "causal", "cache", False), ("bfloat16", "bool", "cache", False), ("float32", "additive", "swapped", False),
    ("bfloat16", "causal", "cache", True), ("float16", "additive", "swapped", True)])
def test_check_schedules_split_kv_stream(backend, monkeypatch, dtype_name, mask_kind, layout, early):
    """One-launch decode under every schedule: the bars' phases (bulk copies) or the lanes'
    element copies (a swapped K / V layout), each stage refilled only after every lane read
    it (after the arithmetic, or with STREAM_EARLY_REFILL before it); 1100 keys, GQA 2, Lq = 2."""
    monkeypatch.setattr(att, "STREAM_EARLY_REFILL", early)
    dtype = DTYPES[dtype_name]
    q, k, v = make_qkv(1, 4, 2, 2, 1100, 64, 64, dtype, seed_of("sched-stream", dtype_name))
    kv, vv = kv_layout(k, layout), kv_layout(v, layout)
    mask = make_mask(mask_kind, 1, 4, 2, 1100, dtype, 5)
    spec, kwargs = att._stream_launch(q, kv, vv, _mask_obj(mask, q, k), 0.125, "emulate")
    (out,) = emulate.check_schedules(runtime.get_kernel(spec, "emulate"), **kwargs)
    assert_close(out, np_attention(q, k, v, 0.125, mask), dtype, "one-launch decode (schedules)")


def test_split_kv_mma_knob_fallback(kernel_backend, monkeypatch):
    """split_kv_mma on where the tiles do not fit (float32, D = 256 on 32 KiB): the lane walk."""
    if kernel_backend not in ("emulate", "metal"):
        pytest.skip("the 32 KiB stage budget")
    set_walk(monkeypatch, "mma")
    q, k, v = make_qkv(1, 2, 1, 1, 40, 256, 256, mx.float32, seed_of("mma fallback"))
    spy = LaunchSpy(monkeypatch)
    out = att.attention_decode_split_kv(q, k, v, scale=0.0625, block_size=16)
    assert_close(out, np_attention(q, k, v, 0.0625, None), mx.float32, "fallback")
    assert spy.kernels == ["attention_partial", "attention_reduce"]


def test_split_kv_auto_block_size():
    """The automatic block size halves (to 64) until the pass-1 grid has enough
    threadgroups; one K / V read per split for all the query heads of a kv head."""
    def plan(b, hq, hkv, lq, lk, d=128):
        q, k = mx.zeros((b, hq, lq, d), dtype=mx.float16), mx.zeros((b, hkv, lk, d), dtype=mx.float16)
        bs = att._auto_block_size(q, k, k)
        _, kw = att._partial_launch(q, k, k, att._Mask(0), 0.1, bs)
        groups = kw["grid"][0] // kw["threadgroup"][0] * kw["grid"][1] * kw["grid"][2]
        return bs, dict(kw["template"])["R"], groups

    assert plan(1, 32, 8, 1, 4096) == (128, 2, 512)  # B=1, Hkv=8: 512 threadgroups, > 132 SMs
    assert plan(1, 32, 32, 1, 4096) == (256, 1, 512)
    assert plan(8, 32, 8, 1, 8192) == (256, 2, 4096)
    assert plan(1, 32, 8, 1, 300)[0] == 64  # never below 64


def test_split_kv_auto_decode(kernel_backend, monkeypatch):
    """One query over 1030 keys takes the split-KV path with the default block size."""
    q, k, v = make_qkv(1, 2, 1, 1, 1030, 64, 64, mx.float16, seed_of("auto decode"))
    spy = LaunchSpy(monkeypatch)
    out = att.scaled_dot_product_attention(q, k, v, scale=0.125)
    assert_close(out, np_attention(q, k, v, 0.125, None), mx.float16, "auto split-KV decode")
    if kernel_backend != "reference":
        # 2-byte dtype: the tiles on cuda and the emulator, the lane walk on Apple GPUs
        assert spy.kernels == ["attention_partial" if kernel_backend == "metal" else "attention_partial_mma",
                               "attention_reduce"]


@pytest.mark.parametrize("walk", ["lane", "mma"])
def test_partial_lse_and_reduce(kernel_backend, walk):
    """Pass 1's per-block log-sum-exp and normalised outputs, and pass 2 on its own."""
    if kernel_backend == "reference":
        pytest.skip("attention_partial / attention_reduce are kernels; the reference backend has none")
    b, hq, hkv, lq, lk, d, bs = 1, 2, 1, 4, 37, 64, 16
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, mx.float32, seed_of("lse"))
    o_part, lse = att.attention_partial(q, k, v, scale=0.125, mask="causal", block_size=bs, mma=walk == "mma")
    nb = -(-lk // bs)
    assert tuple(o_part.shape) == (b, hq, lq, nb, d) and tuple(lse.shape) == (b, hq, lq, nb)
    qd, kd, vd = f64(q), f64(k), f64(v)
    got_lse, got_o = np.asarray(lse), np.asarray(o_part)
    for h in range(hq):
        for i in range(lq):
            s = kd[0, 0] @ qd[0, h, i] * 0.125
            visible = np.arange(lk) <= i + lk - lq
            for blk in range(nb):
                sel = visible & (np.arange(lk) // bs == blk)
                if not sel.any():
                    assert got_lse[0, h, i, blk] == -np.inf
                    continue
                ref_lse = np.log(np.exp(s[sel]).sum())
                assert abs(got_lse[0, h, i, blk] - ref_lse) < 1e-5 * max(1.0, abs(ref_lse))
                p = np.exp(s[sel] - s[sel].max())
                ref_o = (p / p.sum()) @ vd[0, 0, sel]
                assert rel_err(got_o[0, h, i, blk].astype(np.float64), ref_o) < 1e-5
    out = att.attention_reduce(o_part, lse, block_size=bs, num_keys=lk, dtype=mx.float16)
    assert_close(out, np_attention(q, k, v, 0.125, "causal"), mx.float16, "attention_reduce")


@pytest.mark.parametrize("dv", [64, 40])
@pytest.mark.parametrize("nb", [7, 45])  # one pass of 32 blocks, or two (13 in the second)
def test_reduce_batch_gives_the_same_bits(kernel_backend, monkeypatch, nb, dv):
    """Pass 2 loading RB blocks' partial rows at a time (REDUCE_BATCH: 1, 3, 4, 8, 16, 32,
    over block counts that RB does not divide and head dims not a multiple of 32), with its
    first batch loaded before or after the lse reduction (REDUCE_PREFETCH), adds them in
    block order: the same bits for every RB and prefetch, and the weighted mean of the rows
    (float64)."""
    if kernel_backend == "reference":
        pytest.skip("attention_reduce is a kernel; the reference backend has none")
    rng = np.random.default_rng(seed_of("reduce-batch", nb, dv))
    rows, bs = 5, 16
    o_part = mx.array(rng.standard_normal((1, rows, 1, nb, dv)).astype(np.float32))
    lse_np = rng.standard_normal((1, rows, 1, nb)).astype(np.float32) * 3.0
    lse_np[0, 3, 0, nb // 2] = -np.inf  # a block with no key
    lse_np[0, 4] = -np.finfo(np.float32).max  # every key masked: blocks weighted by key counts
    lse = mx.array(lse_np)
    outs = {}
    for rb in (1, 3, 4, 8, 16, 32):
        for pf in (False, True):
            monkeypatch.setattr(att, "REDUCE_BATCH", rb)
            monkeypatch.setattr(att, "REDUCE_PREFETCH", pf)
            outs[rb, pf] = np.asarray(att.attention_reduce(o_part, lse, block_size=bs, num_keys=nb * bs,
                                                           dtype=mx.float32))
    for key, out in outs.items():
        assert np.array_equal(out, outs[4, False]), key
    w = np.exp(lse_np.astype(np.float64) - lse_np.max(axis=-1, keepdims=True))
    w[0, 4] = bs  # the all-masked row: every block holds bs keys
    want = (w[..., None] * np.asarray(o_part, dtype=np.float64)).sum(-2) / w.sum(-1)[..., None]
    assert rel_err(outs[4, False].astype(np.float64), want) < 1e-5


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_decode_loop_with_a_growing_cache(kernel_backend, dtype_name, monkeypatch):
    """A decode loop's KV cache grows a key a step (k_cache[:, :, :lk]): every step is a new
    Lk. From the second length on, the calls share one family call (no new memo entry per
    step), and each result still matches float64."""
    dtype = getattr(mx, dtype_name)
    q, kc, vc = make_qkv(1, 4, 2, 1, 1040, 16, 16, dtype, seed_of("growing cache", dtype_name))
    spy = LaunchSpy(monkeypatch)
    for lk in (1030, 1031, 1033, 1036):
        k, v = kc[:, :, :lk], vc[:, :, :lk]
        spy.kernels.clear()
        out = att.scaled_dot_product_attention(q, k, v, scale=0.25)
        assert_close(out, np_attention(q, k, v, 0.25, None), dtype, f"growing cache, Lk {lk}")
        assert len(att._CALLS) == 1  # only the first length is memoised
        assert len(att._FAMILIES) == 1
        if kernel_backend != "reference":
            assert len(spy.kernels) == 2 and spy.kernels[1] == "attention_reduce", spy.kernels
    for _ in range(2):  # then a fixed length, twice: memoised (replayed on cuda / metal)
        out = att.scaled_dot_product_attention(q, k, v, scale=0.25)
        assert_close(out, np_attention(q, k, v, 0.25, None), dtype, "fixed length after growth")
    assert len(att._CALLS) == 2
    # an empty cache is never a family call: the full build (the reference path: zero keys)
    empty = att.scaled_dot_product_attention(q, kc[:, :, :0], vc[:, :, :0], scale=0.25)
    ref_empty = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), kc[:, :, :0].astype(mx.float32),
                                                     vc[:, :, :0].astype(mx.float32), scale=0.25)
    assert tuple(empty.shape) == tuple(ref_empty.shape)
    np.testing.assert_array_equal(np.isnan(np.asarray(empty.astype(mx.float32))), np.isnan(np.asarray(ref_empty)))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_decode_family_with_batches_and_query_runs(kernel_backend, dtype_name):
    """The family's prepared launches declare pass 1's outputs (rows, blocks, DV) and pass 2's
    (B, Hq, Lq, DV) directly: with several sequences, a query run (Lq 3, causal) and a value
    head dim unlike the key's, each step's output keeps its shape and matches float64."""
    dtype = getattr(mx, dtype_name)
    q, kc, vc = make_qkv(2, 6, 2, 3, 1100, 16, 24, dtype, seed_of("family batches", dtype_name))
    att._CALLS.clear()
    att._FAMILIES.clear()
    for lk in (1030, 1031, 1057, 1090):
        k, v = kc[:, :, :lk], vc[:, :, :lk]
        out = att.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
        assert tuple(out.shape) == (2, 6, 3, 24)
        assert_close(out, np_attention(q, k, v, 0.25, "causal"), dtype, f"family, Lk {lk}")
    assert len(att._FAMILIES) == 1


def test_decode_family_fast_path_follows_the_memo_and_the_configuration(kernel_backend, monkeypatch):
    """After a family's call, the next step at a new length skips the memo lookups
    (_LAST_FAMILY): no family-memo lookup per step. An environment change applies at the
    very next step (here the split threshold moves above Lk: one pass, not split-KV), and a
    cleared memo is not bypassed (the spy, made after the family, sees the launches)."""
    q, kc, vc = make_qkv(1, 4, 2, 1, 1100, 16, 16, mx.float32, seed_of("family fast path"))
    att._CALLS.clear()
    att._FAMILIES.clear()
    for lk in (1030, 1031):  # the family is made at the second length
        att.scaled_dot_product_attention(q, kc[:, :, :lk], vc[:, :, :lk], scale=0.25)
    lookups = []
    real_get = att._FAMILIES.get
    monkeypatch.setattr(att._FAMILIES, "get", lambda key: lookups.append(key) or real_get(key))
    for lk in (1032, 1033, 1040):
        k, v = kc[:, :, :lk], vc[:, :, :lk]
        out = att.scaled_dot_product_attention(q, k, v, scale=0.25)
        assert_close(out, np_attention(q, k, v, 0.25, None), mx.float32, f"fast path, Lk {lk}")
    assert lookups == []
    spy = LaunchSpy(monkeypatch)  # clears the memos: the next steps build anew and launch through the spy
    for lk in (1041, 1042, 1043):
        k, v = kc[:, :, :lk], vc[:, :, :lk]
        out = att.scaled_dot_product_attention(q, k, v, scale=0.25)
        assert_close(out, np_attention(q, k, v, 0.25, None), mx.float32, f"after clearing, Lk {lk}")
    if kernel_backend != "reference":
        assert spy.kernels == ["attention_partial", "attention_reduce"] * 3, spy.kernels
    spy.kernels.clear()
    monkeypatch.setenv("XLSTM_ATTENTION_SPLIT_KV_MIN_KEYS", "100000")
    k, v = kc[:, :, :1044], vc[:, :, :1044]
    out = att.scaled_dot_product_attention(q, k, v, scale=0.25)
    assert_close(out, np_attention(q, k, v, 0.25, None), mx.float32, "threshold moved")
    if kernel_backend != "reference":
        assert spy.kernels == ["attention_prefill"], spy.kernels


def test_decode_family_keeps_the_path_rule(kernel_backend, monkeypatch):
    """A family's call serves only lengths that take its path: crossing split_kv_min_keys
    goes back to a full build (split-KV above it, one pass below)."""
    q, kc, vc = make_qkv(1, 4, 2, 1, 1040, 16, 16, mx.float32, seed_of("family path"))
    spy = LaunchSpy(monkeypatch)
    seen = []
    for lk in (1029, 1030, 1031, 1032, 1033, 1031):
        k, v = kc[:, :, :lk], vc[:, :, :lk]
        spy.kernels.clear()
        out = att.scaled_dot_product_attention(q, k, v, scale=0.25, split_kv_min_keys=1032)
        assert_close(out, np_attention(q, k, v, 0.25, None), mx.float32, f"family path, Lk {lk}")
        seen.append(list(spy.kernels))
    if kernel_backend != "reference":
        split = [["attention_partial", "attention_reduce"]]
        assert seen[:3] == [["attention_prefill"]] * 3 and seen[3:5] == split * 2 and seen[5] == ["attention_prefill"]


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("nb,dv", [(3, 5), (33, 64), (70, 130), (64, 128)])
def test_reduce_many_blocks(kernel_backend, monkeypatch, nb, dv, prefetch):
    """Pass 2 alone over random partials: 32 blocks at a time (nb past 32 and not a multiple
    of it), columns past a lane's first (DV > 32, and not a multiple of 32); one row with
    a -inf block, one with every block at the masked level (weighted by key counts); the
    first batch's loads before or after the lse reduction (REDUCE_PREFETCH)."""
    if kernel_backend == "reference":
        pytest.skip("attention_reduce is a kernel; the reference backend has none")
    monkeypatch.setattr(att, "REDUCE_PREFETCH", prefetch)
    rows, bs = 6, 16
    lk = nb * bs - 5  # the last block holds 11 keys
    rng = np.random.default_rng(seed_of("reduce", nb, dv))
    o_part = rng.standard_normal((rows, nb, dv)).astype(np.float32)
    lse = (3.0 * rng.standard_normal((rows, nb))).astype(np.float32)
    lse[1, nb // 2] = -np.inf
    lse[2, :] = -np.finfo(np.float32).max
    out = np.asarray(att.attention_reduce(mx.array(o_part), mx.array(lse), block_size=bs, num_keys=lk,
                                          dtype=mx.float32)).astype(np.float64)
    lse64, op64 = lse.astype(np.float64), o_part.astype(np.float64)
    wt = np.exp(lse64 - lse64.max(axis=1, keepdims=True))
    wt[2] = np.minimum(bs, lk - np.arange(nb) * bs)  # the all-masked row: key counts
    ref = (wt[:, :, None] * op64).sum(axis=1) / wt.sum(axis=1, keepdims=True)
    assert out.shape == (rows, dv)
    assert rel_err(out, ref) < 1e-5
    # the same partials as transposed views (the kernel reads its inputs as they are: the op
    # makes them row-contiguous first)
    o_view = mx.array(np.ascontiguousarray(o_part.transpose(1, 0, 2))).transpose(1, 0, 2)
    lse_view = mx.array(np.ascontiguousarray(lse.T)).T
    out_view = att.attention_reduce(o_view, lse_view, block_size=bs, num_keys=lk, dtype=mx.float32)
    assert rel_err(np.asarray(out_view).astype(np.float64), ref) < 1e-5


def test_reduce_takes_its_rows_from_o_parts_shape(kernel_backend):
    """Pass 2 reads its row count from o_part's shape (passed by value), not from params, so
    that its first loads wait for no read of memory (session 34): with params' row count
    set to 0 every row is still reduced (a kernel that gated its rows on params would leave
    the output unwritten); params' block size still weights an all-masked row."""
    if kernel_backend == "reference":
        pytest.skip("attention_reduce is a kernel; the reference backend has none")
    rows, nb, dv, bs = 5, 9, 40, 16
    lk = nb * bs - 3
    rng = np.random.default_rng(seed_of("reduce-rows-by-shape"))
    o_part = rng.standard_normal((rows, nb, dv)).astype(np.float32)
    lse = (2.0 * rng.standard_normal((rows, nb))).astype(np.float32)
    lse[3, :] = -np.finfo(np.float32).max
    spec, kw = att._reduce_launch(mx.array(o_part), mx.array(lse), bs, lk, mx.float32)
    inputs = list(kw["inputs"])
    assert np.asarray(inputs[2]).tolist()[:3] == [rows, 0, bs]  # the params the op passes
    inputs[2] = att._params([0, 0, bs, 0])
    (out,) = att._run((spec, {**kw, "inputs": inputs}), kernel_backend)
    lse64, op64 = lse.astype(np.float64), o_part.astype(np.float64)
    wt = np.exp(lse64 - lse64.max(axis=1, keepdims=True))
    wt[3] = np.minimum(bs, lk - np.arange(nb) * bs)
    ref = (wt[:, :, None] * op64).sum(axis=1) / wt.sum(axis=1, keepdims=True)
    assert rel_err(np.asarray(out).astype(np.float64), ref) < 1e-5


# ---------------------------------------------------------------------------------------
# Semantics against mx.fast.scaled_dot_product_attention (float32)
# ---------------------------------------------------------------------------------------


def _mx_fast_cases():
    rng = np.random.default_rng(7)
    lq, lk = 6, 70
    full_min = np.full((lq, lk), np.finfo(np.float32).min, dtype=np.float32)
    neg_inf_row = rng.standard_normal((lq, lk)).astype(np.float32)
    neg_inf_row[2] = -np.inf
    return {
        "none": (lq, lk, None),
        "causal_lq_lt_lk": (lq, lk, "causal"),
        "causal_lq_gt_lk": (9, 5, "causal"),  # the first 4 rows see no key: uniform average
        "bool_all_false": (lq, lk, mx.zeros((lq, lk), dtype=mx.bool_)),
        "bool_random": (lq, lk, mx.array(rng.random((1, 4, lq, lk)) < 0.5)),
        "additive_finfo_min": (lq, lk, mx.array(full_min)),
        "additive_inf_row": (lq, lk, mx.array(neg_inf_row)),  # an all -inf row gives NaN
    }


MX_FAST_CASES = _mx_fast_cases()


@pytest.mark.parametrize("case", list(MX_FAST_CASES))
@pytest.mark.parametrize("path", ["auto", "prefill", "split", "split_mma", "split_cluster"])
def test_matches_mx_fast_float32(kernel_backend, monkeypatch, case, path):
    lq, lk, mask = MX_FAST_CASES[case]
    q, k, v = make_qkv(2, 4, 2, lq, lk, 64, 64, mx.float32, seed_of("mxfast", case))
    ref = np.asarray(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)).astype(np.float64)
    if path == "auto":
        out = att.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    elif path == "prefill":
        out = att.attention_prefill(q, k, v, scale=0.125, mask=mask)
    else:
        set_walk(monkeypatch, {"split_mma": "mma", "split_cluster": "cluster"}.get(path, "lane"))
        out = att.attention_decode_split_kv(q, k, v, scale=0.125, mask=mask, block_size=32)
    got = f64(out)
    assert np.array_equal(np.isnan(got), np.isnan(ref)), f"{case}: NaN rows differ from mx.fast"
    fin = ~np.isnan(ref)
    assert fin.any()
    err = float(np.max(np.abs(got[fin] - ref[fin])) / np.max(np.abs(ref[fin])))
    assert err <= 1e-5, f"{case} ({path}): relative error {err:.3e} vs mx.fast"


def test_non_contiguous_inputs(kernel_backend):
    """q/k/v as transposed views of (B, L, H, D) projections, as in a transformer layer."""
    rng = np.random.default_rng(seed_of("noncontig"))
    x = rand(rng, (1, 21, 4, 64), mx.float32)
    kv = rand(rng, (1, 21, 2, 64), mx.float32)
    q, k = x.transpose(0, 2, 1, 3), kv.transpose(0, 2, 1, 3)
    out = att.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal")
    ref = np.asarray(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal")).astype(np.float64)
    assert_close(out, ref, mx.float32, "transposed views")


def offset_view(a: mx.array, off: int) -> mx.array:
    """`a`'s values in a row-contiguous view that starts `off` elements into a larger
    buffer (no copy: for off % 8 != 0 the data pointer is not 16-byte aligned)."""
    flat = a.reshape(-1)
    big = mx.concatenate([mx.zeros((off,), dtype=a.dtype), flat, mx.zeros((3,), dtype=a.dtype)])
    return big[off : off + flat.size].reshape(a.shape)


# Offset-slice inputs (row-contiguous views whose data pointer is not vector-aligned, as
# an MLX slice reaches a kernel uncopied): the prefill's vector tile loads and the
# split-KV pass 1's wide K / V runs must fall back to narrower accesses (CUDA faults on a
# misaligned vector access). Head dims 64 (4- and 8-element runs) and 36 (4-element runs
# only), element offsets 1 and 3 (no 4-byte alignment for 2-byte dtypes) and 2; plus
# k_all[1:] along the batch axis with an odd head dim (an offset of Hkv * Lk * D elements).
@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("d, off", [(64, 1), (64, 2), (36, 3)])
def test_offset_slice_inputs(kernel_backend, monkeypatch, dtype_name, d, off, walk):
    set_walk(monkeypatch, walk)
    dtype = DTYPES[dtype_name]
    b, hq, hkv, lk = 1, 4, 2, 75
    seed = seed_of("offset slice", dtype_name, d, off)
    for lq in (1, 19):
        q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, dtype, seed + lq)
        qv, kv, vv = offset_view(q, off), offset_view(k, off + 2), offset_view(v, off)
        ref = np_attention(q, k, v, d**-0.5, "causal")
        if walk == "lane":  # the prefill does not depend on the walk
            out = att.attention_prefill(qv, kv, vv, scale=d**-0.5, mask="causal", block_q=16, block_k=16)
            assert_close(out, ref, dtype, f"prefill offset {off} Lq={lq}")
        out = att.attention_decode_split_kv(qv, kv, vv, scale=d**-0.5, mask="causal", block_size=32)
        assert_close(out, ref, dtype, f"split-KV offset {off} Lq={lq}")
    # A batch slice: k_all[1:] starts Hkv * Lk * D elements in (odd for D = 37, Lk odd).
    q, k_all, v_all = make_qkv(3, hq, hkv, 2, 45, 37, 37, dtype, seed + 7)
    k, v = k_all[1:], v_all[1:]
    q = q[1:]
    ref = np_attention(q, k, v, 0.2, None)
    if walk == "lane":
        assert_close(att.attention_prefill(q, k, v, scale=0.2), ref, dtype, "prefill k_all[1:]")
    assert_close(att.attention_decode_split_kv(q, k, v, scale=0.2, block_size=16), ref, dtype, "split-KV k_all[1:]")


def kv_layout(a: mx.array, layout: str) -> mx.array:
    """`a` (B, H, L, D)'s values in a view the kernels must read in place through its
    strides (no copy: ensure_row_contiguous is off for the attention kernels)."""
    b, h, n, d = a.shape
    if layout == "cache":  # a KV cache slice k_cache[:, :, :lk] (head stride Lmax * D)
        big = mx.concatenate([a, mx.full((b, h, 13, d), 1e4, dtype=a.dtype)], axis=2)
        return big[:, :, :n]
    if layout == "transposed":  # keys projected as (B, L, H, D), then transposed
        return mx.contiguous(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if layout == "every_other":  # element stride 2: every other column of a wider array
        big = mx.stack([a, mx.full(a.shape, -1e4, dtype=a.dtype)], axis=-1).reshape(b, h, n, 2 * d)
        return big[..., ::2]
    if layout == "swapped":  # element stride L, row stride 1
        return mx.contiguous(a.swapaxes(-1, -2)).swapaxes(-1, -2)
    if layout == "broadcast":  # one batch element's keys broadcast (batch stride 0)
        return mx.broadcast_to(a[:1], a.shape)
    if layout == "misaligned":  # rows of D + 1 elements, the view starting at element 1
        big = mx.concatenate([mx.full((b, h, n, 1), 1e4, dtype=a.dtype), a], axis=-1)
        return big[..., 1:]
    raise ValueError(layout)


KV_LAYOUTS = ("cache", "transposed", "every_other", "swapped", "broadcast", "misaligned")


# K and V reach the kernels uncopied, in any layout: a KV cache slice, transposed
# projections, an element stride (every other column, or swapped axes), a broadcast batch,
# a misaligned start with an odd row stride. Every path that reads them: the prefill
# (attention_prefill, and attention_prefill_mma for 2-byte dtypes) and split-KV pass 1
# (the lane walk and the tiles); q transposed and an additive mask broadcast as well.
@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_kv_read_in_place(kernel_backend, monkeypatch, dtype_name, layout):
    dtype = DTYPES[dtype_name]
    assert not att.PARTIAL.ensure_row_contiguous and not att.PREFILL_MMA.ensure_row_contiguous
    b, hq, hkv, lk, d = 2, 4, 2, 75, 64
    seed = seed_of("kv in place", dtype_name, layout)
    for lq in (1, 19):
        q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, dtype, seed + lq)
        if layout == "broadcast":
            k, v = mx.broadcast_to(k[:1], k.shape), mx.broadcast_to(v[:1], v.shape)
        kv, vv = kv_layout(k, layout), kv_layout(v, layout)
        qv = mx.contiguous(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # q as (B, L, H, D) transposed
        mask = make_mask("additive", b, hq, lq, lk, dtype, seed)
        mask_view = mx.broadcast_to(mask, (b, 1, lq, lk))
        ref = np_attention(q, k, v, d**-0.5, mask)
        what = f"{layout} Lq={lq}"
        out = att.attention_prefill(qv, kv, vv, scale=d**-0.5, mask=mask_view, block_q=16, block_k=16)
        assert_close(out, ref, dtype, f"prefill {what}")
        if dtype != mx.float32:
            monkeypatch.setenv("XLSTM_ATTENTION_PREFILL_MMA", "1")
            out = att.scaled_dot_product_attention(qv, kv, vv, scale=d**-0.5, mask="causal")
            assert_close(out, np_attention(q, k, v, d**-0.5, "causal"), dtype, f"prefill_mma {what}")
            monkeypatch.delenv("XLSTM_ATTENTION_PREFILL_MMA")
        for walk in WALKS if dtype != mx.float32 or layout in ("cache", "swapped") else ("lane",):
            set_walk(monkeypatch, walk)
            out = att.attention_decode_split_kv(qv, kv, vv, scale=d**-0.5, mask=mask_view, block_size=32)
            assert_close(out, ref, dtype, f"split-KV {walk} {what}")


# ---------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lq, lk, min_keys, env, expect",
    [
        (1, 40, 32, None, ["attention_partial", "attention_reduce"]),
        (8, 40, 32, None, ["attention_partial", "attention_reduce"]),
        (9, 40, 32, None, ["attention_prefill"]),
        (1, 40, None, None, ["attention_prefill"]),  # Lk < 1024
        (1, 40, None, "40", ["attention_partial", "attention_reduce"]),
    ],
)
def test_auto_dispatch(kernel_backend, monkeypatch, lq, lk, min_keys, env, expect):
    if kernel_backend == "reference":
        pytest.skip("the reference backend launches no kernels")
    if env is None:
        monkeypatch.delenv(att.ENV_SPLIT_MIN_KEYS, raising=False)
    else:
        monkeypatch.setenv(att.ENV_SPLIT_MIN_KEYS, env)
    spy = LaunchSpy(monkeypatch)
    q, k, v = make_qkv(1, 2, 1, lq, lk, 64, 64, mx.float32, seed_of("dispatch", lq))
    out = att.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal", split_kv_min_keys=min_keys)
    assert spy.kernels == expect
    assert_close(out, np_attention(q, k, v, 0.125, "causal"), mx.float32, "dispatch")


# ---------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("path", ["auto", "split"])
@pytest.mark.parametrize("chunked", [False, True])
def test_gradients(kernel_backend, monkeypatch, mask_kind, path, chunked):
    if chunked:  # the backward recomputes in query chunks: force several
        monkeypatch.setattr(att, "BACKWARD_CHUNK_ELEMENTS", 4 * 37)
    b, hq, hkv, lq, lk, d = 1, 4, 1, 5, 37, 64
    seed = seed_of("grad", mask_kind, path)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, mx.float32, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, mx.float32, seed, layout="default")
    do = rand(np.random.default_rng(seed + 2), (b, hq, lq, d), mx.float32)
    fn = att.scaled_dot_product_attention if path == "auto" else att.attention_decode_split_kv
    additive = mask_kind == "additive"

    def loss(q, k, v, m):
        return (fn(q, k, v, scale=0.125, mask=m if additive else mask) * do).sum()

    argnums = (0, 1, 2, 3) if additive else (0, 1, 2)
    grads = mx.grad(loss, argnums=argnums)(q, k, v, mask if additive else mx.zeros((1,)))
    ref = np_attention_grads(q, k, v, 0.125, mask, f64(do))
    for name, g, r in zip(("dq", "dk", "dv", "dmask"), grads, ref):
        assert_close(g, r, mx.float32, f"{name} ({mask_kind}, {path}, chunked={chunked})", tol=2e-5)


def test_gradients_low_precision(kernel_backend):
    b, hq, hkv, lq, lk, d = 1, 2, 2, 4, 20, 64
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, mx.bfloat16, seed_of("grad-bf16"))
    do = rand(np.random.default_rng(3), (b, hq, lq, d), mx.bfloat16)
    grads = mx.grad(
        lambda q, k, v: (att.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal") * do).sum(),
        argnums=(0, 1, 2),
    )(q, k, v)
    ref = np_attention_grads(q, k, v, 0.125, "causal", f64(do))
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert_close(g, r, mx.bfloat16, f"bf16 {name}", tol=3e-2)


# ---------------------------------------------------------------------------------------
# Validation, zero sizes, reference backend
# ---------------------------------------------------------------------------------------


def _bad_calls():
    q = mx.ones((1, 4, 3, 8))
    k = mx.ones((1, 2, 5, 8))
    h = mx.ones((1, 4, 3, 8), dtype=mx.float16)
    return {
        "head dim": (lambda: att.scaled_dot_product_attention(q, k[..., :4], k, scale=1.0), ValueError, "head dim"),
        "hq multiple": (lambda: att.scaled_dot_product_attention(mx.ones((1, 3, 3, 8)), k, k, scale=1.0), ValueError, "multiple"),
        "mask shape": (lambda: att.scaled_dot_product_attention(q, k, k, scale=1.0, mask=mx.ones((4, 5))), ValueError, "broadcast"),
        "mask rank": (lambda: att.scaled_dot_product_attention(q, k, k, scale=1.0, mask=mx.ones((1, 1, 1, 3, 5))), ValueError, "4 dimensions"),
        "mask string": (lambda: att.scaled_dot_product_attention(q, k, k, scale=1.0, mask="upper"), ValueError, "causal"),
        "mask dtype": (lambda: att.scaled_dot_product_attention(h, h[:, :2], h[:, :2], scale=1.0, mask=mx.ones((3, 3))), TypeError, "promote"),
        "dtype mismatch": (lambda: att.scaled_dot_product_attention(h, k, k, scale=1.0), TypeError, "same dtype"),
        "integer dtype": (lambda: att.scaled_dot_product_attention(q.astype(mx.int32), k, k, scale=1.0), TypeError, "int32"),
        "rank": (lambda: att.scaled_dot_product_attention(q[0], k[0], k[0], scale=1.0), ValueError, "4 dimensions"),
        "batch": (lambda: att.scaled_dot_product_attention(mx.ones((2, 4, 3, 8)), k, k, scale=1.0), ValueError, "batch"),
        "v length": (lambda: att.scaled_dot_product_attention(q, k, k[:, :, :4], scale=1.0), ValueError, "Lk"),
        "scale": (lambda: att.scaled_dot_product_attention(q, k, k, scale=None), TypeError, "scale"),
        "block_q": (lambda: att.attention_prefill(q, k, k, scale=1.0, block_q=12), ValueError, "block_q"),
        "block_size": (lambda: att.attention_decode_split_kv(q, k, k, scale=1.0, block_size=0), ValueError, "block_size"),
    }


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_validation_errors(kernel_backend, name):
    call, exc, text = BAD_CALLS[name]
    with pytest.raises(exc, match=text):
        call()


@pytest.mark.parametrize(
    "qs, ks, vs",
    [
        ((1, 2, 3, 8), (1, 2, 0, 8), (1, 2, 0, 8)),  # no keys: zeros, as in MLX
        ((1, 2, 0, 8), (1, 2, 5, 8), (1, 2, 5, 8)),  # no queries
        ((0, 2, 3, 8), (0, 2, 5, 8), (0, 2, 5, 8)),  # no batch
        ((1, 2, 3, 0), (1, 2, 5, 0), (1, 2, 5, 4)),  # D = 0: uniform average of v
        ((1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 0)),  # DV = 0
    ],
)
def test_zero_size(kernel_backend, qs, ks, vs):
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, qs, mx.float32), rand(rng, ks, mx.float32), rand(rng, vs, mx.float32)
    out = att.scaled_dot_product_attention(q, k, v, scale=1.0, mask="causal")
    assert tuple(out.shape) == (*qs[:3], vs[3])
    if kernel_backend != "cuda":  # MLX 0.32's own CUDA SDPA segfaults on zero-size inputs
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask="causal")
        assert tuple(ref.shape) == tuple(out.shape)
        assert np.allclose(np.asarray(out), np.asarray(ref), atol=1e-6)
    g = mx.grad(lambda q: att.scaled_dot_product_attention(q, k, v, scale=1.0).sum())(q)
    assert tuple(g.shape) == qs


@pytest.mark.parametrize("mask_kind", MASKS)
def test_reference_backend(mask_kind):
    b, hq, hkv, lq, lk, d = 2, 4, 2, 5, 23, 32
    seed = seed_of("reference", mask_kind)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, d, mx.float32, seed)
    mask = make_mask(mask_kind, b, hq, lq, lk, mx.float32, seed)
    with runtime.use_backend("reference"):
        out = att.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    assert_close(out, np_attention(q, k, v, 0.2, mask), mx.float32, "reference backend")


# ---------------------------------------------------------------------------------------
# Races (emulator)
# ---------------------------------------------------------------------------------------


def _mask_obj(mask, q, k):
    return att._check_mask(mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.dtype)


@pytest.mark.emulator_only
@pytest.mark.parametrize("mask_kind, d, dtype_name", [("bool", 64, "float16"), ("causal", 256, "float32")])
def test_check_schedules_prefill(backend, mask_kind, d, dtype_name):
    dtype = DTYPES[dtype_name]
    q, k, v = make_qkv(1, 2, 1, 11, 21, d, d, dtype, seed_of("sched-prefill", d))
    mask = make_mask(mask_kind, 1, 2, 11, 21, dtype, 5)
    spec, kwargs = att._prefill_launch(q, k, v, _mask_obj(mask, q, k), 0.125, block_q=16, block_k=8)
    (out,) = emulate.check_schedules(runtime.get_kernel(spec, "emulate"), **kwargs)
    assert_close(out, np_attention(q, k, v, 0.125, mask), dtype, "prefill (schedules)")


@pytest.mark.emulator_only
@pytest.mark.parametrize("dtype_name, mask_kind, tiles", [("float16", "causal", (2, 1, 16, 2)),
                                                          ("bfloat16", "bool", (2, 1, 16, 3)),
                                                          ("float16", "additive", (4, 1, 32, 1))])
def test_check_schedules_prefill_mma(backend, monkeypatch, dtype_name, mask_kind, tiles):
    """The tile prefill under shuffled schedules: the shared K / V stages (copied by every
    simdgroup, one barrier per tile) and the Q rows (each simdgroup its own)."""
    monkeypatch.setattr(att, "PREFILL_MMA_TILES", tiles)
    dtype = DTYPES[dtype_name]
    q, k, v = make_qkv(1, 2, 1, 37, 75, 40, 40, dtype, seed_of("sched-prefill-mma", dtype_name))
    mask = make_mask(mask_kind, 1, 2, 37, 75, dtype, 6)
    spec, kwargs = att._prefill_mma_launch(q, k, v, _mask_obj(mask, q, k), 0.125, "emulate")
    kwargs.pop("shared_memory")  # cuda's dynamic buffer size; the emulator declares the buffer
    (out,) = emulate.check_schedules(runtime.get_kernel(spec, "emulate"), **kwargs)
    assert_close(out, np_attention(q, k, v, 0.125, mask), dtype, "prefill tiles (schedules)")


@pytest.mark.emulator_only
def test_check_schedules_split_kv(backend):
    q, k, v = make_qkv(1, 2, 1, 2, 45, 64, 64, mx.float32, seed_of("sched-split"))
    m = _mask_obj("causal", q, k)
    spec, kwargs = att._partial_launch(q, k, v, m, 0.125, 16)
    o_part, lse = emulate.check_schedules(runtime.get_kernel(spec, "emulate"), **kwargs)
    spec, kwargs = att._reduce_launch(o_part, lse, 16, 45, mx.float32)
    (out,) = emulate.check_schedules(runtime.get_kernel(spec, "emulate"), **kwargs)
    assert_close(out.reshape(1, 2, 2, 64), np_attention(q, k, v, 0.125, "causal"), mx.float32, "split-KV (schedules)")


@pytest.mark.emulator_only
@pytest.mark.parametrize("dtype_name, mask_kind", [("float16", "causal"), ("bfloat16", "bool")])
def test_check_schedules_split_kv_mma(backend, dtype_name, mask_kind):
    """The tile pass 1 (one simdgroup per threadgroup: the schedules differ only across
    threadgroups, which must not share anything), 3 stages over 5 tiles."""
    dtype = DTYPES[dtype_name]
    q, k, v = make_qkv(1, 4, 2, 2, 75, 64, 64, dtype, seed_of("sched-mma", dtype_name))
    mask = make_mask(mask_kind, 1, 4, 2, 75, dtype, 4)
    spec, kwargs = att._partial_mma_launch(q, k, v, _mask_obj(mask, q, k), 0.125, 80, "emulate")
    o_part, lse = emulate.check_schedules(runtime.get_kernel(spec, "emulate"), **kwargs)
    spec, kwargs = att._reduce_launch(o_part, lse, 80, 75, dtype)
    (out,) = runtime.get_kernel(spec, "emulate")(**kwargs)
    assert_close(out.reshape(1, 4, 2, 64), np_attention(q, k, v, 0.125, mask), dtype, "split-KV tiles (schedules)")


@pytest.mark.emulator_only
@pytest.mark.parametrize("warps, d, backend_plan", [(4, 64, "emulate"), (4, 128, "cuda")])
def test_check_schedules_split_kv_mma_warps(backend, warps, d, backend_plan):
    """The tile pass 1 with several simdgroups per threadgroup under every schedule: the
    simdgroups' own stages, the barrier before their states meet over those stages, the
    merge. backend_plan "cuda": the plan CUDA runs (3 stages of D = 128 per simdgroup,
    102 KiB of dynamic shared memory, which the emulated launch models)."""
    dtype = mx.bfloat16
    q, k, v = make_qkv(1, 8, 2, 1, 300, d, d, dtype, seed_of("sched-mma-warps", warps, d))
    mask = make_mask("causal", 1, 8, 1, 300, dtype, 5)
    spec, kwargs = att._partial_mma_launch(q, k, v, _mask_obj(mask, q, k), 0.125, 176, backend_plan, warps=warps)
    assert kwargs["threadgroup"] == (32 * warps, 1, 1)
    o_part, lse = emulate.check_schedules(runtime.get_kernel(spec, "emulate"), **kwargs)
    spec, kwargs = att._reduce_launch(o_part, lse, 176, 300, dtype)
    (out,) = runtime.get_kernel(spec, "emulate")(**kwargs)
    assert_close(out.reshape(1, 8, 1, d), np_attention(q, k, v, 0.125, mask), dtype,
                 f"split-KV tiles, {warps} simdgroups (schedules)")


@pytest.mark.emulator_only
def test_split_kv_mma_plan_of_a_99_kib_gpu_runs(backend, monkeypatch):
    """The tile pass 1 as an sm_89 GPU gets it (99 KiB a block: 4 simdgroups x 2 stages of
    D = 128, 68 KiB), run through the emulator as that CUDA launch, under every schedule."""
    from xlstm_kernels.cuda import limits

    monkeypatch.setattr(limits, "_arch", ["sm_89"])
    dtype = mx.float16
    q, k, v = make_qkv(1, 8, 2, 1, 300, 128, 128, dtype, seed_of("sm89 plan"))
    spec, kwargs = att._partial_mma_launch(q, k, v, _mask_obj(None, q, k), 0.125, 176, "cuda")
    t = dict(kwargs["template"])
    assert (t["NW"], t["ST"], kwargs["shared_memory"]) == (4, 2, 4 * 2 * 16 * 272 * 2)
    o_part, lse = emulate.check_schedules(runtime.get_kernel(spec, "emulate"), **kwargs)
    spec, kwargs = att._reduce_launch(o_part, lse, 176, 300, dtype)
    (out,) = runtime.get_kernel(spec, "emulate")(**kwargs)
    assert_close(out.reshape(1, 8, 1, 128), np_attention(q, k, v, 0.125, None), dtype, "split-KV tiles, sm_89 plan")


@pytest.mark.emulator_only
@pytest.mark.parametrize("d, dv, dtype_name, mask_kind", [(36, 20, "float32", "additive"), (64, 64, "float16", "bool")])
def test_bounds(backend, d, dv, dtype_name, mask_kind):
    """Every kernel against guard pages: tile edges, vector loads, mask strides."""
    dtype = DTYPES[dtype_name]
    b, hq, hkv, lq, lk = 1, 4, 2, 9, 37
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, dtype, seed_of("bounds", d))
    mask = make_mask(mask_kind, b, hq, lq, lk, dtype, 3, layout="head")
    m = _mask_obj(mask, q, k)
    ref = np_attention(q, k, v, 0.125, mask)
    spec, kwargs = att._prefill_launch(q, k, v, m, 0.125)
    (out,) = runtime.get_kernel(spec, "emulate")(**kwargs, check_bounds=True)
    assert_close(out, ref, dtype, "prefill (bounds)")
    if dtype != mx.float32:
        spec, kwargs = att._prefill_mma_launch(q, k, v, m, 0.125, "emulate")
        kwargs.pop("shared_memory")
        (out,) = runtime.get_kernel(spec, "emulate")(**kwargs, check_bounds=True)
        assert_close(out, ref, dtype, "prefill tiles (bounds)")
    spec, kwargs = att._partial_launch(q, k, v, m, 0.125, 16)
    o_part, lse = runtime.get_kernel(spec, "emulate")(**kwargs, check_bounds=True)
    spec, kwargs = att._reduce_launch(o_part, lse, 16, lk, dtype)
    (out,) = runtime.get_kernel(spec, "emulate")(**kwargs, check_bounds=True)
    assert_close(out.reshape(ref.shape), ref, dtype, "split-KV (bounds)")
    spec, kwargs = att._partial_mma_launch(q, k, v, m, 0.125, 16, "emulate")
    o_part, lse = runtime.get_kernel(spec, "emulate")(**kwargs, check_bounds=True)
    spec, kwargs = att._reduce_launch(o_part, lse, 16, lk, dtype)
    (out,) = runtime.get_kernel(spec, "emulate")(**kwargs, check_bounds=True)
    assert_close(out.reshape(ref.shape), ref, dtype, "split-KV tiles (bounds)")
