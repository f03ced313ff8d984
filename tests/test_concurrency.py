"""Ops called from 8 threads at once: every result is checked bit for bit.

The in-process caches (kernel objects per backend and spec, the emulator's loaded
kernel libraries, the kernel sources and the ops' small constant inputs, per thread on
cuda) are emptied
first, so the threads race on filling them. Each thread selects the backend itself
(``use_backend`` is per thread) and runs every op family in its own order, several
times; each result must equal, bit for bit, the result of the same call made before on
the main thread (the emulator is deterministic), and that one must match the float64
reference. The on-disk compile cache under concurrent processes and threads is covered
by tests/emulate/test_emulator_infra.py (``test_disk_cache_*``).
"""

from __future__ import annotations

import threading
import zlib

import mlx.core as mx
import numpy as np
import pytest

import xlstm_kernels as xk
from xlstm_kernels import runtime
from xlstm_kernels.cuda import constants
from xlstm_kernels.ops import mlstm as mlstm_mod
from xlstm_kernels.ops import norm as norm_mod
from xlstm_kernels.ops import rope as rope_mod
from xlstm_kernels.ops import slstm as slstm_mod
from xlstm_kernels.runtime import kernels as kernels_mod
from xlstm_kernels.runtime import sources as sources_mod

N_THREADS = 8
ROUNDS = 3


def arr(shape, seed, scale=1.0, dtype=mx.float32):
    rng = np.random.default_rng(zlib.crc32(repr((shape, seed)).encode()))
    out = mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)
    mx.eval(out)
    return out


def f64(x):
    return np.asarray(x.astype(mx.float32)).astype(np.float64)


def _cases():
    """(name, thunk, float64 reference, tolerance): small shapes, every family."""
    a, v = arr((33, 20), 1), arr((20, 17), 2)
    x, w, b = arr((3, 9, 24), 3), arr((16, 24), 4), arr((16,), 5)
    xn, wn = arr((7, 48), 6, dtype=mx.float16), arr((48,), 7, dtype=mx.float16)
    xr = arr((2, 3, 6, 16), 8)
    q, k, vv = arr((1, 4, 5, 16), 9), arr((1, 2, 7, 16), 10), arr((1, 2, 7, 16), 11)
    qm, km, vm = arr((1, 2, 12, 8), 12), arr((1, 2, 12, 8), 13), arr((1, 2, 12, 8), 14)
    ig, fg = arr((1, 2, 12), 15), arr((1, 2, 12), 16, 1.0) + 2.0
    wx, r, bs = arr((2, 5, 4, 2, 8), 17), arr((2, 8, 4, 8), 18, 0.2), arr((4, 2, 8), 19)
    wg = arr((24,), 21)

    def np_rms(x, w):
        x = f64(x)
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * f64(w)

    def np_ln(x):
        x = f64(x)
        xc = x - x.mean(-1, keepdims=True)
        return xc / np.sqrt((xc * xc).mean(-1, keepdims=True) + 1e-5)

    def np_gelu_linear(x, w, b):
        from math import erf

        y = f64(x) @ f64(w).T + f64(b)
        return 0.5 * y * (1 + np.vectorize(erf)(y / np.sqrt(2)))

    def np_sdpa(q, k, v, scale):
        q, k, v = f64(q), np.repeat(f64(k), 2, axis=1), np.repeat(f64(v), 2, axis=1)
        s = q @ k.swapaxes(-1, -2) * scale
        s = np.exp(s - s.max(-1, keepdims=True))
        return (s / s.sum(-1, keepdims=True)) @ v

    def np_rope(x):
        x = f64(x)
        half = 8
        inv = 10000.0 ** (-np.arange(half) / half)
        th = np.arange(x.shape[-2])[:, None] * inv
        c, s = np.cos(th), np.sin(th)
        x0, x1 = x[..., :half], x[..., half:]
        return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], -1)

    def grad_rms(x, w):
        return mx.grad(lambda xx: (xk.rms_norm(xx, w, 1e-5) * xx).sum())(x)

    return [
        ("gemm_av", lambda: xk.gemm_av(a, v), lambda: f64(a) @ f64(v), 1e-5),
        ("gemm_at_b simd", lambda: xk.gemm_at_b(a, arr((33, 8), 20), tiles={"path": "simd"}),
         lambda: f64(a).T @ f64(arr((33, 8), 20)), 1e-5),
        ("linear gelu", lambda: xk.linear(x, w, b, "gelu"), lambda: np_gelu_linear(x, w, b), 1e-5),
        ("rms_norm f16", lambda: xk.rms_norm(xn, wn, 1e-5), lambda: np_rms(xn, wn), 4e-3),
        ("layer_norm", lambda: xk.layer_norm(x, None, None, 1e-5), lambda: np_ln(x), 1e-5),
        ("rms_norm grad", lambda: grad_rms(x, wg), None, None),
        ("rope", lambda: xk.rope(xr, 16), lambda: np_rope(xr), 1e-5),
        ("sdpa gqa", lambda: xk.scaled_dot_product_attention(q, k, vv, scale=0.25), lambda: np_sdpa(q, k, vv, 0.25), 1e-5),
        ("mlstm", lambda: xk.mlstm(qm, km, vm, ig, fg, chunk_size=4),
         lambda: f64(mlstm_mod.mlstm_reference(*(t.astype(mx.float64) for t in (qm, km, vm, ig, fg)))), 1e-4),
        ("mlstm_step", lambda: xk.mlstm_step(qm[:, :, 0], km[:, :, 0], vm[:, :, 0], ig[:, :, 0], fg[:, :, 0], None)[0],
         lambda: f64(mlstm_mod.mlstm_step_reference(qm[:, :, 0], km[:, :, 0], vm[:, :, 0], ig[:, :, 0], fg[:, :, 0], None)[0]),
         1e-5),
        ("slstm", lambda: xk.slstm(wx, r, bs), lambda: f64(slstm_mod.slstm_reference(wx, r, bs)), 1e-5),
    ]


