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

The default suite's four builds and runs (each a single-threaded compiler, then
a binary that keeps about one core busy) go two at a time, once per module
(``default_runs``); each test then checks its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NATIVE = REPO / "csrc" / "draft_index"
# The native sources each stress program is built with (beside tests/native/<stress>.cpp).
CORES = {"upkeep_stress": ["draft_index", "calibration", "trees"], "trie_stress": ["token_trie"],
         "jacobi_stress": ["jacobi"]}
SANITIZERS = {"thread": ["-fsanitize=thread"],
              "address,undefined": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]}


def _no_preload() -> dict[str, str]:
    """This environment without LD_PRELOAD: ASan must come first in a sanitized binary's library
    list, and an engine started earlier in this process may have put tcmalloc or OpenMP there."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


@dataclass
class StressRun:
    """One stress program built under one sanitizer and run for ``steps`` steps (seed ``seed``)."""

    stress: str
    sanitizer: str
    seed: int
    steps: int
    build: subprocess.CompletedProcess | None = None  # None: no C++ compiler
    run: subprocess.CompletedProcess | None = None  # None: the build failed (or none)

    def execute(self, out_dir: Path) -> StressRun:
        cxx = shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            return self
        exe = out_dir / f"{self.stress}-{self.sanitizer.replace(',', '-')}-{self.seed}"
        sources = [REPO / "tests" / "native" / f"{self.stress}.cpp", *(NATIVE / f"{c}.cpp" for c in CORES[self.stress])]
        threads = ["-pthread"] if self.stress == "upkeep_stress" else []  # the upkeep thread, draft threads
        flags = ["-std=c++17", "-O1", "-g", *threads, *SANITIZERS[self.sanitizer], f"-I{NATIVE}"]
        self.build = subprocess.run([cxx, *flags, *map(str, sources), "-o", str(exe)], capture_output=True, text=True)
        if self.build.returncode == 0:
            self.run = subprocess.run([str(exe), str(self.seed), str(self.steps)], capture_output=True, text=True,
                                      timeout=300, env=_no_preload())
        return self

    def checked(self) -> str:
        """The run's output, once it built, ran, passed and no sanitizer reported anything (skips
        where this machine lacks a compiler or the sanitizer's runtime)."""
        if self.build is None:
            pytest.skip("no C++ compiler")
        err = self.build.stderr
        if self.build.returncode != 0 and "cannot find" in err and "san" in err:
            pytest.skip(f"the {self.sanitizer} sanitizer runtime is not installed: {err.strip()[-200:]}")
        assert self.build.returncode == 0, err[-3000:]
        run = self.run
        if "unexpected memory mapping" in run.stderr:  # the kernel's address layout, before any of our code runs
            pytest.skip(f"ThreadSanitizer cannot run on this kernel: {run.stderr.strip()[-200:]}")
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        assert "Sanitizer" not in run.stderr and "runtime error" not in run.stderr, run.stderr[-4000:]
        assert run.stdout.startswith(f"ok: {self.steps} steps"), run.stdout
        return run.stdout


# The default suite's runs, longest first so that two workers finish together.
DEFAULT_RUNS = {
    ("upkeep_stress", "thread"): StressRun("upkeep_stress", "thread", seed=1, steps=2000),
    ("upkeep_stress", "address,undefined"): StressRun("upkeep_stress", "address,undefined", seed=1, steps=2000),
    ("trie_stress", "address,undefined"): StressRun("trie_stress", "address,undefined", seed=1, steps=3000),
    ("jacobi_stress", "address,undefined"): StressRun("jacobi_stress", "address,undefined", seed=1, steps=2000),
}


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory) -> dict[tuple[str, str], StressRun]:
    """Every run of DEFAULT_RUNS, built and run two at a time (this machine's two cores)."""
    out_dir = tmp_path_factory.mktemp("sanitizers")
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda r: StressRun(r.stress, r.sanitizer, r.seed, r.steps).execute(out_dir),
                             DEFAULT_RUNS.values()))
    return dict(zip(DEFAULT_RUNS, done))


# The default suite runs seed 1 under each sanitizer (2000 random steps);
# seed 2 is the same check on another stream of random operations (slow).
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_upkeep_thread_matches_inline_under_sanitizers(request, tmp_path, sanitizer, seed):
    if seed == 1:
        run = request.getfixturevalue("default_runs")[("upkeep_stress", sanitizer)]
    else:
        run = StressRun("upkeep_stress", sanitizer, seed, 2000).execute(tmp_path)
    run.checked()


def test_trie_under_address_and_undefined_sanitizers(default_runs):
    """``tests/native/trie_stress.cpp``: random operations on the native trie
    (prunes reusing node slots all the time, context chains, merges,
    snapshot tables), every tree checked against its bounds."""
    assert " 0 prunes" not in default_runs[("trie_stress", "address,undefined")].checked()


def test_jacobi_table_under_address_and_undefined_sanitizers(default_runs):
    """``tests/native/jacobi_stress.cpp``: random steps on the native Jacobi table (windows
    opened, rewound and finished, pools filled past their caps, rows drafted, windows chosen and
    updated) for five window shapes, every answer checked against its bounds."""
    default_runs[("jacobi_stress", "address,undefined")].checked()
