"""Input validation of every public op and of the nn layers (table-driven).

Sections:

* argument errors: wrong rank, incompatible shapes, bad options. Each error names the
  argument, the shape received and the shape (or layout) expected;
* dtypes: integer, complex, bool and float64 operands raise a TypeError that lists the
  supported dtypes (Metal has no float64; nothing is cast silently);
* zero-size dimensions: correctly shaped (empty) results equal to the reference backend's;
* views: transposed, strided and broadcast operands give bit-identical results to
  contiguous copies of the same values;
* NaN / Inf: propagate like ``mx.matmul`` / ``mx.fast`` (or the op's plain-mx reference
  where MLX has no fused equivalent): the same non-finite positions, never masked;
* 32-bit limits: element offsets inside the kernels are 64-bit; counts that an op must
  pass as one 32-bit value (a flattened row count, a grid dimension, an MLX shape
  dimension) raise a clear ValueError before anything is launched or evaluated. The
  operands are lazily created ``mx.zeros`` of more than 2**31 elements that are never
  evaluated (peak memory stays flat, the launch function is never reached). The kernel
  side of the 64-bit claim runs for real in ``test_offsets_beyond_2_31_in_the_emulator``
  (rms_norm and gemm_a_bt on 2**31 + 2**20 float16 elements; ~19 GB of memory, opt-in:
  ``XLSTM_TEST_HUGE=1``).

Kernel tests run on ``--backend`` (default emulate); argument errors are raised before
any backend is involved and run on every backend.
"""

from __future__ import annotations

import os
import zlib

import mlx.core as mx
import numpy as np
import pytest
from launch_spies import clear_call_memos

import xlstm_kernels as xk
from xlstm_kernels import nn as xnn
from xlstm_kernels.ops import attention as att_mod
from xlstm_kernels.ops import gemm as gemm_mod
from xlstm_kernels.ops import mlstm as mlstm_mod
from xlstm_kernels.ops import norm as norm_mod
from xlstm_kernels.ops import rope as rope_mod
from xlstm_kernels.ops import slstm as slstm_mod
from xlstm_kernels.ops._validate import INT32_MAX

SUPPORTED = "float32, float16, bfloat16"
BAD_DTYPES = (mx.int32, mx.uint8, mx.bool_, mx.complex64, mx.float64)


def arr(shape, dtype=mx.float32, seed=0, scale=1.0) -> mx.array:
    rng = np.random.default_rng(zlib.crc32(repr((shape, seed)).encode()))
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def npf(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32))


def contiguous(x: mx.array) -> mx.array:
    """A fresh row-contiguous array with x's values (float32 test data)."""
    return mx.array(np.ascontiguousarray(np.asarray(x)))


# ---------------------------------------------------------------------------------------
# Every public op: how to call it, and its array arguments (default shape, message name)
# ---------------------------------------------------------------------------------------

OPS = {
    "gemm_av": (lambda a: xk.gemm_av(a["a"], a["v"]), {"a": ((4, 5), "a"), "v": ((5, 3), "v")}),
    "gemm_at_b": (lambda a: xk.gemm_at_b(a["a"], a["b"]), {"a": ((5, 4), "a"), "b": ((5, 3), "b")}),
    "gemm_a_bt": (lambda a: xk.gemm_a_bt(a["a"], a["b"]), {"a": ((4, 5), "a"), "b": ((3, 5), "b")}),
    "linear": (
        lambda a: xk.linear(a["x"], a["weight"], a["bias"], "gelu", a["residual"]),
        {"x": ((2, 4, 5), "x"), "weight": ((3, 5), "weight"), "bias": ((3,), "bias"), "residual": ((2, 4, 3), "residual")},
    ),
    "rms_norm": (lambda a: xk.rms_norm(a["x"], a["weight"]), {"x": ((3, 8), "x"), "weight": ((8,), "weight")}),
    "layer_norm": (
        lambda a: xk.layer_norm(a["x"], a["weight"], a["bias"]),
        {"x": ((3, 8), "x"), "weight": ((8,), "weight"), "bias": ((8,), "bias")},
    ),
    "multihead_layer_norm": (
        lambda a: xk.multihead_layer_norm(a["x"], a["weight"], a["bias"], 2),
        {"x": ((3, 8), "x"), "weight": ((8,), "weight"), "bias": ((8,), "bias")},
    ),
    "rope": (lambda a: xk.rope(a["x"], 8), {"x": ((2, 3, 8), "x")}),
    "scaled_dot_product_attention": (
        lambda a: xk.scaled_dot_product_attention(a["q"], a["k"], a["v"], scale=0.35),
        {"q": ((1, 2, 3, 8), "q"), "k": ((1, 2, 4, 8), "k"), "v": ((1, 2, 4, 8), "v")},
    ),
    "mlstm": (
        lambda a: xk.mlstm(a["q"], a["k"], a["v"], a["i_pre"], a["f_pre"], state=(a["C"], a["n"], a["m"])),
        {
            "q": ((1, 2, 5, 8), "q"), "k": ((1, 2, 5, 8), "k"), "v": ((1, 2, 5, 4), "v"),
            "i_pre": ((1, 2, 5), "i_pre"), "f_pre": ((1, 2, 5), "f_pre"),
            "C": ((1, 2, 8, 4), "state C"), "n": ((1, 2, 8), "state n"), "m": ((1, 2), "state m"),
        },
    ),
    "mlstm_step": (
        lambda a: xk.mlstm_step(a["q"], a["k"], a["v"], a["i_pre"], a["f_pre"], (a["C"], a["n"], a["m"])),
        {
            "q": ((1, 2, 8), "q"), "k": ((1, 2, 8), "k"), "v": ((1, 2, 4), "v"),
            "i_pre": ((1, 2), "i_pre"), "f_pre": ((1, 2), "f_pre"),
            "C": ((1, 2, 8, 4), "state C"), "n": ((1, 2, 8), "state n"), "m": ((1, 2), "state m"),
        },
    ),
    "slstm": (
        lambda a: xk.slstm(a["wx"], a["r"], a["b"], state=(a["y"], a["c"], a["n"], a["m"])),
        {
            "wx": ((1, 3, 4, 2, 8), "wx"), "r": ((2, 8, 4, 8), "r"), "b": ((4, 2, 8), "b"),
            "y": ((1, 2, 8), "state.y"), "c": ((1, 2, 8), "state.c"), "n": ((1, 2, 8), "state.n"),
            "m": ((1, 2, 8), "state.m"),
        },
    ),
    "slstm_step": (
        lambda a: xk.slstm_step(a["wx"], a["r"], a["b"], (a["y"], a["c"], a["n"], a["m"])),
        {
            "wx": ((1, 4, 2, 8), "wx_t"), "r": ((2, 8, 4, 8), "r"), "b": ((4, 2, 8), "b"),
            "y": ((1, 2, 8), "state.y"), "c": ((1, 2, 8), "state.c"), "n": ((1, 2, 8), "state.n"),
            "m": ((1, 2, 8), "state.m"),
        },
    ),
}


