#!/usr/bin/env bash
# Wheels the GPU kit (../shared/gpu) lacks and vLLM 0.32's GPU engine imports: compressed-tensors
# (the model loader imports it for every model) and its loguru. Downloads them for the GPU machine
# (CPython 3.12, x86-64) into .whl/ (ignored by git); carry ".whl" in the run call that installs
# the kit (docs/gpu.md). Run from the checkout root on a machine with registry access.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .whl compressed-tensors==0.17.0 loguru==0.7.3
ls -l .whl
