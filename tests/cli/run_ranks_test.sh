#!/usr/bin/env bash
# moerl run with ranks.train: 2: the trainer as two processes (one EP rank each) learns exactly as
# the two threads of one process do, resumes exactly, and a killed rank ends the run with an error
# naming it. The rollout engine over 2 processes (ranks.rollout: 2) samples what one process does,
# alone, with the trainer's processes, and in distributed mode.
set -u
moerl=$1
src=$2
fail() { echo "FAIL: $*"; exit 1; }
export OPENBLAS_NUM_THREADS=1
rm -rf threads procs split bad.yaml procs.yaml long dist.yaml rollout.yaml rollout both.yaml both bench-both
sed 's/^  ep: 2$/  ep: 2\n  train: 2/' "$src/examples/quickstart.yaml" >procs.yaml
grep -q "train: 2" procs.yaml || fail "could not write procs.yaml"

# The same metrics, step for step (timings aside, and how the weights got to the rollout: memory
# in one process, files between CPU processes).
"$moerl" run "$src/examples/quickstart.yaml" --steps 20 --out threads --quiet >threads.log 2>&1 ||
  fail "threads run: $(cat threads.log)"
"$moerl" run procs.yaml --steps 20 --out procs --quiet >procs.log 2>&1 || fail "processes run: $(cat procs.log)"
# Every rank wrote its experts into the checkpoint.
for f in model-00002-of-00002.safetensors optimizer-rank1.safetensors; do
  ls procs/checkpoints/ckpt-*/$f >/dev/null 2>&1 || fail "no $f in $(ls -R procs/checkpoints)"
done

same_metrics() {
  python3 - "$1" "$2" <<'PY' || fail "$1 and $2 differ"
import json, sys
def rows(p):
    out = []
    for line in open(p):
        j = json.loads(line)
        out.append({k: v for k, v in j.items()
                    if not (k.endswith("_s") or k.startswith("sync_") or k in ("step_seconds", "tokens_per_s"))})
    return out
a, b = rows(sys.argv[1]), rows(sys.argv[2])
assert len(a) == 20 and len(b) == 20, (len(a), len(b))
for x, y in zip(a, b):
    assert x == y, {k: (x[k], y.get(k)) for k in x if x[k] != y.get(k)}
PY
}
same_metrics threads/metrics.jsonl procs/metrics.jsonl

# The rollout engine over 2 processes (each half the experts), alone and with the trainer over 2:
# the same samples, so every count and reward equal the threads run; the losses and norms within
# 1e-4 (the experts' sums run in another order).
close_metrics() {
  python3 - "$1" "$2" <<'PY' || fail "$1 and $2 differ"
import json, sys
def rows(p):
    return [{k: v for k, v in json.loads(line).items()
             if not (k.endswith("_s") or k.startswith("sync_") or k in ("step_seconds", "tokens_per_s", "logprob_diff"))}
            for line in open(p)]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
assert len(a) == 20 and len(b) == 20, (len(a), len(b))
for s, (x, y) in enumerate(zip(a, b)):
    for k, v in x.items():
        if isinstance(v, float) and k not in ("reward", "reward_std"):
            assert abs(v - y[k]) <= 1e-4 * abs(v) + 1e-7, (s, k, v, y[k])
        else:
            assert v == y[k], (s, k, v, y[k])
PY
}
sed 's/^  ep: 2$/  ep: 2\n  rollout: 2/' "$src/examples/quickstart.yaml" >rollout.yaml
"$moerl" run rollout.yaml --steps 20 --out rollout --quiet >rollout.log 2>&1 || fail "rollout processes run: $(cat rollout.log)"
close_metrics threads/metrics.jsonl rollout/metrics.jsonl
sed 's/^  train: 2$/  train: 2\n  rollout: 2/' procs.yaml >both.yaml
"$moerl" run both.yaml --steps 20 --out both --quiet >both.log 2>&1 || fail "trainer and rollout processes run: $(cat both.log)"
close_metrics threads/metrics.jsonl both/metrics.jsonl
# bench rl measures such a config as moerl run runs it: over its processes.
rm -rf bench-both
# With --save-policy the last policy's weights (both ranks' experts) are a checkpoint that loads.
rm -rf bench-both-policy
"$moerl" bench rl both.yaml --steps 4 --warmup 1 --out bench-both --save-policy bench-both-policy >bench-both.log 2>&1 ||
  fail "bench rl: $(cat bench-both.log)"