def call(op: str, **over):
    fn, spec = OPS[op]
    vals = {k: over[k] if k in over else arr(shape, seed=i) for i, (k, (shape, _)) in enumerate(spec.items())}
    if op.startswith("slstm") and "n" not in over:  # a valid state has n > 0
        vals["n"] = mx.abs(vals["n"]) + 1.0
    return fn(vals)


def test_every_public_op_is_in_the_table():
    public = {
        name for name in xk.__all__
        if callable(getattr(xk, name)) and getattr(xk, name).__module__.startswith("xlstm_kernels.ops")
        and getattr(xk, name).__module__ != "xlstm_kernels.ops.fused"  # validated in tests/test_fused.py
    }
    assert public == set(OPS)


@pytest.mark.parametrize("op", sorted(OPS))
def test_table_defaults_are_valid(kernel_backend, op):
    out = call(op)
    mx.eval(out)


# ---------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------

DTYPE_CASES = [
    pytest.param(op, key, dt, id=f"{op}-{key}-{str(dt).split('.')[-1]}")
    for op, (_, spec) in OPS.items()
    for key in spec
    for dt in BAD_DTYPES
]


def _zeros(shape, dtype):
    """Zeros of any dtype: float64 made on the CPU (Apple and CUDA GPUs have no float64, so
    MLX refuses such arrays on the GPU; the op must still reject them with a TypeError)."""
    return mx.zeros(shape, dtype=dtype, stream=mx.cpu if dtype == mx.float64 else None)


@pytest.mark.parametrize("op,key,dtype", DTYPE_CASES)
def test_unsupported_dtypes_raise_type_error_listing_supported(op, key, dtype):
    shape, name = OPS[op][1][key]
    with pytest.raises(TypeError) as info:
        call(op, **{key: _zeros(shape, dtype)})
    msg = str(info.value)
    assert name in msg and str(dtype) in msg and SUPPORTED in msg, msg


@pytest.mark.parametrize(
    "thunk,match",
    [
        (lambda: xk.gemm_av(np.ones((2, 2), np.float32), mx.ones((2, 2))), "a must be an mx.array"),
        (lambda: xk.rope(mx.ones((2, 3, 8)), 8, freqs=mx.ones((4,), dtype=mx.int32)), "freqs has dtype.*float32"),
        (lambda: xk.rope(mx.ones((2, 3, 8)), 8, offset=mx.array(1.5)), "offset must be an integer array"),
        (
            lambda: xk.scaled_dot_product_attention(
                mx.ones((1, 1, 2, 8)), mx.ones((1, 1, 3, 8)), mx.ones((1, 1, 3, 8)), scale=1.0,
                mask=mx.zeros((2, 3), dtype=mx.complex64)),
            "additive mask has dtype.*complex64",
        ),
        (
            lambda: xk.scaled_dot_product_attention(
                mx.ones((1, 1, 2, 8), dtype=mx.float16), mx.ones((1, 1, 3, 8), dtype=mx.float16),
                mx.ones((1, 1, 3, 8), dtype=mx.float16), scale=1.0, mask=_zeros((2, 3), mx.float64)),
            "additive mask has dtype.*float64.*does not promote",
        ),
        (
            lambda: xk.scaled_dot_product_attention(
                mx.ones((1, 1, 2, 8)), mx.ones((1, 1, 3, 8), dtype=mx.float16), mx.ones((1, 1, 3, 8)), scale=1.0),
            r"q \(mlx.core.float32\) and k \(mlx.core.float16\) must have the same dtype",
        ),
    ],
)
def test_other_dtype_and_type_errors(thunk, match):
    with pytest.raises(TypeError, match=match):
        thunk()


def test_rope_float64_freqs_are_a_documented_cast(kernel_backend):
    x = arr((2, 3, 8))
    f = mx.array([1.0, 10.0, 100.0, 1000.0], dtype=mx.float32)
    a = xk.rope(x, 8, base=None, freqs=f.astype(mx.float64, stream=mx.cpu))
    b = xk.rope(x, 8, base=None, freqs=f)
    assert np.array_equal(npf(a), npf(b))  # "inv_freq = 1 / freqs computed in float32"


# ---------------------------------------------------------------------------------------
# Shapes and options: each message names the argument, what was received and what is expected
# ---------------------------------------------------------------------------------------

