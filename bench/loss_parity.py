#!/usr/bin/env python3
"""Loss parity with PyTorch on real weights (issue 20's check), run on the GPU machine:

    python3 bench/loss_parity.py --weft ./.gpu/weft [--seq 4096] [--steps 4] [--lr 1e-4]
        [--weft-args "--fused-loss"] [--weft ./.gpu/weftA ...] [--weft-runs 2]

1. Builds the 1.24B Llama-3-style model (the `llama3.2-1b` preset's config) with
   transformers from seed 0 and writes it with `save_pretrained` (config.json +
   model.safetensors, tied embeddings) to a temporary directory, in bf16.
2. Draws one fixed batch (seed 1; labels = input_ids, HF shifts them) and saves it as
   `--inputs` safetensors.
3. Trains PyTorch (bf16 params, fused AdamW in the params' dtype, betas 0.9/0.95, eps
   1e-8, weight decay 0.1) `--steps` steps on that batch and records each step's loss,
   `--torch-runs` times from the saved weights: their spread is the run-to-run noise
   (cuDNN's attention backward accumulates with atomics, and AdamW's first steps move
   each weight by about lr whatever its gradient's size, so the noise grows by step).
4. Runs `weft run DIR --backend cuda --dtype bf16 --torch-adamw --lr LR --inputs ...` on
   the same checkpoint and batch, and compares the per-step losses; with several
   `--weft` binaries (or `--weft-runs` above 1), each binary's runs are compared in turn,
   against PyTorch and against each other (Weft's own run-to-run noise).

With `--grads`, it first compares the step-1 gradients, tensor by tensor, before any
update: PyTorch's twice (its own noise) and Weft's (`weft run --grads-out`, the first
`--weft` binary), each tensor's relative L2 difference and the fraction of its elements
whose sign differs (AdamW's first step moves each weight by about lr times that sign), by
kind of tensor and the worst ten; and both bf16 runs against PyTorch's in float32 from the
same weights (which of the two is nearer the exact gradient).

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
p.add_argument("--weft", action="append", help="a weft binary (repeat to compare builds; default ./.gpu/weft)")
p.add_argument("--weft-runs", type=int, default=1, help="runs of each --weft binary")
p.add_argument("--seq", type=int, default=4096)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--lr", type=float, default=1e-4)
p.add_argument("--tol", type=float, default=5e-3)
p.add_argument("--json", default=None)
p.add_argument("--weft-args", default="", help="more flags for weft run, e.g. '--fused-loss'")
p.add_argument("--grads", action="store_true", help="compare the step-1 gradients tensor by tensor first")
p.add_argument("--torch-runs", type=int, default=2, help="PyTorch runs from the same weights (their spread is printed as the noise floor)")
a = p.parse_args()
if a.torch_runs < 1 or a.steps < 1 or a.weft_runs < 1:
    p.error("--torch-runs, --weft-runs and --steps must be at least 1")
a.weft = a.weft or ["./.gpu/weft"]

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

ids_gpu = ids.to("cuda")


def train_torch():
    """PyTorch's losses from the saved weights (cuDNN's attention backward accumulates with
    atomics, so two runs need not agree bit for bit)."""
    m = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="sdpa").to("cuda").train()
    opt = torch.optim.AdamW(m.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    losses = []
    for _ in range(a.steps):
        loss = m(input_ids=ids_gpu, labels=ids_gpu).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    del m, opt
    torch.cuda.empty_cache()
    return losses


del model


def run_weft(binary, steps, *extra, dtype="bf16"):
    """`weft run` on the same checkpoint and batch as PyTorch's; its stdout."""
    cmd = [binary, "run", ckpt, "--backend", "cuda", "--dtype", dtype, "--torch-adamw", "--lr", str(a.lr),
           "--inputs", inputs, "--steps", str(steps), *extra] + a.weft_args.split()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr[-3000:], file=sys.stderr)
        sys.exit(f"weft run failed (rc {r.returncode}): {' '.join(cmd)}")
    return r.stdout


def torch_grads(dtype=torch.bfloat16):
    """PyTorch's step-1 gradients (f32 on the host) from the saved weights, the model run in
    `dtype` (float32: the reference both bf16 runs are read against)."""
    m = LlamaForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation="sdpa").to("cuda").train()
    m(input_ids=ids_gpu, labels=ids_gpu).loss.backward()
    g = {"grad." + n: p.grad.float().cpu() for n, p in m.named_parameters()}
    del m
    torch.cuda.empty_cache()
    return g


def kind(name):
    """The tensor's kind: its parameter name without the layer index."""
    parts = name.split(".")
    return ".".join(x for x in parts if not x.isdigit())


