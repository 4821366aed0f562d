#!/usr/bin/env bash
# Prepares the Shepherd Model Gateway environment (.venv-smg): the `smg` gateway from the package
# registry, pinned, used by the `vllm` test tier's two-replica test and by
# `contextpilot-bench --engine vllm-cpu --replicas N --router smg` (found there by default;
# elsewhere name the binary with CONTEXTPILOT_SMG or --smg-binary:
# benchmarks/contextpilot_bench/testbed/locations.py). smg is a Rust binary shipped in a wheel; it
# needs nothing else of this package, so the venv holds smg alone.
# Idempotent: a second run only checks the pinned version and that the binary answers.
#
# Facts and flags: docs/DESIGN.md, "The smg gateway".
# Environment: PYTHON (interpreter for the venv, default python3), SMG_VENV (default
# <repo>/.venv-smg).
set -euo pipefail

SMG_VERSION="1.13.0"

start_seconds=$(date +%s)
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SMG_VENV:-$repo_root/.venv-smg}"
python="${PYTHON:-python3}"

log() { echo "[setup-smg-env] $*"; }

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating $venv with $("$python" --version 2>&1)"
    "$python" -m venv "$venv"
fi
vpython="$venv/bin/python"

installed="$("$vpython" -c 'from importlib.metadata import PackageNotFoundError, version
try:
    print(version("smg"))
except PackageNotFoundError:
    pass')"
if [[ "$installed" != "$SMG_VERSION" ]]; then
    log "installing smg==$SMG_VERSION (found: '${installed:-none}')"
    "$vpython" -m pip install --quiet --disable-pip-version-check "smg==$SMG_VERSION"
fi

# The gateway must run here (a wheel for another platform shows up at this point).
if [[ ! -x "$venv/bin/smg" ]]; then
    echo "error: $venv/bin/smg is missing after installing smg==$SMG_VERSION" >&2
    exit 1
fi
"$venv/bin/smg" launch --help >/dev/null
elapsed=$(($(date +%s) - start_seconds))
log "ok: smg $SMG_VERSION at $venv/bin/smg, ready in ${elapsed} s ($(du -sh "$venv" | cut -f1))"
if [[ "$venv" != "$repo_root/.venv-smg" ]]; then
    log "point the benchmark and the vllm tests at it: export CONTEXTPILOT_SMG=$venv/bin/smg"
fi
