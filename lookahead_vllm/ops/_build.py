"""Build the CUDA kernels in ``csrc/``: :func:`load_extension` on GPU machines, :func:`compile_objects` (the
compile-only check) on any machine with nvcc; nothing runs at import (csrc/README.md, "Build")."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
CUDA_SOURCES = ("tree_attention.cu", "kv_compaction.cu")
BINDINGS_SOURCE = "torch_bindings.cpp"
EXTENSION_NAME = "lookahead_vllm_C"
CI_ARCHS = ("90a", "80")
NVCC_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC")
BUILD_DIR_ENV = "LOOKAHEAD_VLLM_KERNEL_DIR"

# The header torch's CMake generates for CUDA builds (CPU wheels lack it), and its text there.
_CUDA_CMAKE_MACROS_H = "c10/cuda/impl/cuda_cmake_macros.h"
_CUDA_CMAKE_MACROS = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"


@dataclass(frozen=True, slots=True)
class CompileResult:
    """One compiler invocation: what ran, how it ended, how long it took."""

    source: Path
    output: Path | None  # the object file (None for syntax-only checks)
    command: tuple[str, ...]
    returncode: int
    seconds: float
    log: str  # stdout + stderr

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def csrc_dir() -> Path:
    """The ``csrc/`` folder of this checkout; a clear error if absent (wheel install)."""
    if not (CSRC_DIR / CUDA_SOURCES[0]).is_file():
        raise FileNotFoundError(f"{CSRC_DIR} has no {CUDA_SOURCES[0]}: the kernels build from a source checkout "
                                "(pip install -e .), not from an installed wheel")
    return CSRC_DIR


def _cuda_roots() -> list[Path]:
    return [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ]


def find_nvcc() -> str | None:
    """nvcc from ``$CUDA_HOME``, ``PATH`` or ``/usr/local/cuda``; None if absent."""
    candidates = [str(root / "bin" / "nvcc") for root in _cuda_roots()]
    candidates += [shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def find_cuda_include() -> Path:
    """The CUDA toolkit's include folder (holding ``cuda_runtime_api.h``)."""
    nvcc = find_nvcc()  # may be a wrapper script: resolve it to the toolkit's bin/
    roots = [*_cuda_roots(), *([Path(nvcc).resolve().parents[1]] if nvcc else []), Path("/usr/local/cuda")]
    for root in roots:
        if (root / "include" / "cuda_runtime_api.h").is_file():
            return root / "include"
    raise FileNotFoundError(f"cuda_runtime_api.h not found under {', '.join(map(str, roots))}")


def gencode_flags(archs: tuple[str, ...]) -> list[str]:
    """``("90a", "80")`` -> ``-gencode arch=compute_90a,code=sm_90a ...``."""
    flags: list[str] = []
    for arch in archs:
        if not arch.rstrip("af").isdigit():
            raise ValueError(f"arch {arch!r} is not a CUDA compute capability like '80' or '90a'")
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return flags


def _run(source: Path, output: Path | None, command: list[str]) -> CompileResult:
    start = time.perf_counter()
    proc = subprocess.run(command, check=False, capture_output=True, text=True)
    return CompileResult(source, output, tuple(command), proc.returncode, time.perf_counter() - start,
                         proc.stdout + proc.stderr)


def compile_object(source: Path, out_dir: Path, archs: tuple[str, ...] = CI_ARCHS) -> CompileResult:
    """``nvcc -c`` one ``.cu`` file into ``out_dir/<name>.o``."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    output = Path(out_dir) / (Path(source).stem + ".o")
    command = [nvcc, "-c", *NVCC_FLAGS, *gencode_flags(archs), "-I", str(csrc_dir()), str(source), "-o", str(output)]
    return _run(Path(source), output, command)


def host_cxx() -> str:
    """The host C++ compiler: ``$CXX``, else Python's, else ``c++``."""
    return (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()[0]


def bindings_include_paths(work_dir: Path) -> list[str]:
    """Include folders for compiling the bindings with the installed torch; where it lacks
    :data:`_CUDA_CMAKE_MACROS_H` (CPU wheels), a copy is written under ``work_dir``."""
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), str(find_cuda_include()), str(csrc_dir())]
    if not any((Path(p) / _CUDA_CMAKE_MACROS_H).is_file() for p in includes):
        shim = Path(work_dir) / "include"
        (shim / _CUDA_CMAKE_MACROS_H).parent.mkdir(parents=True, exist_ok=True)
        (shim / _CUDA_CMAKE_MACROS_H).write_text(_CUDA_CMAKE_MACROS)
        includes.append(str(shim))
    return includes


