"""csrc/ compiles on machines without a GPU: every .cu with nvcc for sm_90a + sm_80, the bindings syntax-only.

All compilations run once, in background threads started at collection
(tests/ops/conftest.py); the slowest, tree_attention.cu with 6 kernel
instantiations x 2 archs, takes ~10 s of CPU.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from lookahead_vllm.ops import _build

NVCC = _build.find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA_HOME, PATH, /usr/local/cuda/bin)")

# extern "C" launchers each object must define (the torch bindings link against them).
EXPORTS = {
    "tree_attention.cu": {"lookahead_tree_attention", "lookahead_tree_attention_workspace"},
    "kv_compaction.cu": {"lookahead_compact_kv"},
}


@pytest.fixture(scope="module")
def build(nvcc_results):  # compiled in the background (tests/ops/conftest.py)
    return nvcc_results


def test_every_cu_source_is_built(build):
    sources = {p.name for p in _build.csrc_dir().glob("*.cu")}
    assert sources == set(EXPORTS), "a new .cu file needs its exports listed here"
    assert sources <= set(build)


@pytest.mark.parametrize("source", sorted(EXPORTS))
def test_cu_compiles_for_sm90a_and_sm80(build, source):
    result = build[source]
    assert result.ok, f"{' '.join(result.command)}\n{result.log[-4000:]}"
    assert "arch=compute_90a,code=sm_90a" in result.command and "arch=compute_80,code=sm_80" in result.command
    assert result.output.stat().st_size > 0
    if shutil.which("nm") is None:
        pytest.skip("nm not found: cannot list the object's symbols")
    symbols = subprocess.run(["nm", "--defined-only", str(result.output)], check=False, capture_output=True,
                             text=True).stdout
    defined = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
    assert EXPORTS[source] <= defined, f"missing extern C launchers: {EXPORTS[source] - defined}"


def test_torch_bindings_build_load_and_register(bindings_library_path):
    """torch_bindings.cpp compiles against the installed torch, links, loads and registers both ops for CUDA.

    Linked with the emulated launchers and link-time stand-ins for libc10_cuda
    (absent from CPU wheels): loading runs TORCH_LIBRARY, which checks each C++
    signature against its schema. Running the ops needs CUDA tensors (GPU tests).
    """
    import torch

    torch.ops.load_library(str(bindings_library_path))
    schemas = {name: str(getattr(torch.ops.lookahead_vllm, name).default._schema)
               for name in ("tree_attention", "compact_kv")}
    assert "float scale, int max_query_len, int max_seq_len, Tensor(a!) out) -> ()" in schemas["tree_attention"]
    assert schemas["compact_kv"].startswith("lookahead_vllm::compact_kv(Tensor(a!)[] key_caches, Tensor(b!)[]")
    for name in schemas:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"lookahead_vllm::{name}", "CUDA")
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"lookahead_vllm::{name}", "CPU")


def test_compile_failure_is_reported(tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text("__global__ void k(float* x) { x[0] = undefined_name; }\n")
    result = _build.compile_object(bad, tmp_path, archs=("80",))
    assert not result.ok and "undefined_name" in result.log


def test_gencode_flags_validate_arch():
    assert _build.gencode_flags(("90a",)) == ["-gencode", "arch=compute_90a,code=sm_90a"]
    with pytest.raises(ValueError, match="sm_90"):
        _build.gencode_flags(("sm_90",))