_z = mx.zeros
SHAPE_ERRORS = [
    # GEMM
    ("gemm_av rank", lambda: xk.gemm_av(_z((5,)), _z((5, 3))), ["a", "(5,)", "at least 2"]),
    ("gemm_av inner", lambda: xk.gemm_av(_z((4, 5)), _z((6, 3))), ["a (..., m, n)", "v (..., n, k)", "(4, 5)", "(6, 3)"]),
    ("gemm_at_b inner", lambda: xk.gemm_at_b(_z((5, 4)), _z((6, 3))), ["b (..., m, k)", "(5, 4)", "(6, 3)"]),
    ("gemm_a_bt inner", lambda: xk.gemm_a_bt(_z((4, 5)), _z((3, 6))), ["b (..., n, k)", "(4, 5)", "(3, 6)"]),
    ("gemm batch", lambda: xk.gemm_av(_z((2, 4, 5)), _z((3, 5, 3))), ["do not broadcast", "(2, 4, 5)", "(3, 5, 3)"]),
    ("gemm tiles", lambda: xk.gemm_av(_z((4, 5)), _z((5, 3)), tiles="abc"), ["tiles", "TMxTN"]),
    ("linear weight rank", lambda: xk.linear(_z((2, 5)), _z((3, 5, 1))), ["weight", "2 dimensions", "(3, 5, 1)"]),
    ("linear in_features", lambda: xk.linear(_z((2, 5)), _z((3, 6))), ["x (..., in_features)", "(2, 5)", "(3, 6)"]),
    ("linear bias", lambda: xk.linear(_z((2, 5)), _z((3, 5)), _z((4,))), ["bias", "(3,)", "(4,)"]),
    ("linear residual", lambda: xk.linear(_z((2, 5)), _z((3, 5)), residual=_z((2, 4))), ["residual", "(2, 4)", "(2, 3)"]),
    ("linear activation", lambda: xk.linear(_z((2, 5)), _z((3, 5)), activation="tanh"), ["activation", "'tanh'", "relu"]),
    # norms
    ("rms_norm rank", lambda: xk.rms_norm(_z(()), None), ["x", "at least 1", "()"]),
    ("rms_norm weight", lambda: xk.rms_norm(_z((3, 8)), _z((7,))), ["weight", "(8,)", "(7,)", "(3, 8)"]),
    ("layer_norm bias rank", lambda: xk.layer_norm(_z((3, 8)), None, _z((8, 1))), ["bias", "1 dimensions", "(8, 1)"]),
    ("layer_norm eps", lambda: xk.layer_norm(_z((3, 8)), None, None, -1.0), ["eps", "-1.0"]),
    ("mhln heads", lambda: xk.multihead_layer_norm(_z((3, 8)), None, None, 3), ["num_heads=3", "(3, 8)", "D=8"]),
    ("mhln heads type", lambda: xk.multihead_layer_norm(_z((3, 8)), None, None, 0), ["num_heads", "positive int", "0"]),
    # rope
    ("rope rank", lambda: xk.rope(_z((8,)), 8), ["x", "at least 2", "(8,)"]),
    ("rope dims", lambda: xk.rope(_z((2, 3, 8)), 16), ["dims (16)", "D=8", "(2, 3, 8)"]),
    ("rope odd dims", lambda: xk.rope(_z((2, 3, 8)), 5), ["dims", "even", "5"]),
    ("rope offset", lambda: xk.rope(_z((2, 3, 8)), 8, offset=mx.zeros((3,), mx.int32)), ["offset", "(2,)", "(3,)", "(2, 3, 8)"]),
    ("rope freqs", lambda: xk.rope(_z((2, 3, 8)), 8, base=None, freqs=_z((3,))), ["freqs", "(4,)", "(3,)"]),
    ("rope base+freqs", lambda: xk.rope(_z((2, 3, 8)), 8, base=2.0, freqs=_z((4,))), ["base", "freqs", "base=None"]),
    # attention
    ("sdpa rank", lambda: xk.scaled_dot_product_attention(_z((2, 3, 8)), _z((1, 2, 3, 8)), _z((1, 2, 3, 8)), scale=1.0),
     ["q", "4 dimensions", "(2, 3, 8)"]),
    ("sdpa head dim", lambda: xk.scaled_dot_product_attention(_z((1, 2, 3, 8)), _z((1, 2, 4, 6)), _z((1, 2, 4, 6)), scale=1.0),
     ["q (B, Hq, Lq, D)", "k (B, Hkv, Lk, D)", "(1, 2, 3, 8)", "(1, 2, 4, 6)"]),
    ("sdpa batch", lambda: xk.scaled_dot_product_attention(_z((1, 2, 3, 8)), _z((2, 2, 4, 8)), _z((2, 2, 4, 8)), scale=1.0),
     ["batch size B", "(1, 2, 3, 8)", "(2, 2, 4, 8)"]),
    ("sdpa kv", lambda: xk.scaled_dot_product_attention(_z((1, 2, 3, 8)), _z((1, 2, 4, 8)), _z((1, 2, 5, 8)), scale=1.0),
     ["v (B, Hkv, Lk, DV)", "(1, 2, 4, 8)", "(1, 2, 5, 8)"]),
    ("sdpa gqa", lambda: xk.scaled_dot_product_attention(_z((1, 3, 3, 8)), _z((1, 2, 4, 8)), _z((1, 2, 4, 8)), scale=1.0),
     ["Hq=3", "Hkv=2", "(1, 3, 3, 8)", "(1, 2, 4, 8)"]),
    ("sdpa mask", lambda: xk.scaled_dot_product_attention(_z((1, 2, 3, 8)), _z((1, 2, 4, 8)), _z((1, 2, 4, 8)), scale=1.0,
                                                           mask=_z((1, 1, 3, 5))),
     ["mask", "(1, 1, 3, 5)", "(1, 2, 3, 4)"]),
    ("sdpa mask string", lambda: xk.scaled_dot_product_attention(_z((1, 2, 3, 8)), _z((1, 2, 4, 8)), _z((1, 2, 4, 8)),
                                                                  scale=1.0, mask="upper"), ["mask", "'causal'", "'upper'"]),
    ("sdpa scale", lambda: xk.scaled_dot_product_attention(_z((1, 2, 3, 8)), _z((1, 2, 4, 8)), _z((1, 2, 4, 8)),
                                                            scale=float("inf")), ["scale", "finite", "inf"]),
    # mLSTM
    ("mlstm rank", lambda: call("mlstm", q=_z((2, 5, 8))), ["q", "4 dimensions", "(2, 5, 8)"]),
    ("mlstm k", lambda: call("mlstm", k=_z((1, 2, 6, 8))), ["k", "(1, 2, 5, 8)", "(1, 2, 6, 8)"]),
    ("mlstm v", lambda: call("mlstm", v=_z((1, 2, 6, 4))), ["v", "(B, NH, S, DHV)", "(1, 2, 6, 4)"]),
    ("mlstm gate", lambda: call("mlstm", f_pre=_z((1, 2, 6))), ["f_pre", "(1, 2, 5)", "(1, 2, 6)"]),
    ("mlstm state", lambda: call("mlstm", C=_z((1, 2, 4, 8))), ["state C", "(1, 2, 8, 4)", "(1, 2, 4, 8)"]),
    ("mlstm chunk", lambda: xk.mlstm(*[arr((1, 2, 5, 8))] * 3, *[arr((1, 2, 5))] * 2, chunk_size=0),
     ["chunk_size", "positive int", "0"]),
    ("mlstm dhqk 0", lambda: xk.mlstm(*[_z((1, 2, 5, 0))] * 2, _z((1, 2, 5, 4)), *[_z((1, 2, 5))] * 2),
     ["DHQK", "(1, 2, 5, 0)"]),
    ("mlstm_step rank", lambda: call("mlstm_step", q=_z((1, 2, 1, 8))), ["q", "3 dimensions", "(1, 2, 1, 8)"]),
    ("mlstm_step gate", lambda: call("mlstm_step", i_pre=_z((1, 3))), ["i_pre", "(1, 2)", "(1, 3)"]),
    # sLSTM
    ("slstm rank", lambda: call("slstm", wx=_z((1, 3, 4, 16))), ["wx", "5 dimensions", "(1, 3, 4, 16)"]),
    ("slstm gates axis", lambda: call("slstm", wx=_z((1, 3, 3, 2, 8))), ["(B, S, 4, NH, DH)", "(1, 3, 3, 2, 8)"]),
    ("slstm r", lambda: call("slstm", r=_z((2, 8, 4, 4))), ["r", "(2, 8, 4, 8)", "(2, 8, 4, 4)"]),
    ("slstm b", lambda: call("slstm", b=_z((4, 2, 7))), ["b", "(4, 2, 8)", "(4, 2, 7)"]),
    ("slstm state", lambda: call("slstm", c=_z((2, 2, 8))), ["state.c", "(1, 2, 8)", "(2, 2, 8)"]),
    ("slstm config", lambda: xk.slstm(_z((1, 3, 4, 2, 8)), _z((2, 8, 4, 8)), _z((4, 2, 8)), config={"threads_per_unit": 3}),
     ["threads_per_unit", "power of two", "3"]),
    ("slstm_step rank", lambda: call("slstm_step", wx=_z((1, 1, 4, 2, 8))), ["wx_t", "4 dimensions", "(1, 1, 4, 2, 8)"]),
    ("slstm_step b", lambda: call("slstm_step", b=_z((4, 8))), ["b", "3 dimensions", "(4, 8)"]),
]


@pytest.mark.parametrize("thunk,expect", [pytest.param(t, e, id=i) for i, t, e in SHAPE_ERRORS])
def test_argument_errors_name_argument_received_and_expected(thunk, expect):
    with pytest.raises((ValueError, TypeError)) as info:
        thunk()
    msg = str(info.value)
    missing = [s for s in expect if s not in msg]
    assert not missing, f"{missing} not in: {msg}"


