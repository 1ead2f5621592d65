#!/usr/bin/env bash
# Policies by broadcast (sync.transfer: broadcast) while rollout workers come and go: trainer, env
# and two rollout workers on the test Redis, every version broadcast from the trainer over Gloo on
# loopback. Once the second worker has a version by broadcast it gets SIGKILL; the trainer's next
# send fails on it, a new generation leaves it out, and a third worker started then asks to join
# and is sent the current version while the trainer waits. Then: the run finishes, no policy
# version went through the checkpoint store (only checkpoints are there), and every task was
# trained on exactly once.
#
#   tests/chaos/policy_broadcast_test.sh PATH/TO/moerl tests/chaos     (needs MOERL_TEST_REDIS_URL set, else skips)
set -uo pipefail

source "$(dirname "$0")/common.sh" "$@"
command -v redis-cli >/dev/null || { echo "policy broadcast chaos: redis-cli not found" >&2; exit 1; }
tmp=$(mktemp -d /tmp/moerl-broadcast.XXXXXX)
mkdir -p "$tmp/logs"
run_id=broadcast-$$
url=$MOERL_TEST_REDIS_URL
failed=0
trainer="" env_pid="" w1="" w2="" w3=""
fail() {
    echo "policy broadcast chaos: FAIL: $*" >&2
    failed=1
}
cleanup() {
    kill -9 $trainer $env_pid $w1 $w2 $w3 2>/dev/null
    wait 2>/dev/null
    ((failed)) || { rm -rf "$tmp"; return; }
    echo "---- logs (kept in $tmp) ----" >&2
    tail -n 25 "$tmp"/logs/*.log >&2
}
trap cleanup EXIT

run_cfg=$tmp/run.yaml
sed 's/steps: 90,/steps: 40,/' "$cfg" >"$run_cfg"
echo "sync: {transfer: broadcast, address: 127.0.0.1, port: 0, timeout_s: 30, join_timeout_s: 3}" >>"$run_cfg"
grep -q 'steps: 40,' "$run_cfg" || { echo "policy broadcast chaos: cannot write $run_cfg" >&2; exit 1; }

worker() {  # worker ROLE LOG [extra args]
    local role=$1 log=$2
    shift 2
    "$moerl" worker --role "$role" --redis "$url" --store "file://$tmp/store" --run-id "$run_id" --out "$tmp/out" \
        --lease-timeout-ms 1500 --grace-s 5 "$@" "$run_cfg" >>"$tmp/logs/$log.log" 2>&1 &
}

worker train train --audit "$tmp/audit.jsonl"
trainer=$!
worker env env
env_pid=$!
worker rollout w1 --worker-id "w1-$run_id"
w1=$!
worker rollout w2 --worker-id "w2-$run_id"
w2=$!
start_time=$SECONDS

# Both workers have a version by broadcast and the trainer trains; then SIGKILL the second.
for _ in $(seq 900); do
    grep -q "by broadcast" "$tmp/logs/w2.log" 2>/dev/null && grep -q "by broadcast" "$tmp/logs/w1.log" 2>/dev/null &&
        grep -q "step [3-9]/" "$tmp/logs/train.log" && break
    kill -0 "$trainer" 2>/dev/null || break
    sleep 0.1
done
grep -q "by broadcast" "$tmp/logs/w2.log" || { fail "the second worker never had a policy by broadcast"; exit 1; }
kill -9 "$w2"
wait "$w2" 2>/dev/null
w2=""
killed_at=$((SECONDS - start_time))
worker rollout w3 --worker-id "w3-$run_id"
w3=$!

while kill -0 "$trainer" 2>/dev/null; do
    ((SECONDS - start_time <= 200)) || { fail "the run did not finish within 200 s"; exit 1; }
    sleep 0.5
done
wait "$trainer"
trainer_rc=$?
trainer=""
((trainer_rc == 0)) || fail "trainer exited with $trainer_rc"
for pid in $env_pid $w1 $w3; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    wait "$pid" || fail "pid $pid exited with $? after the run finished"
done
env_pid="" w1="" w3=""

grep -q "policies go to the rollout workers by broadcast from broadcast://127.0.0.1:" "$tmp/logs/train.log" ||
    fail "the trainer did not say it broadcasts"
grep -q "broadcast to 2 rollout workers" "$tmp/logs/train.log" || fail "no broadcast reached both workers"
grep -Eq "leaves out w2-$run_id|w2-$run_id of generation [0-9]+ did not come" "$tmp/logs/train.log" ||
    fail "no generation left the killed worker out"
grep -q "by broadcast" "$tmp/logs/w3.log" || fail "the worker started later never had a policy by broadcast"
grep -q "pushed [1-9]" "$tmp/logs/w3.log" || fail "the worker started later pushed no experience"
policies=$(find "$tmp/store" -maxdepth 1 -name 'policy-v*' | wc -l)
((policies == 0)) || fail "$policies policy versions went through the store"
ls "$tmp/store" | grep -q '^ckpt-' || fail "no checkpoint in the store"

rcli() { redis-cli -u "${url%%\?*}" "$@"; }
prefix="moerl:{$run_id}"
python3 "$(dirname "$0")/trained_once.py" "policy broadcast chaos" "$tmp" "$run_cfg" \
    "$(rcli SMEMBERS "$prefix:experience:seen" | tr '\n' ' ')" "$(rcli XLEN "$prefix:experience")" || failed=1
((failed == 0)) || { echo "policy broadcast chaos: FAILED"; exit 1; }
echo "policy broadcast chaos: PASSED in $((SECONDS - start_time)) s (worker killed at ${killed_at} s)"
