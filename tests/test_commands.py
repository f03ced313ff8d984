"""The bench / tune / info commands and the library functions behind them.

Kernels run on the test backend (default: the emulator) on tiny shapes: `bench --quick` is
the CI smoke test; the tuner sweeps a handful of configs and writes a preset file into a
temp dir, which the runtime then picks up (checked through `explain`).
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import mlx.core as mx
import pytest
import yaml

from xlstm_kernels import benchmarks as xb
from xlstm_kernels import cli, tiles
from xlstm_kernels.benchmarks import report, suite
from xlstm_kernels.benchmarks import tuner as tune_mod
from xlstm_kernels.benchmarks import tune_knobs
from xlstm_kernels.tiles import GemmConfig, TileConfigError, explain, explain_knobs, knob_shape_class
from xlstm_kernels.tiles import knobs as knobs_mod
from xlstm_kernels.tiles import presets as presets_mod
from xlstm_kernels.tiles import resolve as resolve_mod

ROOT = Path(__file__).resolve().parents[1]


def _reset():
    presets_mod._reset_caches()
    resolve_mod._reset()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No XLSTM_* tile variables, an empty config home, fresh tile caches."""
    knob_vars = set(knobs_mod.knob_env_vars())
    for var in list(os.environ):
        if var.startswith("XLSTM_GEMM_") or var in knob_vars or var in ("XLSTM_KERNELS_PRESETS", "XLSTM_KERNELS_DEVICE",
                                                                        "XLSTM_KERNELS_BACKEND"):
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config-home"))
    _reset()
    yield
    _reset()


@pytest.fixture
def kernel_backend_name(backend):
    """The test backend, for commands that need kernels (tune skips on 'reference')."""
    if backend == "reference":
        pytest.skip("tune needs a kernel backend (metal or emulate)")
    return backend


