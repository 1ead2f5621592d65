#!/usr/bin/env bash
# `moerl cluster` takes its workers with it, and a run has one trainer:
#   1. SIGKILL of the supervisor: every worker it started exits within a few seconds (each asked
#      the kernel for SIGTERM when its parent dies) instead of living on under PID 1;
#   2. SIGHUP of the supervisor (a closed terminal): it stops its workers and exits;
#   3. a second trainer on the run id of a live one is refused, naming the run and the holder.
#
#   tests/chaos/cluster_test.sh PATH/TO/moerl tests/chaos     (needs MOERL_TEST_REDIS_URL set, else skips)
set -uo pipefail

source "$(dirname "$0")/common.sh" "$@"
source "$(dirname "$0")/../test_lib.sh"
new_tmp cluster
cleanup() {
    for pid in $(cat "$tmp"/*.pids 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    keep_or_remove_tmp
}
trap cleanup EXIT

# The chaos config with a run long enough to outlive every check here (90 steps can finish within
# the 10 s a second trainer waits for the lock on an idle machine); each cluster is stopped early.
long_cfg=$tmp/long.yaml
sed 's/steps: 90,/steps: 100000,/' "$cfg" >"$long_cfg"
grep -q 'steps: 100000,' "$long_cfg" || { echo "cluster test: cannot lengthen $cfg" >&2; exit 1; }

# start_cluster NAME: a cluster of trainer, env and one rollout worker on its own run id; sets
# $cluster and writes the workers' pids to $tmp/NAME.pids once the trainer trains.
start_cluster() {
    local name=$1
    "$moerl" cluster --redis "$MOERL_TEST_REDIS_URL" --store "file://$tmp/$name-store" --out "$tmp/$name-out" \
        --run-id "$name-$$" --rollout-workers 1 --grace-s 3 "$long_cfg" >"$tmp/$name.log" 2>&1 &
    cluster=$!
    for _ in $(seq 600); do
        grep -q "step 1/" "$tmp/$name.log" && break
        kill -0 "$cluster" 2>/dev/null || break
        sleep 0.1
    done
    grep -q "step 1/" "$tmp/$name.log" || { fail "$name: the trainer did not start training"; return 1; }
    pgrep -P "$cluster" >"$tmp/$name.pids"
    (($(wc -l <"$tmp/$name.pids") == 3)) || { fail "$name: expected 3 workers, found $(wc -l <"$tmp/$name.pids")"; return 1; }
}

# expect_gone NAME SECONDS: every worker of NAME has exited within SECONDS.
expect_gone() {
    local name=$1 limit=$2 alive
    for _ in $(seq $((limit * 10))); do
        alive=0
        for pid in $(cat "$tmp/$name.pids"); do kill -0 "$pid" 2>/dev/null && alive=$((alive + 1)); done
        ((alive == 0)) && return 0
        sleep 0.1
    done
    fail "$name: $alive of its workers still run ${limit}s after the supervisor went"
}

# 1 and 3: SIGKILL, after a second trainer was refused.
if start_cluster kill; then
    # The live trainer renews its lock: a second one on the same run id must be refused.
    "$moerl" worker --role train --redis "$MOERL_TEST_REDIS_URL" --store "file://$tmp/kill-store" \
        --out "$tmp/second-out" --run-id "kill-$$" "$long_cfg" >"$tmp/second.log" 2>&1
    rc=$?
    ((rc != 0)) || fail "a second trainer on a live run exited with 0"
    grep -q "run kill-$$ already has a trainer: train-" "$tmp/second.log" ||
        fail "the second trainer's error does not name the run and the holder: $(tail -n 1 "$tmp/second.log")"
    kill -9 "$cluster"
    wait "$cluster" 2>/dev/null
    expect_gone kill 10
fi

# 2: SIGHUP.
if start_cluster hup; then
    kill -HUP "$cluster"
    for _ in $(seq 100); do kill -0 "$cluster" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$cluster" 2>/dev/null && fail "hup: the supervisor still runs 10 s after SIGHUP"
    wait "$cluster" 2>/dev/null
    expect_gone hup 10
fi

if ((failed)); then
    echo "cluster test: FAILED"
    exit 1
fi
echo "cluster test: PASSED"
