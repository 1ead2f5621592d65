#!/usr/bin/env bash
# Chaos test of distributed mode: trainer, env and 3 rollout worker processes (`moerl worker`) on a
# redis-server this test starts with append-only persistence (fsync always) and a file:// store.
#   - every ~2.5 s a random rollout worker gets SIGKILL or SIGTERM (alternating); a replacement
#     starts at once, so 3 stay up; SIGTERMed workers must exit 0 within their grace period
#   - once the trainer passed step 15: SIGKILL it and start it again; it must resume (first_step > 0)
#   - once it passed step 30: SIGKILL redis-server and start it again on the same append-only file
# Then it checks: every task of the run completed (acknowledged) and its experience was pushed
# exactly once; the durable training history (audit log, with the steps a restarted trainer rolled
# back dropped) trains every step exactly once on exactly its tasks; the final checkpoint's consumed
# set is exactly the run's tasks; some tasks were redone (attempt > 0); and the reward rises:
# mean of the last 10 steps >= 0.45 and >= mean of the first 10 + 0.25 (undisturbed local runs of
# this config: ~0.07 -> ~0.7 in 80 steps; here 0.50..0.65 after 70 steps in three runs).
#
#   tests/chaos/chaos_test.sh PATH/TO/moerl tests/chaos     (needs MOERL_TEST_REDIS_URL set, else skips)
set -uo pipefail

source "$(dirname "$0")/common.sh" "$@"
for tool in redis-server redis-cli python3; do
    command -v $tool >/dev/null || { echo "chaos: $tool not found" >&2; exit 1; }
done

tmp=$(mktemp -d /tmp/moerl-chaos.XXXXXX)
mkdir -p "$tmp/redis" "$tmp/logs"
run_id=chaos-$$
store=file://$tmp/store
lease_ms=2000
grace_s=5
limit_s=${MOERL_CHAOS_LIMIT_S:-200}
start_time=$SECONDS
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url="redis://127.0.0.1:$port/0?retry_ms=60000"  # workers outlive the Redis restart
rcli() { redis-cli -h 127.0.0.1 -p "$port" "$@"; }

declare -A rollout  # pid -> log
declare -a stopped  # SIGTERMed rollout pids, checked for exit 0
trainer=""
env_pid=""
failed=0

fail() {
    echo "chaos: FAIL: $*" >&2
    failed=1
}

start_redis() {
    redis-server --port "$port" --bind 127.0.0.1 --appendonly yes --appendfsync always --save '' \
        --dir "$tmp/redis" --daemonize yes --pidfile "$tmp/redis/redis.pid" \
        --logfile "$tmp/redis/redis.log" >/dev/null
    for _ in $(seq 100); do
        rcli ping >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "chaos: redis-server did not start on port $port" >&2
    return 1
}

