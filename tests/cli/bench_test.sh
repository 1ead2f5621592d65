#!/usr/bin/env bash
# moerl bench ep / bench rollout --ep: ranks forked around a hosted store report their figures; a rank
# that cannot run reports why instead of the table row.
set -u
moerl=$1
fail() { echo "FAIL: $*"; exit 1; }

# Two host-memory ranks, both cases, bf16 and fp8 dispatch: a row each, no error, positive times.
out=$("$moerl" bench ep --transport host --ranks 2 --tokens 32 --iters 1 --dispatch bf16,fp8 --no-baseline 2>&1) ||
  fail "bench ep exited non-zero: $out"
echo "$out" | grep -q "error" && fail "a rank failed: $out"
[ "$(echo "$out" | grep -cE '^\| host +\|  2 \|')" -eq 4 ] || fail "expected 4 host rows: $out"
echo "$out" | grep -E '^\| host .*\| fp8 ' | grep -qE '\| +[0-9]+\.[0-9] \|' || fail "no fp8 timing: $out"

# A dispatch format the dtype cannot take is refused by name.
out=$("$moerl" bench ep --transport host --ranks 2 --dtype fp32 --dispatch bf16 2>&1) && fail "fp32 with bf16 accepted"
echo "$out" | grep -q -- "--dispatch bf16" || fail "unclear refusal: $out"

# Rollout over EP on a machine without the GPUs: every transport's row names the missing device.
if ! "$moerl" bench rollout --help >/dev/null 2>&1; then echo "bench rollout not built: skipped"; exit 0; fi
out=$(CUDA_VISIBLE_DEVICES= "$moerl" bench rollout --device cuda --ep 2 --transport cuda,nccl --layers 1 --batch 1 \
  --new 3 2>&1)
if echo "$out" | grep -qE '^\| cuda \| 2 \| 1 \|'; then
  echo "GPUs present: rollout rows printed"
else
  [ "$(echo "$out" | grep -c 'error: rank 0: .*CUDA')" -eq 2 ] || fail "expected a CUDA error per transport: $out"
fi
echo "bench tests: ok"
