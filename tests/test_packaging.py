"""The wheel works on its own: build it, install it into a fresh venv outside the source
tree, and run an op, ``xlstm-kernels info`` and ``xlstm-kernels bench --quick`` from the
installed package.

This catches files missing from the wheel (metal_src/*.metal, tuning/presets.yaml, the
emulator's C++ sources, data/corpus.txt) that the editable install used by the rest of
the suite would hide. The wheel is built from a copy of the files git would commit
(tracked plus untracked-but-not-ignored), so ignored build outputs cannot leak in.

About a minute with a warm pip and emulator cache (~20 s of it for bench --quick).
Skipped, with the reason, when the wheel cannot be built or its dependencies cannot be
downloaded here; ``XLSTM_SKIP_PACKAGING=1`` skips it on purpose.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".whl", ".pytest_cache",
                                 ".hypothesis", ".ruff_cache", "*.so")
_OFFLINE = ("No matching distribution", "Could not find a version", "Failed to establish a new connection",
            "Temporary failure in name resolution", "Network is unreachable", "ProxyError", "Read timed out")

pytestmark = pytest.mark.skipif(os.environ.get("XLSTM_SKIP_PACKAGING") == "1", reason="XLSTM_SKIP_PACKAGING=1")


def _run(cmd, *, cwd, env=None, timeout=300) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"[{time.perf_counter() - t0:5.1f} s] {' '.join(str(c) for c in cmd)} -> {proc.returncode}")
    return proc


def _tail(proc: subprocess.CompletedProcess, n: int = 3000) -> str:
    return (proc.stdout + proc.stderr)[-n:]


def _copy_source(dst: Path) -> None:
    """The files git would commit (tracked + untracked, not ignored), else the tree minus build outputs."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.SubprocessError):
        files = []
    if not files:
        shutil.copytree(ROOT, dst, ignore=_IGNORE)
        return
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def _clean_env(home_cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "XLSTM_"))}
    env["XLSTM_KERNELS_BACKEND"] = "emulate"
    if os.environ.get("XLSTM_KERNELS_EMULATE_CACHE"):  # share compiled kernels (their key hashes the installed C++)
        env["XLSTM_KERNELS_EMULATE_CACHE"] = os.environ["XLSTM_KERNELS_EMULATE_CACHE"]
    env["MPLCONFIGDIR"] = str(home_cache / "mpl")
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, venv bin dir, a work dir outside the source tree, env, wheel path)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src, dist, work = tmp / "src", tmp / "dist", tmp / "work"
    for d in (src, dist, work):
        d.mkdir()
    _copy_source(src)

    build = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, src], cwd=tmp, timeout=600)
    wheels = sorted(dist.glob("xlstm_kernels-*.whl"))
    if build.returncode != 0 or not wheels:
        if any(s in _tail(build) for s in _OFFLINE):
            pytest.skip(f"cannot build the wheel here (build dependencies unavailable):\n{_tail(build, 800)}")
        pytest.fail(f"building the wheel failed:\n{_tail(build)}")
    wheel = wheels[0]

    venv = tmp / "venv"
    mk = _run([sys.executable, "-m", "venv", venv], cwd=tmp, timeout=300)
    if mk.returncode != 0:
        pytest.skip(f"cannot create a venv here (python -m venv failed):\n{_tail(mk, 800)}")
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    py = bindir / "python"
    env = _clean_env(tmp)
    inst = _run([py, "-m", "pip", "install", "-q", wheel], cwd=work, env=env, timeout=900)
    if inst.returncode != 0:
        if any(s in _tail(inst) for s in _OFFLINE):
            pytest.skip(f"the wheel's dependencies cannot be downloaded here:\n{_tail(inst, 800)}")
        pytest.fail(f"installing the wheel failed:\n{_tail(inst)}")
    return py, bindir, work, env, wheel


def test_wheel_ships_every_data_file(installed):
    *_, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"xlstm_kernels/metal_src/{p.name}" for p in (ROOT / "metal_src").glob("*.metal")}
    expected |= {f"xlstm_kernels/tuning/{p.name}" for p in (ROOT / "tuning").glob("*.yaml")}
    expected |= {f"xlstm_kernels/data/{p.name}" for p in (ROOT / "xlstm_kernels" / "data").glob("*.txt")}
    csrc = ROOT / "xlstm_kernels" / "emulate" / "csrc"
    expected |= {f"xlstm_kernels/emulate/csrc/{p.relative_to(csrc).as_posix()}" for p in csrc.rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts}
    missing = sorted(expected - names)
    assert not missing, f"missing from {wheel.name}: {missing}"
    assert any(n.endswith("entry_points.txt") for n in names)


def test_installed_package_runs_an_op(installed):
    py, _, work, env, _ = installed
    code = r"""
import os, sys
import mlx.core as mx
import numpy as np
import xlstm_kernels as xk
from xlstm_kernels.runtime import families
here = os.path.dirname(xk.__file__)
assert "site-packages" in here, here
print("package:", here)
print("families:", families())
from xlstm_kernels.runtime import family_header
print("shared header:", "xk_frag_coord" if "inline void xk_frag_coord" in family_header("gemm") else "missing")
with xk.use_backend("emulate"):
    a, v = mx.random.normal((33, 29)), mx.random.normal((29, 31))
    c = xk.gemm_av(a, v)
    x, w = mx.random.normal((4, 40)), mx.random.normal((40,))
    y = xk.rms_norm(x, w, 1e-5)
err = max(float(mx.abs(c - a @ v).max()), float(mx.abs(y - mx.fast.rms_norm(x, w, 1e-5)).max()))
assert err < 1e-4, err
print("ok", err)
"""
    proc = _run([py, "-c", code], cwd=work, env=env, timeout=600)
    assert proc.returncode == 0, _tail(proc)
    assert "site-packages" in proc.stdout and "ok" in proc.stdout
    fams = proc.stdout.split("families:", 1)[1].splitlines()[0]
    for f in (p.stem for p in (ROOT / "metal_src").glob("*.metal") if not p.stem.startswith("_")):
        assert f"'{f}'" in fams, (f, fams)
    # the shared _*.metal headers ship too (every family's header ends with them)
    assert "xk_frag_coord" in proc.stdout.split("shared header:", 1)[1], _tail(proc)


def test_installed_cli_info(installed):
    _, bindir, work, env, _ = installed
    proc = _run([bindir / "xlstm-kernels", "info", "--json"], cwd=work, env=env, timeout=300)
    assert proc.returncode == 0, _tail(proc)
    doc = json.loads(proc.stdout)
    text = json.dumps(doc)
    assert "presets.yaml" in text, text[:2000]  # the shipped tuning file was found and used


def test_installed_cli_bench_quick(installed):
    _, bindir, work, env, _ = installed
    out = work / "bench-out"
    proc = _run([bindir / "xlstm-kernels", "bench", "--quick", "--out", out], cwd=work, env=env, timeout=900)
    assert proc.returncode == 0, _tail(proc)
    doc = json.loads((out / "bench-emulate.json").read_text())
    assert doc["options"]["quick"] is True and doc["summary"]["passed"] is True, doc["summary"]
    families = {r.get("family") for r in doc["rows"]}
    assert {"gemm", "norm", "rope", "attention", "mlstm", "slstm"} <= families, families
