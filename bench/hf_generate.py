#!/usr/bin/env python3
"""The reference for `moerl bench rollout`: Hugging Face transformers' generate on the same checkpoint.

Usage: hf_generate.py --model DIR --batch 1,16,64,256 --prompt 128 --new 128 [--seed 1]
Loads DIR (written by moerl in the HF layout) as Qwen3MoeForCausalLM in bfloat16 on the GPU and runs
greedy generate with exactly --new new tokens per sequence (no early stop) for random prompts of
--prompt tokens at each batch size. Prints one JSON object per batch size:
  {"batch": B, "tokens_per_s": generated tokens / wall seconds of the generate call, "seconds": s}
"""
import argparse
import json
import time

import torch
import transformers
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    t0 = time.time()
    try:
        model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16, device_map="cuda")
    except (ImportError, ValueError):  # device_map needs accelerate
        model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16).cuda()
    model.eval()
    print(json.dumps({"loaded_s": round(time.time() - t0, 1), "transformers": transformers.__version__,
                      "torch": torch.__version__,
                      "attn": getattr(model.config, "_attn_implementation", "?")}), flush=True)
    gen = torch.Generator().manual_seed(a.seed)
    vocab = model.config.vocab_size

    def generate(batch, new):
        ids = torch.randint(1, vocab, (batch, a.prompt), generator=gen).cuda()
        mask = torch.ones_like(ids)
        torch.cuda.synchronize()
        t = time.time()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        torch.cuda.synchronize()
        assert out.shape[1] == a.prompt + new, out.shape
        return time.time() - t

    generate(1, 2)  # warm-up
    for b in [int(x) for x in a.batch.split(",")]:
        s = generate(b, a.new)
        print(json.dumps({"batch": b, "tokens_per_s": round(b * a.new / s, 1), "seconds": round(s, 3)}), flush=True)


if __name__ == "__main__":
    main()
