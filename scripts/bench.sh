#!/usr/bin/env bash
# The main job: the benchmark on a real workload with embedded defaults.
# First run creates .venv (a minute or two). Arguments go to contextpilot-bench, e.g.
#   scripts/bench.sh --workload mtrag --mode online --cache-tokens unlimited
#   scripts/bench.sh --engine vllm-cpu --workload multihop-rag   (after scripts/setup-vllm-env.sh)
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bench_extras=""
[[ " $* " == *" --retriever mem0 "* || " $* " == *" --retriever=mem0 "* ]] && bench_extras=mem0
# --engine vllm-cpu: the model's tokenizer and the KV-event link (the test bed's extra) run
# here; vLLM itself runs in its own environment (scripts/setup-vllm-env.sh, or --engine-python).
if [[ " $* " == *" --engine vllm-cpu "* || " $* " == *" --engine=vllm-cpu "* ]]; then
    bench_extras="${bench_extras:+$bench_extras,}testbed"
fi
if [[ " $* " == *" --workload agentic-"* || " $* " == *" --workload=agentic-"* ]]; then
    bench_extras="${bench_extras:+$bench_extras,}agents"
fi
bash "$repo_root/scripts/setup-venv.sh" "" "$bench_extras"
cd "$repo_root"
exec "$repo_root/.venv/bin/contextpilot-bench" "$@"
