"""Exports a Llama-3 style model of the shapes of bench/make_big_checkpoint.py (default
the 1.24B llama3.2-1b preset; `--layers N` for fewer) with random bf16 weights as a
`.pt2` archive (torch.export.save, weights first as torch writes them), for
bench/load_rss.rs. Needs torch and transformers (the /tmp/tv venv); a few minutes and
about 3x the model's size in memory on CPU. Do not commit the output.

    python bench/make_big_pt2.py OUT.pt2 [--layers N]
"""

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
PRESET = os.path.join(HERE, "..", "frontends", "presets", "llama3.2-1b.json")


def main():
    out = sys.argv[1]
    cfg = json.load(open(PRESET))
    if "--layers" in sys.argv:
        cfg["num_hidden_layers"] = int(sys.argv[sys.argv.index("--layers") + 1])
    cfg.pop("torch_dtype", None)
    cfg["use_cache"] = False
    config = LlamaConfig(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    ep = torch.export.export(
        model, (), kwargs={"input_ids": ids},
        dynamic_shapes={"input_ids": {1: torch.export.Dim.AUTO}}, strict=False,
    )
    torch.export.save(ep, out)
    print(f"wrote {out}: {os.path.getsize(out) / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
