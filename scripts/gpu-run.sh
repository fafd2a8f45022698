#!/usr/bin/env bash
# One device call after the kit's parts went up (docs/gpu.md, "On the GPU machine"): put the parts
# back, install, then bench_gpu.py runs one after another, each under its own limit, every result
# under $OUT (at most 8 files come back: install.log plus JSON, PNG and log of two runs).
#
#   bash scripts/gpu-run.sh NAME:SECONDS:ARGS [NAME:SECONDS:ARGS ...]
#
# e.g. bash scripts/gpu-run.sh "graphs:200:--parts speed --variants chain chain-ragged" \
#        "full:200:--parts speed --variants chain --cudagraph-mode FULL"
# Each run gets --compile-backend eager, --budget-s SECONDS-15 and --out $OUT/NAME.json unless ARGS
# say otherwise. INSTALL_ARGS: extra install.sh arguments (e.g. --kernels, --skip-suffix).
set -uo pipefail
: "${OUT:?run this on the device machine, where \$OUT is the folder that comes back}"
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n '2,12p' "$0"; exit 2; }
mkdir -p .stage
[ -d /tmp/ks ] && cp -r /tmp/ks/p* .stage/ 2>/dev/null
last=$(ls -d .stage/p* 2>/dev/null | sort -V | tail -n 1)
[ -n "$last" ] && [ -f "$last/install.sh" ] || { echo "gpu-run: no kit part with install.sh under .stage/"; exit 1; }
start=$(date +%s)
# shellcheck disable=SC2086
bash "$last/install.sh" ${INSTALL_ARGS:-} >"$OUT/install.log" 2>&1 || { tail -n 20 "$OUT/install.log"; exit 1; }
echo "gpu-run: installed in $(( $(date +%s) - start )) s"
# shellcheck disable=SC1091
. /tmp/site/kit-env.sh
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
for spec in "$@"; do
    name=${spec%%:*}; rest=${spec#*:}; limit=${rest%%:*}; args=${rest#*:}
    case "$args" in *--budget-s*) ;; *) args="$args --budget-s $(( limit - 15 ))" ;; esac
    case "$args" in *--compile-backend*) ;; *) args="$args --compile-backend eager" ;; esac
    echo "gpu-run: $name ($limit s): bench_gpu.py $args"
    t0=$(date +%s)
    # INT first (the JSON is rewritten after every cell); KILL 30 s later: the fourth H200 run's
    # bench_gpu.py outlived its INT by minutes after an engine core failed to start
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 timeout -k 30 -s INT "$limit" python3 benchmarks/bench_gpu.py $args --out "$OUT/$name.json" \
        2>"$OUT/$name.log"
    echo "gpu-run: $name rc $? in $(( $(date +%s) - t0 )) s"
    pkill -9 -f "EngineCore|bench_gpu.py" 2>/dev/null; sleep 2  # orphaned engine cores hold GPU memory
    grep -E "^\[|MISMATCH|Error" "$OUT/$name.log" | tail -n 25
done
