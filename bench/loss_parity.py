#!/usr/bin/env python3
"""Loss parity with PyTorch on real weights (issue 20's check), run on the GPU machine:

    python3 bench/loss_parity.py --weft ./.gpu/weft [--seq 4096] [--steps 4] [--lr 1e-4]
        [--weft-args "--fused-loss"]

1. Builds the 1.24B Llama-3-style model (the `llama3.2-1b` preset's config) with
   transformers from seed 0 and writes it with `save_pretrained` (config.json +
   model.safetensors, tied embeddings) to a temporary directory, in bf16.
2. Draws one fixed batch (seed 1; labels = input_ids, HF shifts them) and saves it as
   `--inputs` safetensors.
3. Trains PyTorch (bf16 params, fused AdamW in the params' dtype, betas 0.9/0.95, eps
   1e-8, weight decay 0.1) `--steps` steps on that batch and records each step's loss.
4. Runs `weft run DIR --backend cuda --dtype bf16 --torch-adamw --lr LR --inputs ...` on
   the same checkpoint and batch, and compares the per-step losses.

Passes (exit 0) when every step's loss is within --tol (relative, default 0.5%) of
PyTorch's: bf16 noise only. Prints one line per step and writes --json if given.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--weft", default="./.gpu/weft")
p.add_argument("--seq", type=int, default=4096)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--lr", type=float, default=1e-4)
p.add_argument("--tol", type=float, default=5e-3)
p.add_argument("--json", default=None)
p.add_argument("--weft-args", default="", help="more flags for weft run, e.g. '--fused-loss'")
a = p.parse_args()

cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                  rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                  use_cache=False, attn_implementation="sdpa")
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(dtype=torch.bfloat16)
work = tempfile.mkdtemp(prefix="weft-parity-")
ckpt = os.path.join(work, "llama-1b")
model.save_pretrained(ckpt, safe_serialization=True)
gen = torch.Generator().manual_seed(1)
ids = torch.randint(0, cfg.vocab_size, (1, a.seq), generator=gen)
inputs = os.path.join(work, "inputs.safetensors")
save_file({"input_ids": ids.contiguous(), "labels": ids.clone().contiguous()}, inputs)

model = model.to("cuda").train()
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
ids_gpu = ids.to("cuda")
torch_losses = []
for _ in range(a.steps):
    loss = model(input_ids=ids_gpu, labels=ids_gpu).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch_losses.append(loss.item())
del model, opt
torch.cuda.empty_cache()

cmd = [a.weft, "run", ckpt, "--backend", "cuda", "--dtype", "bf16", "--torch-adamw", "--lr", str(a.lr),
       "--inputs", inputs, "--steps", str(a.steps), "--json"] + a.weft_args.split()
r = subprocess.run(cmd, capture_output=True, text=True)
if r.returncode != 0:
    print(r.stderr[-3000:], file=sys.stderr)
    sys.exit(f"weft run failed (rc {r.returncode}): {' '.join(cmd)}")
d = json.loads(r.stdout)
weft_losses = [s["loss"] for s in d["steps"]]
worst = 0.0
rows = []
for i, (t, w) in enumerate(zip(torch_losses, weft_losses)):
    rel = abs(w - t) / abs(t)
    worst = max(worst, rel)
    rows.append({"step": i + 1, "torch": t, "weft": w, "rel": rel})
    print(f"step {i + 1}: torch {t:.6f}  weft {w:.6f}  rel {rel:.2e}")
ok = len(weft_losses) == a.steps and worst <= a.tol
print(f"{'ok' if ok else 'FAILED'}: worst relative difference {worst:.2e} (tolerance {a.tol:.0e}), seq {a.seq}, lr {a.lr}")
if a.json:
    json.dump({"steps": rows, "worst": worst, "tol": a.tol, "ok": ok, "seq": a.seq, "lr": a.lr}, open(a.json, "w"), indent=1)
sys.exit(0 if ok else 1)
