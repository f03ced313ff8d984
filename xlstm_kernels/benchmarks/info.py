"""``xlstm-kernels info``: versions, device, preset family, backend, env overrides, the
config each GEMM op would pick for a sample shape (as :func:`xlstm_kernels.explain`), and
the knobs of the other kernels for a sample shape each (as
:func:`xlstm_kernels.tiles.explain_knobs`, with the values the op then uses)."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import mlx.core as mx

from .. import runtime
from .. import tiles as tiles_mod
from ..tiles import env as env_mod
from ..tiles import knobs as knobs_mod
from ..tiles import presets as presets_mod
from .args import parse_dtypes, parse_shapes, shape_text
from .tuner import _relevant

__all__ = ["ENV_DESCRIPTIONS", "EXPLAIN_OPS", "KNOB_SAMPLE_SHAPES", "collect_info", "env_overrides", "format_info"]

EXPLAIN_OPS = ("gemm_av", "gemm_at_b", "gemm_a_bt")
DEFAULT_SHAPES = ((512, 512, 512), (1, 4096, 4096))
#: One sample shape per knob op, in the tuner's notation.
KNOB_SAMPLE_SHAPES = {
    "rms_norm": (4096, 4096),
    "layer_norm": (4096, 4096),
    "attention": (1, 32, 512, 2048, 128),
    "mlstm": (1, 8, 1024, 128),
    "slstm": (8, 4, 256, 64),
    "fused": (512, 4096, 4096),
}

ENV_DESCRIPTIONS = {
    runtime.ENV_VAR: "backend: metal | emulate | reference",
    env_mod.ENV_PRESETS: "user presets YAML (above ~/.config/xlstm_kernels/presets.yaml)",
    env_mod.ENV_DEVICE: "force a preset family (or an architecture string)",
    env_mod.ENV_TILE["gemm_av"]: "gemm_av tile TMxTN[xTK] (scalar path; with XLSTM_GEMM_PATH=simd: BMxBN[xBK])",
    env_mod.ENV_TILE["gemm_at_b"]: "gemm_at_b tile TMxTN[xTK] (scalar path; with XLSTM_GEMM_PATH=simd: BMxBN[xBK])",
    env_mod.ENV_TILE["gemm_a_bt"]: "gemm_a_bt tile TMxTN[xTK] (scalar path; with XLSTM_GEMM_PATH=simd: BMxBN[xBK])",
    env_mod.ENV_PATH: "GEMM path: simd | scalar",
    env_mod.ENV_PAD: "scalar-path tile padding (int or boolean word)",
    env_mod.ENV_DB: "scalar-path double buffering",
    env_mod.ENV_VEC4: "scalar-path vector loads",
    env_mod.ENV_ALIGN_EXECW: "scalar-path TN := 32*RN",
    env_mod.ENV_MICRO: "scalar-path outputs per thread RMxRN",
    env_mod.ENV_WARPS: "simd-path simdgroups WMxWN",
    env_mod.ENV_SPLIT_K: "simd-path K partitions, forced for every shape",
    env_mod.ENV_STAGES: "simd-path K tiles in flight (0 = as many as fit)",
    env_mod.ENV_GEMV_THREADS: "threads per threadgroup of the M == 1 kernel",
    **{knobs_mod.knob_env_var(op, k): f"{op} knob {k}: {knob.meaning}"
       for op, ks in knobs_mod.KNOBS.items() for k, knob in ks.items()},
    knobs_mod.ALIAS_SPLIT_MIN_KEYS: "alias of XLSTM_ATTENTION_SPLIT_KV_MIN_KEYS",
    "XLSTM_KERNELS_EMULATE_CACHE": "emulator build cache directory",
    "XLSTM_EMULATE_WORKERS": "CPU threads running emulated threadgroups",
    "XLSTM_EMULATE_STACK_KB": "stack per emulated thread (KiB)",
    "XLSTM_TEST_BACKEND": "pytest's default --backend",
}


def env_overrides() -> list[dict[str, Any]]:
    """Every XLSTM_* variable set (non-empty) in this process, with its meaning and, for the
    GEMM and kernel-knob variables, the error the runtime would raise for a malformed value.
    Knob variables also carry ``knob: true``."""
    errors: dict[str, str] = {}
    for op in EXPLAIN_OPS:
        try:
            env_mod.read_gemm_env(op)
        except tiles_mod.TileConfigError as e:
            var = str(e).split("=", 1)[0].strip()
            errors.setdefault(var, str(e))
    for op, spec in knobs_mod.KNOBS.items():
        for name, knob in spec.items():
            var = knobs_mod.knob_env_var(op, name)
            for v in (var, knobs_mod.ALIAS_SPLIT_MIN_KEYS) if name == "split_kv_min_keys" else (var,):
                value = os.environ.get(v, "")
                if value.strip():
                    try:
                        knobs_mod.parse_knob_env(op, knob, v, value)
                    except tiles_mod.TileConfigError as e:
                        errors.setdefault(v, str(e))
    out = []
    for name in sorted(os.environ):
        if not name.startswith("XLSTM_"):
            continue
        value = os.environ[name]
        if not value.strip():
            continue
        if name == runtime.ENV_VAR and value.strip().lower() not in runtime.BACKENDS:
            errors[name] = f"{name}: unknown backend {value!r}; expected one of {', '.join(runtime.BACKENDS)}"
        out.append({"name": name, "value": value, "meaning": ENV_DESCRIPTIONS.get(name, ""),
                    "error": errors.get(name, ""), "knob": name in _KNOB_VARS})
    return out


_KNOB_VARS = frozenset(knobs_mod.knob_env_vars())


def _knob_items(dtype: str) -> list[dict[str, Any]]:
    """Per knob op: the sample shape's resolved knobs, their sources, skipped presets and
    the values the op then uses (or the error a malformed setting gives)."""
    from .args import shape_text
    from .tune_knobs import effective_knobs

    items = []
    for op, shape in KNOB_SAMPLE_SHAPES.items():
        item: dict[str, Any] = {"op": op, "shape": shape_text(shape), "dtype": dtype}
        try:
            ex = knobs_mod.explain_knobs(op, dtype, shape)
            item.update(shape_class=ex["shape_class"], family=ex["family"], values=ex["values"],
                        sources=ex["sources"], skipped=ex["skipped"], effective=effective_knobs(op, dtype, shape),
                        error="")
        except Exception as e:  # noqa: BLE001  (a malformed variable: reported, info goes on)
            item["error"] = str(e)
        items.append(item)
    return items


def _backend_info() -> dict[str, Any]:
    env = os.environ.get(runtime.ENV_VAR, "").strip()
    try:
        active = runtime.current_backend()
        error = ""
    except ValueError as e:
        active, error = None, str(e)
    if error:
        source = runtime.ENV_VAR
    elif env and active == env.lower():
        source = runtime.ENV_VAR
    elif not env and active == runtime.default_backend():
        source = "default (metal where MLX has a Metal device, else reference)"
    else:
        source = "use_backend() / --backend"
    avail = {}
    for name in runtime.BACKENDS:
        ok, why = runtime.available(name)
        avail[name] = {"ok": ok, "why": why}
    return {"active": active, "source": source, "error": error, "available": avail}


def _device_info() -> dict[str, Any]:
    raw: dict[str, Any] = {}
    try:
        get = getattr(mx, "device_info", None) or mx.metal.device_info
        raw = {str(k): (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in get().items()}
    except Exception:  # noqa: BLE001  (older MLX, no device)
        raw = {}
    out: dict[str, Any] = {"metal_available": bool(mx.metal.is_available()), "mlx_device": str(mx.default_device()),
                           "device_info": raw, "error": ""}
    try:
        dev = tiles_mod.detect_device()
        out.update(name=dev.name, architecture=dev.architecture or raw.get("architecture", ""), family=dev.family_key)
        if os.environ.get(env_mod.ENV_DEVICE, "").strip():
            out["matched_by"] = f"{env_mod.ENV_DEVICE} override"
        elif not mx.metal.is_available():
            out["matched_by"] = "no Metal device: the 'cpu' family (kernels run through the emulator)"
            out["name"] = raw.get("device_name", "cpu")
        elif dev.family_key == presets_mod.FAMILY_FALLBACK:
            out["matched_by"] = "no family matched: generic fallback"
        else:
            out["matched_by"] = "architecture / device name match"
    except Exception as e:  # noqa: BLE001  (a broken preset file: reported, info goes on)
        out.update(name=raw.get("device_name", ""), architecture=raw.get("architecture", ""), family=None,
                   matched_by="", error=str(e))
    return out


def _presets_info() -> dict[str, Any]:
    user = presets_mod.user_presets_path()
    out: dict[str, Any] = {"env": os.environ.get(env_mod.ENV_PRESETS) or None, "user_path": user,
                           "user_path_exists": os.path.exists(user), "files": [], "error": ""}
    try:
        out["files"] = [p for p, _, _ in presets_mod.stack_stamps()]
    except Exception as e:  # noqa: BLE001
        out["error"] = str(e)
    return out


def collect_info(shapes: Any = None, dtype: Any = "float16") -> dict[str, Any]:
    """Everything `xlstm-kernels info` prints, as a dict (JSON-ready).

    shapes: sample GEMM shapes "MxNxK" (default 512x512x512 and 1x4096x4096); dtype: of the
    sample. Problems (a malformed env value, a broken preset file) are reported in the
    dict, never raised.
    """
    import xlstm_kernels

    sample = parse_shapes(shapes, "shapes") if shapes is not None else list(DEFAULT_SHAPES)
    dt = parse_dtypes(dtype, "dtype")[0]
    info: dict[str, Any] = {
        "package_version": xlstm_kernels.__version__,
        "mlx_version": mx.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": _device_info(),
        "backend": _backend_info(),
        "presets": _presets_info(),
        "env": env_overrides(),
        "roofline": None,
        "explain": [],
        "knobs": [],
    }
    try:
        info["roofline"] = tiles_mod.roofline()
    except Exception as e:  # noqa: BLE001
        info["roofline"] = {"error": str(e)}
    for op in EXPLAIN_OPS:
        for s in sample:
            item: dict[str, Any] = {"op": op, "shape": shape_text(s), "dtype": dt}
            try:
                ex = tiles_mod.explain(op, s, dt)
                cfg = _relevant(ex["config"])
                item.update(shape_class=ex["shape_class"], family=ex["family"], path=ex["path"], config=cfg,
                            sources={f: ex["sources"].get(f) for f in cfg if f in ex["sources"]},
                            threads=list(ex["threads"]), threadgroup_bytes=ex["threadgroup_bytes"],
                            grid=list(ex["grid"]), error="")
            except Exception as e:  # noqa: BLE001
                item["error"] = str(e)
            info["explain"].append(item)
    info["knobs"] = _knob_items(dt)
    return info


def format_info(info: dict[str, Any]) -> str:
    d, b, p = info["device"], info["backend"], info["presets"]
    lines = [
        f"xlstm-kernels {info['package_version']}   MLX {info['mlx_version']}   Python {info['python']}",
        f"platform      {info['platform']}",
        f"device        {d.get('name') or '?'}   architecture {d.get('architecture') or '?'}   "
        f"(Metal {'available' if d['metal_available'] else 'not available'}; MLX device {d['mlx_device']})",
        f"preset family {d.get('family')}   ({d.get('matched_by') or d.get('error')})",
    ]
    if d.get("error"):
        lines.append(f"  error: {d['error']}")
    roof = info.get("roofline") or {}
    if "error" in roof:
        lines.append(f"roofline      error: {roof['error']}")
    elif roof:
        lines.append("roofline      " + ", ".join(f"{k} {v:g}" for k, v in roof.items()))
    avail = ", ".join(f"{n} {'yes' if a['ok'] else 'no'}" for n, a in b["available"].items())
    lines.append(f"backend       {b['active'] or 'INVALID'}   (from {b['source']}; available: {avail})")
    if b.get("error"):
        lines.append(f"  error: {b['error']}")
    lines.append("preset files  " + (" > ".join(p["files"]) if p["files"] else "-") + "   (highest first)")
    lines.append(f"  user file   {p['user_path']} ({'exists' if p['user_path_exists'] else 'absent'}); "
                 f"{env_mod.ENV_PRESETS}={p['env'] or '(unset)'}")
    if p.get("error"):
        lines.append(f"  error: {p['error']}")
    lines.append("environment overrides" + ("" if info["env"] else ": none (no XLSTM_* variable set)"))
    for e in info["env"]:
        lines.append(f"  {e['name']}={e['value']}" + (f"   # {e['meaning']}" if e["meaning"] else ""))
        if e["error"]:
            lines.append(f"    INVALID: {e['error']}")
    lines.append("config per op (as xlstm_kernels.explain picks it):")
    for it in info["explain"]:
        head = f"  {it['op']:<10} {it['shape']:<14} {it['dtype']:<9}"
        if it.get("error"):
            lines.append(f"{head} error: {it['error']}")
            continue
        cfg = ", ".join(f"{k}={v}" for k, v in it["config"].items() if k != "path")
        lines.append(f"{head} {it['shape_class']:<6} {it['path']:<6} {cfg}; threads {tuple(it['threads'])}, "
                     f"{it['threadgroup_bytes']} B threadgroup memory")
        srcs: dict[str, list[str]] = {}
        for f, src in it["sources"].items():
            src = src[: -len(f) - 1] if src.endswith("." + f) else src  # group fields of one YAML entry
            srcs.setdefault(src, []).append(f)
        for src, fs in srcs.items():
            lines.append(f"      {','.join(fs)} <- {src}")
    knob_env = [e["name"] for e in info["env"] if e.get("knob")]
    lines.append("kernel knobs (as xlstm_kernels.tiles.explain_knobs picks them; "
                 + (f"env overrides: {', '.join(knob_env)})" if knob_env else "no XLSTM_<OP>_<KNOB> override set)"))
    for it in info.get("knobs", []):
        head = f"  {it['op']:<10} {it['shape']:<16} {it['dtype']:<9}"
        if it.get("error"):
            lines.append(f"{head} error: {it['error']}")
            continue
        eff = ", ".join(f"{k}={v}" for k, v in it["effective"].items())
        lines.append(f"{head} {it['shape_class']:<6} {eff}")
        srcs = {}
        for k, src in it["sources"].items():
            src = src[: -len(k) - 1] if src.endswith("." + k) else src
            srcs.setdefault(src, []).append(k)
        for src, ks in srcs.items():
            lines.append(f"      {','.join(ks)} <- {src}")
        for sk in it["skipped"]:
            lines.append(f"      skipped {sk['knob']}={sk['value']!r} from {sk['source']}: {sk['reason']}")
    return "\n".join(lines)