def _clear_in_process_caches() -> None:
    kernels_mod._cache.clear()
    sources_mod.family_sections.cache_clear()
    for fn in (norm_mod._dummy, rope_mod._base_freqs, rope_mod._base_freqs_list):
        fn.cache_clear()
    constants.clear()  # the cuda backend's device copies of small constants (this thread's; each thread has its own)
    try:
        from xlstm_kernels.emulate import kernel as emu_kernel
    except ImportError:  # pragma: no cover
        return
    with emu_kernel._compiled_lock:
        emu_kernel._compiled.clear()


def test_ops_from_8_threads_at_once(kernel_backend):
    cases = _cases()
    expected = []
    for name, thunk, ref, tol in cases:  # once on the main thread: the expected bits (and warm disk cache)
        out = thunk()
        mx.eval(out)
        if ref is not None:
            with mx.stream(mx.cpu):  # float64 references (no float64 on the GPU)
                want = ref()
            err = np.max(np.abs(f64(out) - want)) / max(1.0, np.max(np.abs(want)))
            assert err < tol, (name, err)
        expected.append(np.asarray(out.astype(mx.float32)).copy())

    _clear_in_process_caches()
    start = threading.Barrier(N_THREADS)
    errors: list[str] = []
    checked = [0] * N_THREADS

    def work(tid: int) -> None:
        try:
            rng = np.random.default_rng(tid)
            with xk.use_backend(kernel_backend):
                start.wait(timeout=60)
                for _ in range(ROUNDS):
                    for i in rng.permutation(len(cases)):
                        name, thunk = cases[i][:2]
                        got = np.asarray(thunk().astype(mx.float32))
                        if got.shape != expected[i].shape or not np.array_equal(got, expected[i], equal_nan=True):
                            bad = np.argwhere(got != expected[i])[:3] if got.shape == expected[i].shape else got.shape
                            errors.append(f"thread {tid}: {name} differs from the single-threaded result at {bad}")
                        checked[tid] += 1
        except Exception as e:  # noqa: BLE001 - reported below with the thread id
            errors.append(f"thread {tid}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(t,), name=f"xk-test-{t}") for t in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, "\n".join(errors[:20])
    assert checked == [ROUNDS * len(cases)] * N_THREADS
    if kernel_backend != "reference":  # one kernel object per (backend, spec), whoever built it first
        keys = [key for key in kernels_mod._cache if key[0] == kernel_backend]
        assert keys and len(keys) == len(set(keys))
        for key in keys:
            assert runtime.get_kernel(key[1], kernel_backend) is kernels_mod._cache[key]


def test_backend_choice_is_per_thread(kernel_backend):
    """use_backend in one thread does not leak into another running at the same time."""
    seen: dict[str, str] = {}
    inside = threading.Event()
    release = threading.Event()

    def holder():
        with xk.use_backend("reference"):
            seen["holder"] = xk.current_backend()
            inside.set()
            release.wait(timeout=30)

    def other():
        inside.wait(timeout=30)
        with xk.use_backend(kernel_backend):
            seen["other"] = xk.current_backend()
        release.set()

    ts = [threading.Thread(target=holder), threading.Thread(target=other)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert seen == {"holder": "reference", "other": kernel_backend}


@pytest.mark.emulator_only
def test_kernel_object_built_once_per_spec_under_a_race(monkeypatch):
    """Threads asking for the same spec at once all get one object (the cache keeps the first)."""
    spec = norm_mod.RMS_NORM
    kernels_mod._cache.pop(("emulate", spec), None)
    start = threading.Barrier(N_THREADS)
    got: list[object] = [None] * N_THREADS

    def work(i):
        start.wait(timeout=30)
        got[i] = runtime.get_kernel(spec, "emulate")

    ts = [threading.Thread(target=work, args=(i,)) for i in range(N_THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert all(g is got[0] for g in got) and got[0] is kernels_mod._cache[("emulate", spec)]
