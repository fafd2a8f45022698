"""Build the CPU emulation of csrc/ (see cuda_emu.h) and a loadable copy of the torch bindings.

* :func:`emulated_objects`: csrc/*.cu compiled as host C++ with cuda_emu.h force-included.
* :func:`kernels_library`: those objects as one shared library for ctypes.
* :func:`bindings_library`: torch_bindings.cpp compiled against the installed
  (CPU) torch, linked with the emulated launchers, libcudart and link-time
  stand-ins for libc10_cuda (c10_cuda_stubs.cpp), so ``torch.ops.load_library``
  can load it and run its ``TORCH_LIBRARY`` registration.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lookahead_vllm.ops import _build

EMU_DIR = Path(__file__).resolve().parent
EMU_HEADER = EMU_DIR / "cuda_emu.h"
C10_CUDA_STUBS = EMU_DIR / "c10_cuda_stubs.cpp"


def _run(command: list[str]) -> None:
    proc = subprocess.run(command, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}\n{proc.stderr[-4000:]}")


def emulated_objects(out_dir: Path) -> list[Path]:
    src, cuda_include = _build.csrc_dir(), _build.find_cuda_include()
    commands, objects = [], []
    for name in _build.CUDA_SOURCES:
        obj = out_dir / f"{Path(name).stem}.emu.o"
        commands.append([_build.host_cxx(), "-std=c++20", "-O2", "-fPIC", "-c", "-Wno-attributes",
                         "-include", str(EMU_HEADER), f"-I{src}", f"-I{cuda_include}", "-x", "c++",
                         str(src / name), "-o", str(obj)])
        objects.append(obj)
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(_run, commands))
    return objects


def kernels_library(out_dir: Path, objects: list[Path]) -> Path:
    path = out_dir / "libkernels_emu.so"
    _run([_build.host_cxx(), "-shared", *map(str, objects), "-o", str(path)])
    return path


def bindings_library(out_dir: Path, objects: list[Path]) -> Path:
    import torch

    includes = [f"-I{p}" for p in _build.bindings_include_paths(out_dir)]
    compile_ = [_build.host_cxx(), "-std=c++20", "-O0", "-fPIC", "-c", *includes]
    bind_obj, stub_obj = out_dir / "torch_bindings.o", out_dir / "c10_cuda_stubs.o"
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(_run, [[*compile_, str(_build.csrc_dir() / _build.BINDINGS_SOURCE), "-o", str(bind_obj)],
                             [*compile_, str(C10_CUDA_STUBS), "-o", str(stub_obj)]]))
    torch_lib = Path(torch.__file__).parent / "lib"
    cuda_lib = _build.find_cuda_include().parent / "lib64"
    path = out_dir / "liblookahead_bindings_cpu.so"
    _run([_build.host_cxx(), "-shared", str(bind_obj), str(stub_obj), *map(str, objects), f"-L{torch_lib}",
          "-ltorch", "-ltorch_cpu", "-lc10", f"-L{cuda_lib}", "-lcudart", f"-Wl,-rpath,{cuda_lib}",
          f"-Wl,-rpath,{torch_lib}", "-Wl,--no-undefined", "-o", str(path)])
    return path