@pytest.mark.parametrize(
    "thunk,exc,expect",
    [
        (lambda: xk.mlstm(*[_z((1, 2, 5, 8))] * 3, *[_z((1, 2, 5))] * 2, state=(_z((1, 2, 8, 8)),) * 2), TypeError,
         ["state", "(C, n, m)"]),
        (lambda: xk.slstm(_z((1, 3, 4, 2, 8)), _z((2, 8, 4, 8)), _z((4, 2, 8)), state=(_z((1, 2, 8)),) * 3), TypeError,
         ["state", "(y, c, n, m)", "length 3"]),
        (lambda: xk.slstm_step(_z((1, 4, 2, 8)), _z((2, 8, 4, 8)), _z((4, 2, 8)), None), TypeError, ["state", "required"]),
    ],
)
def test_state_container_errors(thunk, exc, expect):
    with pytest.raises(exc) as info:
        thunk()
    assert all(s in str(info.value) for s in expect), str(info.value)


# nn layers ------------------------------------------------------------------------------

E = 16


def _stack_cfg(**kw):
    return xnn.xLSTMBlockStackConfig(
        mlstm_block=xnn.mLSTMBlockConfig(mlstm=xnn.mLSTMLayerConfig(num_heads=2, chunk_size=8)),
        slstm_block=xnn.sLSTMBlockConfig(slstm=xnn.sLSTMLayerConfig(num_heads=2)),
        context_length=16, num_blocks=2, embedding_dim=E, **kw,
    )


def _layers():
    cfg = _stack_cfg(slstm_at=[1])
    return {
        "Linear": xnn.Linear(E, 8),
        "HeadwiseLinear": xnn.HeadwiseLinear(E, 4),
        "RMSNorm": xnn.RMSNorm(E),
        "LayerNorm": xnn.LayerNorm(E),
        "MultiHeadLayerNorm": xnn.MultiHeadLayerNorm(E, 2),
        "CausalConv1d": xnn.CausalConv1d(E),
        "FeedForward": xnn.FeedForward(xnn.FeedForwardConfig(embedding_dim=E)),
        "MultiHeadAttention": xnn.MultiHeadAttention(E, 4, 2),
        "mLSTMLayer": xnn.mLSTMLayer(cfg.mlstm_block.mlstm),
        "sLSTMLayer": xnn.sLSTMLayer(cfg.slstm_block.slstm),
        "mLSTMBlock": xnn.mLSTMBlock(cfg.mlstm_block),
        "sLSTMBlock": xnn.sLSTMBlock(cfg.slstm_block),
        "xLSTMBlockStack": xnn.xLSTMBlockStack(cfg),
    }


LAYER_NAMES = [
    "Linear", "HeadwiseLinear", "RMSNorm", "LayerNorm", "MultiHeadLayerNorm", "CausalConv1d", "FeedForward",
    "MultiHeadAttention", "mLSTMLayer", "sLSTMLayer", "mLSTMBlock", "sLSTMBlock", "xLSTMBlockStack",
]
# layers taking (B, S, E) only (the others take (..., E))
SEQUENCE_LAYERS = {"CausalConv1d", "MultiHeadAttention", "mLSTMLayer", "sLSTMLayer", "mLSTMBlock", "sLSTMBlock",
                   "xLSTMBlockStack"}


@pytest.fixture(scope="module")
def layers():
    mx.random.seed(3)
    return _layers()


def _out(y):
    return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("name", LAYER_NAMES)
def test_layers_accept_valid_input(kernel_backend, layers, name):
    y = _out(layers[name](arr((2, 5, E))))
    mx.eval(y)
    assert y.shape[:2] == (2, 5)


@pytest.mark.parametrize("name", LAYER_NAMES)
def test_layers_reject_a_wrong_feature_size(layers, name):
    x = arr((2, 5, E + 2))
    with pytest.raises(ValueError) as info:
        layers[name](x)
    msg = str(info.value)
    assert "(2, 5, 18)" in msg or ("18" in msg and str(E) in msg), msg


@pytest.mark.parametrize("name", sorted(SEQUENCE_LAYERS - {"xLSTMBlockStack", "mLSTMBlock", "sLSTMBlock"}))
def test_sequence_layers_reject_a_wrong_rank(layers, name):
    with pytest.raises(ValueError) as info:
        layers[name](arr((2, E)))
    msg = str(info.value)
    assert name in msg and "(B, S" in msg and f"(2, {E})" in msg, msg


@pytest.mark.parametrize("name", ["mLSTMBlock", "sLSTMBlock", "xLSTMBlockStack"])
def test_blocks_reject_a_wrong_rank(layers, name):
    with pytest.raises(ValueError, match=r"\(B, S, E\).*\(2, 16\)"):
        layers[name](arr((2, E)))


@pytest.mark.parametrize("name", ["MultiHeadAttention", "mLSTMLayer", "sLSTMLayer"])
def test_step_methods_reject_a_sequence(layers, name):
    with pytest.raises(ValueError, match=rf"{name}\.step: x must have shape \(B, E\).*\(2, 1, 16\)"):
        layers[name].step(arr((2, 1, E)), None)


@pytest.mark.parametrize("name", LAYER_NAMES)
@pytest.mark.parametrize("dtype", [mx.int32, mx.float64])
def test_layers_reject_unsupported_dtypes(layers, name, dtype):
    with pytest.raises(TypeError) as info:
        layers[name](_zeros((2, 5, E), dtype))
    assert str(dtype) in str(info.value) and SUPPORTED in str(info.value), str(info.value)


def test_conv_state_shape_is_checked(layers):
    with pytest.raises(ValueError, match=r"state must have shape \(B, K - 1, C\) = \(2, 3, 16\), got \(2, 2, 16\)"):
        layers["CausalConv1d"](arr((2, 5, E)), arr((2, 2, E)))


def test_lm_checks_tokens():
    model = xnn.xLSTMLM(xnn.xLSTMLMModelConfig(
        mlstm_block=xnn.mLSTMBlockConfig(mlstm=xnn.mLSTMLayerConfig(num_heads=2, chunk_size=8)),
        num_blocks=1, embedding_dim=E, vocab_size=11))
    with pytest.raises(TypeError, match=r"tokens must be an integer mx.array \(B, S\).*float32"):
        model(mx.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"tokens must have shape \(B, S\), got \(3,\)"):
        model(mx.zeros((3,), dtype=mx.int32))
    with pytest.raises(ValueError, match=r"token must have shape \(B,\), got \(2, 1\)"):
        model.step(mx.zeros((2, 1), dtype=mx.int32), None)


# ---------------------------------------------------------------------------------------
# Zero-size dimensions
# ---------------------------------------------------------------------------------------

