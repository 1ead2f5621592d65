#!/usr/bin/env bash
# `moerl cluster` against a control plane that fails, on a redis-server of its own (no persistence):
#   1. an unreachable Redis at start: the cluster fails within seconds, starting no worker;
#   2. max_staleness: 0 holds exactly: staleness_max is 0 on every step;
#   3. FLUSHALL mid-run (a Redis restarted empty): the trainer says so, re-issues the tasks it
#      still needs and the run finishes; then a SIGKILLed trainer is restarted and resumes;
#   4. SIGTERM of the cluster mid-run exits 143, not 0 like a finished run.
#
#   tests/chaos/control_plane_test.sh PATH/TO/moerl tests/chaos   (skips without MOERL_TEST_REDIS_URL)
set -uo pipefail

source "$(dirname "$0")/common.sh" "$@"
source "$(dirname "$0")/../test_lib.sh"
new_tmp control-plane
cleanup() {
    [[ -n ${cluster:-} ]] && kill -9 "$cluster" 2>/dev/null
    [[ -n ${redis_pid:-} ]] && kill "$redis_pid" 2>/dev/null
    keep_or_remove_tmp
}
trap cleanup EXIT

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$tmp" >"$tmp/redis.log" 2>&1 &
redis_pid=$!
url=redis://127.0.0.1:$port
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done

# wait_log FILE TEXT SECONDS: FILE holds TEXT within SECONDS (while the cluster runs).
wait_log() {
    for _ in $(seq $(($3 * 10))); do
        grep -q -- "$2" "$1" && return 0
        kill -0 "$cluster" 2>/dev/null || break
        sleep 0.1
    done
    grep -q -- "$2" "$1"
}
# start NAME CONFIG: a cluster with one rollout worker on its own run id, in the background.
start() {
    "$moerl" cluster --redis "$url" --store "file://$tmp/$1-store" --out "$tmp/$1-out" --run-id "$1-$$" \
        --rollout-workers 1 --grace-s 3 --lease-timeout-ms 3000 "$2" >"$tmp/$1.log" 2>&1 &
    cluster=$!
}
finish() {  # finish SECONDS: waits for the cluster; sets rc
    for _ in $(seq $(($1 * 10))); do kill -0 "$cluster" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$cluster" 2>/dev/null && { fail "the cluster still runs after $1 s"; kill -9 "$cluster"; }
    wait "$cluster"
    rc=$?
    cluster=
}

# 1. Unreachable control plane.
t0=$SECONDS
"$moerl" cluster --redis redis://127.0.0.1:1 --store "file://$tmp/dead-store" --out "$tmp/dead-out" "$cfg" \
    >"$tmp/dead.log" 2>&1
rc=$?
((rc == 1)) || fail "cluster on a dead Redis exited with $rc; expected 1"
((SECONDS - t0 < 15)) || fail "cluster on a dead Redis took $((SECONDS - t0)) s to fail"
grep -q "the control plane does not answer, so no worker was started" "$tmp/dead.log" ||
    fail "dead Redis: $(tail -n 1 "$tmp/dead.log")"

# 2. Exact staleness bound.
sed 's/max_staleness: 1/max_staleness: 0/; s/steps: 90,/steps: 20,/' "$cfg" >"$tmp/onpolicy.yaml"
start onpolicy "$tmp/onpolicy.yaml"
finish 180
((rc == 0)) || fail "on-policy cluster exited with $rc"
python3 - "$tmp/onpolicy-out/metrics.jsonl" <<'PY' || fail "max_staleness 0 was not honoured"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
bad = [r["step"] for r in rows if r["staleness_max"] != 0]
print(f"on-policy: {len(rows)} steps, {len(bad)} with staleness_max > 0: {bad[:10]}")
sys.exit(0 if len(rows) == 20 and not bad else 1)
PY

# 3. FLUSHALL mid-run, then a SIGKILLed trainer. 150 steps: at 40 an idle machine had finished the
# run (13 steps a second) before the FLUSHALL reached Redis.
sed 's/steps: 90,/steps: 150,/; s/checkpoint_every: 0/checkpoint_every: 5/' "$cfg" >"$tmp/flush.yaml"
start flush "$tmp/flush.yaml"
wait_log "$tmp/flush.log" "step 6/" 120 || fail "flush: the trainer did not reach step 6"
redis-cli -p "$port" FLUSHALL >/dev/null
wait_log "$tmp/flush.log" "lost the run's data" 30 || fail "flush: the trainer did not notice the FLUSHALL"
wait_log "$tmp/flush.log" "step 20/" 120 || fail "flush: no progress after the FLUSHALL"
trainer=$(pgrep -f -P "$cluster" -- "--role train")
[[ -n $trainer ]] && kill -9 "$trainer"
wait_log "$tmp/flush.log" "restarting it (it resumes" 20 || fail "flush: the SIGKILLed trainer was not restarted"
finish 240
((rc == 0)) || fail "the flushed cluster exited with $rc"
rows=$(wc -l <"$tmp/flush-out/metrics.jsonl")
((rows == 150)) || fail "the flushed run's metrics.jsonl has $rows rows; expected 150"

# 4. SIGTERM mid-run.
sed 's/steps: 90,/steps: 100000,/' "$cfg" >"$tmp/long.yaml"
start term "$tmp/long.yaml"
wait_log "$tmp/term.log" "step 2/" 120 || fail "term: the trainer did not start training"
kill -TERM "$cluster"
finish 30
((rc == 143)) || fail "cluster stopped by SIGTERM exited with $rc; expected 143"
grep -q "stopped by SIGTERM before the run finished" "$tmp/term.log" || fail "term: $(tail -n 1 "$tmp/term.log")"

if ((failed)); then
    echo "control-plane test: FAILED"
    exit 1
fi
echo "control-plane test: PASSED"
