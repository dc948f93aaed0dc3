"""Writes a bf16 safetensors checkpoint of random bytes with the shapes of a Llama-3
style model (default: the 1.24B llama3.2-1b preset: hidden 2048, 16 layers, 32/8 heads,
intermediate 8192, vocab 128256, tied), plus its config.json, for bench/load_rss.rs.

    python bench/make_big_checkpoint.py OUT_DIR [--layers N]

The data is random bytes (masked so every bf16 is finite), streamed to disk: the
script needs no more memory than one tensor. Do not commit the output (~2.5 GB).
"""

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PRESET = os.path.join(HERE, "..", "frontends", "presets", "llama3.2-1b.json")


def shapes(cfg):
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", [v, h]), ("model.norm.weight", [h])]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out += [
            (p + "input_layernorm.weight", [h]),
            (p + "post_attention_layernorm.weight", [h]),
            (p + "self_attn.q_proj.weight", [q, h]),
            (p + "self_attn.k_proj.weight", [kv, h]),
            (p + "self_attn.v_proj.weight", [kv, h]),
            (p + "self_attn.o_proj.weight", [h, q]),
            (p + "mlp.gate_proj.weight", [i, h]),
            (p + "mlp.up_proj.weight", [i, h]),
            (p + "mlp.down_proj.weight", [h, i]),
        ]
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", [v, h]))
    return out


def main():
    import numpy as np  # here, so shapes() imports without numpy (bench/tiny_llama3_ckpt.py)

    out_dir = sys.argv[1]
    cfg = json.load(open(PRESET))
    if "--layers" in sys.argv:
        cfg["num_hidden_layers"] = int(sys.argv[sys.argv.index("--layers") + 1])
    os.makedirs(out_dir, exist_ok=True)
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"), indent=2)
    header, offset = {}, 0
    tensors = shapes(cfg)
    for name, shape in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    rng = np.random.default_rng(0)
    with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for name, shape in tensors:
            bits = rng.integers(0, 1 << 16, size=int(np.prod(shape)), dtype=np.uint16)
            # Clear the top exponent bit: values in (-2, 2), never inf or NaN.
            bits &= 0xBFFF
            f.write(bits.tobytes())
    size = os.path.getsize(os.path.join(out_dir, "model.safetensors"))
    print(f"wrote {out_dir}/model.safetensors: {size / 1e9:.3f} GB, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
