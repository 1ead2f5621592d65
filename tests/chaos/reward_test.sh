#!/usr/bin/env bash
# Reward workers killed while a distributed run trains: trainer, env, one rollout and two reward
# worker processes (`moerl worker --role reward`, a random reward model from `moerl model init
# --reward`) on the test Redis; every 0.75 to 2.75 s a reward worker gets SIGKILL and a replacement starts.
# Then: every experience went through the scoring stage (acknowledged, or left open by a worker
# killed after its push) and into the buffer exactly once, and the trainer trained every step exactly once on exactly its
# tasks.
#
#   tests/chaos/reward_test.sh PATH/TO/moerl tests/chaos     (needs MOERL_TEST_REDIS_URL set, else skips)
set -uo pipefail

source "$(dirname "$0")/common.sh" "$@"
command -v redis-cli >/dev/null || { echo "reward chaos: redis-cli not found" >&2; exit 1; }
tmp=$(mktemp -d /tmp/moerl-reward.XXXXXX)
mkdir -p "$tmp/logs"
run_id=reward-$$
url=$MOERL_TEST_REDIS_URL
failed=0
declare -A reward  # pid -> log
trainer="" env_pid="" rollout_pid=""
fail() {
    echo "reward chaos: FAIL: $*" >&2
    failed=1
}
cleanup() {
    kill -9 "${!reward[@]}" $trainer $env_pid $rollout_pid 2>/dev/null
    wait 2>/dev/null
    ((failed)) || { rm -rf "$tmp"; return; }
    echo "---- logs (kept in $tmp) ----" >&2
    tail -n 15 "$tmp"/logs/*.log >&2
}
trap cleanup EXIT

# A small reward model over the built-in 18-token vocabulary, and the chaos run shortened to 48 steps
# (24 took 5 s on a fast machine: one kill only).
cat >"$tmp/rm.json" <<'EOF'
{"model_type": "qwen3_moe", "vocab_size": 18, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
 "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
 "max_position_embeddings": 64, "initializer_range": 0.2, "torch_dtype": "float32"}
EOF
"$moerl" model init --reward --config "$tmp/rm.json" --out "$tmp/rm" --pad-token-id 0 >"$tmp/logs/init.log" 2>&1 ||
    { fail "model init --reward failed"; exit 1; }
run_cfg=$tmp/run.yaml
sed 's/steps: 90,/steps: 48,/' "$cfg" >"$run_cfg"
echo "reward: {model_path: $tmp/rm, model_weight: 0.2, batch_size: 8}" >>"$run_cfg"
grep -q 'steps: 48,' "$run_cfg" || { echo "reward chaos: cannot shorten $cfg" >&2; exit 1; }

worker() {  # worker ROLE LOG [extra args]
    local role=$1 log=$2
    shift 2
    "$moerl" worker --role "$role" --redis "$url" --store "file://$tmp/store" --run-id "$run_id" --out "$tmp/out" \
        --lease-timeout-ms 1500 --grace-s 5 "$@" "$run_cfg" >>"$tmp/logs/$log.log" 2>&1 &
}
num_reward=0
start_reward() {
    num_reward=$((num_reward + 1))
    worker reward "reward-$num_reward" --worker-id "reward-$num_reward"
    reward[$!]=reward-$num_reward
}
rcli() { redis-cli -u "${url%%\?*}" "$@"; }
prefix="moerl:{$run_id}"
score="moerl:{$run_id/score}"
holds_leases() {  # holds_leases NAME: the worker has scoring-stage leases it did not acknowledge
    [[ -n $(rcli XPENDING "$score:tasks" workers - + 10 "$1" 2>/dev/null) ]]
}

worker train train --audit "$tmp/audit.jsonl"
trainer=$!
worker env env
env_pid=$!
worker rollout rollout
rollout_pid=$!
start_reward
start_reward

# SIGKILL, the case that must lose nothing (a SIGTERMed worker finishes or releases its batch;
# tests/rl covers that): every 0.75 to 2.75 s a reward worker goes, one caught holding leases within
# 2 s if there is one, else the oldest; a fresh one replaces it.
num_kill=0 num_holding=0
start_time=$SECONDS
while kill -0 "$trainer" 2>/dev/null; do
    ((SECONDS - start_time <= 200)) || { fail "the run did not finish within 200 s"; exit 1; }
    sleep 0.75
    victim=""
    for _ in $(seq 20); do
        for pid in "${!reward[@]}"; do holds_leases "${reward[$pid]}" && victim=$pid && break; done
        [[ -n $victim ]] && break
        sleep 0.1
    done
    kill -0 "$trainer" 2>/dev/null || break
    [[ -n $victim ]] && num_holding=$((num_holding + 1))
    oldest=${victim:-$(printf '%s\n' "${!reward[@]}" | sort -n | head -n 1)}
    kill -9 "$oldest" 2>/dev/null && num_kill=$((num_kill + 1))
    wait "$oldest" 2>/dev/null
    unset "reward[$oldest]"
    start_reward
done
wait "$trainer"
trainer_rc=$?
trainer=""
echo "reward chaos: trainer exited with $trainer_rc after $((SECONDS - start_time)) s; $num_kill reward workers killed, $num_holding of them holding leases"
((trainer_rc == 0)) || fail "trainer exited with $trainer_rc"
((num_kill >= 2)) || fail "only $num_kill reward workers were killed (run too short?)"
((num_holding >= 1)) || fail "no reward worker was killed while it held leases"
# The survivors see the run-done marker and exit 0 by themselves.
for pid in $env_pid $rollout_pid "${!reward[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    wait "$pid" || fail "pid $pid exited with $? after the run finished"
done
env_pid="" rollout_pid=""
reward=()
redone=$(cat "$tmp"/logs/reward-*.log | sed -n 's/.* redone \([0-9]*\) .*/\1/p' | awk '{s += $1} END {print s + 0}')
echo "reward chaos: the reward workers that saw the run end redid $redone leases of killed ones"

python3 "$(dirname "$0")/trained_once.py" "reward chaos" "$tmp" "$run_cfg" \
    "$(rcli SMEMBERS "$prefix:experience:seen" | tr '\n' ' ')" "$(rcli XLEN "$prefix:experience")" \
    "$(rcli SMEMBERS "$score:tasks:done" | tr '\n' ' ')" "$(rcli SMEMBERS "$score:tasks:open" | tr '\n' ' ')" || failed=1
((failed == 0)) || { echo "reward chaos: FAILED"; exit 1; }
echo "reward chaos: PASSED in $((SECONDS - start_time)) s"
