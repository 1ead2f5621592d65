#!/usr/bin/env python3
"""moerl's model against Hugging Face Qwen3MoeForCausalLM (transformers) on random checkpoints.

Usage: hf_parity.py PATH/TO/model_hf_dump
For each config below, model_hf_dump writes an fp32 checkpoint and moerl's outputs on fixed
left-padded inputs; HF loads the same checkpoint and must agree on logits, per-token log-probs,
the experts chosen by every router, the load-balancing loss and the KV-cache decode step.
"""
import json
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeForCausalLM

CONFIGS = {
    "dense-layer-untied": {
        "model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96,
        "moe_intermediate_size": 24, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "mlp_only_layers": [1], "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "initializer_range": 0.1, "rms_norm_eps": 1e-6, "torch_dtype": "float32"},
    "sparse-step-tied": {
        "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16, "intermediate_size": 80,
        "moe_intermediate_size": 16, "num_experts": 6, "num_experts_per_tok": 3, "norm_topk_prob": False,
        "decoder_sparse_step": 2, "rope_theta": 1000000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "initializer_range": 0.1, "rms_norm_eps": 1e-5, "torch_dtype": "float32"},
}


def check(name, config, dump):
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/input.json", "w") as f:
            json.dump(config, f)
        subprocess.run([dump, f"{d}/input.json", f"{d}/ckpt"], check=True)
        t = load_file(f"{d}/ckpt/moerl_outputs.safetensors")
        m = Qwen3MoeForCausalLM.from_pretrained(f"{d}/ckpt", torch_dtype=torch.float32,
                                                attn_implementation="eager").eval()
        ids, mask = t["ids"], t["mask"]
        with torch.no_grad():
            o = m(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                  output_router_logits=True)
    valid = mask.bool()
    scale = max(1.0, o.logits.abs().max().item())
    logits = (o.logits - t["logits"]).abs()[valid].max().item() / scale
    both = valid[:, 1:] & valid[:, :-1]
    lp = torch.log_softmax(o.logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logprobs = (lp - t["token_logprobs"][:, 1:]).abs()[both].max().item()
    k = m.config.num_experts_per_tok
    same, total = 0, 0
    for layer, router_logits in enumerate(o.router_logits):
        hf = torch.softmax(router_logits.float(), -1).topk(k, -1).indices.view(*ids.shape, k)
        same += (hf == t["routing"][:, :, layer, :]).all(-1)[valid].sum().item()
        total += valid.sum().item()
    aux = abs(o.aux_loss.item() - t["aux"].item())
    decode = (o.logits[:, -1] - t["decode_logits"]).abs().max().item() / scale
    ok = logits < 1e-4 and logprobs < 1e-4 and same == total and aux < 1e-5 and decode < 1e-4
    print(f"{name}: logits {logits:.1e}, logprobs {logprobs:.1e}, routing rows {same}/{total}, "
          f"aux |diff| {aux:.1e}, decode {decode:.1e}: {'OK' if ok else 'MISMATCH'}")
    return ok


if __name__ == "__main__":
    results = [check(name, config, sys.argv[1]) for name, config in CONFIGS.items()]
    sys.exit(0 if all(results) else 1)
