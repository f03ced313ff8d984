"""Test switch: ``pytest --backend emulate|metal|cuda|reference`` (default ``emulate``).

Kernel tests take the ``metal_kernel`` fixture (the kernel factory of the chosen
backend) or the ``kernel_backend`` fixture (ops run on the chosen backend). On a Mac
``pytest --backend metal`` runs the same tests against real Metal, on an NVIDIA GPU
``pytest --backend cuda`` runs them through ``mx.fast.cuda_kernel``; a backend that
cannot run here skips with the reason. Tests marked ``emulator_only`` check the
emulator's own bug detection and skip on other backends.
"""

from __future__ import annotations

import os

import pytest

from xlstm_kernels import runtime

import conftest_hypothesis  # noqa: E402,F401  (registers the hypothesis profiles before --hypothesis-profile is read)

BACKEND_CHOICES = ("emulate", "metal", "cuda", "reference")


def pytest_addoption(parser):
    parser.addoption(
        "--backend",
        default=os.environ.get("XLSTM_TEST_BACKEND", "emulate"),
        choices=BACKEND_CHOICES,
        help="backend the kernel tests run on (default: emulate, or $XLSTM_TEST_BACKEND)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "emulator_only: checks the emulator itself; skipped on other backends")


def pytest_report_header(config):
    return f"xlstm-kernels test backend: {config.getoption('--backend')}"


@pytest.fixture(scope="session")
def backend(request) -> str:
    name = request.config.getoption("--backend")
    ok, why = runtime.available(name)
    if not ok:
        pytest.skip(f"backend '{name}' is not available here: {why}")
    return name


@pytest.fixture(autouse=True)
def _emulator_only(request):
    if request.node.get_closest_marker("emulator_only") and request.config.getoption("--backend") != "emulate":
        pytest.skip("checks the emulator's own behaviour (run with --backend emulate)")


@pytest.fixture
def kernel_backend(backend):
    """Run the ops of the test on the selected backend."""
    with runtime.use_backend(backend):
        yield backend


@pytest.fixture
def metal_kernel(backend):
    """The ``metal_kernel`` factory of the selected backend (MLX's own on Metal, the
    ``mx.fast.cuda_kernel`` wrapper on CUDA)."""
    if backend == "metal":
        import mlx.core as mx

        return mx.fast.metal_kernel
    if backend == "emulate":
        from xlstm_kernels.emulate import metal_kernel as factory

        return factory
    if backend == "cuda":
        from xlstm_kernels.cuda import metal_kernel as factory

        return factory
    pytest.skip(f"backend '{backend}' runs no Metal kernels")
