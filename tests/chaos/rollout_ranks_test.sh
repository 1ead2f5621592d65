#!/usr/bin/env bash
# A rollout engine over two processes (ranks.rollout: 2, each rank holding half the experts and its
# own sequences) killed while a distributed run trains: trainer, env, one plain rollout worker and
# the engine (`moerl launch -n 2 -- moerl worker --role rollout`) on the test Redis. Once the
# engine holds leases, its rank 1 gets SIGKILL; the launcher stops rank 0, the engine's tasks go
# back to the queue, and a new engine starts under the same worker id. Then: every task reached
# the buffer exactly once and the trainer trained every step exactly once on exactly its tasks.
#
#   tests/chaos/rollout_ranks_test.sh PATH/TO/moerl tests/chaos     (needs MOERL_TEST_REDIS_URL set, else skips)
set -uo pipefail

source "$(dirname "$0")/common.sh" "$@"
command -v redis-cli >/dev/null || { echo "rollout ranks chaos: redis-cli not found" >&2; exit 1; }
tmp=$(mktemp -d /tmp/moerl-rollout-ranks.XXXXXX)
mkdir -p "$tmp/logs"
run_id=rollout-ranks-$$
url=$MOERL_TEST_REDIS_URL
failed=0
trainer="" env_pid="" plain="" engine=""
fail() {
    echo "rollout ranks chaos: FAIL: $*" >&2
    failed=1
}
cleanup() {
    kill -9 $trainer $env_pid $plain $engine 2>/dev/null
    pkill -9 -f "worker-id engine-$run_id" 2>/dev/null
    wait 2>/dev/null
    ((failed)) || { rm -rf "$tmp"; return; }
    echo "---- logs (kept in $tmp) ----" >&2
    tail -n 15 "$tmp"/logs/*.log >&2
}
trap cleanup EXIT

run_cfg=$tmp/run.yaml
sed 's/steps: 90,/steps: 60,/; s/^ranks: {ep: 2}$/ranks: {ep: 2, rollout: 2}/; s/max_batch: 128/max_batch: 32/' "$cfg" >"$run_cfg"
grep -q 'rollout: 2}' "$run_cfg" || { echo "rollout ranks chaos: cannot write $run_cfg" >&2; exit 1; }
plain_cfg=$tmp/plain.yaml  # the same run; a plain worker holds every expert (and fewer sequences)
sed "s/ranks: {ep: 2, rollout: 2}/ranks: {ep: 2}/; s/max_batch: 32/max_batch: 8/" "$run_cfg" >"$plain_cfg"

worker() {  # worker ROLE LOG CONFIG [extra args]
    local role=$1 log=$2 config=$3
    shift 3
    "$moerl" worker --role "$role" --redis "$url" --store "file://$tmp/store" --run-id "$run_id" --out "$tmp/out" \
        --lease-timeout-ms 1500 --grace-s 5 "$@" "$config" >>"$tmp/logs/$log.log" 2>&1 &
}
start_engine() {  # the engine's ranks under the local launcher, as `moerl cluster` starts them
    "$moerl" launch -n 2 --grace 5 -- "$moerl" worker --role rollout --redis "$url" --store "file://$tmp/store" \
        --run-id "$run_id" --out "$tmp/out" --lease-timeout-ms 1500 --grace-s 5 --worker-id "engine-$run_id" \
        "$run_cfg" >>"$tmp/logs/engine.log" 2>&1 &
    engine=$!
}
rcli() { redis-cli -u "${url%%\?*}" "$@"; }
prefix="moerl:{$run_id}"
engine_holds_leases() {  # the engine has leases it did not acknowledge
    rcli XPENDING "$prefix:tasks" workers - + 10 "engine-$run_id" 2>/dev/null | grep -q "engine-$run_id"
}

worker train train "$run_cfg" --audit "$tmp/audit.jsonl"
trainer=$!
worker env env "$run_cfg"
env_pid=$!
worker rollout plain "$plain_cfg" --worker-id "plain-$run_id"
plain=$!
start_engine
start_time=$SECONDS

# Wait until the engine holds leases (it generates), then SIGKILL its rank 1; the launcher stops rank
# 0, which gives the engine's leases back; a supervisor starts the engine again. Between the look
# at the leases and the kill the engine may finish its batch and hold none: then nothing went back,
# and the kill is tried again (at most 3 times) while the run lasts.
for attempt in 1 2 3; do
    held=0  # what the loop saw decides: asking again could find the engine between two batches
    for _ in $(seq 600); do
        engine_holds_leases && { held=1; break; }
        kill -0 "$trainer" 2>/dev/null || break
        sleep 0.05
    done
    ((held)) || { fail "the engine never held a lease (attempt $attempt)"; exit 1; }
    victim=""
    for p in $(pgrep -P "$engine"); do
        tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=1" && victim=$p
    done
    [[ -n $victim ]] || { fail "no rank 1 under the engine's launcher"; exit 1; }
    logged=$(wc -l <"$tmp/logs/engine.log")
    kill -9 "$victim"
    killed_at=$((SECONDS - start_time))
    wait "$engine"
    engine_rc=$?
    ((engine_rc != 0)) || fail "the engine's launcher exited 0 after its rank 1 was killed"
    # Its leases come back (rank 0 gives them back).
    for _ in $(seq 200); do engine_holds_leases || break; sleep 0.1; done
    engine_holds_leases && fail "the dead engine still holds leases"
    echo "rollout ranks chaos: rank 1 killed at ${killed_at} s; the engine exited with $engine_rc after $((SECONDS - start_time - killed_at)) s"
    start_engine  # what a supervisor does
    tail -n "+$((logged + 1))" "$tmp/logs/engine.log" | grep -qE "went back to the queue|terminated: .* released [1-9]" &&
        break
    echo "rollout ranks chaos: the engine held no lease when its rank 1 died; again"
done

while kill -0 "$trainer" 2>/dev/null; do
    ((SECONDS - start_time <= 200)) || { fail "the run did not finish within 200 s"; exit 1; }
    sleep 0.5
done
wait "$trainer"
trainer_rc=$?
trainer=""
((trainer_rc == 0)) || fail "trainer exited with $trainer_rc"
for pid in $env_pid $plain $engine; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    wait "$pid" || fail "pid $pid exited with $? after the run finished"
done
env_pid="" plain="" engine=""
grep -q "rollout engine rank 1 of 2" "$tmp/logs/engine.log" || fail "no rank 1 in the engine's log"
# Rank 0 gave the engine's tasks back: it saw rank 1 go (the host transport checks its peers'
# processes) and said so, or the launcher's SIGTERM came first and it released them on the way out.
if grep -q "went back to the queue" "$tmp/logs/engine.log"; then
    grep -q "rank 1 (pid [0-9]*) has exited" "$tmp/logs/engine.log" || fail "rank 0 did not name the dead rank 1"
else
    grep -q "terminated: .* released [1-9]" "$tmp/logs/engine.log" || fail "rank 0 did not give the engine's tasks back"
fi
grep -q "pushed [1-9]" "$tmp/logs/engine.log" || fail "the restarted engine pushed no experience"

python3 "$(dirname "$0")/trained_once.py" "rollout ranks chaos" "$tmp" "$run_cfg" \
    "$(rcli SMEMBERS "$prefix:experience:seen" | tr '\n' ' ')" "$(rcli XLEN "$prefix:experience")" || failed=1
((failed == 0)) || { echo "rollout ranks chaos: FAILED"; exit 1; }
echo "rollout ranks chaos: PASSED in $((SECONDS - start_time)) s"