def _main(argv, capsys):
    """Run the CLI in-process: (exit status, stdout, stderr)."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------


def test_bench_quick_smoke_cli(backend, tmp_path):
    """The CI smoke test, exactly as CI runs it: a fresh process, all families, --quick."""
    out_dir = tmp_path / "out"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "xlstm_kernels.cli", "--backend", backend, "bench", "--quick", "--out", str(out_dir)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    print(f"bench --quick on {backend}: {seconds:.1f} s")  # CI budget: < 60 s on the emulator

    doc = json.loads((out_dir / f"bench-{backend}.json").read_text())
    assert doc["schema"] == report.SCHEMA and doc["schema_version"] == report.SCHEMA_VERSION
    assert doc["backend"] == backend and doc["emulated"] == (backend == "emulate")
    assert doc["options"]["quick"] is True and doc["summary"]["passed"] is True
    rows = doc["rows"]
    assert {r["op"] for r in rows} >= {"gemm_av", "gemm_at_b", "gemm_a_bt", "linear"}
    assert {r["dtype"] for r in rows} == {"float32", "float16", "bfloat16"}
    for r in rows:
        assert list(r) == list(report.ROW_FIELDS)
        assert r["ok"] is True and r["max_rel_err"] <= r["tolerance"]
    if backend == "emulate":
        assert "emulated rate only" in proc.stdout
        assert all(r["ratio"] is None and r["ours_ms"] is None and r["emulated_s"] > 0 for r in rows)
        assert all(r["emulated_threads_per_s"] > 0 for r in rows if r["family"] == "gemm")
    else:
        assert all(r["ratio"] > 0 and r["pct_roofline"] > 0 for r in rows)
    # families without a module yet are skipped with a note, not silently
    skipped = {s["family"] for s in doc["skipped"]}
    for fam in ("norm", "rope", "attention", "mlstm", "slstm"):
        assert fam in skipped or any(r["family"] == fam for r in rows)
    with open(out_dir / f"bench-{backend}.csv", newline="") as fh:
        lines = list(csv.reader(fh))
    assert tuple(lines[0]) == report.ROW_FIELDS and len(lines) == len(rows) + 1
    assert (out_dir / f"bench-{backend}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_library_timed_rows_on_reference():
    """Ratio, rates and roofline % where wall time is meaningful (the reference path here)."""
    res = xb.run_bench(ops="gemm_av,linear", dtypes="float32", shapes=[(16, 24, 8), "1x32x16"], backend="reference",
                       repeats=2, warmup=1)
    assert res.ok and len(res.rows) == 4
    for r in res.rows:
        assert r["ours_ms"] > 0 and r["baseline_ms"] > 0
        assert r["ratio"] == pytest.approx(r["baseline_ms"] / r["ours_ms"])
        assert r["pct_roofline"] > 0 and r["metric"] in ("GFLOP/s", "GB/s") and r["bound"] in ("compute", "memory")
        assert r["repeats"] == 2
    gemv = next(r for r in res.rows if r["dims"] == [1, 32, 16])
    assert gemv["bound"] == "memory" and gemv["metric"] == "GB/s"
    doc = res.to_dict()
    json.dumps(doc, allow_nan=False)
    assert doc["summary"]["rows"] == 4 and doc["device"]["family"] == tiles.detect_device().family_key


def test_bench_family_module_contract(monkeypatch):
    """ops_<family>.run(backend, dtypes, quick) rows are normalised; a missing module is skipped
    with a note; a module that raises is an error (and fails the run)."""
    calls = []

    def run(backend, dtypes, quick):
        calls.append((backend, dtypes, quick))
        return [{"op": "rms_norm", "shape": (4, 128), "dtype": dtypes[0], "ours_ms": 2.0, "mlx_ms": 3.0, "ratio": 99.0,
                 "gbps": 10.0, "pct_roofline": 5.0, "max_rel_err": 1e-3, "emulated_s": 0.5, "threads": 7}]

    def broken(backend, dtypes, quick):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(sys.modules, "xlstm_kernels.benchmarks.ops_norm", types.SimpleNamespace(run=run))
    monkeypatch.setitem(sys.modules, "xlstm_kernels.benchmarks.ops_rope", types.SimpleNamespace(run=broken))
    monkeypatch.setitem(sys.modules, "xlstm_kernels.benchmarks.ops_slstm", None)  # as if not installed
    notes = []
    res = xb.run_bench(ops="norm,rope,slstm", dtypes="float16", quick=True, backend="reference", on_note=notes.append)
    assert calls == [("reference", [mx.float16], True)]
    (row,) = res.rows
    assert list(row) == list(report.ROW_FIELDS)
    assert row["family"] == "norm" and row["shape"] == "4x128" and row["dims"] == [4, 128] and row["dtype"] == "float16"
    assert row["baseline_ms"] == 3.0 and row["ratio"] == pytest.approx(1.5)  # recomputed: baseline / ours
    assert row["metric"] == "GB/s" and row["ok"] is True and row["tolerance"] == 1e-2
    assert row["extra"] == {"threads": 7}
    assert [s["family"] for s in res.skipped] == ["slstm"]
    assert any("slstm: skipped" in n for n in notes)
    assert res.errors and "kernel exploded" in res.errors[0]["error"] and not res.ok
    # on the emulator the timing columns are cleared
    emu = suite.normalize_row({"op": "x", "shape": "8", "dtype": "float32", "ours_ms": 4.0, "mlx_ms": 1.0,
                               "max_rel_err": 1e-7}, "norm", "emulate")
    assert emu["ours_ms"] is None and emu["ratio"] is None and emu["emulated_s"] == pytest.approx(0.004)


def test_bench_schema_matches_the_doc():
    """docs/BENCH_SCHEMA.md documents exactly the row fields and top-level keys the code writes."""
    text = (ROOT / "docs" / "BENCH_SCHEMA.md").read_text()
    rows_section = text.split("### Row fields", 1)[1].split("###", 1)[0]
    documented = re.findall(r"^\| `([a-z_]+)` \|", rows_section, flags=re.M)
    assert tuple(documented) == report.ROW_FIELDS
    top_section = text.split("### JSON document", 1)[1].split("###", 1)[0]
    top = re.findall(r"^\| `([a-z_]+)` \|", top_section, flags=re.M)
    res = suite.BenchResult(backend="reference", rows=[], options={}, device={}, roofline={})
    assert top == list(res.to_dict())


# ---------------------------------------------------------------------------------------
# tune
# ---------------------------------------------------------------------------------------


def test_tune_candidates_use_the_runtime_validation():
    valid, rejected = xb.enumerate_candidates("gemm_av", "float32", (256, 256, 256))
    assert len(valid) > 500 and rejected
    for cfg in valid:
        cfg.validate("float32")  # the very check a launch runs
    msgs = " ".join(msg for _, msg in rejected)
    assert "1024" in msgs and "32 KiB" in msgs
    for cfg, _ in rejected[:50]:
        with pytest.raises(TileConfigError):
            cfg.validate("float32")
    paths = {c.path for c in valid}
    assert paths == {"scalar", "simd"}
    assert {c.split_k for c in valid} == {1}  # the split-K rule does not fire at 256^3
    assert any(c.align_execw and c.tn == 32 * c.rn for c in valid)
    assert any(c.double_buffer and c.pad and c.vec4 for c in valid)
    # long K, small output: split-K candidates, capped at K // (2*BK)
    split = {(c.split_k, c.bk) for c in xb.enumerate_candidates("gemm_a_bt", "float16", (16, 16, 512))[0]
             if c.path == "simd"}
    assert (4, 16) in split and all(s <= 512 // (2 * bk) for s, bk in split)
    # M == 1: the gemv kernel's thread counts
    gemv, _ = xb.enumerate_candidates("gemm_av", "float16", (1, 64, 128), quick=True)
    assert {c.path for c in gemv} == {"gemv"} and len(gemv) >= 2
    # quick grid is small; paths can be restricted
    quick, _ = xb.enumerate_candidates("gemm_av", "float16", (64, 64, 64), quick=True, paths=["simd"])
    assert 1 <= len(quick) <= 8 and {c.path for c in quick} == {"simd"}


@pytest.mark.parametrize("cfg", [
    GemmConfig(path="scalar", tm=16, tn=64, tk=8, rm=2, rn=4, pad=1, double_buffer=True, vec4=True),
    GemmConfig(path="scalar", tm=32, rn=2, rm=4, tk=16, align_execw=True),
    GemmConfig(path="simd", bm=64, bn=32, bk=32, wm=2, wn=1, split_k=1),
])
def test_config_env_reproduces_the_config(monkeypatch, cfg):
    """--env mode's variables resolve to exactly the candidate (no kernel runs)."""
    for var, value in xb.config_env("gemm_at_b", cfg).items():
        monkeypatch.setenv(var, value)
    got = explain("gemm_at_b", (64, 64, 64), "float16")["config"]
    assert tune_mod._relevant(got) == tune_mod._relevant(cfg.to_dict())