ZERO_SIZE = [
    ("gemm_av m=0", lambda: xk.gemm_av(arr((0, 5)), arr((5, 3))), (0, 3)),
    ("gemm_av k=0", lambda: xk.gemm_av(arr((4, 0)), arr((0, 3))), (4, 3)),
    ("gemm_at_b n=0", lambda: xk.gemm_at_b(arr((5, 0)), arr((5, 3))), (0, 3)),
    ("gemm_a_bt batch=0", lambda: xk.gemm_a_bt(arr((0, 4, 5)), arr((3, 5))), (0, 4, 3)),
    ("linear in=0 bias gelu", lambda: xk.linear(arr((4, 0)), arr((3, 0)), arr((3,)), "gelu"), (4, 3)),
    ("linear out=0", lambda: xk.linear(arr((2, 4, 5)), arr((0, 5))), (2, 4, 0)),
    ("linear rows=0", lambda: xk.linear(arr((0, 5)), arr((3, 5)), residual=arr((3,))), (0, 3)),
    ("rms_norm D=0", lambda: xk.rms_norm(arr((3, 0)), arr((0,))), (3, 0)),
    ("rms_norm rows=0", lambda: xk.rms_norm(arr((0, 8)), arr((8,))), (0, 8)),
    ("layer_norm rows=0", lambda: xk.layer_norm(arr((2, 0, 8)), arr((8,)), arr((8,))), (2, 0, 8)),
    ("mhln rows=0", lambda: xk.multihead_layer_norm(arr((0, 8)), None, None, 2), (0, 8)),
    ("rope L=0", lambda: xk.rope(arr((2, 0, 8)), 8), (2, 0, 8)),
    ("rope rows=0", lambda: xk.rope(arr((0, 3, 8)), 4, offset=mx.zeros((0,), mx.int32)), (0, 3, 8)),
    ("sdpa Lq=0", lambda: xk.scaled_dot_product_attention(arr((1, 2, 0, 8)), arr((1, 2, 5, 8)), arr((1, 2, 5, 8)), scale=0.3),
     (1, 2, 0, 8)),
    ("sdpa Lk=0", lambda: xk.scaled_dot_product_attention(arr((1, 2, 3, 8)), arr((1, 2, 0, 8)), arr((1, 2, 0, 4)), scale=0.3),
     (1, 2, 3, 4)),
    ("sdpa DV=0", lambda: xk.scaled_dot_product_attention(arr((1, 2, 3, 8)), arr((1, 2, 4, 8)), arr((1, 2, 4, 0)), scale=0.3),
     (1, 2, 3, 0)),
    ("sdpa B=0 causal", lambda: xk.scaled_dot_product_attention(arr((0, 2, 3, 8)), arr((0, 1, 4, 8)), arr((0, 1, 4, 8)),
                                                                 scale=0.3, mask="causal"), (0, 2, 3, 8)),
    ("mlstm S=0", lambda: xk.mlstm(*[arr((1, 2, 0, 8))] * 3, *[arr((1, 2, 0))] * 2), (1, 2, 0, 8)),
    ("mlstm B=0", lambda: xk.mlstm(*[arr((0, 2, 3, 8))] * 3, *[arr((0, 2, 3))] * 2), (0, 2, 3, 8)),
    ("mlstm DHV=0", lambda: xk.mlstm(*[arr((1, 2, 3, 8))] * 2, arr((1, 2, 3, 0)), *[arr((1, 2, 3))] * 2), (1, 2, 3, 0)),
    ("mlstm_step NH=0", lambda: xk.mlstm_step(*[arr((1, 0, 8))] * 3, *[arr((1, 0))] * 2, None)[0], (1, 0, 8)),
    ("slstm S=0", lambda: xk.slstm(arr((2, 0, 4, 2, 8)), arr((2, 8, 4, 8)), arr((4, 2, 8))), (2, 0, 2, 8)),
    ("slstm B=0", lambda: xk.slstm(arr((0, 3, 4, 2, 8)), arr((2, 8, 4, 8)), arr((4, 2, 8))), (0, 3, 2, 8)),
    ("slstm NH=0", lambda: xk.slstm(arr((2, 3, 4, 0, 8)), arr((0, 8, 4, 8)), arr((4, 0, 8))), (2, 3, 0, 8)),
    ("slstm DH=0", lambda: xk.slstm(arr((2, 3, 4, 2, 0)), arr((2, 0, 4, 0)), arr((4, 2, 0))), (2, 3, 2, 0)),
    ("slstm_step B=0", lambda: xk.slstm_step(arr((0, 4, 2, 8)), arr((2, 8, 4, 8)), arr((4, 2, 8)), (_z((0, 2, 8)),) * 4)[0],
     (0, 2, 8)),
    ("nn.Linear rows=0", lambda: xnn.Linear(5, 3)(arr((0, 5))), (0, 3)),
]


@pytest.mark.parametrize("thunk,shape", [pytest.param(t, s, id=i) for i, t, s in ZERO_SIZE])
def test_zero_size_dimensions_give_shaped_results(kernel_backend, thunk, shape):
    mx.random.seed(0)
    out = thunk()
    mx.eval(out)
    assert tuple(out.shape) == shape and out.dtype == mx.float32
    with xk.use_backend("reference"):
        mx.random.seed(0)
        ref = thunk()
    assert np.array_equal(npf(out), npf(ref), equal_nan=True)


def test_zero_size_return_state_shapes(kernel_backend):
    h, (c, n, m) = xk.mlstm(*[arr((1, 2, 0, 8))] * 3, *[arr((1, 2, 0))] * 2, return_state=True)
    assert h.shape == (1, 2, 0, 8) and c.shape == (1, 2, 8, 8) and n.shape == (1, 2, 8) and m.shape == (1, 2)
    y, st = xk.slstm(arr((2, 3, 4, 0, 8)), arr((0, 8, 4, 8)), arr((4, 0, 8)), return_state=True)
    assert y.shape == (2, 3, 0, 8) and all(s.shape == (2, 0, 8) for s in st)


# ---------------------------------------------------------------------------------------
# Non-contiguous, transposed and broadcast views
# ---------------------------------------------------------------------------------------


