"""Builds the native drafting core, lookahead_vllm._draft_index (csrc/draft_index), and the CPU
verification attention, lookahead_vllm._cpu_attention (csrc/cpu_attention).

Everything else about the package lives in pyproject.toml; `pip install -e .`
compiles the extension (pybind11 comes from [build-system] requires).
"""

from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

draft_index = Pybind11Extension(
    "lookahead_vllm._draft_index",
    sorted(glob("csrc/draft_index/*.cpp")),
    include_dirs=["csrc/draft_index"],
    depends=sorted(glob("csrc/draft_index/*.h")),
    cxx_std=17,
    # No -ffast-math and no fused multiply-adds (GCC contracts a*b + c on aarch64): confidences and
    # the Jacobi yields must match the references bit for bit.
    extra_compile_args=["-O3", "-ffp-contract=off"],
)

# Vectorised per ISA inside the source (picked at run time); OpenMP resolves to the runtime torch loads.
cpu_attention = Pybind11Extension(
    "lookahead_vllm._cpu_attention",
    ["csrc/cpu_attention/verify_attention.cpp"],
    cxx_std=17,
    extra_compile_args=["-O3", "-fopenmp"],
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[draft_index, cpu_attention], cmdclass={"build_ext": build_ext})