def _check_runtime_picks(path: Path, res, shape, family):
    doc = yaml.safe_load(path.read_text())
    entry = doc["families"][family]["shapes"][tiles.shape_class(*shape)][res.op][res.dtype]
    assert entry == {**entry, **res.winners[tiles.shape_class(*shape)]["entry"]}
    info = explain(res.op, shape, res.dtype)
    prefix = f"{path}: families.{family}.shapes.{tiles.shape_class(*shape)}.{res.op}.{res.dtype}."
    fields = [f for f in entry if f != "gemv_threads"] if shape[0] > 1 else ["gemv_threads"]
    for f in fields:
        assert info["config"][f] == entry[f], f
        assert info["sources"][f] == prefix + f
    return entry


def test_tune_cli_writes_presets_the_runtime_loads(kernel_backend_name, tmp_path, capsys):
    out = tmp_path / "out"
    rc, stdout, stderr = _main(["--backend", kernel_backend_name, "tune", "--op", "gemm_av", "--dtype", "float16",
                                "--shapes", "64x64x64", "--limit", "3", "--write", "--out", str(out)], capsys)
    assert rc == 0, stdout + stderr
    assert "3/3" in stderr  # progress bar on stderr
    assert "rank" in stdout and "(current)" in stdout and "winner small" in stdout
    target = tmp_path / "config-home" / "xlstm_kernels" / "presets.yaml"
    assert str(target) in stdout and target.exists()
    res_doc = json.loads((out / f"tune-gemm_av-float16-{kernel_backend_name}.json").read_text())
    assert res_doc["schema"] == "xlstm-kernels/tune" and res_doc["counts"]["64x64x64"]["run"] == 3
    assert res_doc["presets_path"] == str(target)
    assert sum(r["current"] for r in res_doc["results"]) == 1
    assert (out / f"tune-gemm_av-float16-{kernel_backend_name}.png").read_bytes()[:4] == b"\x89PNG"

    _reset()
    family = tiles.detect_device().family_key
    res = tune_mod.TuneResult(op="gemm_av", dtype="float16", backend=kernel_backend_name, device={}, shapes=[],
                              mode="", quick=True, limit=3, counts={}, results=[], winners=res_doc["winners"])
    _check_runtime_picks(target, res, (64, 64, 64), family)
    # other shape classes and dtypes are untouched
    assert "shapes" not in str(explain("gemm_av", (64, 64, 64), "float32")["sources"]["tm"])