def _views():
    """(id, fn, view arguments): each is called with the views and with contiguous copies."""
    big = arr((7, 12, 10), seed=1)
    q_bshd = arr((1, 5, 2, 8), seed=2)  # (B, L, H, D): transposed to (B, H, L, D), as attention layers do
    k_bshd = arr((1, 6, 2, 8), seed=3)
    v_bshd = arr((1, 6, 2, 8), seed=4)
    return [
        ("gemm_av transposed a", xk.gemm_av, [arr((5, 4), seed=5).T, arr((5, 3), seed=6)]),
        ("gemm_av strided v", xk.gemm_av, [arr((4, 6), seed=5), big[0, :6, ::2]]),
        ("gemm_at_b broadcast batch", xk.gemm_at_b, [mx.broadcast_to(arr((1, 5, 4), seed=7), (3, 5, 4)), arr((3, 5, 2), seed=8)]),
        ("gemm_a_bt transposed batch", xk.gemm_a_bt, [arr((4, 3, 5), seed=9).transpose(1, 0, 2), arr((2, 5), seed=10)]),
        ("linear transposed weight", lambda x, w, b: xk.linear(x, w, b, "silu"),
         [big[:, 1:4, :], arr((10, 6), seed=11).T, mx.broadcast_to(arr((1,), seed=12), (6,))]),
        ("rms_norm strided rows", lambda x, w: xk.rms_norm(x, w), [big[::2, 3], arr((10,), seed=13)]),
        ("layer_norm transposed", lambda x, w, b: xk.layer_norm(x, w, b), [big.transpose(1, 0, 2), arr((10,), seed=14),
                                                                          mx.broadcast_to(arr((), seed=15), (10,))]),
        ("mhln broadcast rows", lambda x: xk.multihead_layer_norm(x, None, None, 2), [mx.broadcast_to(big[0, :1], (4, 10))]),
        ("rope transposed (B,L,H,D)", lambda x: xk.rope(x, 8, offset=3), [q_bshd.transpose(0, 2, 1, 3)]),
        ("rope strided features", lambda x: xk.rope(x, 4, traditional=True), [big[:, :, 1:9]]),
        ("sdpa transposed + broadcast mask", lambda q, k, v, m: xk.scaled_dot_product_attention(q, k, v, scale=0.3, mask=m),
         [q_bshd.transpose(0, 2, 1, 3), k_bshd.transpose(0, 2, 1, 3), v_bshd.transpose(0, 2, 1, 3),
          mx.broadcast_to(arr((1, 6), seed=16), (5, 6))]),
        ("mlstm transposed", lambda q, k, v, i, f: xk.mlstm(q, k, v, i, f, chunk_size=4),
         [q_bshd.transpose(0, 2, 1, 3), k_bshd[:, :5].transpose(0, 2, 1, 3), v_bshd[:, 1:].transpose(0, 2, 1, 3),
          arr((1, 5, 2), seed=17).transpose(0, 2, 1), big[:1, :2, :5]]),
        ("mlstm_step strided", lambda q, k, v, i, f: xk.mlstm_step(q, k, v, i, f, None)[0],
         [big[:2, :3, ::2][:, :, :5], big[2:4, :3, 1::2], big[4:6, 4:7, :4], big[:2, 9, :3], big[3:5, :3, 0]]),
        ("slstm transposed wx", lambda wx, r, b: xk.slstm(wx, r, b),
         [arr((2, 2, 4, 6, 8), seed=18).transpose(0, 3, 2, 1, 4), arr((2, 8, 4, 8), seed=19, scale=0.1).transpose(0, 3, 2, 1),
          mx.broadcast_to(arr((4, 1, 8), seed=20), (4, 2, 8))]),
        ("slstm_step strided", lambda wx, r, b: xk.slstm_step(wx, r, b, (_z((2, 2, 8)),) * 4)[0],
         [arr((2, 4, 2, 16), seed=21)[..., ::2], arr((2, 8, 4, 8), seed=22, scale=0.1), arr((4, 2, 8), seed=23)]),
    ]


@pytest.mark.parametrize("case", range(len(_views())), ids=[c[0] for c in _views()])
def test_views_give_the_same_bits_as_contiguous_copies(kernel_backend, case):
    _, fn, args = _views()[case]
    assert any(not _is_plain(a) for a in args)
    got = fn(*args)
    want = fn(*[contiguous(a) for a in args])
    assert got.shape == want.shape
    assert np.array_equal(npf(got), npf(want), equal_nan=True)


def _is_plain(a: mx.array) -> bool:
    """Whether `a` is a row-contiguous array of its own (not a view with other strides)."""
    return np.asarray(a).flags.c_contiguous and np.asarray(a).base is None


# ---------------------------------------------------------------------------------------
# NaN and Inf propagation
# ---------------------------------------------------------------------------------------


def _poke(x: mx.array, *cells) -> mx.array:
    """x with the given (index, value) cells set (NaN / +-Inf)."""
    a = np.array(x.astype(mx.float32))
    for idx, val in cells:
        a[idx] = val
    return mx.array(a).astype(x.dtype)


NAN, INF = float("nan"), float("inf")


def _nonfinite_cases():
    x2 = _poke(arr((6, 9), seed=30), ((1, 2), NAN), ((3, 4), INF), ((4, 0), -INF))
    w = arr((5, 9), seed=31)
    b = arr((5,), seed=32)
    xn = _poke(arr((4, 40), seed=33), ((1, 3), NAN), ((2, 7), INF))
    xl = _poke(arr((3, 5000), seed=34), ((0, 4097), NAN), ((2, 11), -INF))
    wn = arr((40,), seed=35)
    xr = _poke(arr((2, 5, 16), seed=36), ((0, 1, 2), NAN), ((1, 3, 9), INF))
    q = _poke(arr((1, 2, 5, 8), seed=37), ((0, 0, 1, 2), NAN))
    k = _poke(arr((1, 2, 7, 8), seed=38), ((0, 1, 3, 0), INF))
    v = _poke(arr((1, 2, 7, 8), seed=39), ((0, 0, 5, 5), NAN))
    kn, vn = _poke(arr((1, 2, 7, 8), seed=50), ((0, 0, 2, 1), NAN)), arr((1, 2, 7, 8), seed=51)
    qm, km, vm = arr((1, 2, 6, 8), seed=40), arr((1, 2, 6, 8), seed=41), arr((1, 2, 6, 4), seed=42)
    ig = _poke(arr((1, 2, 6), seed=43), ((0, 1, 2), NAN))
    fg = _poke(arr((1, 2, 6), seed=44), ((0, 0, 4), INF))
    wx = _poke(arr((2, 5, 4, 2, 8), seed=45), ((0, 2, 0, 1, 3), NAN), ((1, 3, 2, 0, 0), INF))
    r, bs = arr((2, 8, 4, 8), seed=46, scale=0.1), arr((4, 2, 8), seed=47)
    z = mx.zeros((2, 2, 8))
    fast_rope = dict(traditional=False, base=10000.0, scale=1.0, offset=0)
    return [
        # (id, kernel thunk, oracle thunk (mx.matmul / mx.fast / the op's plain-mx reference))
        ("gemm_av scalar", lambda: xk.gemm_av(x2, w.T, tiles={"path": "scalar"}), lambda: x2 @ w.T),
        ("gemm_av simd", lambda: xk.gemm_av(x2, w.T, tiles={"path": "simd"}), lambda: x2 @ w.T),
        ("gemm_a_bt gemv", lambda: xk.gemm_a_bt(x2[1:2], w), lambda: x2[1:2] @ w.T),
        ("gemm_at_b", lambda: xk.gemm_at_b(x2, arr((6, 3), seed=48)), lambda: x2.T @ arr((6, 3), seed=48)),
        ("linear bias+gelu+residual", lambda: xk.linear(x2, w, b, "gelu", arr((5,), seed=49)),
         lambda: gemm_mod.gemm_reference("gemm_a_bt", x2, w, b, "gelu", arr((5,), seed=49))),
        ("linear relu", lambda: xk.linear(x2, w, b, "relu"), lambda: mx.maximum(x2 @ w.T + b, 0.0)),
        ("rms_norm", lambda: xk.rms_norm(xn, wn), lambda: mx.fast.rms_norm(xn, wn, 1e-5)),
        ("layer_norm", lambda: xk.layer_norm(xn, wn, wn), lambda: mx.fast.layer_norm(xn, wn, wn, 1e-5)),
        ("rms_norm looped", lambda: xk.rms_norm(xl, None), lambda: mx.fast.rms_norm(xl, None, 1e-5)),
        ("layer_norm looped", lambda: xk.layer_norm(xl, None, None), lambda: mx.fast.layer_norm(xl, None, None, 1e-5)),
        ("multihead_layer_norm", lambda: xk.multihead_layer_norm(xn, wn, None, 4),
         lambda: norm_mod.multihead_layer_norm_reference(xn, wn, None, 4, 1e-5)),
        ("rope", lambda: xk.rope(xr, 16), lambda: mx.fast.rope(xr, 16, **fast_rope)),
        ("rope partial dims", lambda: xk.rope(xr, 8), lambda: mx.fast.rope(xr, 8, **fast_rope)),
        ("sdpa prefill", lambda: xk.scaled_dot_product_attention(q, k, v, scale=0.3),
         lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3)),
        ("sdpa prefill causal", lambda: xk.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal"),
         lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")),
        ("sdpa split-KV, NaN in q and v", lambda: att_mod.attention_decode_split_kv(q[:, :, :2], vn, v, scale=0.3, block_size=4),
         lambda: mx.fast.scaled_dot_product_attention(q[:, :, :2], vn, v, scale=0.3)),
        ("sdpa split-KV, NaN in k",  # key 2 lies in the first of two key blocks; the second block is finite
         lambda: att_mod.attention_decode_split_kv(q[:, :, 2:4], kn, vn, scale=0.3, block_size=4),
         lambda: mx.fast.scaled_dot_product_attention(q[:, :, 2:4], kn, vn, scale=0.3)),
        ("mlstm", lambda: xk.mlstm(qm, km, vm, ig, fg, chunk_size=4),
         lambda: mlstm_mod.mlstm_chunkwise_mx(qm, km, vm, ig, fg, chunk_size=4)),
        ("mlstm Inf in v", lambda: xk.mlstm(qm, km, _poke(vm, ((0, 1, 3, 2), INF)), ig * 0, fg * 0, chunk_size=4),
         lambda: mlstm_mod.mlstm_chunkwise_mx(qm, km, _poke(vm, ((0, 1, 3, 2), INF)), ig * 0, fg * 0, chunk_size=4)),
        ("mlstm_step", lambda: xk.mlstm_step(qm[:, :, 0], km[:, :, 0], vm[:, :, 0], ig[:, :, 2], fg[:, :, 4], None)[0],
         lambda: mlstm_mod.mlstm_step_reference(qm[:, :, 0], km[:, :, 0], vm[:, :, 0], ig[:, :, 2], fg[:, :, 4], None)[0]),
        ("slstm", lambda: xk.slstm(wx, r, bs), lambda: slstm_mod.slstm_reference(wx, r, bs)),
        ("slstm_step", lambda: xk.slstm_step(wx[:, 2], r, bs, (z, z, z, z))[0],
         lambda: slstm_mod.slstm_step_reference(wx[:, 2], r, bs, (z, z, z, z))[0]),
    ]


