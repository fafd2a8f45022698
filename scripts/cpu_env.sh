#!/usr/bin/env bash
# CPU performance setup from vLLM's CPU install guide: preload tcmalloc and
# Intel OpenMP (libiomp5) into vLLM processes (lookahead_vllm/cpu_preload.py
# finds them and holds the measurement: a median 1.13x tokens/s here).
#
#   bash scripts/cpu_env.sh                 print the LD_PRELOAD it would set (empty line: neither found)
#   bash scripts/cpu_env.sh --install       install them (Debian libtcmalloc-minimal4, PyPI intel-openmp)
#   bash scripts/cpu_env.sh CMD [ARGS...]   run CMD with that LD_PRELOAD (unless LOOKAHEAD_CPU_PRELOAD=0)
#   source scripts/cpu_env.sh               export it into this shell (unless LOOKAHEAD_CPU_PRELOAD=0)
#
# On by default; LOOKAHEAD_CPU_PRELOAD=0 turns it off. Libraries not found
# are skipped, never an error.
PY="${PYTHON:-python3}"

lookahead_cpu_preload() {
    "$PY" -m lookahead_vllm.cpu_preload 2>/dev/null || true
}

lookahead_cpu_env() {
    [ "${LOOKAHEAD_CPU_PRELOAD:-1}" = 0 ] && return 0
    local preload
    preload="$(lookahead_cpu_preload)"
    [ -n "$preload" ] && export LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}"
    return 0
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then  # sourced
    lookahead_cpu_env
    return 0
fi

set -euo pipefail
case "${1:-}" in
    "" | --print)
        lookahead_cpu_preload ;;
    --install)
        if [ -n "$(lookahead_cpu_preload | tr ':' '\n' | grep tcmalloc)" ]; then
            :  # already there
        elif command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4 >/dev/null ||
                echo "cpu_env: apt-get could not install libtcmalloc-minimal4; going on without tcmalloc" >&2
        else
            echo "cpu_env: install libtcmalloc-minimal4 (Debian/Ubuntu) as root to get tcmalloc" >&2
        fi
        PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --disable-pip-version-check -q intel-openmp
        lookahead_cpu_preload ;;
    -h | --help)
        sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' ;;
    *)
        lookahead_cpu_env
        exec "$@" ;;
esac