def test_tune_env_mode_into_xlstm_kernels_presets(kernel_backend_name, tmp_path, monkeypatch):
    """--env: each candidate in a subprocess with XLSTM_GEMM_* set; winners merged into an
    existing $XLSTM_KERNELS_PRESETS file, keeping what it held (and a .bak copy)."""
    target = tmp_path / "mine.yaml"
    target.write_text("families:\n  m1:\n    gemm:\n      gemm_av:\n        float32: {tm: 16}\n")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(target))
    seen = []
    res = xb.tune("gemm_a_bt", "float32", shapes="48x40x32,1x64x96", env=True, limit=2, backend=kernel_backend_name,
                  progress=False, on_result=seen.append)
    assert res.mode == "env" and len(seen) == 4 and all(r.ok for r in seen), [r.error for r in seen]
    assert {r.config["path"] for r in seen if r.shape[0] == 1} == {"gemv"}
    assert set(res.winners) == {"small"} and "gemv_threads" in res.winners["small"]["entry"]
    path = xb.write_presets(res)
    assert path == str(target) and res.presets_path == path
    assert (tmp_path / "mine.yaml.bak").read_text().startswith("families:\n  m1:")
    _reset()
    family = tiles.detect_device().family_key
    doc = yaml.safe_load(target.read_text())
    assert doc["families"]["m1"]["gemm"]["gemm_av"]["float32"] == {"tm": 16}
    _check_runtime_picks(target, res, (48, 40, 32), family)
    _check_runtime_picks(target, res, (1, 64, 96), family)
    presets_mod.load_preset_file(str(target))  # valid for the strict loader


def test_tune_cli_creates_a_missing_presets_file(kernel_backend_name, tmp_path, monkeypatch, capsys):
    target = tmp_path / "new" / "p.yaml"
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(target))
    rc, stdout, stderr = _main(["--backend", kernel_backend_name, "tune", "--op", "gemm_at_b", "--dtype", "bf16",
                                "--shapes", "24x16x40", "--limit", "2", "--paths", "scalar", "--write", "--no-progress",
                                "--out", str(tmp_path / "out")], capsys)
    assert rc == 0, stdout + stderr
    assert f"created {target}" in stdout and stderr == ""
    _reset()
    assert explain("gemm_at_b", (24, 16, 40), "bfloat16")["sources"]["path"].startswith(str(target))


def test_write_presets_refuses_an_invalid_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("families:\n  cpu:\n    gemm:\n      gemm_av:\n        float32: {tm: 0}\n")
    res = tune_mod.TuneResult(op="gemm_av", dtype="float32", backend="emulate", device={"family": "cpu"},
                              shapes=[(8, 8, 8)], mode="in-process", quick=True, limit=None, counts={}, results=[],
                              winners={"small": {"entry": {"path": "scalar", "tm": 16}}})
    with pytest.raises(TileConfigError, match="bad.yaml"):
        xb.write_presets(res, str(bad))
    assert "tm: 0" in bad.read_text()
    res.winners = {}
    with pytest.raises(tune_mod.TuneError, match="nothing to write"):
        xb.write_presets(res, str(tmp_path / "x.yaml"))


def test_tune_library_errors():
    with pytest.raises(xb.BenchArgumentError, match="^limit: must be a positive integer, got 0"):
        xb.tune("gemm_av", "float16", limit=0, backend="emulate")
    with pytest.raises(xb.BenchArgumentError, match="^op: 'gru' is not a tunable op; expected one of gemm_av, "
                                                    "gemm_at_b, gemm_a_bt, rms_norm, layer_norm, attention, mlstm, slstm"):
        xb.tune("gru", "float16")
    with pytest.raises(xb.BenchArgumentError, match="^paths: applies to the GEMM ops only"):
        xb.tune("rms_norm", "float16", paths="scalar", backend="emulate")
    with pytest.raises(xb.BenchArgumentError, match=r"^shapes: '1x2x40x48' is not a shape; expected 5 positive "
                                                    r"integers joined by 'x': BxHxLqxLkxD"):
        xb.tune("attention", "float16", shapes="1x2x40x48", backend="emulate")
    with pytest.raises(xb.BenchArgumentError, match="^shapes: '64x200x3' is not a shape; expected 2 positive integers"):
        xb.tune("layer_norm", "float16", shapes="64x200x3", backend="emulate")
    with pytest.raises(xb.BenchArgumentError, match="^shapes: 1x8x4096x128 is too large for the emulator"):
        xb.tune("mlstm", "float16", shapes="1x8x4096x128", backend="emulate")
    with pytest.raises(xb.BenchArgumentError, match="too large for the emulator"):
        xb.tune("gemm_av", "float16", shapes="1024x1024x1024", backend="emulate")
    with pytest.raises(tune_mod.TuneError, match="reference backend"):
        xb.tune("gemm_av", "float16", backend="reference")


