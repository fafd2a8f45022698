"""Session fixtures for tests/ops: the compiled artefacts (nvcc objects, CPU emulation, bindings library).

The compilations take ~40 s of CPU. They start in background threads as soon
as collection knows which tests need them, and the tests that need them run
last, so on a 2-core machine the compilers overlap the pure-Python tests.
"""

from __future__ import annotations

import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

_COMPILE_MODULES = ("test_csrc_build", "test_kernels_emu")
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tests-ops-build")
_jobs: dict[str, Future] = {}
_work = Path(tempfile.mkdtemp(prefix="lookahead_ops_build_"))


def _emulation_skip_reason() -> str | None:
    from lookahead_vllm.ops import _build

    if shutil.which(_build.host_cxx()) is None:
        return f"no host C++ compiler ({_build.host_cxx()}) for the CPU emulation of csrc/"
    try:
        _build.find_cuda_include()
    except FileNotFoundError as exc:
        return f"CUDA headers (cuda_fp16.h, vector types) not found: {exc}"
    return None


def _start(name: str) -> Future:
    """Start (once) one background build: 'nvcc', 'emu' (objects + ctypes library) or 'bindings'."""
    if name not in _jobs:
        from lookahead_vllm.ops import _build
        from tests.ops.emu import build

        if name == "nvcc":
            (_work / "nvcc").mkdir(exist_ok=True)
            _jobs[name] = _pool.submit(_build.compile_objects, _work / "nvcc", _build.CI_ARCHS, 2)
        elif name == "emu":
            def emu():
                (_work / "emu").mkdir(exist_ok=True)
                objects = build.emulated_objects(_work / "emu")
                return objects, build.kernels_library(_work / "emu", objects)

            _jobs[name] = _pool.submit(emu)
        else:
            emu_job = _start("emu")
            _jobs[name] = _pool.submit(lambda: build.bindings_library(_work / "emu", emu_job.result()[0]))
    return _jobs[name]


def pytest_collection_modifyitems(config, items):
    # Compile-bound tests last (stable order otherwise), so their background builds overlap the rest.
    items.sort(key=lambda item: _module_name(item) in _COMPILE_MODULES)


def _module_name(item) -> str:
    module = getattr(item, "module", None)
    return module.__name__.rsplit(".", 1)[-1] if module is not None else ""


def pytest_collection_finish(session):
    from lookahead_vllm.ops import _build

    modules = {_module_name(item) for item in session.items}
    if "test_csrc_build" in modules and _build.find_nvcc() is not None:
        _start("nvcc")
    if _COMPILE_MODULES[1] in modules and _emulation_skip_reason() is None:
        _start("emu")
    if "test_csrc_build" in modules and _emulation_skip_reason() is None:
        _start("bindings")


def pytest_sessionfinish(session, exitstatus):
    _pool.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(_work, ignore_errors=True)


@pytest.fixture(scope="session")
def nvcc_results():
    """{source name: CompileResult} of ``nvcc -c`` for sm_90a + sm_80."""
    return {r.source.name: r for r in _start("nvcc").result()}


@pytest.fixture(scope="session")
def emu_kernels_path():
    """Path of the CPU-emulated csrc kernels + launchers (a shared library for ctypes)."""
    reason = _emulation_skip_reason()
    if reason:
        pytest.skip(reason)
    return _start("emu").result()[1]


@pytest.fixture(scope="session")
def bindings_library_path():
    """Path of torch_bindings.cpp linked for the CPU torch (see tests/ops/emu/build.py)."""
    reason = _emulation_skip_reason()
    if reason:
        pytest.skip(reason)
    return _start("bindings").result()
