#!/usr/bin/env bash
# Set everything up, then run the default test suite (not slow, not gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The native drafting core is built by setup (pip install -e .): its tests
# must run, not skip, here.
export LOOKAHEAD_VLLM_REQUIRE_NATIVE=1
exec "${PYTHON:-python3}" -m pytest "$@"