# ---------------------------------------------------------------------------------------
# tune: kernel knobs
# ---------------------------------------------------------------------------------------


def _check_knob_runtime_picks(path: Path, op: str, dtype: str, winners: dict, shape, family: str) -> dict:
    """The written entry is in kernel_shapes.<class>.<op>.<dtype> and explain_knobs names it."""
    cls = knob_shape_class(op, knobs_mod.shape_size(op, shape))
    doc = yaml.safe_load(path.read_text())
    entry = doc["families"][family]["kernel_shapes"][cls][op][dtype]
    assert entry == {**entry, **winners[cls]["entry"]} and entry
    info = explain_knobs(op, dtype, shape)
    for knob, value in entry.items():
        assert info["values"][knob] == value, knob
        assert info["sources"][knob] == f"{path}: families.{family}.kernel_shapes.{cls}.{op}.{dtype}.{knob}"
    current = tune_knobs.current_knobs(op, dtype, shape)  # what the ops now launch with
    assert all(current[k] == v for k, v in entry.items() if k in current)
    return entry


@pytest.mark.parametrize("op, dtype, shapes, limit", [
    ("rms_norm", "float32", "48x200", 3),
    ("attention", "float16", "1x2x40x48x32,1x2x1x300x32", 2),
    ("slstm", "bfloat16", "1x2x6x16", 3),
])
def test_tune_knob_op_cli_writes_presets_the_runtime_loads(kernel_backend_name, tmp_path, monkeypatch, capsys,
                                                          op, dtype, shapes, limit):
    target = tmp_path / "tuned.yaml"  # created by --write
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(target))
    out = tmp_path / "out"
    rc, stdout, stderr = _main(["--backend", kernel_backend_name, "tune", "--op", op, "--dtype", dtype, "--shapes",
                                shapes, "--limit", str(limit), "--write", "--out", str(out)], capsys)
    assert rc == 0, stdout + stderr
    n_shapes = len(shapes.split(","))
    assert f"{limit * n_shapes}/{limit * n_shapes}" in stderr  # progress bar
    assert f"created {target}" in stdout and "(current)" in stdout and "winner" in stdout
    assert f"kernel_shapes.<class>.{op}.{dtype}" in stdout
    doc = json.loads((out / f"tune-{op}-{dtype}-{kernel_backend_name}.json").read_text())
    assert doc["schema"] == "xlstm-kernels/tune" and doc["op"] == op and doc["presets_path"] == str(target)
    assert len(doc["results"]) == limit * n_shapes and sum(r["current"] for r in doc["results"]) == n_shapes
    for r in doc["results"]:
        assert r["ok"], r
        swept = tune_knobs.swept_knobs(op, tuple(r["dims"]))
        assert set(r["config"]) == set(swept)
        assert r["env"] == {knobs_mod.knob_env_var(op, k): (str(int(v)) if isinstance(v, bool) else str(v))
                            for k, v in r["config"].items()}
    for c in doc["counts"].values():
        assert c["run"] == limit and c["valid"] + c["rejected"] == c["enumerated"]
    assert (out / f"tune-{op}-{dtype}-{kernel_backend_name}.png").read_bytes()[:4] == b"\x89PNG"
    _reset()
    family = tiles.detect_device().family_key
    for text in shapes.split(","):
        shape = tuple(int(p) for p in text.split("x"))
        _check_knob_runtime_picks(target, op, dtype, doc["winners"], shape, family)
    if op == "attention":  # one class: the prefill and decode winners merged into one entry
        assert set(doc["winners"]["small"]["entry"]) == {"block_q", "block_k", "split_kv_block_size"}
    presets_mod.load_preset_file(str(target))