cleanup() {
    local pids=("${!rollout[@]}" "${stopped[@]}" $trainer $env_pid)
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
    if [[ -f $tmp/redis/redis.pid ]]; then kill -9 "$(cat "$tmp/redis/redis.pid")" 2>/dev/null; fi
    if ((failed)); then
        echo "---- logs (kept in $tmp) ----" >&2
        tail -n 25 "$tmp"/logs/*.log >&2
    else
        rm -rf "$tmp"
    fi
}
trap cleanup EXIT

worker() {  # worker ROLE LOG [extra args]: starts `moerl worker` in the background
    local role=$1 log=$2
    shift 2
    "$moerl" worker --role "$role" --redis "$url" --store "$store" --run-id "$run_id" --out "$tmp/out" \
        --lease-timeout-ms $lease_ms --grace-s $grace_s "$@" "$cfg" >>"$tmp/logs/$log.log" 2>&1 &
}
num_rollout=0
start_rollout() {
    num_rollout=$((num_rollout + 1))
    worker rollout "rollout-$num_rollout"
    rollout[$!]=rollout-$num_rollout
}
start_trainer() {
    worker train train --audit "$tmp/audit.jsonl"
    trainer=$!
}
trainer_step() {  # the highest step in the audit log, -1 before any
    python3 -c '
import json, sys
m = -1
for line in open(sys.argv[1]):
    j = json.loads(line)
    if j["event"] == "step": m = max(m, j["step"])
print(m)' "$tmp/audit.jsonl" 2>/dev/null || echo -1
}

start_redis || exit 1
start_trainer
worker env env
env_pid=$!
for _ in 1 2 3; do start_rollout; done

killed_trainer=0
restarted_redis=0
num_kill=0
num_term=0
turn=0
while kill -0 "$trainer" 2>/dev/null; do
    if ((SECONDS - start_time > limit_s)); then
        fail "the run did not finish within ${limit_s}s (trainer at step $(trainer_step))"
        exit 1
    fi
    sleep 2.5
    kill -0 "$trainer" 2>/dev/null || break
    step=$(trainer_step)
    # Rollout workers: one SIGKILL or SIGTERM per round, replaced at once.
    pids=("${!rollout[@]}")
    victim=${pids[$((RANDOM % ${#pids[@]}))]}
    if ((turn % 2 == 1)) && ! grep -q "role rollout" "$tmp/logs/${rollout[$victim]}.log"; then
        turn=$((turn + 1))  # SIGTERM only a worker past startup (its handler installed); next round
        continue
    fi
    if ((turn % 2 == 0)); then
        kill -9 "$victim" 2>/dev/null && num_kill=$((num_kill + 1))
        wait "$victim" 2>/dev/null
    else
        kill -TERM "$victim" 2>/dev/null && num_term=$((num_term + 1))
        stopped+=("$victim")
    fi
    unset "rollout[$victim]"
    start_rollout
    turn=$((turn + 1))
    for pid in "${!rollout[@]}"; do  # a worker that died on its own is a failure, but keep 3 up
        if ! kill -0 "$pid" 2>/dev/null; then
            wait "$pid"
            rc=$?  # 0: it saw the run-done marker before the trainer exited
            ((rc == 0)) || fail "rollout worker ${rollout[$pid]} (pid $pid) exited on its own with $rc"
            unset "rollout[$pid]"
            ((rc == 0)) || start_rollout
        fi
    done
    if ((killed_trainer == 0 && step >= 15)); then
        echo "chaos: step $step: SIGKILL trainer"
        kill -9 "$trainer"
        wait "$trainer" 2>/dev/null
        start_trainer
        killed_trainer=2
    fi
    if ((restarted_redis == 0 && step >= 30)); then
        echo "chaos: step $step: SIGKILL redis-server, restart on its append-only file"
        kill -9 "$(cat "$tmp/redis/redis.pid")"
        sleep 1
        rm -f "$tmp/redis/redis.pid"
        start_redis || { fail "redis-server did not restart"; exit 1; }
        restarted_redis=1
    fi
done
wait "$trainer"
trainer_rc=$?
echo "chaos: trainer exited with $trainer_rc after $((SECONDS - start_time))s; $num_kill SIGKILLs, $num_term SIGTERMs of rollout workers"
((trainer_rc == 0)) || fail "trainer exited with $trainer_rc"
((killed_trainer == 2)) || fail "the trainer was never killed (run too short?)"
((restarted_redis == 1)) || fail "redis was never restarted (run too short?)"

# The others see the run-done marker and exit by themselves (0), within a few seconds.
for pid in $env_pid "${!rollout[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
        fail "pid $pid did not exit after the run finished"
    else
        wait "$pid" || fail "pid $pid exited with $? after the run finished"
    fi
done
env_pid=""
rollout=()
for pid in "${stopped[@]}"; do
    wait "$pid"
    rc=$?
    ((rc == 0)) || fail "a SIGTERMed rollout worker (pid $pid) exited with $rc; expected 0 within ${grace_s}s"
done
stopped=()
released=$(cat "$tmp"/logs/rollout-*.log | sed -n 's/.*terminated: .* released \([0-9]*\) .*/\1/p' |
    awk '{s += $1} END {print s + 0}')
echo "chaos: SIGTERMed workers released $released leased tasks with their partial trajectories"

prefix="moerl:{$run_id}"
python3 - "$tmp" "$cfg" \
    "$(rcli SMEMBERS "$prefix:tasks:done" | tr '\n' ' ')" \
    "$(rcli SCARD "$prefix:tasks:open")" \
    "$(rcli SMEMBERS "$prefix:experience:seen" | tr '\n' ' ')" \
    "$(rcli XLEN "$prefix:experience")" <<'EOF' || failed=1
