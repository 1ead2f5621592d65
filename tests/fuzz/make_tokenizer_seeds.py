#!/usr/bin/env python3
"""Writes the seeds of corpus/tokenizer_json/: small tokenizer.json files in the shapes of real
models (byte-level BPE as Qwen and Llama 3 have it, SentencePiece-style BPE with byte fallback as
Llama 2 and Mistral have it, a BERT-style BPE with a subword prefix), each followed by a NUL byte
and its tokenizer_config.json, as the fuzz target splits its input."""
import json
import sys
from pathlib import Path

# The GPT-2 byte-to-character map of byte-level BPE.
def byte_chars():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def with_merges(vocab, merges):
    """Adds each merge's result to the vocabulary (after the tokens already there)."""
    for m in merges:
        a, b = m.split(" ")
        vocab.setdefault(a + b, len(vocab))
    return vocab


def added(content, id, special=True, normalized=False):
    return {"id": id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": normalized, "special": special}


def byte_level(split_pattern, specials, post, config, merges):
    chars = byte_chars()
    vocab = with_merges({chars[b]: i for i, b in enumerate(sorted(chars))}, merges)
    tokenizer = {
        "version": "1.0",
        "added_tokens": [added(s, len(vocab) + i) for i, s in enumerate(specials)],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split_pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    return tokenizer, config


QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_MERGES = ["\u0120 t", "h e", "l l", "\u0120t he", "i n", "\u0120 w", "o r", "ll o", "he llo"]


def qwen():
    return byte_level(QWEN_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                      {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
                      {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                       "add_bos_token": False,
                       "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"},
                      BYTE_MERGES)


def llama3():
    bos = "<|begin_of_text|>"
    tokenizer, config = byte_level(LLAMA3_SPLIT, [bos, "<|end_of_text|>", "<|eot_id|>"], None,
                                   {"bos_token": bos, "eos_token": "<|eot_id|>", "add_bos_token": True},
                                   BYTE_MERGES[:5])
    bos_id = tokenizer["added_tokens"][0]["id"]
    tokenizer["normalizer"] = None
    tokenizer["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}]}
    return tokenizer, config


def sentencepiece():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["\u2581", "a", "b", "c", "e", "h", "l", "o", "w", "r", "d", "!"]:
        vocab[piece] = len(vocab)
    merges = ["\u2581 h", "e l", "el l", "\u2581h ell", "\u2581hell o", "\u2581 w", "o r", "or l", "orl d"]
    with_merges(vocab, merges)
    tokenizer = {
        "version": "1.0",
        "added_tokens": [added("<unk>", 0), added("<s>", 1), added("</s>", 2)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    config = {"bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "__type": "AddedToken"},
              "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}
    return tokenizer, config


def bert_like():
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
    for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'":
        vocab[c] = len(vocab)
        vocab["##" + c] = len(vocab)
    merges = ["h ##e", "he ##l", "hel ##l", "hell ##o", "w ##o", "wo ##r", "wor ##l", "worl ##d"]
    for m in merges:
        a, b = m.split(" ")
        vocab.setdefault(a + b[2:], len(vocab))
    tokenizer = {
        "version": "1.0",
        "added_tokens": [added(t, i) for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"])],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "Lowercase"},
                                                           {"type": "Strip", "strip_left": True, "strip_right": True}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Whitespace"}, {"type": "Digits", "individual_digits": True}]},
        "post_processor": {"type": "BertProcessing", "sep": ["[SEP]", 3], "cls": ["[CLS]", 2]},
        "decoder": {"type": "Fuse"},
        "model": {"type": "BPE", "dropout": None, "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": merges},
    }
    return tokenizer, {"unk_token": "[UNK]", "pad_token": "[PAD]"}


def main(out):
    out.mkdir(parents=True, exist_ok=True)
    for name, (tokenizer, config) in {"qwen_byte_level.json": qwen(), "llama3_template.json": llama3(),
                                      "sentencepiece_byte_fallback.json": sentencepiece(),
                                      "subword_prefix.json": bert_like()}.items():
        text = json.dumps(tokenizer, ensure_ascii=False, separators=(",", ":")).encode()
        (out / name).write_bytes(text + b"\0" + json.dumps(config, separators=(",", ":")).encode())
    minimal = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}}
    (out / "minimal_no_config.json").write_bytes(json.dumps(minimal).encode())


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "corpus" / "tokenizer_json")