def test_tune_knob_env_mode(kernel_backend_name, tmp_path, monkeypatch):
    """--env for mlstm: each candidate in a subprocess configured by XLSTM_MLSTM_CHUNK_SIZE only;
    the parent's own setting is what "current" means and is replaced in the children."""
    target = tmp_path / "mine.yaml"
    target.write_text("families:\n  m1:\n    gemm:\n      gemm_av:\n        float32: {tm: 16}\n")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(target))
    monkeypatch.setenv("XLSTM_MLSTM_CHUNK_SIZE", "16")
    seen = []
    res = xb.tune("mlstm", "float32", shapes="1x2x40x16", env=True, limit=2, backend=kernel_backend_name,
                  progress=False, on_result=seen.append)
    assert res.mode == "env" and len(seen) == 2 and all(r.ok for r in seen), [r.error for r in seen]
    assert seen[0].current and seen[0].config == {"chunk_size": 16} and seen[1].config["chunk_size"] != 16
    assert res.to_dict()["results"][1]["env"] == {"XLSTM_MLSTM_CHUNK_SIZE": str(seen[1].config["chunk_size"])}
    path = xb.write_presets(res)
    assert path == str(target) and (tmp_path / "mine.yaml.bak").exists()
    monkeypatch.delenv("XLSTM_MLSTM_CHUNK_SIZE")  # the variable shadows the file
    _reset()
    family = tiles.detect_device().family_key
    assert yaml.safe_load(target.read_text())["families"]["m1"]["gemm"]["gemm_av"]["float32"] == {"tm": 16}
    _check_knob_runtime_picks(target, "mlstm", "float32", res.winners, (1, 2, 40, 16), family)


def test_knob_env_child_checks_what_it_resolved(monkeypatch, capsys):
    """A child whose variables resolve to other knobs than intended reports it, runs nothing."""
    monkeypatch.setenv("XLSTM_MLSTM_CHUNK_SIZE", "16")
    spec = {"op": "mlstm", "shape": [1, 1, 8, 8], "dtype": "float32", "warmup": 1, "repeats": 1, "seed": 0,
            "max_seconds": None, "expect": {"chunk_size": 32}}
    assert tune_knobs.child_main(json.dumps(spec)) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    out = json.loads(line[len(tune_mod.RESULT_TAG):])
    assert out["ok"] is False and "resolved to different knobs: {'chunk_size': 16}" in out["error"]


def test_knob_candidates_use_the_runtime_checks():
    valid, rejected = tune_knobs.enumerate_knob_candidates("attention", "float32", (1, 2, 40, 48, 64))
    assert {c["block_k"] for c in valid} == {8, 16, 32, 64} and rejected  # block_k 128: > 32 KiB at D = 64
    assert all("32 KiB" in msg and c["block_k"] == 128 for c, msg in rejected)
    valid, _ = tune_knobs.enumerate_knob_candidates("attention", "float16", (1, 2, 1, 300, 64), quick=True)
    assert valid == [{"split_kv_block_size": v} for v in (64, 128, 256)]
    valid, rejected = tune_knobs.enumerate_knob_candidates("slstm", "float32", (1, 1, 4, 64))
    assert {c["threads_per_unit"] for c in valid} == {1, 2, 4, 8, 16}  # 32 * 64 > 1024 threads
    assert all("DH*K = 2048" in msg for _, msg in rejected) and len(rejected) == 2
    # one run per distinct launch: simd_rows only matters where rows run one simdgroup each
    chosen, counts, _, _ = tune_knobs.plan_shape("rms_norm", "float32", (64, 1000),
                                                 tune_knobs.current_knobs("rms_norm", "float32", (64, 1000)),
                                                 quick=True, seed=0, limit=None)
    keys = [tune_knobs.launch_key("rms_norm", (64, 1000), c) for c, _ in chosen]
    assert len(keys) == len(set(keys)) == 4 and counts["same_launch"] == counts["valid"] - 3
    assert chosen[0] == ({"n_reads": 8, "simd_rows": 8, "looped_threads": 1024}, True)  # the automatic layout


def test_tune_help_lists_every_op(capsys):
    rc, out, _ = _main(["tune", "--help"], capsys)
    assert rc == 0
    flat = " ".join(out.split())
    assert "gemm_av, gemm_at_b, gemm_a_bt, rms_norm, layer_norm, attention, mlstm, slstm" in flat
    assert "not exposed" not in flat


# ---------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------


