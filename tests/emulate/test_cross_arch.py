"""The fiber runtime on aarch64: cross-compiled and run under qemu-user.

Skipped unless `aarch64-linux-gnu-g++` and `qemu-aarch64` are installed (Debian:
`apt-get install g++-aarch64-linux-gnu qemu-user`). Builds one static program from
runtime.cpp, a kernel translation unit made by the emulator's own translator (simd_sum,
threadgroup memory, two barriers) and cross_arch_main.cpp, then checks its results
under every schedule and worker count.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

from xlstm_kernels.emulate import metal_kernel
from xlstm_kernels.emulate.compiler import csrc_dir
from xlstm_kernels.emulate.translate import translate

CXX = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64")

SOURCE = """
uint i = thread_position_in_grid.x;
threadgroup float part[32];
float v = simd_sum(inp[i]);
if (thread_index_in_simdgroup == 0) {
  part[simdgroup_index_in_threadgroup] = v;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float total = 0.0f;
for (uint s = 0; s < simdgroups_per_threadgroup; ++s) {
  total += part[s];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
out[i] = total;
"""


@pytest.mark.emulator_only
@pytest.mark.skipif(not (CXX and QEMU), reason="needs aarch64-linux-gnu-g++ and qemu-aarch64")
def test_runtime_on_aarch64(tmp_path: Path):
    kernel = metal_kernel(name="red", input_names=["inp"], output_names=["out"], source=SOURCE)
    (tmp_path / "kernel.cpp").write_text(translate(kernel.generate([mx.ones((256,))], [mx.float32]), "red").text)
    c = csrc_dir()
    exe = tmp_path / "t64"
    subprocess.run(
        [CXX, "-std=gnu++17", "-O1", "-pthread", "-static", "-Wno-attributes", "-fsigned-char",
         f"-I{c}", f"-I{c / 'msl'}", str(Path(__file__).with_name("cross_arch_main.cpp")),
         str(tmp_path / "kernel.cpp"), str(c / "runtime.cpp"), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    out = subprocess.run([QEMU, str(exe)], check=True, capture_output=True, text=True, timeout=120).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 6, out
    for line in lines:  # "sched S workers W rc RC bad BAD message"
        words = line.split()
        assert words[5] == "0" and words[7] == "0", line
