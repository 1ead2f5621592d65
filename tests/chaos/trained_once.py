"""What a chaos run must end with: every task's experience in the buffer exactly once and
acknowledged, and the trainer's durable history (TMP/audit.jsonl) training every step exactly once on
exactly its tasks. With the scoring stage's done and open task ids as well: every experience went
through the stage (acknowledged, or left open by a worker killed after its push).

    python3 trained_once.py LABEL TMP RUN_CONFIG SEEN EXP_LEN [SCORED SCORE_OPEN]

SEEN, SCORED and SCORE_OPEN are space-separated task ids (redis-cli SMEMBERS), EXP_LEN the
experience stream's length (XLEN). Prints each failure and exits 1 on any."""
import json
import os
import re
import sys

label, tmp, cfg_path, seen, exp_len = sys.argv[1:6]
text = open(cfg_path).read()
steps = int(re.search(r"steps: (\d+)", text).group(1))
P = int(re.search(r"prompts_per_step: (\d+)", text).group(1))
G = int(re.search(r"group_size: (\d+)", text).group(1))
expected = {s: {f"s{s}-p{p}-g{g}" for p in range(P) for g in range(G)} for s in range(steps)}
all_ids = set().union(*expected.values())
failures = []


def check(cond, what):
    failures.extend([] if cond else [what])


seen = seen.split()
if len(sys.argv) > 6:
    # A worker killed between its push and its ack leaves a score task open until its lease moves on,
    # which the end of the run may come before: harmless when the buffer has that experience.
    scored, score_open = set(sys.argv[6].split()), set(sys.argv[7].split())
    check(scored | score_open == all_ids,
          f"score tasks: {len(scored)} acknowledged, {len(score_open)} open, of {len(all_ids)}")
    check(score_open <= set(seen), f"{len(score_open - set(seen))} open score tasks never reached the buffer")
check(len(seen) == len(set(seen)) and set(seen) == all_ids,
      f"experience pushed for {len(set(seen))} task ids; expected {len(all_ids)}")
check(int(exp_len) == 0, f"{exp_len} experiences not acknowledged by the trainer")
# A trainer start at first_step f rolls back the (non-durable) steps >= f.
history = []
for line in open(os.path.join(tmp, "audit.jsonl")):
    j = json.loads(line)
    if j["event"] == "start":
        history = [h for h in history if h["step"] < j["first_step"]]
    elif j["event"] == "step":
        history.append(j)
check([h["step"] for h in history] == list(range(steps)), f"trained steps {[h['step'] for h in history]}")
for h in history:
    check(sorted(h["tasks"]) == sorted(expected[h["step"]]), f"step {h['step']} trained on other tasks")
for f in failures:
    print(f"{label}: FAIL:", f, file=sys.stderr)
sys.exit(1 if failures else 0)
