#!/usr/bin/env python3
"""A tiny HF checkpoint of the llama3.2-1b preset (its config.json with the sizes cut to
64 hidden, 2 layers, 4/2 heads of 16, vocab 512: llama3 rope scaling, theta 500000, tied
embeddings, eps 1e-5 kept) and a fixed batch, written with the standard library alone (no
torch, no numpy): for comparing what two Weft builds compute on the CPU reference from the
same HF directory, e.g. whether a loss-parity change on the GPU comes from the import and
the passes or from the GPU kernels. The tensor list is make_big_checkpoint.shapes().

    python3 bench/tiny_llama3_ckpt.py DIR     # DIR/config.json, DIR/model.safetensors,
                                              # DIR/inputs.safetensors (1 x 64 tokens)
    weft run DIR --backend cpu --dtype bf16 --torch-adamw --lr 1e-4 --steps 4 \\
        --inputs DIR/inputs.safetensors --json
"""
import json
import os
import random
import struct
import sys

from make_big_checkpoint import PRESET, shapes

SEQ = 64
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
cfg = json.load(open(PRESET))
cfg.update(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=512, bos_token_id=1, eos_token_id=2, use_cache=False)
json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
rng = random.Random(0)


def bf16(vals):
    """Round-to-nearest-even f32 -> bf16 bytes."""
    b = bytearray()
    for v in vals:
        u = struct.unpack("<I", struct.pack("<f", v))[0]
        b += struct.pack("<H", (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return bytes(b)


def write(path, tensors):
    """safetensors: {name: (dtype, shape, bytes)}, names sorted."""
    header, offset, blobs = {}, 0, []
    for k in sorted(tensors):
        dt, shape, data = tensors[k]
        header[k] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


weights = {}
for name, shape in shapes(cfg):
    n = 1
    for s in shape:
        n *= s
    norm = name.endswith("norm.weight")
    weights[name] = ("BF16", shape, bf16(1.0 + rng.gauss(0, 0.05) if norm else rng.gauss(0, 0.02) for _ in range(n)))
write(os.path.join(out, "model.safetensors"), weights)
ids = b"".join(struct.pack("<q", rng.randrange(cfg["vocab_size"])) for _ in range(SEQ))
write(os.path.join(out, "inputs.safetensors"), {"input_ids": ("I64", [1, SEQ], ids), "labels": ("I64", [1, SEQ], ids)})
print(f"{out}: config.json, model.safetensors ({len(weights)} tensors), inputs.safetensors (1 x {SEQ})")