def check_bindings_syntax(work_dir: Path) -> CompileResult:
    """``c++ -fsyntax-only`` of the torch bindings against the installed torch headers."""
    command = [host_cxx(), "-std=c++20", "-fsyntax-only", "-Wall",
               *(f"-I{p}" for p in bindings_include_paths(work_dir)), str(csrc_dir() / BINDINGS_SOURCE)]
    return _run(csrc_dir() / BINDINGS_SOURCE, None, command)


def compile_objects(out_dir: Path, archs: tuple[str, ...] = CI_ARCHS, jobs: int = 2,
                    bindings: bool = False) -> list[CompileResult]:
    """Compile every ``csrc/*.cu`` (and optionally syntax-check the bindings) in parallel."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(csrc_dir().glob("*.cu"))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(compile_object, s, out_dir, archs) for s in sources]
        if bindings:
            futures.append(pool.submit(check_bindings_syntax, out_dir))
        return [f.result() for f in futures]


def load_extension(verbose: bool = False) -> str:
    """JIT-build (or reuse) and load the extension, registering ``torch.ops.lookahead_vllm.*``; returns
    the library path. Needs a CUDA build of torch and nvcc; raises otherwise."""
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is a CPU build: the CUDA kernels cannot be built")
    src = csrc_dir()
    if build_dir := os.environ.get(BUILD_DIR_ENV):
        Path(build_dir).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    path = cpp_extension.load(
        name=EXTENSION_NAME, sources=[str(src / BINDINGS_SOURCE), *(str(src / s) for s in CUDA_SOURCES)],
        extra_include_paths=[str(src)], extra_cflags=["-O3"], extra_cuda_cflags=["-O3"],
        # The shared libstdc++ by file name: a static one crashed the first TORCH_CHECK (csrc/README.md).
        extra_ldflags=["-l:libstdc++.so.6"], build_directory=build_dir, is_python_module=False, verbose=verbose)
    logger.info("lookahead_vllm kernels loaded from %s in %.1f s", path, time.perf_counter() - start)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    """CLI ``lookahead-vllm-build-kernels``: build the extension, or ``--check`` compile-only."""
    parser = argparse.ArgumentParser(description="Build lookahead-vllm's CUDA kernels (csrc/).")
    parser.add_argument("--check", action="store_true",
                        help="compile-only: nvcc -c every .cu for --arch and syntax-check the bindings")
    parser.add_argument("--arch", nargs="+", default=list(CI_ARCHS), help="archs for --check (default: 90a 80)")
    parser.add_argument("--out", type=Path, default=None, help="object folder for --check (default: a temp dir)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.check:
        out = args.out or Path(tempfile.mkdtemp(prefix="lookahead_kernels_"))
        results = compile_objects(out, tuple(args.arch), bindings=True)
        for r in results:
            print(f"{'ok  ' if r.ok else 'FAIL'} {r.source.name:22s} {r.seconds:6.1f} s  {r.output or '(syntax only)'}")
            if not r.ok or args.verbose:
                print(r.log, file=sys.stderr)
        return 0 if all(r.ok for r in results) else 1
    try:
        print(load_extension(verbose=args.verbose))
    except Exception as exc:  # noqa: BLE001 - a CLI: report, don't trace
        print(f"kernel build failed: {exc}\n(compile-only check: lookahead-vllm-build-kernels --check)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
