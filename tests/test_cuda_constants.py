"""Small constant kernel inputs in device memory (xlstm_kernels/cuda/constants.py).

Runs wherever MLX runs (the copies are made on the default device: the GPU on a CUDA
machine, the CPU here); what these tests check is the values, shapes and caching."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels import runtime
from xlstm_kernels.cuda import constants


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.delenv(constants.ENV_VAR, raising=False)
    constants.clear()
    yield
    constants.clear()


@pytest.mark.parametrize("values,dtype", [
    ([3, 4096, 1, 7, 396], mx.int32),
    ([2**40 + 3, -5, 0, 12, 8, 1, 1, 1, 256, 16], mx.int64),
    (1e-5, mx.float32),  # 0-d: 4 bytes, padded past MLX's 8-byte scalar pool
    ([0.0883883, 1e-6], mx.float32),
    ([True], mx.bool_),
])
def test_device_array_values_shape_dtype(values, dtype):
    got = constants.device_array(values, dtype)
    ref = np.array(values, dtype=np.dtype(str(dtype).split(".")[-1].replace("bool_", "bool")))
    assert got.dtype == dtype and tuple(got.shape) == ref.shape
    np.testing.assert_array_equal(np.array(got), ref)


def test_device_array_is_cached_per_value_and_thread():
    a = constants.device_array([1, 2, 3], mx.int32)
    assert constants.device_array([1, 2, 3], mx.int32) is a
    assert constants.device_array([1, 2, 4], mx.int32) is not a
    assert constants.device_array([1, 2, 3], mx.int64) is not a
    other = []
    t = threading.Thread(target=lambda: other.append(constants.device_array([1, 2, 3], mx.int32)))
    t.start()
    t.join()
    assert other and other[0] is not a  # each thread its own copy (its own stream)
    np.testing.assert_array_equal(np.array(other[0]), [1, 2, 3])


def test_device_array_off_and_large_give_host_arrays(monkeypatch):
    big = list(range(constants.MAX_BYTES // 4 + 1))
    assert constants.device_array(big, mx.int32) is not constants.device_array(big, mx.int32)  # not cached
    monkeypatch.setenv(constants.ENV_VAR, "0")
    a = constants.device_array([5, 6], mx.int32)
    assert a is not constants.device_array([5, 6], mx.int32)
    np.testing.assert_array_equal(np.array(a), [5, 6])
    monkeypatch.setenv(constants.ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=constants.ENV_VAR):
        constants.device_array([5, 6], mx.int32)


def test_const_array_only_goes_to_device_memory_on_cuda():
    a = runtime.const_array([7, 8], mx.int32, backend="emulate")
    assert a is not runtime.const_array([7, 8], mx.int32, backend="emulate")
    c = runtime.const_array([7, 8], mx.int32, backend="cuda")
    assert c is runtime.const_array([7, 8], mx.int32, backend="cuda")
    for x in (a, c):
        np.testing.assert_array_equal(np.array(x), [7, 8])


def test_lazy_device_array_values_and_cache():
    lazy = constants.device_array([4095], mx.int32, lazy=True)
    assert constants.device_array([4095], mx.int32, lazy=True) is lazy
    assert constants.device_array([4096], mx.int32, lazy=True) is not lazy
    assert constants.device_array([4095], mx.int32) is not lazy  # the scheduled copy is its own entry
    assert lazy.dtype == mx.int32 and tuple(lazy.shape) == (1,)
    np.testing.assert_array_equal(np.array(lazy), [4095])


@pytest.mark.parametrize("transform", ["compile", "grad", "vmap"])
def test_lazy_device_array_made_inside_a_transform_is_reusable_outside(transform):
    """A lazy copy first made while a transform traces (a user's mx.compile'd decode step)
    is cached and must still be a plain array outside it."""
    value = {"compile": 17, "grad": 3, "vmap": -9}[transform]
    dtype = mx.float32 if transform == "grad" else mx.int32

    def add(x):
        return x + constants.device_array([value], mx.int32, lazy=True).astype(dtype)

    x = mx.array([1, 2], dtype=dtype)
    if transform == "compile":
        got = mx.compile(add)(x)
        np.testing.assert_array_equal(np.array(mx.compile(add)(x + 1)), [value + 2, value + 3])
    elif transform == "grad":
        got = mx.grad(lambda a: (add(a) * add(a)).sum())(x)
        np.testing.assert_allclose(np.array(got), 2 * (np.array([1, 2]) + value))
        got = add(x)
    else:
        got = mx.vmap(add)(x)
    np.testing.assert_array_equal(np.array(got).reshape(-1), np.array([1, 2]) + value)
    again = constants.device_array([value], mx.int32, lazy=True)
    np.testing.assert_array_equal(np.array(again + 0), [value])


def test_const_array_lazy_only_on_cuda():
    a = runtime.const_array([11], mx.int32, backend="emulate", lazy=True)
    c = runtime.const_array([11], mx.int32, backend="cuda", lazy=True)
    assert c is runtime.const_array([11], mx.int32, backend="cuda", lazy=True)
    assert c is not runtime.const_array([11], mx.int32, backend="cuda")
    for x in (a, c):
        np.testing.assert_array_equal(np.array(x), [11])


def test_lazy_device_arrays_keep_only_the_newest(monkeypatch):
    monkeypatch.setattr(constants, "MAX_LAZY_ENTRIES", 3)
    first = [constants.device_array([v], mx.int32, lazy=True) for v in range(3)]
    assert constants.device_array([0], mx.int32, lazy=True) is first[0]
    newest = constants.device_array([3], mx.int32, lazy=True)  # drops value 0, the oldest
    assert constants.device_array([0], mx.int32, lazy=True) is not first[0]  # (drops value 1)
    assert constants.device_array([2], mx.int32, lazy=True) is first[2]
    assert constants.device_array([3], mx.int32, lazy=True) is newest
    for v in range(4):
        np.testing.assert_array_equal(np.array(constants.device_array([v], mx.int32, lazy=True)), [v])


@pytest.mark.parametrize("value", [0, 4095, -5, 2**31 - 1, -(2**31)])
def test_lazy_device_array_holds_any_int32(value):
    for given in ([value], value):
        got = constants.device_array(given, mx.int32, lazy=True)
        assert got.dtype == mx.int32 and tuple(got.shape) == ((1,) if isinstance(given, list) else ())
        assert np.array(got).tolist() == given


def test_lazy_device_array_takes_one_int32_only():
    for values, dtype in (([1, 2], mx.int32), ([1.5], mx.float32), ([3], mx.int64)):
        with pytest.raises(ValueError, match="one int32 value"):
            constants.device_array(values, dtype, lazy=True)


@pytest.mark.parametrize("transform", ["vjp", "grad", "compile"])
def test_device_array_made_in_a_custom_backward_is_an_evaluated_copy(transform, monkeypatch):
    """A constant first made inside a custom function's backward (where the ops plan their
    backward launches) may not be scheduled on this thread (mx.async_eval refuses there):
    it is made on the helper thread instead of falling back to the host array (managed
    memory on CUDA, read over the host link at every launch): an evaluated array, cached
    for later calls outside the transform."""
    made = []
    real = constants._made_off_thread
    monkeypatch.setattr(constants, "_made_off_thread", lambda *a: made.append(1) or real(*a))
    seen = []

    @mx.custom_function
    def scale(x):
        return x * 2.0

    @scale.vjp
    def scale_vjp(primals, cotangent, output):
        c = constants.device_array([3, 5], mx.float32)  # planned at the first backward
        seen.append(c)
        return cotangent * c

    loss = lambda a: scale(a).sum()  # noqa: E731
    x = mx.array([1.0, 2.0])
    if transform == "vjp":
        _, (g,) = mx.vjp(scale, [x], [mx.array([1.0, 1.0])])
    elif transform == "grad":
        g = mx.grad(loss)(x)
    else:
        g = mx.compile(mx.grad(loss))(x)
    np.testing.assert_allclose(np.array(g), [3.0, 5.0])
    assert made, "the backward's constant was not made on the helper thread"
    c = seen[0]
    assert constants.device_array([3, 5], mx.float32) is c  # cached for calls outside the transform
    np.testing.assert_array_equal(np.array(c * 2), [6.0, 10.0])


def test_device_array_falls_back_to_the_host_array_when_the_helper_fails(monkeypatch):
    """No copy can be made, here or on the helper thread: the host array, not cached, and the
    helper is not tried again (each try would cost a thread round trip)."""
    tries = []

    def refuse(host):
        tries.append(threading.current_thread().name)
        raise RuntimeError("no stream")

    monkeypatch.setattr(constants, "_padded_copy", refuse)
    a = constants.device_array([7, 9], mx.int32)
    np.testing.assert_array_equal(np.array(a), [7, 9])
    assert constants.device_array([7, 9], mx.int32) is not a  # not cached
    assert len(tries) == 3 and tries[1].startswith("xlstm-kernels-consts")  # here, helper; then here only
    np.testing.assert_array_equal(np.array(constants.device_array([7, 9], mx.int32)), [7, 9])