def test_info_text_and_json(monkeypatch, capsys):
    monkeypatch.setenv("XLSTM_GEMM_TILE_AV", "16x16")
    monkeypatch.setenv("XLSTM_GEMM_DB", "maybe")
    rc, out, err = _main(["info", "--shapes", "64x64x64"], capsys)
    assert rc == 0 and err == ""
    family = tiles.detect_device().family_key
    assert f"MLX {mx.__version__}" in out and f"preset family {family}" in out
    assert "XLSTM_GEMM_TILE_AV=16x16" in out and "XLSTM_GEMM_DB=maybe" in out
    assert "INVALID: XLSTM_GEMM_DB='maybe'" in out
    monkeypatch.delenv("XLSTM_GEMM_DB")
    _reset()
    rc, out, _ = _main(["--backend", "reference", "info", "--shapes", "64x64x64,1x64x64", "--json"], capsys)
    info = json.loads(out)
    assert info["backend"]["active"] == "reference" and info["mlx_version"] == mx.__version__
    assert info["device"]["family"] == family and set(info["roofline"]) >= {"fp32_tflops", "bandwidth_gbs"}
    assert [e["name"] for e in info["env"] if e["name"].startswith("XLSTM_GEMM_")] == ["XLSTM_GEMM_TILE_AV"]
    by = {(e["op"], e["shape"]): e for e in info["explain"]}
    assert set(by) == {(op, s) for op in ("gemm_av", "gemm_at_b", "gemm_a_bt") for s in ("64x64x64", "1x64x64")}
    av = by[("gemm_av", "64x64x64")]
    assert av["path"] == "scalar" and av["config"]["tm"] == 16 and av["sources"]["tm"] == "XLSTM_GEMM_TILE_AV"
    assert by[("gemm_av", "1x64x64")]["path"] == "scalar"  # the env tile forces the path, even for M == 1
    assert by[("gemm_at_b", "1x64x64")]["path"] == "gemv"


def test_info_shows_kernel_knobs(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("XLSTM_SLSTM_THREADS_PER_UNIT", "4")
    monkeypatch.setenv("XLSTM_ATTENTION_BLOCK_Q", "12")
    user = tmp_path / "k.yaml"
    user.write_text("families:\n  cpu:\n    kernels:\n      slstm:\n        default: {threads_per_unit: 4}\n"
                    "      mlstm:\n        default: {chunk_size: 32}\n")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(user))
    monkeypatch.setenv("XLSTM_KERNELS_DEVICE", "cpu")
    rc, out, err = _main(["info"], capsys)
    assert rc == 0 and err == ""
    assert "XLSTM_SLSTM_THREADS_PER_UNIT=4   # slstm knob threads_per_unit" in out
    assert "INVALID: XLSTM_ATTENTION_BLOCK_Q='12'" in out
    assert "env overrides: XLSTM_ATTENTION_BLOCK_Q, XLSTM_SLSTM_THREADS_PER_UNIT" in out
    assert "threads_per_unit <- XLSTM_SLSTM_THREADS_PER_UNIT" in out
    assert f"chunk_size <- {user}: families.cpu.kernels.mlstm.default" in out
    assert "attention  1x32x512x2048x128 float16   error: XLSTM_ATTENTION_BLOCK_Q='12'" in out
    monkeypatch.delenv("XLSTM_ATTENTION_BLOCK_Q")
    rc, out, _ = _main(["info", "--json", "--dtype", "float32"], capsys)
    info = json.loads(out)
    by = {k["op"]: k for k in info["knobs"]}
    assert set(by) == set(knobs_mod.KNOB_OPS)
    assert by["slstm"]["effective"] == {"threads_per_unit": 4, "r_in_registers": False}  # 4*16 floats > 128 B
    assert by["slstm"]["sources"]["threads_per_unit"] == "XLSTM_SLSTM_THREADS_PER_UNIT"
    assert by["mlstm"]["values"] == {"chunk_size": 32} and by["mlstm"]["shape_class"] == "medium"
    assert by["attention"]["effective"]["block_q"] == 32 and by["attention"]["error"] == ""
    assert by["rms_norm"]["sources"]["n_reads"].startswith("built-in")
    assert [e["name"] for e in info["env"] if e["knob"]] == ["XLSTM_SLSTM_THREADS_PER_UNIT"]


