"""The memo of prepared op calls: a configuration change must invalidate it at once."""

from __future__ import annotations

import os
import time

import pytest

from xlstm_kernels import runtime, tiles
from xlstm_kernels.ops._callcache import CallCache, config_token
from xlstm_kernels.tiles import presets as presets_mod


def test_token_is_stable_while_nothing_changes():
    assert config_token() == config_token()


def test_env_backend_and_process_tiles_change_the_token(monkeypatch):
    base = config_token()
    monkeypatch.setenv("XLSTM_RMS_NORM_N_READS", "2")
    knob = config_token()
    assert knob != base
    monkeypatch.setenv("XLSTM_GEMM_SPLIT_K", "2")
    assert config_token() not in (base, knob)
    monkeypatch.delenv("XLSTM_RMS_NORM_N_READS")
    monkeypatch.delenv("XLSTM_GEMM_SPLIT_K")
    assert config_token() == base  # equal configurations, equal tokens
    with runtime.use_backend("reference"):
        ref = config_token()
    assert ref != base and config_token() == base
    monkeypatch.setenv(runtime.ENV_VAR, "reference")
    assert config_token() != base
    monkeypatch.delenv(runtime.ENV_VAR)
    tiles.set_gemm_tiles(av="32x8")
    try:
        assert config_token() != base
    finally:
        tiles.set_gemm_tiles()


def test_preset_edits_change_the_token_after_reload_or_ttl(monkeypatch, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("families: {}\n")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(path))
    before = config_token()
    path.write_text("families:\n  cpu:\n    kernels:\n      mlstm:\n        default: {chunk_size: 8}\n")
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    monkeypatch.setattr(presets_mod, "STAMP_TTL_S", 3600.0)
    assert config_token() == before  # not stat()ed again within the TTL ...
    tiles.reload_presets()
    edited = config_token()
    assert edited != before  # ... unless asked to
    os.utime(path, ns=(time.time_ns() + 2 * 10**9, time.time_ns() + 2 * 10**9))
    monkeypatch.setattr(presets_mod, "STAMP_TTL_S", 0.0)
    assert config_token() not in (before, edited)  # or once the TTL has passed


def test_call_cache_keys_on_configuration(monkeypatch):
    c = CallCache("t", maxsize=3)
    assert c.get(("k", 1)) is None
    assert c.put(("k", 1), "v") == "v" and c.get(("k", 1)) == "v"
    monkeypatch.setenv("XLSTM_MLSTM_CHUNK_SIZE", "16")
    assert c.get(("k", 1)) is None  # another configuration
    c.put(("k", 1), "w")
    monkeypatch.delenv("XLSTM_MLSTM_CHUNK_SIZE")
    assert c.get(("k", 1)) == "v"  # back to the first one
    assert c.get(["unhashable"]) is None and c.put(["unhashable"], 1) == 1
    c.put(("k", 2), "x")
    c.put(("k", 3), "y")  # the memo was full: cleared, then stored
    assert len(c) == 1 and c.get(("k", 3)) == "y"


def test_prepared_launch_matches_launch_on_the_emulator():
    import mlx.core as mx
    import numpy as np

    from xlstm_kernels.ops import norm as nm

    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((5, 300)).astype(np.float32))
    w = mx.array(rng.standard_normal(300).astype(np.float32))
    with runtime.use_backend("emulate"):
        spec, kw = nm._plan("rms", x, w, None, 1e-5)
        (want,) = runtime.launch(spec, **kw)
        run = runtime.prepare_launch(spec, **kw)
        (got,) = run(kw["inputs"])
        x2 = mx.array(rng.standard_normal((5, 300)).astype(np.float32))
        (got2,) = run([x2, *kw["inputs"][1:]])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    xf = np.asarray(x2, dtype=np.float64)
    ref = xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-5) * np.asarray(w, dtype=np.float64)
    np.testing.assert_allclose(np.asarray(got2), ref, rtol=1e-5, atol=1e-5)


