#!/usr/bin/env python3
"""moerl's reward model against Hugging Face Qwen3MoeForSequenceClassification (transformers).

Usage: reward_parity.py PATH/TO/moerl
For each config below, `moerl model init --reward` writes a random fp32 reward checkpoint (score
head, no lm_head) and `moerl model score` scores token sequences of different lengths (one ends in
pad-id tokens, one starts with one); transformers loads the same directory, with no missing or
unexpected tensor, and scores the same sequences right-padded and left-padded in one batch. The
scores must agree to 1e-4 (relative to max(1, |score|)).
"""
import json
import subprocess
import sys
import tempfile

import torch
from transformers import Qwen3MoeForSequenceClassification

PAD = 7
CONFIGS = {
    "pad-token": ({
        "model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96,
        "moe_intermediate_size": 24, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "mlp_only_layers": [1], "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "initializer_range": 0.1, "rms_norm_eps": 1e-6,
        "torch_dtype": "float32"}, PAD),
    "no-pad-token": ({
        "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16, "intermediate_size": 80,
        "moe_intermediate_size": 16, "num_experts": 6, "num_experts_per_tok": 3, "norm_topk_prob": False,
        "decoder_sparse_step": 2, "rope_theta": 1000000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "initializer_range": 0.1, "rms_norm_eps": 1e-5,
        "torch_dtype": "float32"}, None),
}


def sequences(vocab):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(8, vocab, (n,), generator=g).tolist() for n in (12, 5, 9, 1, 17)]
    seqs[2] = seqs[2][:6] + [PAD, PAD, PAD]  # ends in pad ids: scored at the token before them
    seqs[1] = [PAD] + seqs[1]  # a pad id that is not at the end
    return seqs


def hf_scores(model, seqs, pad, left):
    if pad is None:  # transformers needs a pad token to batch: one sequence at a time
        with torch.no_grad():
            return [model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in seqs]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s)
        mask[i, cols] = 1
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    return out.logits[:, 0].tolist()


def check(name, config, pad, moerl):
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/config.json", "w") as f:
            json.dump(config, f)
        init = [moerl, "model", "init", "--reward", "--config", f"{d}/config.json", "--out", f"{d}/rm",
                "--dtype", "float32", "--seed", "5", "--pad-token-id", str(-1 if pad is None else pad)]
        subprocess.run(init, check=True, stdout=subprocess.DEVNULL)
        seqs = sequences(config["vocab_size"])
        lines = "".join(json.dumps({"ids": s}) + "\n" for s in seqs)
        out = subprocess.run([moerl, "model", "score", "--reward", f"{d}/rm", "--batch", "3"], input=lines,
                             capture_output=True, text=True, check=True).stdout
        ours = [json.loads(line)["score"] for line in out.splitlines()]
        model, info = Qwen3MoeForSequenceClassification.from_pretrained(
            f"{d}/rm", dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        model.eval()
    problems = [f"{k}: {v}" for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")]
    ok = not problems and len(ours) == len(seqs) and model.config.num_labels == 1
    worst = 0.0
    for left in (False, True):
        theirs = hf_scores(model, seqs, pad, left)
        for a, b in zip(ours, theirs):
            worst = max(worst, abs(a - b) / max(1.0, abs(b)))
    spread = max(ours) - min(ours) if ours else 0.0
    ok = ok and worst < 1e-4 and spread > 1e-4
    print(f"{name}: {len(ours)} sequences, max rel diff {worst:.1e}, score spread {spread:.3f}"
          f"{', ' + '; '.join(problems) if problems else ''}: {'OK' if ok else 'MISMATCH'}")
    return ok


if __name__ == "__main__":
    results = [check(name, config, pad, sys.argv[1]) for name, (config, pad) in CONFIGS.items()]
    sys.exit(0 if all(results) else 1)
