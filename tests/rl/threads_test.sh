#!/usr/bin/env bash
# The same short run with and without OPENBLAS_NUM_THREADS gives the same metrics.jsonl rows (but
# for the timing fields), and a run started with the variable resumes without it exactly.
#   tests/rl/threads_test.sh PATH/TO/moerl
set -euo pipefail
moerl=$(realpath "$1")
tmp=$(mktemp -d /tmp/moerl-threads.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/run.yaml" <<'YAML'
run: {name: threads, seed: 3, steps: 12, checkpoint_every: 6}
model: {hidden_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 2, head_dim: 16, num_experts: 8, top_k: 2,
        moe_intermediate_size: 64}
task: {kind: sort, length: 3, max_value: 5, partial_credit: true}
rollout: {max_batch: 128}
train: {group_size: 8, prompts_per_step: 16, lr: 0.003}
ranks: {ep: 2}
YAML
strip() { python3 -c '
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    for timing in ("tokens_per_s", "step_seconds", "rollout_s", "reward_s", "sync_s", "train_s", "publish_s"):
        j.pop(timing)
    print(json.dumps(j, sort_keys=True))' "$1"; }
OPENBLAS_NUM_THREADS=1 "$moerl" run "$tmp/run.yaml" --out "$tmp/with" --quiet >/dev/null
env -u OPENBLAS_NUM_THREADS "$moerl" run "$tmp/run.yaml" --out "$tmp/without" --quiet >/dev/null
OPENBLAS_NUM_THREADS=1 "$moerl" run "$tmp/run.yaml" --out "$tmp/resumed" --steps 6 --quiet >/dev/null
env -u OPENBLAS_NUM_THREADS "$moerl" run "$tmp/run.yaml" --out "$tmp/resumed" --resume --quiet >/dev/null
strip "$tmp/with/metrics.jsonl" >"$tmp/with.txt"
strip "$tmp/without/metrics.jsonl" >"$tmp/without.txt"
strip "$tmp/resumed/metrics.jsonl" >"$tmp/resumed.txt"
[[ $(wc -l <"$tmp/with.txt") -eq 12 ]] || { echo "FAIL: $(wc -l <"$tmp/with.txt") rows; expected 12"; exit 1; }
diff "$tmp/with.txt" "$tmp/without.txt" >/dev/null ||
    { echo "FAIL: metrics differ with and without OPENBLAS_NUM_THREADS:"; diff "$tmp/with.txt" "$tmp/without.txt" | head -4; exit 1; }
diff "$tmp/with.txt" "$tmp/resumed.txt" >/dev/null ||
    { echo "FAIL: a run resumed without OPENBLAS_NUM_THREADS differs:"; diff "$tmp/with.txt" "$tmp/resumed.txt" | head -4; exit 1; }
echo "threads: PASSED (12 identical rows with and without OPENBLAS_NUM_THREADS, and across a resume)"