def test_gemm_calls_are_memoised_per_signature_and_compute_fresh_inputs():
    import mlx.core as mx
    import numpy as np

    from xlstm_kernels.ops import gemm as gemm_mod

    rng = np.random.default_rng(4)
    gemm_mod._CALLS.clear()
    with runtime.use_backend("emulate"):
        for _ in range(3):
            a = rng.standard_normal((33, 29)).astype(np.float32)
            v = rng.standard_normal((29, 31)).astype(np.float32)
            got = np.asarray(gemm_mod.gemm_av(mx.array(a), mx.array(v)))
            np.testing.assert_allclose(got, a.astype(np.float64) @ v, rtol=1e-5, atol=1e-5)
        assert len(gemm_mod._CALLS) == 1
        gemm_mod.gemm_av(mx.array(a), mx.array(v), tiles="16x16")  # another signature
        assert len(gemm_mod._CALLS) == 2
        for _ in range(2):  # tiles as a dict: memoised by its items (equal dicts, one entry)
            got = gemm_mod.gemm_av(mx.array(a), mx.array(v), tiles={"tm": 16, "tn": 32, "path": "scalar"})
        np.testing.assert_allclose(np.asarray(got), a.astype(np.float64) @ v, rtol=1e-5, atol=1e-5)
        assert len(gemm_mod._CALLS) == 3
        got = gemm_mod.gemm_av(mx.array(a), mx.array(v), tiles={"path": "scalar", "tn": 32, "tm": 16})
        assert len(gemm_mod._CALLS) == 3
        with pytest.raises(ValueError, match="v"):  # a bad call is still checked
            gemm_mod.gemm_av(mx.array(a), mx.array(v[:5]))