import glob, json, os, sys
tmp, cfg_path, done, num_open, seen, exp_len = sys.argv[1:]
done, seen = done.split(), seen.split()
import re
text = open(cfg_path).read()
steps = int(re.search(r"steps: (\d+)", text).group(1))
P = int(re.search(r"prompts_per_step: (\d+)", text).group(1))
G = int(re.search(r"group_size: (\d+)", text).group(1))
ok = True
def check(cond, what):
    global ok
    if not cond:
        ok = False
        print("chaos: FAIL:", what, file=sys.stderr)
expected = {s: {f"s{s}-p{p}-g{g}" for p in range(P) for g in range(G)} for s in range(steps)}
all_ids = set().union(*expected.values())

# Tasks: each acknowledged (done), none outstanding; experience: each task pushed once, all consumed.
check(set(done) == all_ids, f"tasks done: {len(set(done))} of {len(all_ids)}, extra {len(set(done) - all_ids)}")
check(int(num_open) == 0, f"{num_open} tasks still outstanding")
check(len(seen) == len(set(seen)) and set(seen) == all_ids, f"experience pushed for {len(set(seen))} task ids; expected {len(all_ids)}")
check(int(exp_len) == 0, f"{exp_len} experiences not acknowledged by the trainer")

# Durable history: a trainer start at first_step f rolls back the (non-durable) steps >= f.
history, starts, retried = [], [], 0
for line in open(os.path.join(tmp, "audit.jsonl")):
    j = json.loads(line)
    if j["event"] == "start":
        starts.append(j["first_step"])
        history = [h for h in history if h["step"] < j["first_step"]]
    elif j["event"] == "step":
        history.append(j)
check(len(starts) >= 2 and starts[0] == 0 and starts[1] > 0, f"trainer starts at steps {starts}; expected 0, then a resume > 0")
trained = [h["step"] for h in history]
check(trained == list(range(steps)), f"durable history trains steps {trained[:5]}...{trained[-5:]} ({len(trained)}); expected 0..{steps - 1} once each")
for h in history:
    check(len(h["tasks"]) == len(set(h["tasks"])) == P * G and set(h["tasks"]) == expected.get(h["step"]),
          f"step {h['step']} trained on {len(h['tasks'])} experiences ({len(set(h['tasks']))} distinct); expected its {P * G} tasks")
    retried += h["retried"]
check(retried > 0, "no experience came from a redone task (attempt > 0): the kills hit no leased task?")

# Final checkpoint: consumed is exactly the run's tasks, in the compact form.
ckpts = sorted(glob.glob(os.path.join(tmp, "store", "ckpt-*", "manifest.json")))
check(bool(ckpts), "no checkpoint in the store")
if ckpts:
    state = json.load(open(os.path.join(os.path.dirname(ckpts[-1]), "trainer_state.json")))
    check(state["next_step"] == steps, f"final checkpoint next_step {state['next_step']}; expected {steps}")
    # Compact: every task of the steps below the watermark, plus the ids listed.
    below = state.get("consumed_below_step", 0)
    consumed = set(state["consumed"]).union(*[expected[s] for s in range(min(below, steps))])
    check(consumed == all_ids and below == steps and not state["consumed"],
          f"final checkpoint consumed {len(consumed)} task ids (watermark {below}, {len(state['consumed'])} listed); "
          f"expected all {len(all_ids)} by the watermark {steps}")

rewards = [h["reward"] for h in history]
if len(rewards) >= 20:
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"chaos: reward first 10 steps {first:.3f}, last 10 steps {last:.3f}; {retried} experiences from redone tasks; trainer starts {starts}")
    check(last >= 0.45 and last >= first + 0.25, f"reward did not rise enough: {first:.3f} -> {last:.3f} (need last >= 0.45 and >= first + 0.25)")
sys.exit(0 if ok else 1)
EOF
if ((failed)); then
    echo "chaos: FAILED"
    exit 1
fi
echo "chaos: PASSED in $((SECONDS - start_time))s"
