"""How the cuda backend assembles a kernel's text and reuses its launch plans, checked
without a GPU (mx.fast.cuda_kernel is replaced by a recorder)."""

from __future__ import annotations

import os
import re

import mlx.core as mx
import numpy as np
import pytest

from xlstm_kernels.cuda import kernel as ck
from xlstm_kernels.runtime.sources import family_header, kernel_body

COPY = "const uint i = thread_position_in_grid.x;\nif (i < uint(n)) { y[i] = x[i]; }\n"


_TEXT_FILE = re.compile(r'#include "([^"]+)"\n')


def _expand(text: str) -> str:
    """A text that is one #include line of a kernel text file (text_files.as_include), after
    an optional comment line: the file's content; else the text itself."""
    comment, _, last = text.rpartition("\n#") if text.startswith("//") else ("", "", text)
    last = ("#" + last) if comment else last
    m = _TEXT_FILE.fullmatch(last)
    if m and os.path.basename(os.path.dirname(m.group(1))) == "cuda-text":
        with open(m.group(1)) as f:
            return f.read()
    return text


class _Recorder:
    """Stands in for mx.fast.cuda_kernel: records each object built (its texts as handed
    over, "passed_*", and as NVRTC reads them) and each launch."""

    def __init__(self):
        self.built: list[dict] = []
        self.launches: list[dict] = []

    def __call__(self, name, input_names, output_names, source, header, ensure_row_contiguous=True, **kw):
        self.built.append({"name": name, "source": _expand(source), "header": _expand(header),
                           "passed_source": source, "passed_header": header, "input_names": list(input_names),
                           "shared_memory": kw.get("shared_memory", 0)})

        def run(inputs, output_shapes, output_dtypes, grid, threadgroup, **kwargs):
            self.launches.append({"grid": grid, "threadgroup": threadgroup, "inputs": inputs})
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

        return run


@pytest.fixture
def recorder(monkeypatch, tmp_path):
    monkeypatch.setenv("XLSTM_KERNELS_CUDA_TEXT_DIR", str(tmp_path / "cuda-text"))
    rec = _Recorder()
    monkeypatch.setattr(mx.fast, "cuda_kernel", rec)
    return rec


def _kernel(family: str, name: str, inputs, outputs, atomic: bool = False) -> ck.CudaKernel:
    return ck.CudaKernel(name, inputs, outputs, kernel_body(family, name), family_header(family, name),
                         atomic_outputs=atomic)


def test_strip_comments_keeps_code_and_string_literals():
    text = 'int a = 1; // one\n/* block\n comment */ asm("mma.sync // not a comment");\n\n  char c = \'/\';\n'
    out = ck.strip_comments(text)
    assert "one" not in out and "block" not in out
    assert 'asm("mma.sync // not a comment");' in out and "char c = '/';" in out
    assert "\n\n" not in out and not out.startswith(" ")


def test_header_parts_follow_what_the_kernel_uses():
    norm = _kernel("norm", "layer_norm", ["x", "w", "b", "eps", "params"], ["y"]).cuda_header(256)
    gemm = _kernel("gemm", "gemm_simd", ["A", "B", "bias", "residual", "params"], ["C", "P"]).cuda_header(256)
    atomic = ck.CudaKernel("acc", ["x"], ["y"], "y[0] += x[0];", atomic_outputs=True).cuda_header(32)
    names = lambda h: {n for n, _ in ck.HEADER_PARTS if ck.header_part_text(n) in h}  # noqa: E731
    assert names(norm) == {"compat.h", "vector_io.h"}
    assert names(gemm) == {"compat.h", "vector_io.h", "simdgroup_matrix.h"}
    assert names(atomic) == {"compat.h", "vector_io.h", "atomics.h"}
    for h in (norm, gemm, atomic):
        assert h.startswith("#define XK_MAX_THREADS ")
        assert h.index("compat.h") < h.index("namespace mlx::core::cu {")


def test_included_parts_are_the_package_files_and_inline_mode_pastes_them(monkeypatch):
    for name, _ in ck.HEADER_PARTS:
        line = ck.header_part_text(name)
        m = re.fullmatch(r'#include "(.+)"\n', line)
        assert m, line
        assert os.path.isfile(m.group(1)) and m.group(1).endswith(os.sep + name)
    monkeypatch.setattr(ck, "INCLUDE_HEADERS", False)
    inline = ck.header_part_text("simdgroup_matrix.h")
    assert "#include" not in inline.split("\n", 1)[0] and "mma.sync" in inline
    assert "//" not in inline.replace('"//', "")  # comments stripped (string literals kept)
    assert len(ck.compat_header(stripped=True)) < len(ck.compat_header())