def test_rope_and_norm_calls_are_memoised_per_signature():
    import mlx.core as mx
    import numpy as np

    from xlstm_kernels.ops import norm as nm
    from xlstm_kernels.ops import rope as rp

    rng = np.random.default_rng(5)
    rp._CALLS.clear()
    nm._CALLS.clear()
    with runtime.use_backend("emulate"):
        x = mx.array(rng.standard_normal((2, 3, 7, 32)).astype(np.float32))
        for offset in (0, 5, 1000):  # an int offset is a kernel input, not part of the signature
            got = rp.rope(x, 32, base=10000.0, offset=offset)
            want = rp.rope_reference(x, 32, base=10000.0, offset=offset)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
        with pytest.raises(ValueError, match="int32"):
            rp.rope(x, 32, base=10000.0, offset=2**31)
        assert len(rp._CALLS) == 1
        for _ in range(2):
            xv = rng.standard_normal((5, 33)).astype(np.float32)
            got = nm.rms_norm(mx.array(xv), None, 1e-5)
            ref = xv / np.sqrt((xv.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
            np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)
        assert len(nm._CALLS) == 1
        with pytest.raises(ValueError, match="eps"):
            nm.rms_norm(mx.array(xv), None, -1.0)


def test_env_snapshot_memo_sees_every_change(monkeypatch):
    """make_snapshot memoises its tuple against a copy of the whole environment: any
    os.environ change (relevant or not, set, changed, deleted) must show at the next read."""
    from xlstm_kernels.tiles import env as env_mod

    monkeypatch.delenv("XLSTM_TEST_SNAP_A", raising=False)
    monkeypatch.delenv("XLSTM_TEST_SNAP_UNRELATED", raising=False)
    snap = env_mod.make_snapshot(("XLSTM_TEST_SNAP_A", "HOME"))
    first = snap()
    assert first[0] is None and snap() is first  # unchanged environment: the memoised tuple
    monkeypatch.setenv("XLSTM_TEST_SNAP_UNRELATED", "1")  # another variable: re-read, same values
    assert snap() == first
    monkeypatch.setenv("XLSTM_TEST_SNAP_A", "x")
    assert snap()[0] in (b"x", "x")
    monkeypatch.setenv("XLSTM_TEST_SNAP_A", "y")
    assert snap()[0] in (b"y", "y")
    monkeypatch.delenv("XLSTM_TEST_SNAP_A")
    assert snap()[0] is None


def test_environ_changes_are_counted_through_every_mutation(monkeypatch):
    """os.environ's mapping counts each change made through os.environ's API (set, del, pop,
    update, setdefault, clear), so the snapshots' memo (environ_version) sees all of them."""
    import os
    import unittest.mock

    from xlstm_kernels.tiles import env as env_mod

    if env_mod.environ_version() is None:
        pytest.skip("os.environ's changes are not counted on this platform")
    name = "XLSTM_TEST_COUNTED"
    monkeypatch.delenv(name, raising=False)
    snap = env_mod.make_snapshot((name,))
    seen = [env_mod.environ_version()]

    def changed(expect):
        version = env_mod.environ_version()
        assert version != seen[-1]
        seen.append(version)
        got = snap()[0]
        assert (None if got is None else os.fsdecode(got)) == expect

    os.environ[name] = "a"
    changed("a")
    os.environ.update({name: "b"})
    changed("b")
    assert os.environ.pop(name) == "b"
    changed(None)
    os.environ.setdefault(name, "c")
    changed("c")
    del os.environ[name]
    changed(None)
    monkeypatch.setenv(name, "d")
    changed("d")
    with unittest.mock.patch.dict(os.environ, {name: "e"}):
        changed("e")
    changed("d")
    monkeypatch.delenv(name)
    changed(None)
    assert snap() is snap()  # unchanged: the memoised tuple


def test_snapshot_falls_back_when_environ_is_replaced(monkeypatch):
    """With os.environ replaced by another mapping (its changes then not counted) the
    snapshots read the variables themselves: still exact."""
    import os

    from xlstm_kernels.tiles import env as env_mod

    snap = env_mod.make_snapshot(("XLSTM_TEST_REPLACED", "HOME"))
    fake = {"XLSTM_TEST_REPLACED": "x"}
    monkeypatch.setattr(os, "environ", fake)
    assert env_mod.environ_version() is None
    assert snap()[0] in ("x", b"x")
    fake["XLSTM_TEST_REPLACED"] = "y"
    assert snap()[0] in ("y", b"y")
    del fake["XLSTM_TEST_REPLACED"]
    assert snap()[0] is None


def test_token_follows_a_knob_variable_set_and_reset_between_calls(monkeypatch):
    from xlstm_kernels.tiles import knobs as knobs_mod

    var = knobs_mod._ALL_VARS[0]
    monkeypatch.delenv(var, raising=False)
    t0 = config_token()
    monkeypatch.setenv(var, "4")
    t1 = config_token()
    assert t1 != t0
    monkeypatch.setenv(var, "8")
    assert config_token() not in (t0, t1)
    monkeypatch.delenv(var)
    assert config_token() == t0


# ----------------------------------------------------------------------------- graph replay
@pytest.fixture
def replay_on(monkeypatch):
    monkeypatch.setenv("XLSTM_KERNELS_REPLAY", "1")


def test_replay_is_on_by_default_on_gpu_backends_only(monkeypatch):
    from xlstm_kernels.ops._callcache import replayable

    monkeypatch.delenv("XLSTM_KERNELS_REPLAY", raising=False)
    f, _ = _counted_custom_function()
    assert replayable(f, "cuda") is not f
    assert replayable(f, "metal") is not f
    assert replayable(f, "emulate") is f
    assert replayable(f, "reference") is f


def _counted_custom_function():
    """A differentiable f(x, w) = x * w (VJP by hand) that counts how often its Python runs."""
    import mlx.core as mx

    calls = {"forward": 0, "vjp": 0}

    @mx.custom_function
    def f(x, w):
        calls["forward"] += 1
        return x * w

    @f.vjp
    def f_vjp(primals, cotangent, output):
        calls["vjp"] += 1
        x, w = primals
        return cotangent * w, (cotangent * x).sum(axis=0)

    return f, calls


@pytest.mark.parametrize("backend", ["emulate", "reference"])
def test_replayable_leaves_eager_backends_alone(backend):
    from xlstm_kernels.ops._callcache import replayable

    f, _ = _counted_custom_function()
    assert replayable(f, backend) is f


def test_replayable_records_once_and_replays_with_fresh_values(replay_on):
    import mlx.core as mx
    import numpy as np

    from xlstm_kernels.ops._callcache import replayable

    f, calls = _counted_custom_function()
    g = replayable(f, "cuda")
    assert g is not f
    rng = np.random.default_rng(7)
    w = mx.array(rng.standard_normal(5).astype(np.float32))
    for i in range(4):  # fresh values each call: the replay must not bake in the first inputs
        xn = rng.standard_normal((3, 5)).astype(np.float32)
        y = g(mx.array(xn), w)
        np.testing.assert_allclose(np.array(y), xn * np.array(w), rtol=1e-6)
    assert calls["forward"] == 1  # recorded once, replayed three times
    # A new shape records again.
    g(mx.array(rng.standard_normal((2, 5)).astype(np.float32)), w)
    assert calls["forward"] == 2
    # Gradients through the replayed function use the custom VJP.
    x = mx.array(rng.standard_normal((3, 5)).astype(np.float32))
    dx, dw = mx.grad(lambda x, w: g(x, w).sum(), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.array(dx), np.broadcast_to(np.array(w), (3, 5)), rtol=1e-6)
    np.testing.assert_allclose(np.array(dw), np.array(x).sum(axis=0), rtol=1e-6)
    assert calls["vjp"] >= 1


def test_replay_switch(monkeypatch):
    from xlstm_kernels.ops._callcache import REPLAY_ENV_VAR, replayable

    f, _ = _counted_custom_function()
    base = config_token()
    monkeypatch.setenv(REPLAY_ENV_VAR, "0")
    assert config_token() != base  # memoised calls are rebuilt with the new setting
    assert replayable(f, "cuda") is f
    monkeypatch.setenv(REPLAY_ENV_VAR, "1")
    assert replayable(f, "cuda") is not f
    monkeypatch.setenv(REPLAY_ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=REPLAY_ENV_VAR):
        replayable(f, "cuda")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Backend 'cuda' on a machine without it: mx.fast.cuda_kernel replaced by a fake whose
    launches are counted (outputs: zeros). Kernel objects and memos made here are dropped."""
    import mlx.core as mx

    from xlstm_kernels.ops import attention as attention_mod
    from xlstm_kernels.ops import gemm as gemm_mod
    from xlstm_kernels.ops import mlstm as mlstm_mod
    from xlstm_kernels.ops import norm as norm_mod
    from xlstm_kernels.ops import rope as rope_mod
    from xlstm_kernels.runtime import backends as backends_mod
    from xlstm_kernels.runtime import kernels as kernels_mod

    if backends_mod._cuda_available():
        pytest.skip("a real CUDA device: the GPU runs of the op tests cover replay")
    launches = []

    class FakeKernel:
        def __call__(self, *, inputs, output_shapes, output_dtypes, **kwargs):
            launches.append(len(inputs))
            # outputs that depend on every input, as a real kernel's do (so that a replayed
            # graph holds them: an input array also used inside as a constant is refused)
            tie = sum(mx.sum(mx.array(x).astype(mx.float32)) * 0.0 for x in inputs)
            return [(mx.zeros(s, d) + tie).astype(d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kwargs: FakeKernel(), raising=False)
    monkeypatch.setattr(backends_mod, "_cuda_available", lambda: True)

    def drop():
        for key in [k for k in kernels_mod._cache if k[0] == "cuda"]:
            kernels_mod._cache.pop(key, None)
        for memo in (norm_mod._CALLS, rope_mod._CALLS, attention_mod._CALLS, mlstm_mod._STEP_CALLS,
                     gemm_mod._CALLS, gemm_mod._LAUNCHERS):
            memo.clear()

    drop()
    yield launches
    drop()


def test_calls_never_synchronise(fake_cuda, monkeypatch):
    """Building a call (memoised or not: tiles= a dict, knobs=) evaluates nothing: an mx.eval
    there would wait for all the GPU work queued before the call (session 5: 400+ us per
    GEMM call with tiles= a dict, whose memo key failed and whose placeholder was evaluated)."""
    import mlx.core as mx

    import xlstm_kernels as xk
    from xlstm_kernels.ops import gemm as gemm_mod

    a, v = mx.random.normal((40, 24)), mx.random.normal((24, 33))
    q, k = mx.random.normal((1, 4, 1, 16)), mx.random.normal((1, 2, 2048, 16))
    mx.eval(a, v, q, k)
    evals = []
    real = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *args, **kw: (evals.append(1), real(*args, **kw))[1])
    gemm_mod._CALLS.clear()
    with runtime.use_backend("cuda"):
        for _ in range(2):
            xk.gemm_av(a, v, tiles={"bm": 64, "bn": 64, "bk": 16, "wm": 2, "wn": 2, "path": "simd"})
        assert len(gemm_mod._CALLS) == 1  # a dict of tiles is memoised by its items
        xk.linear(a, mx.random.normal((8, 24)), mx.random.normal((8,)))
        xk.scaled_dot_product_attention(q, k, k, scale=0.25, knobs={"split_kv_block_size": 256})
        xk.rms_norm(a, None, 1e-5, knobs={"n_reads": 2})
    assert evals == []


def test_memoised_ops_replay_their_launches_on_cuda(fake_cuda, replay_on):
    import mlx.core as mx

    import xlstm_kernels as xk

    w = mx.random.normal((64,))
    with runtime.use_backend("cuda"):
        for _ in range(3):
            mx.eval(xk.rms_norm(mx.random.normal((8, 64)), w, 1e-5))
        assert len(fake_cuda) == 1  # launched (recorded) once, then replayed by MLX
        for offset in (0, 5, 9):  # an int offset is an input array of the replayed graph
            mx.eval(xk.rope(mx.random.normal((2, 3, 16, 32)), 32, offset=offset))
        assert len(fake_cuda) == 2  # launched (recorded) once, then replayed by MLX
        k = mx.random.normal((1, 2, 4096, 16))
        for i in range(3):  # split-KV decode: its two launches recorded once
            mx.eval(xk.scaled_dot_product_attention(mx.random.normal((1, 4, 1, 16)), k, k, scale=0.25))
            if i == 0:
                assert len(fake_cuda) == 4
        assert len(fake_cuda) == 4
        for _ in range(3):
            q = mx.random.normal((2, 3, 8))
            mx.eval(xk.mlstm_step(q, q, q, mx.random.normal((2, 3)), mx.random.normal((2, 3)), None)[0])
        assert len(fake_cuda) == 5
        for _ in range(3):
            mx.eval(xk.gemm_av(mx.random.normal((40, 24)), mx.random.normal((24, 33))))
        assert len(fake_cuda) == 6
    with runtime.use_backend("cuda"):
        os.environ["XLSTM_KERNELS_REPLAY"] = "0"
        try:
            for _ in range(2):
                mx.eval(xk.rope(mx.random.normal((2, 3, 16, 32)), 32, offset=1))
        finally:
            del os.environ["XLSTM_KERNELS_REPLAY"]
        assert len(fake_cuda) == 8  # no replay: every call launches from Python


def test_plain_products_take_one_memo_entry_and_cast_only_where_needed(fake_cuda, replay_on):
    """gemm_av / gemm_at_b / gemm_a_bt without tiles, and linear without residual or tiles,
    look their memo entry up by a flat key of the operands' shapes and dtypes (and linear's
    activation), before any check; the stored call casts only where the operands' dtypes
    differ from the result's."""
    import mlx.core as mx

    import xlstm_kernels as xk
    from xlstm_kernels.ops import gemm as gemm_mod

    a, b = mx.random.normal((5, 24)).astype(mx.float16), mx.random.normal((33, 24)).astype(mx.float16)
    with runtime.use_backend("cuda"):
        for _ in range(3):
            y = xk.gemm_a_bt(a, b)
            assert y.shape == (5, 33) and y.dtype == mx.float16
            mx.eval(y)
        assert len(fake_cuda) == 1 and len(gemm_mod._CALLS) == 1
        for _ in range(2):  # the same product through linear: the same function (a second,
            mx.eval(xk.linear(a, b))  # flat key of linear's own), replayed
        assert len(fake_cuda) == 1 and len(gemm_mod._CALLS) == 2
        assert gemm_mod._CALLS.get(("linear", a.shape, a.dtype, b.shape, b.dtype, None, None)) is \
            gemm_mod._CALLS.get(("gemm_a_bt", a.shape, a.dtype, b.shape, b.dtype))
        mixed = xk.gemm_a_bt(a, b.astype(mx.float32))  # promoted: a's cast is part of the call
        assert mixed.dtype == mx.float32 and mixed.shape == (5, 33)
        mx.eval(mixed)
        assert len(gemm_mod._CALLS) == 3
        key = ("gemm_a_bt", a.shape, a.dtype, b.shape, mx.float32)
        assert gemm_mod._CALLS.get(key) is not None
        bias = mx.random.normal((33,)).astype(mx.float16)
        launches = len(fake_cuda)
        for _ in range(3):  # linear with a bias: memoised under its own flat key, replayed
            y = xk.linear(a, b, bias, activation="gelu")
            assert y.shape == (5, 33) and y.dtype == mx.float16
            mx.eval(y)
        assert len(fake_cuda) == launches + 1
        assert gemm_mod._CALLS.get(("linear", a.shape, a.dtype, b.shape, b.dtype, (bias.shape, bias.dtype),
                                    "gelu")) is not None
        with pytest.raises(ValueError, match="in_features"):  # another signature: checked again
            xk.linear(a[:, :7], b, bias)
        with pytest.raises(ValueError, match="activation"):
            xk.linear(a, b, bias, activation="swish")


