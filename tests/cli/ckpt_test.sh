#!/usr/bin/env bash
# moerl model init refuses to mix checkpoints and replaces one only with --force; moerl ckpt inspect
# verifies manifest.json (sizes and sha256) and says when there is none.
set -u
moerl=$1
fail() { echo "FAIL: $*"; exit 1; }
dir=$(mktemp -d /tmp/moerl-ckpt-cli.XXXXXX)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/tiny.json" <<'JSON'
{"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
 "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true,
 "max_position_embeddings": 128}
JSON

# A sharded checkpoint, then an attempt to write a single-file one over it.
"$moerl" model init --config "$dir/tiny.json" --out "$dir/m" --shard-mb 0 >/dev/null || fail "model init failed"
"$moerl" model init --config "$dir/tiny.json" --out "$dir/s" --shard-mb 1 >/dev/null || fail "sharded init failed"
cp "$dir/s"/* "$dir/m"/ 2>/dev/null
before=$(ls "$dir/m" | sort)
out=$("$moerl" model init --config "$dir/tiny.json" --out "$dir/m" 2>&1) && fail "init over a checkpoint accepted"
echo "$out" | grep -q -- "--force" || fail "unclear refusal: $out"
[ "$(ls "$dir/m" | sort)" = "$before" ] || fail "a refused init changed the directory"
"$moerl" model init --config "$dir/tiny.json" --out "$dir/m" --force >/dev/null || fail "init --force failed"
[ "$(ls "$dir/m" | sort | tr '\n' ' ')" = "config.json model.safetensors " ] ||
  fail "init --force left other files: $(ls "$dir/m")"
ls -a "$dir" | grep -q '\.init-' && fail "a staging directory was left behind"

# No manifest: inspect passes and says the contents are not verified.
out=$("$moerl" ckpt inspect "$dir/m" 2>&1) || fail "inspect of a fresh checkpoint failed: $out"
echo "$out" | grep -q "manifest      none" || fail "inspect does not say there is no manifest: $out"

# A checkpoint published by a run: verified; one flipped byte in a weight file is refused by name.
cfg=$(dirname "$0")/../../examples/quickstart.yaml
OPENBLAS_NUM_THREADS=1 "$moerl" run "$cfg" --steps 1 --out "$dir/run" >/dev/null 2>&1 || fail "a 1-step run failed"
ckpt=$(dirname "$(find "$dir/run" -name manifest.json | sort | tail -1)")
[ -n "$ckpt" ] && [ -d "$ckpt" ] || fail "the run published no checkpoint with a manifest"
out=$("$moerl" ckpt inspect "$ckpt" 2>&1) || fail "inspect of a published checkpoint failed: $out"
echo "$out" | grep -q "sha256 verified" || fail "inspect did not verify the manifest: $out"
shard=$(ls "$ckpt"/*.safetensors | head -1)
python3 - "$shard" <<'PY'
import sys
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
b[-1] ^= 1
open(p, "wb").write(bytes(b))
PY
out=$("$moerl" ckpt inspect "$ckpt" 2>&1) && fail "inspect accepted a flipped byte"
echo "$out" | grep -q "$(basename "$shard")" || fail "the refusal does not name the damaged file: $out"
echo "ckpt cli: ok"