grep -q "ranks: trainer 2, rollout 2 processes (3 in all)" bench-both.log || fail "bench rl: no ranks line: $(cat bench-both.log)"
grep -q "^median over steps 1..3" bench-both.log || fail "bench rl: no summary: $(cat bench-both.log)"
[ -f bench-both-policy/config.json ] || fail "bench rl --save-policy wrote no config.json: $(ls bench-both-policy)"
"$moerl" ckpt inspect bench-both-policy >inspect.log 2>&1 || fail "the saved policy does not load: $(cat inspect.log)"

# Ten steps, then --resume to twenty: what the uninterrupted run did.
"$moerl" run procs.yaml --steps 10 --out split --quiet >split.log 2>&1 || fail "first half: $(cat split.log)"
"$moerl" run procs.yaml --steps 20 --out split --quiet --resume >>split.log 2>&1 || fail "resume: $(cat split.log)"
same_metrics procs/metrics.jsonl split/metrics.jsonl

# ranks.train must match ranks.ep.
sed 's/^  ep: 2$/  ep: 4/' procs.yaml >bad.yaml
"$moerl" run bad.yaml --steps 2 --out bad --quiet >bad.log 2>&1 && fail "ranks.train 2 with ranks.ep 4 accepted"
grep -q "ranks.ep must be 2" bad.log || fail "unclear error: $(cat bad.log)"

# Kill rank 1 mid-run: the run ends within seconds, non-zero, naming the rank.
"$moerl" run procs.yaml --steps 800 --out long --quiet >long.log 2>&1 &
launcher=$!
victim=""
for _ in $(seq 100); do
  for p in $(pgrep -P $launcher); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=1" && victim=$p
  done
  [ -n "$victim" ] && [ -s long/metrics.jsonl ] && break
  sleep 0.1
done
[ -n "$victim" ] || fail "no rank 1 under the launcher: $(cat long.log)"
kill -9 "$victim"
start=$(date +%s)
wait $launcher
code=$?
[ "$code" -ne 0 ] || fail "the run exited 0 after its rank 1 was killed"
[ $(( $(date +%s) - start )) -lt 60 ] || fail "the run took too long to end"
grep -q "rank 1 exited" long.log || fail "the launcher did not name rank 1: $(cat long.log)"
# Distributed mode (moerl cluster against Redis): the trainer worker runs as 2 processes.
if [ -n "${MOERL_TEST_REDIS_URL:-}" ]; then
  rm -rf dist dist-store
  # Its own keys in Redis; each rollout engine over 2 processes too (half the experts each).
  # Learning is shown by a 10-step mean reward of 0.75 (0.9 takes 70-280 steps, seed and timing alike).
  sed "s/^  name: quickstart$/  name: ranks-$$-$RANDOM/; s/^  train: 2$/  train: 2\n  rollout: 2/;
       s/^  stop_at_reward: 0.9 /  stop_at_reward: 0.75 /" procs.yaml >dist.yaml
  "$moerl" run --distributed --redis "$MOERL_TEST_REDIS_URL" --store "file://$PWD/dist-store" --out dist \
    --rollout-workers 2 dist.yaml >dist.log 2>&1 || fail "distributed run: $(tail -20 dist.log)"
  grep -q "reward target reached" dist.log || fail "the distributed run did not learn: $(tail -20 dist.log)"
  grep -q "trainer rank 1 of 2" dist.log || fail "no trainer rank 1 in the cluster's log: $(tail -20 dist.log)"
  [ "$(grep -c "rollout engine rank 1 of 2" dist.log)" -eq 2 ] || fail "not 2 rollout engines of 2 ranks: $(tail -20 dist.log)"
  ls dist-store/ckpt-*/model-00002-of-00002.safetensors >/dev/null 2>&1 || fail "no rank-1 shard in the store"
else
  echo "skip distributed mode (MOERL_TEST_REDIS_URL not set)"
fi
echo "run over trainer processes: ok"