def test_replay_records_once_per_stream(replay_on):
    """A recorded graph runs on the stream it was recorded on (MLX's GPU streams belong to
    their thread): another default stream records its own."""
    import mlx.core as mx

    from xlstm_kernels.ops._callcache import replayable

    f, calls = _counted_custom_function()
    g = replayable(f, "cuda")
    x, w = mx.ones((2, 3)), mx.ones((3,))
    mx.eval(g(x, w), g(x, w))
    assert calls["forward"] == 1
    other = mx.new_stream(mx.default_device())
    with mx.stream(other):
        mx.eval(g(x, w), g(x, w))
    assert calls["forward"] == 2
    mx.eval(g(x, w))
    assert calls["forward"] == 2


def test_replay_only_on_the_main_thread(replay_on):
    """MLX's GPU streams belong to their thread (replays from other threads failed on the
    H100): other threads run the function itself."""
    import threading

    import mlx.core as mx

    from xlstm_kernels.ops._callcache import replayable

    f, calls = _counted_custom_function()
    g = replayable(f, "cuda")
    x, w = mx.ones((2, 3)), mx.ones((3,))
    mx.eval(g(x, w))
    errors = []

    def work():
        try:
            for _ in range(3):
                mx.eval(g(mx.ones((2, 3)), mx.ones((3,))))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors and calls["forward"] == 4
    mx.eval(g(x, w))
    assert calls["forward"] == 4  # the main thread still replays