# Known kernel gaps (the reference backend is right): strict xfails on kernel backends, so a
# fix shows up as XPASS -> failure and the entry must be removed.
KERNEL_NAN_GAPS: dict[str, str] = {}  # kernels that mask NaN/Inf (none now: both found were fixed)


@pytest.mark.parametrize("case", range(len(_nonfinite_cases())), ids=[c[0] for c in _nonfinite_cases()])
def test_nan_and_inf_propagate_like_mlx(kernel_backend, request, case):
    name, kernel, oracle = _nonfinite_cases()[case]
    if name in KERNEL_NAN_GAPS and kernel_backend != "reference":
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=KERNEL_NAN_GAPS[name]))
    got, want = npf(kernel()), npf(oracle())
    assert got.shape == want.shape
    assert np.isnan(want).any() or np.isinf(want).any()  # the case does produce non-finite values
    assert np.array_equal(np.isnan(got), np.isnan(want)), (np.argwhere(np.isnan(got)), np.argwhere(np.isnan(want)))
    assert np.array_equal(np.isposinf(got), np.isposinf(want)) and np.array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-4, atol=2e-4)


# ---------------------------------------------------------------------------------------
# 32-bit limits: a clear error before launch, or 64-bit offsets
# ---------------------------------------------------------------------------------------


class _Launched(Exception):
    """Raised by the launch spy: the op got as far as a kernel launch."""


@pytest.fixture
def launch_spy(monkeypatch):
    """Replace every op module's `launch` with a spy that records the call and stops."""
    calls: list[dict] = []

    def spy(spec, **kwargs):
        calls.append(dict(spec=spec, **kwargs))
        raise _Launched(spec.kernel)

    def prepare_spy(spec, **kwargs):  # memoised ops: the launch stops where it would run
        return lambda inputs: spy(spec, **{**kwargs, "inputs": list(inputs)})

    # no graph replay: a recorded call would hand the spy placeholders instead of arrays
    monkeypatch.setenv("XLSTM_KERNELS_REPLAY", "0")
    for mod in (gemm_mod, norm_mod, rope_mod, att_mod, mlstm_mod, slstm_mod):
        if hasattr(mod, "launch"):
            monkeypatch.setattr(mod, "launch", spy)
        if hasattr(mod, "prepare_launch"):
            monkeypatch.setattr(mod, "prepare_launch", prepare_spy)
        clear_call_memos(mod)
    mx.eval(mx.zeros((1,)))
    mx.reset_peak_memory()
    yield calls
    # nothing of the > 2**31-element operands was ever evaluated
    assert mx.get_peak_memory() < 64 * 2**20, mx.get_peak_memory()


def _huge(*shape, dtype=mx.float16):
    x = mx.zeros(shape, dtype=dtype)  # lazy: never evaluated by these tests
    assert x.size > INT32_MAX
    return x


H = 2**16  # with H2, dims whose products cross 2**31
H2 = 2**15 + 1

TOO_BIG = [
    # (id, thunk, message, checked on every backend (else only where a kernel would launch))
    ("rms_norm rows", lambda: xk.rms_norm(_huge(H, 2**15, 2), None), "rows (x.size // (D / num_heads)) = 2147483648", True),
    ("layer_norm rows", lambda: xk.layer_norm(_huge(H, 2**15, 2), None, None), "rows", True),
    ("multihead_layer_norm rows", lambda: xk.multihead_layer_norm(_huge(H, 2**14, 4), None, None, 2), "rows", True),
    ("rope rows", lambda: xk.rope(_huge(H, 2**15, 1, 2), 2), "rows (x.size // (L * D)) = 2147483648", True),
    ("sdpa split-KV rows", lambda: xk.scaled_dot_product_attention(
        _huge(H, 2**14, 2, 8), _huge(H, 2**14, 1100, 8), _huge(H, 2**14, 1100, 8), scale=1.0),
     "rows B * Hq * Lq of the split-KV reduction = 2147483648", False),
    ("mlstm B*NH", lambda: xk.mlstm(*[_huge(H, 2**15, 2, 1)] * 3, *[mx.zeros((H, 2**15, 2))] * 2),
     "B * NH (the kernels' grid z) = 2147483648", False),
    ("mlstm_step B*NH", lambda: xk.mlstm_step(*[_huge(H, 2**15, 1)] * 3, *[mx.zeros((H, 2**15))] * 2, None),
     "B * NH (the kernel's grid z) = 2147483648", False),
    ("gemm batch count", lambda: xk.gemm_av(_huge(H, 2**15, 1, 1), _huge(H, 2**15, 1, 1)),
     "batch count x split_k (grid z) = 2147483648", False),
]


