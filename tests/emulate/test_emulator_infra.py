"""The emulator's plumbing: verbose output, compile options, call validation, and the
on-disk cache of compiled kernels under concurrency (threads and processes)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels.emulate import metal_kernel
from xlstm_kernels.emulate.signature import format_verbose


def _load_kernels():
    name = "xlstm_emulate_test_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("kernels.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


K = _load_kernels()
pytestmark = pytest.mark.emulator_only

N = 77  # not a multiple of the threadgroup


def _x(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


def _exp_kernel():
    return metal_kernel(name="infra_exp", input_names=["inp"], output_names=["out"], source=K.EXP)


def _call(kernel, x: np.ndarray, **extra):
    return kernel(inputs=[mx.array(x)], output_shapes=[x.shape], output_dtypes=[mx.float32],
                  grid=(128, 1, 1), threadgroup=(64, 1, 1), **extra)


def _rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


# ---------------------------------------------------------------------------
# verbose
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("template", [None, [("T", mx.float32), ("N", 3), ("B", True)]], ids=["plain", "templated"])
def test_verbose_prints_mlx_dump(capsys, template):
    k = _exp_kernel()
    x = _x(1)
    extra = {"template": template} if template else {}
    (y,) = _call(k, x, verbose=True, **extra)
    out = capsys.readouterr().out
    gen = k.generate([mx.array(x)], [mx.float32], template)
    assert out == format_verbose("infra_exp", gen)
    assert "infra_exp" in out and gen.name in out
    assert K.EXP in out  # the body is pasted verbatim
    if template:
        assert "template <typename T, int N, bool B>" in out
    assert _rel_err(y, np.exp(x.astype(np.float64))) < 1e-6
    # without verbose nothing is printed
    _call(k, x, **extra)
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------
# compile_options
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode, expected", [("fast", 1.0), ("safe", 0.0), ("relaxed", 0.0), (None, 0.0)])
def test_math_mode_defines_fast_math(mode, expected):
    options = None if mode is None else {"math_mode": mode}
    k = metal_kernel(name="infra_fast_math", input_names=["inp"], output_names=["out"],
                     source=K.FAST_MATH_PROBE, compile_options=options)
    x = _x(2)
    (y,) = k(inputs=[mx.array(x)], output_shapes=[x.shape], output_dtypes=[mx.float32],
             grid=(N, 1, 1), threadgroup=(32, 1, 1))
    np.testing.assert_array_equal(np.array(y), np.full(N, expected, np.float32))


@pytest.mark.parametrize("options", [{"math_mode": "precise"}, {"mathmode": "fast"}, {"math_mode": "fast", "opt": 3}])
def test_bad_compile_options_raise(options):
    with pytest.raises(ValueError):
        k = metal_kernel(name="infra_exp", input_names=["inp"], output_names=["out"], source=K.EXP,
                         compile_options=options)
        _call(k, _x())


# ---------------------------------------------------------------------------
# Call validation
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [mx.gpu, mx.cpu, None], ids=["gpu", "cpu", "none"])
def test_stream_is_accepted(stream):
    x = _x(3)
    (y,) = _call(_exp_kernel(), x, stream=stream)
    assert _rel_err(y, np.exp(x.astype(np.float64))) < 1e-6


def test_wrong_number_of_inputs_raises_mlx_message():
    x = mx.array(_x(4))
    with pytest.raises(ValueError, match=r"\[metal_kernel\] Expected `inputs` to have size 1 but got size 2\."):
        _exp_kernel()(inputs=[x, x], output_shapes=[x.shape], output_dtypes=[mx.float32],
                      grid=(N, 1, 1), threadgroup=(32, 1, 1))
    with pytest.raises(ValueError, match=r"Expected `output_shapes` to have size 1 but got size 2"):
        _exp_kernel()(inputs=[x], output_shapes=[x.shape, x.shape], output_dtypes=[mx.float32],
                      grid=(N, 1, 1), threadgroup=(32, 1, 1))


@pytest.mark.parametrize("where", ["input", "output"])
def test_unsupported_dtype_raises_type_error(where):
    x = mx.array(_x(5))
    if where == "input":
        inputs, out_dtype = [x.astype(mx.complex64)], mx.float32
    else:
        inputs, out_dtype = [x], mx.complex64
    with pytest.raises(TypeError, match="complex64"):
        _exp_kernel()(inputs=inputs, output_shapes=[x.shape], output_dtypes=[out_dtype],
                      grid=(N, 1, 1), threadgroup=(32, 1, 1))


# ---------------------------------------------------------------------------
# On-disk cache under concurrency
# ---------------------------------------------------------------------------
def _libraries(cache: Path, kernel_name: str) -> list[Path]:
    return sorted(cache.glob(f"custom_kernel_{kernel_name}_*.so"))


def _leftovers(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.name.endswith(".tmp")]


def test_disk_cache_threads_share_one_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("XLSTM_KERNELS_EMULATE_CACHE", str(tmp_path))
    tag = uuid.uuid4().int % 10**12
    name = f"infra_cache_threads_{tag}"
    kernel = metal_kernel(name=name, input_names=["inp"], output_names=["out"], source=K.unique_axpy(tag))
    n_threads = 8
    start = threading.Barrier(n_threads)
    results: dict[int, object] = {}

    def work(i: int) -> None:
        x = np.random.default_rng(100 + i).standard_normal(N).astype(np.float32)
        start.wait()
        try:
            (y,) = _call(kernel, x)
            results[i] = _rel_err(y, 3.0 * x.astype(np.float64) + 1.0)
        except BaseException as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == n_threads
    for i, r in results.items():
        assert isinstance(r, float) and r < 1e-6, (i, r)
    assert len(_libraries(tmp_path, name)) == 1
    assert _leftovers(tmp_path) == []


_SUBPROCESS = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import mlx.core as mx
    import numpy as np
    from xlstm_kernels.emulate import metal_kernel

    name, tag, go, seed = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    sys.path.insert(0, sys.argv[5])
    import kernels
    k = metal_kernel(name=name, input_names=["inp"], output_names=["out"], source=kernels.unique_axpy(tag))
    x = np.random.default_rng(seed).standard_normal(77).astype(np.float32)
    print("ready", flush=True)
    deadline = time.time() + 120
    while not go.exists() and time.time() < deadline:
        time.sleep(0.005)
    (y,) = k(inputs=[mx.array(x)], output_shapes=[x.shape], output_dtypes=[mx.float32],
             grid=(128, 1, 1), threadgroup=(64, 1, 1))
    err = np.max(np.abs(np.array(y, dtype=np.float64) - (3.0 * x.astype(np.float64) + 1.0)))
    assert err < 1e-5, err
    print("ok", flush=True)
    """
)


def test_disk_cache_processes_compile_concurrently(tmp_path):
    cache = tmp_path / "cache"
    go = tmp_path / "go"
    tag = uuid.uuid4().int % 10**12
    name = f"infra_cache_procs_{tag}"
    env = dict(os.environ, XLSTM_KERNELS_EMULATE_CACHE=str(cache))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SUBPROCESS, name, str(tag), str(go), str(i), str(Path(__file__).parent)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for i in range(3)
    ]
    try:
        for p in procs:  # every process has imported everything: now compile at once
            line = p.stdout.readline()
            assert line.strip() == "ready", p.stderr.read()
        go.touch()
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip() == "ok", (out, err)
    assert len(_libraries(cache, name)) == 1
    assert len(list(cache.glob("xk_runtime-*.so"))) == 1  # the runtime was built concurrently too
    assert _leftovers(cache) == []