def test_traced_tells_transforms_from_plain_calls():
    """ops._callcache.traced: True for the arrays a transform traces (grad, vjp, jvp,
    vmap, a caller's compile), False for plain ones, also at a new signature."""
    import mlx.core as mx

    from xlstm_kernels.ops._callcache import traced

    x, w = mx.ones((3,)), mx.ones((3,))
    seen = {}

    def f(a, b=None, tag=""):
        seen[tag] = traced([a] if b is None else [a, b])
        return (a * 2).sum()

    f(x, tag="plain")
    f(mx.ones((4, 2)), tag="plain, new shape")
    f(mx.ones((4, 2), dtype=mx.float16), tag="plain, new dtype")
    mx.grad(lambda a: f(a, tag="grad"))(x)
    mx.grad(lambda b: f(x, b, tag="grad of the second"))(w)
    mx.vjp(lambda a: f(a, tag="vjp"), [x], [mx.array(1.0)])
    mx.jvp(lambda a: f(a, tag="jvp"), [x], [x])
    mx.vmap(lambda a: f(a, tag="vmap"))(mx.ones((2, 3)))
    mx.compile(lambda a: f(a, tag="compile"))(x)
    mx.checkpoint(lambda a: f(a, tag="checkpoint"))(x)
    mx.grad(mx.checkpoint(lambda a: f(a, tag="grad of checkpoint")))(x)
    mx.grad(lambda a: f(a, tag="grad, new rank"))(mx.ones((2, 2, 2)))
    f(x, tag="plain again")
    assert seen == {"plain": False, "plain, new shape": False, "plain, new dtype": False, "grad": True,
                    "grad of the second": True, "vjp": True, "jvp": True, "vmap": True, "compile": True,
                    "checkpoint": False, "grad of checkpoint": True, "grad, new rank": True,
                    "plain again": False}