def test_named_header_sections_only_where_called():
    """A family's named header sections (``// @header <name>``) reach only the kernels whose
    body names them (after the family's @header), all of them without a kernel (RMSNorm's
    kernels, which test_small_kernel_text_per_launch holds under 16 KiB, skip LayerNorm's
    moments)."""
    from xlstm_kernels.runtime.sources import KernelSourceError, family_sections

    assert "@header xk_row_moments" in family_sections("norm")
    for kernel in ("rms_norm", "rms_norm_vjp", "norm_partials_sum"):
        assert "xk_row_moments" not in family_header("norm", kernel), kernel
    for kernel in ("layer_norm", "layer_norm_vjp"):
        hdr = family_header("norm", kernel)
        assert "inline void xk_row_moments" in hdr and hdr.index("xk_row_moments") > hdr.index("xk_row_sum2"), kernel
    assert "inline void xk_row_moments" in family_header("norm")
    with pytest.raises(KernelSourceError, match="no kernel '@header xk_row_moments'"):
        kernel_body("norm", "@header xk_row_moments")


def test_shared_named_sections_only_where_named():
    """metal_src/_warpgroup.metal's section (``// @header xk_tile_wg``) goes before the headers
    of the kernels whose text names xk_tile_wg: the GEMM family (its header calls it) and the
    tile prefill (its named copy section does), not norms or the other attention kernels."""
    wg = "inline int xk_tile_wg("
    assert wg in family_header("gemm", "gemm_simd") and wg in family_header("gemm", "gemv")
    hdr = family_header("attention", "attention_prefill_mma")
    assert wg in hdr and hdr.index(wg) < hdr.index("inline int xk_attn_tile_at")
    for family, kernel in (("norm", "rms_norm"), ("norm", "layer_norm_vjp"), ("attention", "attention_partial_mma"),
                           ("attention", "attention_prefill"), ("rope", "rope")):
        assert wg not in family_header(family, kernel), (family, kernel)
    assert wg in family_header("norm")  # without a kernel: every section


