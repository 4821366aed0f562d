#!/usr/bin/env bash
# Every test tier, as CI runs them. Creates the environments on first use:
#   .venv          this package with every extra (frameworks, service, embeddings, notebooks);
#   .venv-sglang   real SGLang 0.5.23 code on CPU torch, for the KV-event tier;
#   .venv-vllm     vLLM's CPU build, for the real-engine tier;
#   .venv-smg      the smg gateway (pinned), for the gateway tests and the two-replica tier.
# Usage: scripts/test.sh            all tiers
#        scripts/test.sh main       one tier (main | sglang | vllm)
# Exits non-zero if any tier fails or a tier runs no test (pytest's exit code 5).
set -uo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# The datasets: $CONTEXTPILOT_DATA_DIR when set (tests that need data skip without it).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MEM0_TELEMETRY=False
tiers=("${@:-main sglang vllm}")
read -r -a tiers <<< "${tiers[*]}"
failed=()

run_tier() {
    local name="$1"
    shift
    echo "=== tier: $name"
    local start=$SECONDS
    "$@"
    local rc=$?
    echo "=== tier $name: exit $rc after $((SECONDS - start)) s"
    if [[ $rc -ne 0 ]]; then
        echo "=== tier $name failed (exit $rc)"
        failed+=("$name")
    fi
}

main_tier() {
    bash scripts/setup-venv.sh all,dev testbed,mem0,hosted,agents || return 1
    bash scripts/setup-smg-env.sh || return 1
    .venv/bin/python -m ipykernel install --user --name contextpilot --display-name contextpilot \
        > /dev/null || return 1
    echo "--- ruff check, ruff format --check, mypy (both distributions), the import contracts"
    .venv/bin/ruff check . || return 1
    .venv/bin/ruff format --check . || return 1
    .venv/bin/mypy contextpilot_integrations || return 1
    .venv/bin/mypy benchmarks/contextpilot_bench || return 1
    .venv/bin/lint-imports || return 1
    .venv/bin/python -m pytest -m "not sglang and not vllm" --durations=15 "$@"
}

sglang_tier() {
    bash scripts/setup-sglang-env.sh || return 1
    .venv-sglang/bin/python -m pytest -m sglang --durations=5 tests/sync
}

vllm_tier() {
    bash scripts/setup-vllm-env.sh || return 1
    bash scripts/setup-smg-env.sh || return 1
    bash scripts/setup-venv.sh all,dev testbed,mem0,hosted,agents || return 1
    .venv/bin/python -m pytest -m vllm --durations=15 tests
}

for tier in "${tiers[@]}"; do
    case "$tier" in
        main) run_tier main main_tier ;;
        sglang) run_tier sglang sglang_tier ;;
        vllm) run_tier vllm vllm_tier ;;
        *) echo "unknown tier: $tier (main | sglang | vllm)"; exit 2 ;;
    esac
done

if [[ ${#failed[@]} -gt 0 ]]; then
    echo "FAILED tiers: ${failed[*]}"
    exit 1
fi
echo "all tiers passed: ${tiers[*]}"
