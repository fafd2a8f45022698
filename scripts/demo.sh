#!/usr/bin/env bash
# Set everything up, then run the demo: plain vLLM vs vLLM ngram vs lookahead
# on HumanEval prompts with the bundled SmolLM2 (table on stdout + PNG plot).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" benchmarks/bench_offline.py --preset demo "$@"