def compare_grads():
    from safetensors.torch import load_file
    ref, again, exact = torch_grads(), torch_grads(), torch_grads(torch.float32)
    out = os.path.join(work, "weft_grads.safetensors")
    run_weft(a.weft[0], 1, "--grads-out", out)
    weft = load_file(out)
    # Weft in float32 against PyTorch in float32: the two programs' math, without bf16's rounding.
    run_weft(a.weft[0], 1, "--grads-out", out, dtype="f32")
    weft32 = load_file(out)
    unmatched = sorted(set(ref) ^ set(weft))
    if unmatched:
        print(f"gradients only one side has (not compared): {unmatched[:8]}")

    def diff(x, y):
        rel = ((x - y).norm() / y.norm().clamp_min(1e-30)).item()
        nz = y != 0
        flips = ((torch.sign(x) != torch.sign(y)) & nz).sum().item() / max(nz.sum().item(), 1)
        return rel, flips

    rows = []
    for n in sorted(set(ref) & set(weft)):
        w_rel, w_flip = diff(weft[n], ref[n])
        t_rel, t_flip = diff(again[n], ref[n])
        w32, _ = diff(weft[n], exact[n])
        t32, _ = diff(ref[n], exact[n])
        f32, _ = diff(weft32[n], exact[n])
        rows.append((n, w_rel, w_flip, t_rel, t_flip, w32, t32, f32))
    by_kind = {}
    for n, *v in rows:
        by_kind.setdefault(kind(n), []).append(v)
    print("step-1 gradients, mean over layers: relative L2 difference and sign flips, Weft against PyTorch "
          "(PyTorch against itself); each bf16 run against PyTorch in float32; Weft in float32 against it")
    for k, vs in sorted(by_kind.items()):
        m = [sum(v[i] for v in vs) / len(vs) for i in range(7)]
        print(f"grad {k.removeprefix('grad.'):<52} rel {m[0]:.2e} ({m[2]:.2e})  flips {m[1]:.2e} ({m[3]:.2e})"
              f"  to f32: Weft {m[4]:.2e}, PyTorch {m[5]:.2e}; f32 Weft {m[6]:.2e}")
    for n, w_rel, w_flip, t_rel, t_flip, w32, t32, f32 in sorted(rows, key=lambda r: -r[1])[:10]:
        print(f"grad worst {n.removeprefix('grad.'):<52} rel {w_rel:.2e} ({t_rel:.2e})  flips {w_flip:.2e} ({t_flip:.2e})"
              f"  to f32: Weft {w32:.2e}, PyTorch {t32:.2e}; f32 Weft {f32:.2e}")
    del ref, again, exact, weft, weft32


if a.grads:
    compare_grads()
runs = [train_torch() for _ in range(a.torch_runs)]
torch_losses = runs[0]
# PyTorch against itself: the run-to-run noise floor Weft's difference is read against.
noise = [max(abs(r[i] - runs[0][i]) / abs(runs[0][i]) for r in runs) for i in range(a.steps)]


def train_weft(binary):
    """Weft's per-step losses."""
    return [s["loss"] for s in json.loads(run_weft(binary, a.steps, "--json"))["steps"]]


worst = 0.0
complete = True
rows = []
weft_runs = {}
for binary in a.weft:
    for _ in range(a.weft_runs):
        weft_losses = train_weft(binary)
        complete &= len(weft_losses) == a.steps
        weft_runs.setdefault(binary, []).append(weft_losses)
        run, first = len(weft_runs[binary]), weft_runs[binary][0]
        for i, (t, w) in enumerate(zip(torch_losses, weft_losses)):
            rel = abs(w - t) / abs(t)
            own = abs(w - first[i]) / abs(first[i])
            worst = max(worst, rel)
            rows.append({"weft": binary, "run": run, "step": i + 1, "torch": t, "weft_loss": w, "rel": rel,
                         "torch_noise": noise[i], "weft_vs_its_first_run": own})
            print(f"{binary} run {run} step {i + 1}: torch {t:.6f}  weft {w:.6f}  rel {rel:.2e}  "
                  f"(torch against itself {noise[i]:.2e}, this build against its first run {own:.2e})")
ok = complete and worst <= a.tol
print(f"{'ok' if ok else 'FAILED'}: worst relative difference {worst:.2e} (tolerance {a.tol:.0e}), seq {a.seq}, lr {a.lr}")
if a.json:
    json.dump({"steps": rows, "worst": worst, "tol": a.tol, "ok": ok, "seq": a.seq, "lr": a.lr,
               "torch_runs": runs, "weft_runs": weft_runs}, open(a.json, "w"), indent=1)
sys.exit(0 if ok else 1)
