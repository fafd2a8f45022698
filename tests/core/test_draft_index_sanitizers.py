"""The native draft index and trie under sanitizers, without Python in the way.

``tests/native/upkeep_stress.cpp`` runs the same random operations on an
index pair whose upkeep runs on its own thread and on one that runs it
inline, passes every step's drafts through the tree kernels (plan, match,
book: their results checked against their bounds), and exits non-zero on
the first difference or violation. Built with
ThreadSanitizer it also fails on any data race between the caller, the
upkeep thread and draft_rows' drafting threads (a draft_rows that did not
wait for the upkeep is reported: checked by hand); built with
AddressSanitizer and UBSan, on any memory error or undefined behaviour.
``tests/native/trie_stress.cpp`` does the same for the native trie and
``tests/native/jacobi_stress.cpp`` for the native Jacobi table (one thread:
AddressSanitizer and UBSan).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = [REPO / "tests" / "native" / "upkeep_stress.cpp", REPO / "csrc" / "draft_index" / "draft_index.cpp",
           REPO / "csrc" / "draft_index" / "calibration.cpp", REPO / "csrc" / "draft_index" / "trees.cpp"]
SANITIZERS = {"thread": ["-fsanitize=thread"],
              "address,undefined": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]}


def _no_preload() -> dict[str, str]:
    """This environment without LD_PRELOAD: ASan must come first in a sanitized binary's library
    list, and an engine started earlier in this process may have put tcmalloc or OpenMP there."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def _build(tmp_path: Path, sanitizer: str) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "upkeep_stress"
    flags = ["-std=c++17", "-O1", "-g", "-pthread", *SANITIZERS[sanitizer], f"-I{REPO / 'csrc' / 'draft_index'}"]
    proc = subprocess.run([cxx, *flags, *map(str, SOURCES), "-o", str(exe)], capture_output=True, text=True)
    if proc.returncode != 0 and "cannot find" in proc.stderr and "san" in proc.stderr:
        pytest.skip(f"the {sanitizer} sanitizer runtime is not installed: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


# The default suite runs seed 1 under each sanitizer (2000 random steps);
# seed 2 is the same check on another stream of random operations (slow).
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_upkeep_thread_matches_inline_under_sanitizers(tmp_path, sanitizer, seed):
    exe = _build(tmp_path, sanitizer)
    proc = subprocess.run([str(exe), str(seed), "2000"], capture_output=True, text=True, timeout=300, env=_no_preload())
    if "unexpected memory mapping" in proc.stderr:  # the kernel's address layout, before any of our code runs
        pytest.skip(f"ThreadSanitizer cannot run on this kernel: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "Sanitizer" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stdout.startswith("ok: 2000 steps"), proc.stdout


def _run_single_threaded(tmp_path: Path, stress: str, core: str, steps: int) -> str:
    """``tests/native/<stress>.cpp`` with ``csrc/draft_index/<core>.cpp`` built under AddressSanitizer
    + UBSan and run for ``steps`` steps (seed 1): its output, once it passed with no report."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / stress
    sources = [REPO / "tests" / "native" / f"{stress}.cpp", REPO / "csrc" / "draft_index" / f"{core}.cpp"]
    flags = ["-std=c++17", "-O1", "-g", *SANITIZERS["address,undefined"], f"-I{REPO / 'csrc' / 'draft_index'}"]
    proc = subprocess.run([cxx, *flags, *map(str, sources), "-o", str(exe)], capture_output=True, text=True)
    if proc.returncode != 0 and "cannot find" in proc.stderr and "san" in proc.stderr:
        pytest.skip(f"the sanitizer runtime is not installed: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = subprocess.run([str(exe), "1", str(steps)], capture_output=True, text=True, timeout=300, env=_no_preload())
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "Sanitizer" not in run.stderr and "runtime error" not in run.stderr, run.stderr[-4000:]
    assert run.stdout.startswith(f"ok: {steps} steps"), run.stdout
    return run.stdout


def test_trie_under_address_and_undefined_sanitizers(tmp_path):
    """``tests/native/trie_stress.cpp``: random operations on the native trie
    (prunes reusing node slots all the time, context chains, merges,
    snapshot tables), every tree checked against its bounds."""
    assert " 0 prunes" not in _run_single_threaded(tmp_path, "trie_stress", "token_trie", 3000)


def test_jacobi_table_under_address_and_undefined_sanitizers(tmp_path):
    """``tests/native/jacobi_stress.cpp``: random steps on the native Jacobi table (windows
    opened, rewound and finished, pools filled past their caps, rows drafted, windows chosen and
    updated) for five window shapes, every answer checked against its bounds."""
    _run_single_threaded(tmp_path, "jacobi_stress", "jacobi", 2000)