@pytest.mark.parametrize("thunk,match,everywhere", [pytest.param(t, m, e, id=i) for i, t, m, e in TOO_BIG])
def test_32bit_counts_raise_before_launch(kernel_backend, launch_spy, thunk, match, everywhere):
    if kernel_backend == "reference" and not everywhere:
        pytest.skip("the reference backend launches nothing: no 32-bit count to check")
    with pytest.raises(ValueError) as info:
        thunk()
    msg = str(info.value)
    assert match in msg and "2**31 - 1" in msg and "shape" in msg, msg
    assert not launch_spy


def _launch_fits_32bit(call: dict) -> None:
    """Every count the kernel receives as a 32-bit value fits: grid, threadgroup, int32 params."""
    assert all(0 <= g <= INT32_MAX for g in call["grid"]), call["grid"]
    for x in call["inputs"]:
        if isinstance(x, mx.array):
            assert all(d <= INT32_MAX for d in x.shape)


SIXTY_FOUR_BIT = [
    # Operands of more than 2**31 elements whose shapes fit in 32 bits: the op launches,
    # with element offsets computed in 64 bits by the kernels (audited in metal_src:
    # gemm/attention/mlstm use `long`, norm/rope `size_t`, slstm `ulong`).
    ("rms_norm", lambda: xk.rms_norm(_huge(H, H2), None), "rms_norm_looped", (H, H2)),
    ("layer_norm", lambda: xk.layer_norm(_huge(H, H2), None, None), "layer_norm_looped", (H, H2)),
    ("rope", lambda: xk.rope(_huge(H, H2, 2), 2), "rope", (H, H2, 2)),
    ("gemm_av", lambda: xk.gemm_av(_huge(H, H2), mx.zeros((H2, 8), mx.float16)), None, (H, H2)),
    ("linear rows > 2**31 runs batched", lambda: xk.linear(_huge(H, H2, 4), mx.zeros((3, 4), dtype=mx.float16)), None,
     (H, H2, 4)),
    ("gemm_a_bt batched fold avoided", lambda: xk.gemm_a_bt(_huge(H, H2, 4), mx.zeros((3, 4), dtype=mx.float16)), None,
     (H, H2, 4)),
    ("sdpa prefill", lambda: xk.scaled_dot_product_attention(
        _huge(H, 2, 128, 128), _huge(H, 2, 128, 128), mx.zeros((H, 2, 128, 8), mx.float16), scale=1.0),
     ("attention_prefill", "attention_prefill_mma"), (H, 2, 128, 128)),
    ("mlstm", lambda: xk.mlstm(*[_huge(2, 2, H2, 2**14)] * 2, mx.zeros((2, 2, H2, 8), mx.float16), *[mx.zeros((2, 2, H2))] * 2,
                               chunk_size=64), "mlstm_chunk_states", None),
    ("slstm", lambda: xk.slstm(_huge(H, 2**10, 4, 2, 4), mx.zeros((2, 4, 4, 4), mx.float16), mx.zeros((4, 2, 4))),
     "slstm_fwd", (H, 2**10, 4, 2, 4)),
]


@pytest.mark.parametrize("thunk,kernel,a_shape", [pytest.param(t, k, s, id=i) for i, t, k, s in SIXTY_FOUR_BIT])
def test_more_than_2_31_elements_launch_with_32bit_safe_counts(kernel_backend, launch_spy, thunk, kernel, a_shape):
    if kernel_backend == "reference":
        pytest.skip("the reference backend launches no kernel")
    with pytest.raises(_Launched):
        thunk()
    (call,) = launch_spy
    if kernel is not None:
        assert call["spec"].kernel in ((kernel,) if isinstance(kernel, str) else kernel)
    _launch_fits_32bit(call)
    if a_shape is not None:
        first = call["inputs"][0]
        assert first.size == int(np.prod(a_shape, dtype=np.int64)) and first.size > INT32_MAX
        if len(a_shape) == 3 and call["spec"].family == "gemm":  # not folded into one > 2**31 dimension
            assert tuple(first.shape) == a_shape
    params = [x for x in call["inputs"] if isinstance(x, mx.array) and x.dtype in (mx.int64, mx.int32) and x.ndim == 1]
    # int64 params (GEMM, attention) carry the full sizes; int32 ones only counts that fit
    for p in params:
        if p.size <= 16:
            vals = np.asarray(p)
            assert (vals >= 0).all() and (vals <= (2**63 - 1 if p.dtype == mx.int64 else INT32_MAX)).all()


HUGE_ROWS, HUGE_N = 2049, 2**20  # 2**31 + 2**20 elements; the last row starts at element 2**31


def _huge_rows() -> mx.array:
    pattern = (mx.arange(HUGE_N) % 7 + 1).astype(mx.float16)
    scale = (mx.arange(1, HUGE_ROWS + 1) / HUGE_ROWS).astype(mx.float16)[:, None]
    return pattern * scale  # float16 (2049, 2**20), built without a float32 intermediate


@pytest.mark.skipif(os.environ.get("XLSTM_TEST_HUGE") != "1",
                    reason="needs ~19 GB of memory (~100 s on 16 cores): set XLSTM_TEST_HUGE=1 to run it")
@pytest.mark.emulator_only
@pytest.mark.parametrize("op", ["rms_norm", "gemm_a_bt"])
def test_offsets_beyond_2_31_in_the_emulator(kernel_backend, op):
    """The kernels run for real on an operand of 2**31 + 2**20 elements whose last row starts
    at element 2**31 (a 32-bit signed offset would wrap negative there): rms_norm (the looped
    kernel, row offset ``size_t(row) * n``) and gemm_a_bt (``long`` offsets ``row * K``)."""
    x = _huge_rows()
    mx.eval(x)
    assert x.size > INT32_MAX and (HUGE_ROWS - 1) * HUGE_N == 2**31
    xs = np.asarray(x[-3:].astype(mx.float32)).astype(np.float64)
    if op == "rms_norm":
        y = xk.rms_norm(x, None, 1e-5)
        got = np.asarray(y[-3:].astype(mx.float32)).astype(np.float64)
        ref = xs / np.sqrt((xs * xs).mean(axis=-1, keepdims=True) + 1e-5)
        tol = 2e-3
    else:
        b = mx.stack([mx.full((HUGE_N,), 1 / 1024), (mx.arange(HUGE_N) % 3 + 1) / 2048]).astype(mx.float16)
        y = xk.gemm_a_bt(x, b)
        got = np.asarray(y[-3:].astype(mx.float32)).astype(np.float64)
        ref = xs @ np.asarray(b.astype(mx.float32)).astype(np.float64).T
        tol = 1e-2
    assert y.shape[0] == HUGE_ROWS
    err = np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-3)
    assert err < tol, (op, err, got[-1][:4], ref[-1][:4])
