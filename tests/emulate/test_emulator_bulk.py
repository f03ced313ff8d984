"""Bulk copies in the emulator (``metal_src/_memory.metal``'s ``xk_bulk_bar`` section; CUDA's
``cp.async.bulk`` completing on an mbarrier): a bar counts phases, ``xk_bulk_expect`` arms
the current one with a byte count, ``xk_bulk_copy`` delivers bytes to it and
``xk_bulk_wait(bar, parity)`` completes it, where CUDA would hang on a phase never armed or
short of bytes: the emulator raises instead, and refuses copies CUDA cannot make (partial
16-byte words, misaligned addresses, a destination outside threadgroup memory).

The toy kernel streams ROUNDS rows of W floats through two stages, lane 0 issuing, all 32
lanes waiting and reading (both phase parities of each bar); the broken variants change one
line each. Emulator-only (its keywords and errors).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels.emulate import EmulatorError, check_schedules, metal_kernel

pytestmark = pytest.mark.emulator_only

W = 64  # floats a row (256 bytes: 16 words)
ROUNDS = 6  # rows, alternating between two stages: each bar's phases 0, 1, 0

INIT = "    xk_bulk_init(&bars[0]);\n    xk_bulk_init(&bars[1]);\n"
EXPECT = "    xk_bulk_expect(&bars[s], W * 4);\n"
COPY = "    xk_bulk_copy(stage + s * W, inp + r * W, uint(W), &bars[s]);\n"
WAIT = "  xk_bulk_wait(&bars[s], (r / 2) & 1);\n"


def _body(init: str = INIT, expect: str = EXPECT, copy: str = COPY, wait: str = WAIT) -> str:
    return f"""\
  threadgroup float4 stage4[2 * W / 4];
  threadgroup xk_bulk_bar bars[2];
  threadgroup float* stage = (threadgroup float*)stage4;
  const uint lane = thread_index_in_simdgroup;
  if (lane == 0) {{
{init}  }}
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (uint r = 0; r < ROUNDS; ++r) {{
    const uint s = r % 2;
    if (lane == 0) {{
{expect}{copy}    }}
    simdgroup_barrier(mem_flags::mem_threadgroup);
{wait}    simdgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = lane; i < W; i += 32) {{
      out[r * W + i] = 2.0f * stage[s * W + i] + float(r);
    }}
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }}
""".replace("W", str(W)).replace("ROUNDS", str(ROUNDS))


def _kernel(name: str, body: str):
    return metal_kernel(name=name, input_names=["inp"], output_names=["out"], source=body)


def _inputs(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.5, 2.0, (ROUNDS * W + 8,)) * rng.choice([-1.0, 1.0], (ROUNDS * W + 8,))
    return x.astype(np.float32)


def _call(x: np.ndarray, **extra):
    return dict(inputs=[mx.array(x)], output_shapes=[(ROUNDS * W,)], output_dtypes=[mx.float32],
                grid=(32, 1, 1), threadgroup=(32, 1, 1), **extra)


def test_bulk_copies_stream_through_both_phases():
    x = _inputs(1)
    (out,) = check_schedules(_kernel("bulk_ok", _body()), **_call(x))
    want = 2.0 * x[: ROUNDS * W].astype(np.float64) + np.repeat(np.arange(ROUNDS), W)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)


@pytest.mark.parametrize(
    "what, parts, message",
    [
        ("no expect", dict(expect=""), "no xk_bulk_expect armed"),
        ("short", dict(expect="    xk_bulk_expect(&bars[s], W * 4 + 16);\n"), "expects more bytes than its copies"),
        ("over", dict(expect="    xk_bulk_expect(&bars[s], W * 4 - 16);\n"), "deliver more bytes than it expects"),
        ("twice", dict(expect=EXPECT + EXPECT), "armed already"),
        ("no init", dict(init=""), "before xk_bulk_init"),
        ("partial word", dict(copy="    xk_bulk_copy(stage + s * W, inp + r * W, uint(W) - 1u, &bars[s]);\n"),
         "whole 16-byte words"),
        ("misaligned", dict(copy="    xk_bulk_copy(stage + s * W, inp + r * W + 1, uint(W), &bars[s]);\n"),
         "not 16-byte aligned"),
        ("to device memory", dict(copy="    xk_bulk_copy(out + r * W, inp + r * W, uint(W), &bars[s]);\n"),
         "not \\(wholly\\) in threadgroup memory"),
        ("wrong parity", dict(wait="  xk_bulk_wait(&bars[s], 0u);\n"), "armed already"),  # the phase never completes
    ],
)
def test_bulk_misuse_is_reported(what, parts, message):
    """Each misuse CUDA would hang on (a phase never armed, short of bytes) or refuse."""
    kernel = _kernel(f"bulk_{what.replace(' ', '_')}", _body(**{k: v.replace("W", str(W)) for k, v in parts.items()}))
    with pytest.raises(EmulatorError, match=message):
        kernel(**_call(_inputs(2)))
