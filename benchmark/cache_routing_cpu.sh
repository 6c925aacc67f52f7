#!/bin/bash
# Cache-aware vs round-robin routing on CPU (docs/performance.md, "Cache-aware routing (CPU)"):
# two scheduler instances of the demo model, the shared-prefix workload, one JSON line per run
# (lines alternate: round-robin, cache-aware, round-robin, ...).
# Usage: benchmark/cache_routing_cpu.sh OUT.jsonl [runs per policy, default 3]
set -euo pipefail
out=$1; runs=${2:-3}
# One torch thread per service: two schedulers' default thread pools on the same cores spin against each
# other and make every figure 5-10x slower and noisy.
export OMP_NUM_THREADS=1
for i in $(seq 1 "$runs"); do
  for policy in round-robin cache-aware; do
    port=$((18400 + RANDOM % 500))
    kubesgl up --schedulers 2 --port "$port" --base-port 0 --tokenizer-args "--routing-policy $policy" \
      --scheduler-args "--max-prefill-length 1024" >"/tmp/kubesgl-up-$policy.log" 2>&1 &
    up=$!
    for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break; sleep 1; done
    sleep 4  # the tokenizer hears every scheduler and snapshots their caches
    kubesgl bench serve --url "http://127.0.0.1:$port" --workload shared-prefix --temperature 0 \
      --groups 4 --conversations 4 --turns 4 --prefix-len 1024 --turn-input 64 --turn-output 16 \
      --max-concurrency 8 --json "$out"
    kill -INT "$up"; wait "$up" || true
  done
done