def test_traced_calls_the_probe_once_for_a_signature_seen_plain(monkeypatch):
    """traced(): a tracer at an input signature (dtypes, ranks) already seen without
    tracers costs one call of the compiled probe; at a new signature, two."""
    import mlx.core as mx

    from xlstm_kernels.ops import _callcache

    runs = []
    real = _callcache._probe_mark
    monkeypatch.setattr(_callcache, "_probe_mark", lambda *a: (runs.append(1), real(*a))[1])
    probe = mx.compile(lambda *a: _callcache._probe_mark(*a), shapeless=True)
    monkeypatch.setattr(_callcache, "_probe", probe)
    monkeypatch.setattr(_callcache, "_probe_known", set())
    x, w = mx.ones((3, 5), dtype=mx.float16), mx.ones((5,), dtype=mx.float16)
    seen = []

    def f(a, b):
        del runs[:]
        seen.append((_callcache.traced([a, b]), len(runs)))
        return (a * b).sum()

    mx.grad(f)(x, w)  # new signature, traced: both calls run the probe's Python
    f(x, w)  # new signature, plain: the first call traces the probe, the second replays
    mx.grad(f)(x, w)  # known signature, traced: one call
    f(mx.ones((7, 5), dtype=mx.float16), mx.ones((1,), dtype=mx.float16))  # known (shapeless), plain: nothing runs
    assert seen == [(True, 2), (False, 1), (True, 1), (False, 0)]




