#!/usr/bin/env bash
# Set everything up, then run the default test suite (not slow, not gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest "$@"