# ---------------------------------------------------------------------------------------
# Malformed arguments: a clear message naming the argument, non-zero exit, no traceback
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, expect", [
    (["bench", "--ops", "foo"], "argument --ops: unknown op 'foo'"),
    (["bench", "--ops", "gemm,"], "argument --ops: empty entry"),
    (["bench", "--dtypes", "float64"], "argument --dtypes: unknown dtype 'float64'"),
    (["bench", "--shapes", "12x"], "argument --shapes: '12x' is not a shape"),
    (["bench", "--shapes", "64x64x0"], "argument --shapes: '64x64x0' has a zero size"),
    (["bench", "--repeats", "0"], "argument --repeats: must be a positive integer"),
    (["tune", "--op", "gemm_av", "--limit", "0"], "argument --limit: must be a positive integer, got 0"),
    (["tune", "--op", "gemm_av", "--limit", "many"], "argument --limit: must be a positive integer"),
    (["tune", "--op", "gru"], "argument --op: 'gru' is not a tunable op; expected one of gemm_av, gemm_at_b, "
                              "gemm_a_bt, rms_norm, layer_norm, attention, mlstm, slstm"),
    (["tune", "--op", "rms_norm", "--shapes", "64x64x64"],
     "argument --shapes: '64x64x64' is not a shape; expected 2 positive integers joined by 'x': ROWSxN"),
    (["tune", "--op", "slstm", "--shapes", "1x2x0x16"], "argument --shapes: '1x2x0x16' has a zero size"),
    (["tune", "--op", "attention", "--paths", "simd"], "argument --paths: applies to the GEMM ops only"),
    (["--backend", "emulate", "tune", "--op", "attention", "--shapes", "1x32x2048x2048x128"],
     "error: --shapes: 1x32x2048x2048x128 is too large for the emulator"),
    (["tune", "--dtype", "float16"], "the following arguments are required: --op"),
    (["tune", "--op", "gemm_av", "--dtype", "int8"], "argument --dtype: unknown dtype 'int8'"),
    (["tune", "--op", "gemm_av", "--shapes", "64x64"], "argument --shapes: '64x64' is not a shape"),
    (["tune", "--op", "gemm_av", "--paths", "gemv"], "argument --paths: unknown path 'gemv'"),
    (["--backend", "emulate", "tune", "--op", "gemm_av", "--shapes", "2048x2048x2048"],
     "error: --shapes: 2048x2048x2048 is too large for the emulator"),
    (["--backend", "reference", "tune", "--op", "gemm_av"], "error: tune needs a kernel backend"),
    (["info", "--shapes", "axbxc"], "argument --shapes: 'axbxc' is not a shape"),
])
def test_malformed_arguments(argv, expect, capsys):
    rc, out, err = _main(argv, capsys)
    assert rc == 2
    assert expect in err, err
    assert "Traceback" not in out + err


def test_malformed_environment_is_a_clear_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("XLSTM_GEMM_TILE_AV", "12x")
    rc, _, err = _main(["--backend", "reference", "bench", "--quick", "--ops", "gemm_av", "--out", str(tmp_path)], capsys)
    assert rc == 2 and "XLSTM_GEMM_TILE_AV='12x'" in err and "Traceback" not in err
    monkeypatch.delenv("XLSTM_GEMM_TILE_AV")
    monkeypatch.setenv("XLSTM_KERNELS_PRESETS", str(tmp_path / "missing.yaml"))
    rc, _, err = _main(["--backend", "emulate", "tune", "--op", "gemm_av"], capsys)
    assert rc == 2 and "XLSTM_KERNELS_PRESETS" in err and "missing.yaml" in err


def test_library_argument_errors_name_the_parameter():
    with pytest.raises(xb.BenchArgumentError, match="^ops: unknown op 'gemm_xx'"):
        xb.run_bench(ops="gemm_xx", backend="reference")
    with pytest.raises(xb.BenchArgumentError, match="^shapes: '12x' is not a shape"):
        xb.run_bench(ops="gemm_av", shapes="12x", backend="reference")
    with pytest.raises(xb.BenchArgumentError, match="^dtypes: unknown dtype"):
        xb.run_bench(dtypes=["float16", "int4"], backend="reference")
    assert xb.parse_shapes([(1, 2, 3), "4X5x6"]) == [(1, 2, 3), (4, 5, 6)]
    assert xb.parse_dtypes("fp16,bf16,float32,half") == ["float16", "bfloat16", "float32"]
    assert xb.parse_ops("all") == list(suite.FAMILIES) + [f for f in suite.available_family_modules()
                                                          if f not in suite.FAMILIES]