def test_traced_is_true_off_the_main_thread():
    """traced() off the main thread answers True (its probe count is shared), so that the
    callers there take the custom function, never a bare forward under a transform."""
    import threading

    import mlx.core as mx

    from xlstm_kernels.ops._callcache import traced

    x = mx.ones((3,))
    assert traced([x]) is False
    seen = []
    t = threading.Thread(target=lambda: seen.append(traced([x])))
    t.start()
    t.join()
    assert seen == [True]


def _graph_text(tmp_path, out) -> str:
    import mlx.core as mx

    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), out)
    return path.read_text()


@pytest.mark.parametrize("order", ["plain first", "grad first"])
def test_replay_records_the_bare_forward_and_differentiates_through_the_custom_vjp(replay_on, tmp_path, order):
    """replayable(..., bare=): plain calls replay the forward without the custom function's
    StopGradient / CustomTransforms nodes; gradients still take the custom VJP (made
    recognisable here: it returns 7 * the true one), whichever kind of call comes first."""
    import mlx.core as mx
    import numpy as np

    from xlstm_kernels.ops._callcache import replayable

    f, calls = _counted_custom_function()
    bare_calls = []

    def bare(x, w):
        bare_calls.append(1)
        return x * w

    @mx.custom_function
    def g(x, w):
        return f(x, w)

    @g.vjp
    def g_vjp(primals, cotangent, output):
        x, w = primals
        return 7 * cotangent * w, 7 * (cotangent * x).sum(axis=0)

    r = replayable(g, "cuda", bare=bare)
    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal(5).astype(np.float32))
    x = mx.array(rng.standard_normal((3, 5)).astype(np.float32))

    def grads():
        dx, dw = mx.grad(lambda a, b: r(a, b).sum(), argnums=(0, 1))(x, w)
        np.testing.assert_allclose(np.array(dx), 7 * np.broadcast_to(np.array(w), (3, 5)), rtol=1e-6)
        np.testing.assert_allclose(np.array(dw), 7 * np.array(x).sum(axis=0), rtol=1e-6)

    if order == "grad first":
        grads()
        assert bare_calls == []
    for i in range(3):
        xn = mx.array(rng.standard_normal((3, 5)).astype(np.float32))
        y = r(xn, w)
        np.testing.assert_allclose(np.array(y), np.array(xn) * np.array(w), rtol=1e-6)
        text = _graph_text(tmp_path, r(xn, w))
        assert "CustomTransforms" not in text and "StopGradient" not in text
    assert len(bare_calls) == 1  # recorded once, then replayed
    grads()
    vm = mx.vmap(lambda a: r(a, w))(mx.ones((2, 3, 5)))
    np.testing.assert_allclose(np.array(vm), np.broadcast_to(np.array(w), (2, 3, 5)), rtol=1e-6)
    assert "CustomTransforms" in _graph_text(tmp_path, g(x, w))


