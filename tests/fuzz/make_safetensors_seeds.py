#!/usr/bin/env python3
"""Writes the safetensors seeds of corpus/safetensors_header/: small files in the format's layout
(little-endian u64 header length, JSON header, data region), without any ML library."""
import json
import struct
import sys
from pathlib import Path


def safetensors(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, data bytes), laid out in order."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def main(out):
    out.mkdir(parents=True, exist_ok=True)
    f32 = lambda *v: struct.pack(f"<{len(v)}f", *v)
    seeds = {
        "two_tensors.safetensors": safetensors(
            [("model.norm.weight", "F32", [2], f32(1, 2)),
             ("model.embed_tokens.weight", "BF16", [2, 2], b"\x80\x3f" * 4)],
            {"format": "pt"}),
        "all_dtypes.safetensors": safetensors(
            [(f"t.{d}", d, [1], b"\0" * n) for d, n in
             [("F64", 8), ("F32", 4), ("F16", 2), ("BF16", 2), ("I64", 8), ("I32", 4), ("I16", 2),
              ("I8", 1), ("U8", 1), ("BOOL", 1)]]),
        "empty_and_scalar.safetensors": safetensors(
            [("empty", "F32", [0, 4], b""), ("scalar", "I64", [], struct.pack("<q", 7))]),
        "no_tensors.safetensors": safetensors([], {"format": "pt"}),
    }
    for name, raw in seeds.items():
        (out / name).write_bytes(raw)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "corpus" / "safetensors_header")
