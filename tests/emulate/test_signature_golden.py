"""Golden tests: ``xlstm_kernels.emulate.signature`` vs. MLX's own generated kernel text.

On Linux ``mx.fast.metal_kernel(...)(...)`` only works while tracing under
``mx.export_function``; with ``verbose=True`` MLX then prints the generated
source through C++ ``std::cout``.  All cases run in one subprocess (fd-level
capture, one MLX import) and every case is compared byte for byte with
:func:`format_verbose`.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")

try:
    from xlstm_kernels.emulate import signature as sig
except ImportError:  # running pytest without the repo root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from xlstm_kernels.emulate import signature as sig


# ---------------------------------------------------------------------------
# Case description (JSON-serialisable, shared with the MLX subprocess)
#   inputs: [name, {"shape": [...], "dtype": "float32"}] -> traced mx.array arg
#           [name, {"scalar": value}]                     -> Python scalar in inputs=
#   template: [name, "bool"|"int"|"dtype", value] or None
# ---------------------------------------------------------------------------


def case(cid, *, name="k", inputs=(), outputs=(("out", "float32"),), source="out[0] = 0;",
         header="", template=None, atomic=False):
    return {
        "id": cid,
        "name": name,
        "inputs": [list(i) for i in inputs],
        "outputs": [list(o) for o in outputs],
        "source": source,
        "header": header,
        "template": template,
        "atomic": atomic,
    }


def arr(shape, dtype="float32"):
    return {"shape": list(shape), "dtype": dtype}


ALL_ATTRS_SRC = "\n".join(f"    // {a}" for a, _ in reversed(sig.ATTRIBUTES)) + "\n    out[0] = 1;\n"

HAND_CASES = [
    case("plain", name="plain", inputs=[("inp", arr((4, 8)))],
         source="\n    uint elem = thread_position_in_grid.x;\n    out[elem] = metal::exp(inp[elem]);\n"),
    case("brief_example", name="myexp", inputs=[("inp", arr((4, 8))), ("n", {"scalar": 2.0}),
                                                 ("small", arr((3,), "int32"))],
         outputs=[("out", "float16")], header="// hdr\n",
         template=[["T", "dtype", "float32"], ["N", "int", 16], ["B", "bool", True]],
         source="\n    uint elem = thread_position_in_grid.x;\n    T tmp = inp[elem];\n"
                "    out[elem] = metal::exp(tmp);\n"),
    case("tmpl_dtype_only", name="t1", inputs=[("a", arr((16,)))],
         template=[["T", "dtype", "bfloat16"]], source="out[0] = T(a[0]);"),
    case("tmpl_ints_negative", name="t2", inputs=[("a", arr((16,)))],
         template=[["N", "int", -16], ["M", "int", 0], ["L", "int", 2147483647],
                   ["K", "int", -2147483648]], source="out[0] = N + M;"),
    case("tmpl_bools", name="t3", inputs=[("a", arr((16,)))],
         template=[["X", "bool", False], ["Y", "bool", True], ["Z", "int", 1]],
         source="out[0] = X ? 1 : 0;"),
    case("tmpl_all_dtypes", name="t4", inputs=[("a", arr((16,)))],
         template=[[f"T{i}", "dtype", d] for i, d in enumerate(
             ["float32", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8",
              "uint16", "uint32", "uint64", "bool_", "complex64"])],
         source="out[0] = 0;"),
    case("scalars", name="sc", inputs=[("f", {"scalar": 1.5}), ("i", {"scalar": 7}),
                                        ("b", {"scalar": True}), ("big", {"scalar": 2**40})],
         source="out[0] = f + i + b + f_shape + i_ndim + b_strides;"),
    case("zero_d_array", name="z", inputs=[("x", arr((), "float16"))],
         source="out[0] = x + x_shape[0] + x_strides[0] + x_ndim;"),
    case("small_and_large", name="sl", inputs=[("a", arr((7,))), ("b", arr((8,))), ("c", arr((1, 1))),
                                                ("d", arr((0,))), ("e", arr((2, 4)))],
         source="out[0] = a[0] + b[0] + c[0] + e[0];"),
    case("shape_strides_ndim", name="ssn",
         inputs=[("x", arr((4, 8))), ("y", arr((3,), "int32")), ("zz", arr((2, 2, 2)))],
         source="\n  out[0] = x_shape[0] * x_strides[1] + x_ndim;\n  out[1] = y_ndim + zz_strides[0];\n"),
    case("shape_substring", name="sub", inputs=[("a", arr((9,))), ("data", arr((9,)))],
         source="out[0] = data_shape[0] + data_ndim;"),  # data_shape contains a_shape
    case("attrs_all_reversed_in_comments", name="attrs", inputs=[("a", arr((9,)))],
         source=ALL_ATTRS_SRC),
    case("attrs_some", name="attrs2", inputs=[("a", arr((9,)))],
         source="\n  uint3 g = threadgroup_position_in_grid; uint l = thread_index_in_simdgroup;\n"
                "  // simdgroup_index_in_threadgroup only in a comment\n"
                "  out[g.x * threads_per_threadgroup.x + l] = a[grid_size.x];\n"),
    case("attr_in_header_only", name="hdr_attr", inputs=[("a", arr((9,)))],
         header="// thread_position_in_grid a_shape a_ndim\n#define ADD(x, y) ((x) + (y))\n",
         source="out[0] = ADD(a[0], 1);"),
    case("header_without_newline", name="hnn", inputs=[("a", arr((9,)))],
         header="/* no newline */", template=[["N", "int", 3]], source="out[0] = N;"),
    case("atomic", name="atom", inputs=[("a", arr((32,)))],
         outputs=[("out", "float32"), ("cnt", "int32")], atomic=True,
         source="atomic_fetch_add_explicit(&out[0], a[thread_position_in_grid.x], memory_order_relaxed);"),
    case("atomic_no_attr", name="atom2", inputs=[], outputs=[("o1", "float32"), ("o2", "uint32")],
         atomic=True, source="o1[0] = 1;"),
    case("multi_out_dtypes", name="mo", inputs=[("x", arr((64,), "float16")), ("y", arr((64,), "bfloat16"))],
         outputs=[("o_f16", "float16"), ("o_bf16", "bfloat16"), ("o_i32", "int32"),
                  ("o_u32", "uint32"), ("o_b", "bool_")],
         source="uint i = thread_position_in_grid.x; o_f16[i] = x[i]; o_bf16[i] = y[i];"),
    case("multi_out_shape_no_attr_quirk", name="quirk", inputs=[("x", arr((8,)))],
         outputs=[("o1", "float32"), ("o2", "int32"), ("o3", "float16")],
         source="o1[0] = x_shape[0];"),
    case("multi_out_no_shape_no_attr", name="mono", inputs=[("x", arr((8,)))],
         outputs=[("o1", "float32"), ("o2", "int32")], source="o1[0] = x[0];"),
    case("no_inputs", name="noin", inputs=[], source="out[0] = 42;"),
    case("empty_body", name="empty", inputs=[("x", arr((8,)))], source=""),
    case("fp16_bf16_inputs_small", name="halfs",
         inputs=[("h", arr((2,), "float16")), ("bf", arr((5,), "bfloat16")), ("u8", arr((100,), "uint8"))],
         outputs=[("out", "bfloat16")], template=[["T", "dtype", "float16"], ["U", "bool", False]],
         source="out[0] = T(h[0]) + bf[0] + u8[0] + h_ndim + bf_shape[0];"),
    case("odd_name", name="my-kernel.v2", inputs=[("x", arr((8,)))],
         template=[["N", "int", -1]], source="out[0] = x[0];"),
]


def _random_cases(n: int, seed: int = 20240611) -> list[dict]:
    rng = random.Random(seed)
    dtypes = ["float32", "float16", "bfloat16", "int32", "uint32", "bool_", "int8", "uint64", "int64"]
    shapes = [(), (1,), (3,), (7,), (8,), (2, 4), (3, 3), (2, 2, 2), (16,), (0,), (1, 7)]
    cases = []
    for k in range(n):
        n_in = rng.randint(0, 4)
        names = [f"in{i}" for i in range(n_in)]
        inputs = []
        for nm in names:
            r = rng.random()
            if r < 0.15:
                inputs.append((nm, {"scalar": rng.choice([0.25, -3, True, 123456])}))
            else:
                inputs.append((nm, arr(rng.choice(shapes), rng.choice(dtypes))))
        outputs = [(f"out{j}", rng.choice(dtypes)) for j in range(rng.randint(1, 3))]
        lines = [f"{outputs[0][0]}[0] = 0;"]
        for nm in names:
            for suffix in ("_shape", "_strides", "_ndim"):
                if rng.random() < 0.3:
                    lines.append(f"// uses {nm}{suffix}")
        for attr, _ in sig.ATTRIBUTES:
            if rng.random() < 0.15:
                lines.append(f"auto v_{attr} = {attr};")
        rng.shuffle(lines)
        template = None
        if rng.random() < 0.6:
            template = []
            for t in range(rng.randint(1, 3)):
                kind = rng.choice(["bool", "int", "dtype"])
                val = {"bool": rng.choice([True, False]),
                       "int": rng.choice([0, 1, 32, -7, 1024]),
                       "dtype": rng.choice(dtypes)}[kind]
                template.append([f"P{t}", kind, val])
        header = rng.choice(["", "// helper\n", "#include <metal_stdlib>\nusing namespace metal;\n"])
        cases.append(case(f"random_{k:02d}", name=f"rk{k}", inputs=inputs, outputs=outputs,
                          source="\n  " + "\n  ".join(lines) + "\n", header=header,
                          template=template, atomic=rng.random() < 0.2))
    return cases


ALL_CASES = HAND_CASES + _random_cases(40)


# ---------------------------------------------------------------------------
# Running MLX
# ---------------------------------------------------------------------------

_RUNNER = textwrap.dedent(
    r'''
    import json, os, sys, tempfile
    import mlx.core as mx

    def emit(s):
        os.write(1, s.encode())

    cases = json.load(sys.stdin)
    tmp = tempfile.mkdtemp()
    for c in cases:
        k = mx.fast.metal_kernel(
            name=c["name"], input_names=[i[0] for i in c["inputs"]],
            output_names=[o[0] for o in c["outputs"]], source=c["source"],
            header=c["header"], atomic_outputs=c["atomic"])
        tmpl = None
        if c["template"] is not None:
            tmpl = [(n, getattr(mx, v) if kind == "dtype" else v)
                    for n, kind, v in c["template"]]
        arrays = [mx.zeros(i[1]["shape"], dtype=getattr(mx, i[1]["dtype"]))
                  for i in c["inputs"] if "shape" in i[1]]

        def f(*args):
            it = iter(args)
            ins = [next(it) if "shape" in i[1] else i[1]["scalar"] for i in c["inputs"]]
            return k(inputs=ins, template=tmpl, grid=(32, 1, 1), threadgroup=(32, 1, 1),
                     output_shapes=[(4,)] * len(c["outputs"]),
                     output_dtypes=[getattr(mx, o[1]) for o in c["outputs"]],
                     verbose=True)

        emit("@@CASE %s@@\n" % c["id"])
        try:
            mx.export_function(os.path.join(tmp, "k.mlxfn"), f, *arrays)
        except Exception as e:
            emit("@@ERROR %s: %s@@\n" % (type(e).__name__, str(e).replace("\n", " ")))
        emit("@@END %s@@\n" % c["id"])
    '''
)


@pytest.fixture(scope="module")
def mlx_outputs() -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(ALL_CASES),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        pytest.skip(f"MLX export tracing runner failed (rc={proc.returncode}): {proc.stderr[-500:]}")
    out = proc.stdout
    results = {}
    for c in ALL_CASES:
        start_tag, end_tag = f"@@CASE {c['id']}@@\n", f"@@END {c['id']}@@\n"
        a = out.index(start_tag) + len(start_tag)
        results[c["id"]] = out[a:out.index(end_tag, a)]
    if "Generated source code for" not in results[ALL_CASES[0]["id"]]:
        pytest.skip(
            "this MLX does not print metal_kernel source while export tracing: "
            + results[ALL_CASES[0]["id"]][:300]
        )
    return results


def _expected(c: dict) -> str:
    specs = []
    for nm, desc in c["inputs"]:
        if "shape" in desc:
            shape = desc["shape"]
            specs.append(sig.InputSpec(nm, getattr(mx, desc["dtype"]), len(shape), math.prod(shape)))
        else:
            specs.append(sig.InputSpec.from_value(nm, desc["scalar"]))
    tmpl = None
    if c["template"] is not None:
        tmpl = [(n, getattr(mx, v) if kind == "dtype" else v) for n, kind, v in c["template"]]
    gen = sig.generate(
        c["name"],
        [i[0] for i in c["inputs"]],
        [o[0] for o in c["outputs"]],
        c["source"],
        c["header"],
        specs,
        [getattr(mx, o[1]) for o in c["outputs"]],
        tmpl,
        c["atomic"],
    )
    return sig.format_verbose(c["name"], gen)


@pytest.mark.parametrize("c", ALL_CASES, ids=[c["id"] for c in ALL_CASES])
def test_golden_matches_mlx(c, mlx_outputs):
    got = mlx_outputs[c["id"]]
    assert not got.startswith("@@ERROR"), got
    assert _expected(c) == got


# ---------------------------------------------------------------------------
# Unit tests of the pure-Python pieces (no MLX tracing needed)
# ---------------------------------------------------------------------------


def test_dtype_type_names():
    expected = {
        mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t",
        mx.float64: "double", mx.complex64: "complex64_t", mx.bool_: "bool",
        mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
        mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    }
    for dt, name in expected.items():
        assert sig.dtype_type_name(dt) == name
    with pytest.raises(TypeError):
        sig.dtype_type_name("float32")


def test_template_string_and_hash():
    args = [("T", mx.float32), ("N", 16), ("B", True)]
    assert sig.template_string(args) == "<float, 16, 1>"
    assert sig.template_hash(args) == "_float_16_1"
    assert sig.template_hash("<float, -16, 1>") == "_float__16_1"
    assert sig.template_string([("B", False), ("I", 0)]) == "<0, 0>"
    assert sig.template_string(None) == "" and sig.template_hash([]) == ""


@pytest.mark.parametrize("bad", [1.5, "float", None, mx.array(1)])
def test_template_bad_type(bad):
    with pytest.raises(TypeError):
        sig.template_string([("X", bad)])


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1])
def test_template_int_range(bad):
    with pytest.raises(ValueError):
        sig.template_string([("X", bad)])


def test_kernel_name_and_detection():
    specs = [sig.InputSpec("inp", mx.float32, 2, 32), sig.InputSpec.from_value("n", 2.0),
             sig.InputSpec("small", mx.int32, 1, 3)]
    tmpl = [("T", mx.float32), ("N", 16), ("B", True)]
    assert (sig.kernel_name("myexp", tmpl, specs, [mx.float16])
            == "custom_kernel_myexp__float_16_1_float_floats_int32_tc_float16_t")
    assert sig.kernel_name("k", None, [], [mx.float32]) == "custom_kernel_k_float"
    assert sig.detect_shape_infos("a_shape x_ndim // a_strides", ["a", "x", "y"]) == [
        (True, True, False), (False, False, True), (False, False, False)]
    assert sig.detect_attributes("threads_per_grid; // grid_origin") == [
        ("grid_origin", "uint3"), ("threads_per_grid", "uint3")]


def test_generated_structure():
    specs = [sig.InputSpec("x", mx.float32, 2, 32), sig.InputSpec.from_value("s", 1.0)]
    body = "\n  out[0] = x[thread_position_in_grid.x] + x_shape[0] + s;\n"
    g = sig.generate("k", ["x", "s"], ["out"], body, "// h\n", specs, [mx.float16],
                     [("T", mx.float16), ("N", 4)], True)
    assert g.source[g.body_start:g.body_end] == body
    assert g.source[g.header_start:g.header_end] == "// h\n"
    assert g.source.splitlines(keepends=True)[g.body_line - 1].startswith(body.splitlines(True)[0])
    assert g.instantiation == g.name + "<float16_t, 4>"
    assert [(p.kind, p.ctype, p.name, p.index, p.buffer) for p in g.params] == [
        ("input", "const device float*", "x", 0, 0),
        ("shape", "const constant int*", "x_shape", 0, 1),
        ("input", "const constant float&", "s", 1, 2),
        ("output", "device atomic<float16_t>*", "out", 0, 3),
        ("attribute", "uint3", "thread_position_in_grid", 0, None),
    ]
    g0 = sig.generate("k", ["x"], ["out"], "out[0]=x[0];", "", [specs[0]], [mx.float32])
    assert g0.instantiation == g0.name == "custom_kernel_k_float_float"
    assert "template" not in g0.source


def test_generate_validation():
    spec = sig.InputSpec("x", mx.float32, 1, 8)
    with pytest.raises(ValueError):
        sig.generate("k", ["x"], [], "", "", [spec], [])
    with pytest.raises(ValueError):
        sig.generate("k", ["x", "y"], ["o"], "", "", [spec], [mx.float32])
    with pytest.raises(ValueError):
        sig.generate("k", ["y"], ["o"], "", "", [spec], [mx.float32])