@pytest.mark.parametrize("first", ["grad", "plain"])
def test_replay_calls_the_custom_function_directly_after_a_run_of_traced_calls(replay_on, monkeypatch, tmp_path,
                                                                             first):
    """A signature whose last MAX_TRACED_TRIES calls were traced (an eager training loop)
    calls its custom function directly, without mx.compile's wrapper, checking for plain
    arrays every PROBE_PERIOD-th call; the first plain call it sees there records the bare
    forward (once) and replays again. Gradients stay right throughout, whether the
    signature's first call was traced or plain."""
    import mlx.core as mx
    import numpy as np

    from xlstm_kernels.ops import _callcache
    from xlstm_kernels.ops._callcache import replayable

    monkeypatch.setattr(_callcache, "MAX_TRACED_TRIES", 3)
    monkeypatch.setattr(_callcache, "PROBE_PERIOD", 4)
    f, calls = _counted_custom_function()
    bare_calls = []
    r = replayable(f, "cuda", bare=lambda x, w: (bare_calls.append(1), x * w)[1])
    rng = np.random.default_rng(5)
    w = mx.array(rng.standard_normal(4).astype(np.float32))
    probes = []
    real = _callcache.traced
    monkeypatch.setattr(_callcache, "traced", lambda arrays: (probes.append(1), real(arrays))[1])

    def grad_step():
        x = mx.array(rng.standard_normal((2, 4)).astype(np.float32))
        dx, dw = mx.grad(lambda a, b: r(a, b).sum(), argnums=(0, 1))(x, w)
        np.testing.assert_allclose(np.array(dx), np.broadcast_to(np.array(w), (2, 4)), rtol=1e-6)
        np.testing.assert_allclose(np.array(dw), np.array(x).sum(axis=0), rtol=1e-6)

    def plain_step():
        x = mx.array(rng.standard_normal((2, 4)).astype(np.float32))
        y = r(x, w)
        np.testing.assert_allclose(np.array(y), np.array(x) * np.array(w), rtol=1e-6)
        return x

    if first == "plain":
        plain_step()  # checking: one probe, records the bare forward
        assert len(probes) == 1 and bare_calls == [1]
    for _ in range(3):  # checking (a probe each), or replaying (none): then direct
        grad_step()
    probes_before = len(probes)
    vjps = calls["vjp"]
    for _ in range(8):  # direct: a probe every 4th call, and each call's VJP the custom one
        grad_step()
    assert len(probes) - probes_before == 2 and calls["vjp"] - vjps == 8
    assert probes_before == (1 if first == "plain" else 3)
    for _ in range(4):  # direct until the next check, which finds plain arrays: replay again
        x = plain_step()
    assert bare_calls == [1]  # the bare forward recorded once, whatever came first
    forward = calls["forward"]
    probes_before = len(probes)
    for _ in range(3):
        x = plain_step()
    assert calls["forward"] == forward and len(probes) == probes_before  # replayed: no Python, no probe
    assert "CustomTransforms" not in _graph_text(tmp_path, r(x, w))
    grad_step()


def test_bare_unless_traced_picks_per_call(tmp_path):
    """Non-replayed calls (a growing cache's decode family): the bare forward on plain
    calls, at every new shape without re-tracing the probe; the custom function (its VJP)
    under a transform."""
    import mlx.core as mx
    import numpy as np

    from xlstm_kernels.ops import _callcache
    from xlstm_kernels.ops._callcache import bare_unless_traced

    f, calls = _counted_custom_function()
    bare_calls = []
    g = bare_unless_traced(f, "cuda", lambda x, w: (bare_calls.append(1), x * w)[1])
    assert bare_unless_traced(f, "emulate", lambda x, w: x * w) is f
    w = mx.arange(4, dtype=mx.float32)
    for n in range(1, 6):  # a new shape every call
        x = mx.ones((n, 4))
        y = g(x, w)
        if n > 1:  # the shapeless probe ran no Python for a plain call of a new shape
            assert _callcache._probe_calls[0] == 0
        np.testing.assert_allclose(np.array(y), np.broadcast_to(np.array(w), (n, 4)))
        assert "CustomTransforms" not in _graph_text(tmp_path, y)
    assert len(bare_calls) == 5 and calls["forward"] == 0
    dx = mx.grad(lambda a: g(a, w).sum())(mx.ones((3, 4)))
    np.testing.assert_allclose(np.array(dx), np.broadcast_to(np.array(w), (3, 4)))
    assert calls["vjp"] == 1 and len(bare_calls) == 5


def test_with_compile_disabled_every_call_takes_the_custom_function():
    """mx.disable_compile(): the tracer probe runs its Python every call, so `traced` says
    True and calls take the custom function (correct, as before the bare replay)."""
    import mlx.core as mx
    import numpy as np

    from xlstm_kernels.ops._callcache import bare_unless_traced, replayable, traced

    f, calls = _counted_custom_function()
    bare_calls = []

    def bare(x, w):
        bare_calls.append(1)
        return x * w

    x, w = mx.ones((2, 3)), mx.arange(3, dtype=mx.float32)
    mx.disable_compile()
    try:
        assert traced([x, w])
        for g in (replayable(f, "cuda", bare=bare), bare_unless_traced(f, "cuda", bare)):
            np.testing.assert_allclose(np.array(g(x, w)), np.broadcast_to(np.array(w), (2, 3)))
            dx = mx.grad(lambda a: g(a, w).sum())(x)
            np.testing.assert_allclose(np.array(dx), np.broadcast_to(np.array(w), (2, 3)))
    finally:
        mx.enable_compile()
    assert bare_calls == [] and calls["forward"] >= 2
    assert not traced([x, w])
