"""Session fixtures for tests/ops: the CPU emulation of csrc/ is built once and shared."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def emu_objects(tmp_path_factory):
    from lookahead_vllm.ops import _build
    from tests.ops.emu import build

    if shutil.which(_build.host_cxx()) is None:
        pytest.skip(f"no host C++ compiler ({_build.host_cxx()}) for the CPU emulation of csrc/")
    try:
        _build.find_cuda_include()
    except FileNotFoundError as exc:
        pytest.skip(f"CUDA headers (cuda_fp16.h, vector types) not found: {exc}")
    out = tmp_path_factory.mktemp("emu")
    return out, build.emulated_objects(out)
