#!/usr/bin/env python3
"""A tiny Llama-3-style HF checkpoint with the 1.24B parity model's config keys (llama3
rope scaling, theta 500000, tied embeddings, GQA, eps 1e-5) and a fixed batch, written
with the standard library alone (no torch, no numpy): for comparing what two Weft builds
compute on the CPU reference from the same HF directory, e.g. whether a loss-parity change
on the GPU comes from the import and the passes or from the GPU kernels.

    python3 bench/tiny_llama3_ckpt.py DIR     # DIR/config.json, DIR/model.safetensors,
                                              # DIR/inputs.safetensors (1 x 64 tokens)
    weft run DIR --backend cpu --dtype bf16 --torch-adamw --lr 1e-4 --steps 4 \
        --inputs DIR/inputs.safetensors --json
"""
import json
import os
import random
import struct
import sys

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
H, I, L, V, HQ, HK, D, S = 64, 256, 2, 512, 4, 2, 16, 64
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": H,
    "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": HQ, "num_key_value_heads": HK,
    "head_dim": D, "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "rms_norm_eps": 1e-05, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "use_cache": False, "torch_dtype": "bfloat16",
}
json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=1)
rng = random.Random(0)


def bf16(vals):
    """Round-to-nearest-even f32 -> bf16 bytes."""
    b = bytearray()
    for v in vals:
        u = struct.unpack("<I", struct.pack("<f", v))[0]
        b += struct.pack("<H", (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return bytes(b)


tensors = {}


def add(name, shape, norm=False):
    n = 1
    for s in shape:
        n *= s
    vals = [1.0 + rng.gauss(0, 0.05) if norm else rng.gauss(0, 0.02) for _ in range(n)]
    tensors[name] = ("BF16", shape, bf16(vals))


add("model.embed_tokens.weight", [V, H])
for l in range(L):
    p = f"model.layers.{l}."
    add(p + "self_attn.q_proj.weight", [HQ * D, H])
    add(p + "self_attn.k_proj.weight", [HK * D, H])
    add(p + "self_attn.v_proj.weight", [HK * D, H])
    add(p + "self_attn.o_proj.weight", [H, HQ * D])
    add(p + "mlp.gate_proj.weight", [I, H])
    add(p + "mlp.up_proj.weight", [I, H])
    add(p + "mlp.down_proj.weight", [H, I])
    add(p + "input_layernorm.weight", [H], norm=True)
    add(p + "post_attention_layernorm.weight", [H], norm=True)
add("model.norm.weight", [H], norm=True)


def write(path, ts):
    header, offset, blobs = {}, 0, []
    for k in sorted(ts):
        dt, shape, data = ts[k]
        header[k] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


write(os.path.join(out, "model.safetensors"), tensors)
ids = b"".join(struct.pack("<q", rng.randrange(V)) for _ in range(S))
write(os.path.join(out, "inputs.safetensors"), {"input_ids": ("I64", [1, S], ids), "labels": ("I64", [1, S], ids)})
print(f"{out}: config.json, model.safetensors ({len(tensors)} tensors), inputs.safetensors (1 x {S})")