def _rms_launch(k, template_t=mx.float32):
    x = mx.array(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    k(inputs=[x, x[0], mx.array(1e-5), mx.array([4, 64, 1], dtype=mx.int32)], output_shapes=[(4, 64)],
      output_dtypes=[mx.float32], grid=(32, 4, 1), threadgroup=(32, 4, 1),
      template=[("T", template_t), ("HAS_W", True), ("N_READS", 4), ("ONE_SIMD", True)])


def test_small_kernel_text_per_launch(recorder):
    """MLX copies and hashes source + header on every launch (~0.28 us per KB on the H100
    host): each is handed over as one #include line of a file holding the text."""
    _rms_launch(_kernel("norm", "rms_norm", ["x", "w", "eps", "params"], ["y"]))
    (b,) = recorder.built
    assert len(b["passed_header"]) + len(b["passed_source"]) < 512
    assert b["passed_source"].startswith("#include ") and b["passed_header"].startswith("#include ")
    assert len(b["header"]) + len(b["source"]) < 16384  # the texts NVRTC reads
    assert "#line 1 \"rms_norm.metal\"" in b["source"] and "namespace mlx::core::cu {" in b["header"]


def test_kernel_text_files_are_named_by_content(recorder, monkeypatch):
    """Another text is another file (so another MLX module name); the same text, the same
    file; a file altered on disk is written again; inline mode pastes the texts."""
    _rms_launch(_kernel("norm", "rms_norm", ["x", "w", "eps", "params"], ["y"]))
    _rms_launch(_kernel("norm", "rms_norm", ["x", "w", "eps", "params"], ["y"]))
    _rms_launch(_kernel("norm", "rms_norm", ["x", "w", "eps", "params"], ["y"]), mx.float16)
    first, same, other = recorder.built
    assert first["passed_source"] == same["passed_source"] and first["passed_header"] == same["passed_header"]
    assert other["passed_source"] != first["passed_source"] and other["passed_header"] == first["passed_header"]
    path = _TEXT_FILE.fullmatch(first["passed_source"]).group(1)
    with open(path, "w") as f:
        f.write("garbage")
    _rms_launch(_kernel("norm", "rms_norm", ["x", "w", "eps", "params"], ["y"]))
    assert recorder.built[-1]["passed_source"] == first["passed_source"]
    assert recorder.built[-1]["source"] == first["source"]  # the file holds the text again
    monkeypatch.setattr(ck, "INCLUDE_HEADERS", False)
    _rms_launch(_kernel("norm", "rms_norm", ["x", "w", "eps", "params"], ["y"]))
    assert recorder.built[-1]["passed_source"] == first["source"]


def test_launch_plans_are_reused_per_signature(recorder):
    k = ck.CudaKernel("copy", ["x", "n"], ["y"], COPY)
    x = mx.array(np.random.default_rng(1).standard_normal(1000).astype(np.float32))
    n = mx.array(1000, dtype=mx.int32)

    def go(grid, tg, template):
        return k(inputs=[x, n], output_shapes=[(1000,)], output_dtypes=[mx.float32], grid=grid,
                 threadgroup=tg, template=template)

    go((1000, 1, 1), (256, 1, 1), [("T", mx.float32)])
    go([1000, 1, 1], [256, 1, 1], [("T", mx.float32)])  # lists hash like tuples
    assert len(recorder.built) == 1 and len(recorder.launches) == 2
    assert recorder.launches[0]["grid"] == (1024, 1, 1)  # rounded up to whole blocks
    assert recorder.launches[0]["inputs"][-1] is recorder.launches[1]["inputs"][-1]  # xk_grid made once
    go((1000, 1, 1), (256, 1, 1), [("T", mx.float16)])  # another template: another object
    go((1000, 1, 1), (256, 1, 1), [("FLAG", True)])
    go((1000, 1, 1), (256, 1, 1), [("FLAG", 1)])  # bool and int are different template values
    assert len(recorder.built) == 4
    assert "constexpr bool FLAG = true;" in recorder.built[2]["source"]
    assert "constexpr int FLAG = 1;" in recorder.built[3]["source"]
    go((2000, 1, 1), (256, 1, 1), [("T", mx.float32)])  # same object, new grid
    assert len(recorder.built) == 4 and recorder.launches[-1]["grid"] == (2048, 1, 1)


def test_min_blocks_template_becomes_the_launch_bounds_hint(recorder):
    """A template entry XK_MIN_BLOCKS = b compiles the kernel with
    __launch_bounds__(threads, b) (the header defines XK_LAUNCH_MIN_BLOCKS b; the body
    still sees the constant); absent, only the threads bound; out of range, a ValueError
    naming it. The RMSNorm plan asks for it on 16-bit FULL rows held in <= 64 bytes per
    thread, and never where a thread holds more (those spilled at 48 registers)."""
    k = ck.CudaKernel("copy", ["x", "n"], ["y"], COPY)
    x = mx.array(np.random.default_rng(2).standard_normal(256).astype(np.float32))

    def go(template):
        return k(inputs=[x, mx.array(256, dtype=mx.int32)], output_shapes=[(256,)], output_dtypes=[mx.float32],
                 grid=(256, 1, 1), threadgroup=(128, 1, 1), template=template)

    go([("T", mx.float32)])
    go([("T", mx.float32), ("XK_MIN_BLOCKS", 10)])
    plain, hinted = recorder.built
    assert "XK_LAUNCH_MIN_BLOCKS" not in plain["header"] and "#define XK_MAX_THREADS 128" in plain["header"]
    assert "#define XK_LAUNCH_MIN_BLOCKS 10\n" in hinted["header"]
    assert "constexpr int XK_MIN_BLOCKS = 10;" in hinted["source"]
    assert "__launch_bounds__(XK_MAX_THREADS, XK_LAUNCH_MIN_BLOCKS)" in ck.compat_header()
    for bad in (0, 33, True):
        with pytest.raises(ValueError, match="XK_MIN_BLOCKS"):
            go([("T", mx.float32), ("XK_MIN_BLOCKS", bad)])

    from xlstm_kernels.ops import norm as norm_mod

    def hint(rows, n, dtype):
        _, kw = norm_mod._plan("rms", mx.zeros((rows, n), dtype=dtype), mx.zeros((n,), dtype=dtype), None, 1e-5)
        return dict(kw["template"]).get("XK_MIN_BLOCKS")

    base = norm_mod.FORWARD_BASE_REGISTERS
    assert norm_mod._forward_registers(64) == -(-(base + 16) // 8) * 8
    assert hint(4, 4096, mx.bfloat16) == 65536 // (norm_mod._forward_registers(64) * 128)  # 32 per thread: 64 bytes
    assert hint(4, 8192, mx.bfloat16) == 65536 // (norm_mod._forward_registers(128) * 128)  # 64 per thread
    assert hint(4, 4096, mx.float32) == 65536 // (norm_mod._forward_registers(128) * 128)  # 32 per thread
    assert norm_mod._forward_registers(norm_mod.HINT_MAX_ROW_BYTES + 4) == 0  # no hint past the limit
    assert hint(4, 2 * 4097, mx.bfloat16) is None  # not a FULL row


def test_cluster_template_becomes_the_cluster_shape(recorder, monkeypatch):
    """A template entry XK_CLUSTER = C > 1 compiles the kernel with __cluster_dims__(C, 1, 1)
    (the header defines XK_CLUSTER_DIMS C, which also turns on compat.h's xk_cluster_sync /
    xk_cluster_peer); C = 1 adds nothing. Refused with a clear error: C outside 1..8, a grid
    whose threadgroups along x are not a multiple of C, a grid launched as linear blocks, a
    GPU before sm_90."""
    from xlstm_kernels.cuda import limits

    monkeypatch.setattr(limits, "_arch", ["sm_90"])
    k = ck.CudaKernel("copy", ["x", "n"], ["y"], COPY)
    x = mx.array(np.random.default_rng(3).standard_normal(512).astype(np.float32))

    def go(template, grid=(512, 1, 1)):
        return k(inputs=[x, mx.array(512, dtype=mx.int32)], output_shapes=[(512,)], output_dtypes=[mx.float32],
                 grid=grid, threadgroup=(128, 1, 1), template=template)

    go([("T", mx.float32), ("XK_CLUSTER", 1)])
    go([("T", mx.float32), ("XK_CLUSTER", 4)])
    plain, clustered = recorder.built
    assert "XK_CLUSTER_DIMS" not in plain["header"]
    assert "#define XK_CLUSTER_DIMS 4\n" in clustered["header"]
    assert "constexpr int XK_CLUSTER = 4;" in clustered["source"]
    text = ck.compat_header()
    assert "__cluster_dims__(XK_CLUSTER_DIMS, 1, 1)" in text and "barrier.cluster.arrive.release" in text
    assert "mapa.u64" in text
    for bad in (0, 9, True):
        with pytest.raises(ValueError, match="XK_CLUSTER"):
            go([("T", mx.float32), ("XK_CLUSTER", bad)])
    with pytest.raises(ValueError, match="XK_CLUSTER=4: the threadgroups along x \\(3"):
        go([("T", mx.float32), ("XK_CLUSTER", 4)], grid=(384, 1, 1))
    with pytest.raises(ck.CudaKernelError, match="3-D grid"):
        go([("T", mx.float32), ("XK_CLUSTER", 4)], grid=(512, 70000, 1))
    monkeypatch.setattr(limits, "_arch", ["sm_89"])
    with pytest.raises(ck.CudaKernelError, match="sm_90"):
        go([("T", mx.float32), ("XK_CLUSTER", 2)])


def test_bad_launches_still_raise_after_a_good_one(recorder):
    k = ck.CudaKernel("copy", ["x", "n"], ["y"], COPY)
    x = mx.zeros((8,))
    ok = dict(inputs=[x, mx.array(8)], output_shapes=[(8,)], output_dtypes=[mx.float32], grid=(8, 1, 1),
              threadgroup=(8, 1, 1))
    k(**ok)
    with pytest.raises(ValueError, match="threadgroup"):
        k(**{**ok, "threadgroup": (2048, 1, 1)})
    with pytest.raises(ValueError, match="threadgroup"):
        k(**{**ok, "threadgroup": (0, 1, 1)})
    with pytest.raises(ValueError, match="inputs"):
        k(**{**ok, "inputs": [x]})
    with pytest.raises(ValueError, match="template argument"):
        k(**ok, template=[("T", 1.5)])
    (y,) = k(**{**ok, "grid": (0, 1, 1)}, init_value=3.0)  # empty grid: nothing runs, init_value kept
    assert np.all(np.asarray(y) == 3.0) and len(recorder.launches) == 1


def test_prepared_launch_checks_once_and_reuses_the_plan(recorder):
    k = ck.CudaKernel("copy", ["x", "n"], ["y"], COPY)
    x = mx.array(np.random.default_rng(2).standard_normal(300).astype(np.float32))
    run = k.prepare(zero_d=[False, True], output_shapes=[(300,)], output_dtypes=[mx.float32], grid=(300, 1, 1),
                    threadgroup=(128, 1, 1), template=[("T", mx.float32)])
    run([x, mx.array(300)])
    run([x, mx.array(300)])
    assert len(recorder.built) == 1 and len(recorder.launches) == 2
    assert recorder.launches[0]["grid"] == (384, 1, 1) and recorder.launches[0]["threadgroup"] == (128, 1, 1)
    assert "const auto n = xk_s_n[0];" in recorder.built[0]["source"]  # the 0-d input became a value
    with pytest.raises(ValueError, match="inputs"):
        k.prepare(zero_d=[False], output_shapes=[(300,)], output_dtypes=[mx.float32], grid=(300, 1, 1),
                  threadgroup=(128, 1, 1))
    with pytest.raises(ValueError, match="Thread group size"):
        k.prepare(zero_d=[False, True], output_shapes=[(300,)], output_dtypes=[mx.float32], grid=(300, 1, 1),
                  threadgroup=(2048, 1, 1))


def test_exact_grids_skip_the_bounds_check_and_the_grid_load(recorder):
    body = ("const uint i = thread_position_in_grid.x + threads_per_grid.x * thread_position_in_grid.y;\n"
            "y[i] = x[i] + float(threadgroups_per_grid.x);\n")
    k = ck.CudaKernel("grid_probe", ["x"], ["y"], body)
    x = mx.zeros((4096,))
    for grid in ((256, 16, 1), (250, 16, 1)):  # a multiple of the threadgroup, then not
        k(inputs=[x], output_shapes=[(4096,)], output_dtypes=[mx.float32], grid=grid, threadgroup=(64, 4, 1))
    exact, ragged = (b["source"] for b in recorder.built)
    assert "return;" not in exact and "xk_grid[" not in exact
    assert "gridDim.x * blockDim.x" in exact and "uint3(gridDim.x, gridDim.y, gridDim.z)" in exact
    assert "return;" in ragged and "xk_grid[0]" in ragged
    # the exact grid's object takes no xk_grid input and its launches pass none
    assert recorder.built[0]["input_names"] == ["x"] and len(recorder.launches[0]["inputs"]) == 1
    assert recorder.built[1]["input_names"] == ["x", "xk_grid"] and len(recorder.launches[1]["inputs"]) == 2
    run = k.prepare(zero_d=[False], output_shapes=[(4096,)], output_dtypes=[mx.float32], grid=(256, 16, 1),
                    threadgroup=(64, 4, 1))
    run([x])
    assert len(recorder.launches[-1]["inputs"]) == 1 and len(recorder.built) == 2


def test_dynamic_shared_memory_per_launch_signature(recorder):
    """`shared_memory` reaches mx.fast.cuda_kernel (one object per size) and is checked."""
    k = ck.CudaKernel("copy", ["x", "n"], ["y"], COPY)
    x = mx.zeros((256,))
    ok = dict(inputs=[x, mx.array(256)], output_shapes=[(256,)], output_dtypes=[mx.float32], grid=(256, 1, 1),
              threadgroup=(256, 1, 1))
    k(**ok)
    k(**ok, shared_memory=81408)
    k(**ok, shared_memory=81408)
    run = k.prepare(zero_d=[False, True], output_shapes=[(256,)], output_dtypes=[mx.float32], grid=(256, 1, 1),
                    threadgroup=(256, 1, 1), shared_memory=1024)
    run([x, mx.array(256)])
    assert [b["shared_memory"] for b in recorder.built] == [0, 81408, 1024]
    for bad in (-1, 232448 + 16):
        with pytest.raises(ck.CudaKernelError, match="shared_memory"):
            k(**ok, shared_memory=bad)


def test_dynamic_shared_memory_within_this_gpu(recorder, monkeypatch):
    """A launch asking for more dynamic shared memory than this GPU's block may have (99 KiB
    on sm_89) is refused with the limit named, before MLX sees it."""
    from xlstm_kernels.cuda import limits

    monkeypatch.setattr(limits, "_arch", ["sm_89"])
    k = ck.CudaKernel("copy", ["x", "n"], ["y"], COPY)
    x = mx.zeros((256,))
    ok = dict(inputs=[x, mx.array(256)], output_shapes=[(256,)], output_dtypes=[mx.float32], grid=(256, 1, 1),
              threadgroup=(256, 1, 1))
    k(**ok, shared_memory=99 * 1024)
    with pytest.raises(ck.CudaKernelError, match=r"expected 0 to 101376 bytes .*sm_89"):
        k(**ok, shared_memory=99 * 1024 + 16)


def test_gemm_simd_takes_its_tiles_from_dynamic_shared_memory(recorder, monkeypatch):
    """On cuda, gemm_simd's stage buffer is the launch's dynamic shared memory: the op asks
    for exactly its STAGES x stage bytes (beyond CUDA's 48 KiB of static memory when a
    config's stages need it), and the body traps when given less."""
    import xlstm_kernels as xk
    from xlstm_kernels.ops import gemm as gemm_mod
    from xlstm_kernels.runtime import backends as backends_mod
    from xlstm_kernels.runtime import kernels as kernels_mod
    from xlstm_kernels.runtime import use_backend
    from xlstm_kernels.tiles import GemmConfig

    if backends_mod._cuda_available():
        pytest.skip("a real CUDA device: the GPU runs of test_gemm.py launch these")
    monkeypatch.setattr(backends_mod, "_cuda_available", lambda: True)

    def drop():
        for key in [key for key in kernels_mod._cache if key[0] == "cuda"]:
            kernels_mod._cache.pop(key, None)
        gemm_mod._CALLS.clear()
        gemm_mod._LAUNCHERS.clear()

    drop()
    body = kernel_body("gemm", "gemm_simd")
    assert "XK_THREADGROUP_DYNAMIC(TG_WORDS, vec<float, 4>)" in body
    assert "#define XK_THREADGROUP_DYNAMIC(count, ...)" in ck.compat_header() and "__trap()" in ck.compat_header()
    cases = [  # op, config, stages, bytes
        ("gemm_av", GemmConfig(path="simd", bm=128, bn=128, bk=16, wm=2, wn=4), 4, 4 * 2 * (128 * 24 + 16 * 136)),
        ("gemm_at_b", GemmConfig(path="simd", bm=128, bn=256, bk=32, wm=2, wn=4, stages=3), 3,
         3 * 2 * (32 * 136 + 32 * 264)),
        ("gemm_a_bt", GemmConfig(path="simd", bm=128, bn=256, bk=64, wm=2, wn=4, stages=3), 3,
         3 * 2 * (128 * 72 + 256 * 72)),
    ]
    try:
        with use_backend("cuda"):
            for op, cfg, stages, nbytes in cases:
                a = mx.zeros((512, 512), dtype=mx.float16)
                mx.eval(getattr(xk, op)(a, a, tiles=cfg))
                built = recorder.built[-1]
                assert "constexpr int STAGES = %d;" % stages in built["source"]
                assert built["shared_memory"] == nbytes == cfg.simd_threadgroup_bytes(
                    mx.float16, op == "gemm_at_b", op == "gemm_a_bt", "cuda")
            assert recorder.built[-1]["shared_memory"] > 48 * 1024
    finally:
        drop()


def test_grids_past_cudas_limits_launch_as_linear_blocks(recorder):
    """Threadgroups beyond 65535 along y / z, or more than 2**31 threads along x, launch as
    one linear index over blocks along x then y (MLX's grid counts threads in int32)."""
    k = _kernel("norm", "rms_norm", ["x", "w", "eps", "params"], ["y"])
    x = mx.zeros((4, 64))
    inputs = [x, x[0], mx.array(1e-5), mx.array([4, 64, 1], dtype=mx.int32)]
    tmpl = [("T", mx.float32), ("HAS_W", True), ("N_READS", 4), ("ONE_SIMD", False), ("FULL", 0), ("NF", 0),
            ("EPSB", 0), ("STAGED", False)]
    grid, tg = (128, 2 * 257, 65536), (128, 2, 1)  # 257 x 65536 threadgroups: z past 65535
    k(inputs=inputs, output_shapes=[(4, 64)], output_dtypes=[mx.float32], grid=grid, threadgroup=tg, template=tmpl)
    launched = recorder.launches[-1]
    total = 257 * 65536
    bx, by = launched["grid"][0] // 128, launched["grid"][1] // 2
    assert launched["grid"][2] == 1 and launched["threadgroup"] == (128, 2, 1)
    assert bx * 128 <= 2**31 - 1 and by > 1 and bx * by >= total and by == -(-total // bx)
    assert "blockIdx.x + gridDim.x * blockIdx.y" in recorder.built[-1]["source"]
    assert [int(v) for v in launched["inputs"][-1].tolist()] == [*grid, 1, 257, 65536]  # the true grid
    with pytest.raises(ck.CudaKernelError, match=r"needs .* threadgroups: more than CUDA can launch"):
        k(inputs=inputs, output_shapes=[(4, 64)], output_dtypes=[mx.float32], grid=(2**31, 65536, 65536),
          threadgroup=(1024, 1, 1), template=tmpl)


def test_linear_block_launch_runs_on_the_gpu(kernel_backend, monkeypatch):
    """The linear launch over blocks along x then y (forced here with small limits) computes
    what the native one does: RMSNorm of 37 rows, one threadgroup each, as 5 x 8 blocks."""
    if kernel_backend != "cuda":
        pytest.skip("runs the cuda backend's launch (the text and plan are checked above)")
    import xlstm_kernels as xk
    from xlstm_kernels.ops import norm as norm_mod

    rng = np.random.default_rng(11)
    x = mx.array(rng.standard_normal((37, 320)).astype(np.float32))
    w = mx.array(rng.standard_normal((320,)).astype(np.float32))
    want = np.asarray(x, dtype=np.float64)
    want = want / np.sqrt((want**2).mean(axis=1, keepdims=True) + 1e-5) * np.asarray(w, dtype=np.float64)
    _, kw = norm_mod._plan("rms", x, w, None, 1e-5)
    assert kw["grid"][1] == 37 and kw["threadgroup"][1] == 1  # one threadgroup row per x row
    monkeypatch.setattr(ck, "_MAX_GRID_YZ_BLOCKS", 8)  # 37 rows of threadgroups: past it
    monkeypatch.setattr(ck, "_MAX_GRID_X_THREADS", 5 * kw["threadgroup"][0])  # 5 blocks along x, 8 along y
    monkeypatch.setenv("XLSTM_KERNELS_REPLAY", "0")
    norm_mod._CALLS.clear()
    got = np.asarray(xk.rms_norm(x, w, 1e-5), dtype=np.float64)
    norm_mod._CALLS.clear()
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5


def test_shape_arguments_survive_the_include(recorder):
    """mx.fast.cuda_kernel passes x_shape / x_strides / x_ndim when those names occur in the
    source text it is given: the one-line text names those the body uses."""
    body = "const uint i = thread_position_in_grid.x;\nif (i < uint(inp_shape[0])) { y[i] = inp[i] + inp_ndim; }\n"
    k = ck.CudaKernel("shape_user", ["inp", "other"], ["y"], body)
    x = mx.array(np.arange(8, dtype=np.float32))
    k(inputs=[x, x], output_shapes=[(8,)], output_dtypes=[mx.float32], grid=(8, 1, 1), threadgroup=(8, 1, 1))
    (b,) = recorder.built
    first, rest = b["passed_source"].split("\n", 1)
    assert first.startswith("//") and set(first.split()[2:]) == {"inp_shape", "inp_ndim"}
    assert _TEXT_FILE.fullmatch(rest) and "inp_shape[0]" in b["source"]


def test_kernel_text_files_fall_back_to_the_text(monkeypatch, tmp_path):
    """No file can be made (a directory path through a plain file, a quote in the path):
    the text itself is handed over."""
    from xlstm_kernels.cuda import text_files

    text = "constexpr int A = 1;\n"
    (tmp_path / "plain").write_text("not a directory")
    monkeypatch.setenv(text_files.TEXT_DIR_ENV_VAR, str(tmp_path / "plain" / "sub"))
    assert text_files.as_include(text, "k.source") == text
    monkeypatch.setenv(text_files.TEXT_DIR_ENV_VAR, str(tmp_path / 'a"b'))
    assert text_files.as_include(text, "k.source") == text
    monkeypatch.setenv(text_files.TEXT_DIR_ENV_VAR, str(tmp_path / "ok"))
    line = text_files.as_include(text, "k/../source")
    path = _TEXT_FILE.fullmatch(line).group(1)
    assert os.path.dirname(path) == str(tmp_path / "ok") and open(path).read() == text
    assert os.stat(tmp_path / "ok").st_mode & 0o077 == 0  # the user's own directory
