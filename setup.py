"""Builds the native drafting core, lookahead_vllm._draft_index (csrc/draft_index).

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

setup(ext_modules=[draft_index], cmdclass={"build_ext": build_ext})
