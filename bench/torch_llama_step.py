"""PyTorch baseline for `weft run llama3.2-1b --backend cuda`: one training step (forward,
backward, AdamW) of the 1.24B Llama-3-style model (hidden 2048, 16 layers, 32 heads, 8 kv
heads, intermediate 8192, vocab 128256, tied embeddings, rope theta 500000), bf16, batch 1.

Usage: python bench/torch_llama_step.py --seq 4096 --steps 8 [--compile] [--json out.json]
       [--window 4096 --attn sdpa|flex_attention]   (the same model as MistralForCausalLM
       with HF's sliding-window mask: SDPA with the materialized mask, or FlexAttention)
       [--ckpt] [--save-on-cpu]   (HF checkpointing; saved activations in pinned host memory)
       [--config dir/config.json]   (any HF architecture instead, e.g. bench/deepseek_stack)
Prints tokens/s (median step after warm-up) and peak memory.
"""
import argparse, json, time, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--seq", type=int, default=4096)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--compile", action="store_true")
p.add_argument("--ckpt", action="store_true", help="per-layer activation checkpointing (HF gradient_checkpointing)")
p.add_argument("--save-on-cpu", action="store_true", help="keep saved activations in pinned host memory (torch.autograd.graph.save_on_cpu)")
p.add_argument("--attn", default="sdpa")
p.add_argument("--json", default=None)
p.add_argument("--window", type=int, default=None, help="sliding window (MistralForCausalLM, same sizes)")
p.add_argument("--fp8", action="store_true", help="torchao float8 training (tensorwise dynamic scaling) on every nn.Linear but the lm_head; use with --compile")
p.add_argument("--kernels", action="store_true", help="after timing, one more step under torch.profiler: the top CUDA kernels by device time (PyTorch's in-step attention kernels against Weft's --profile-out)")
p.add_argument("--config", default=None, help="any HF config.json (or its directory) instead of the 1.24B model: the same step on AutoModelForCausalLM.from_config")
a = p.parse_args()

cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                  rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                  use_cache=False, attn_implementation=a.attn)
if a.window is not None:
    cfg = MistralConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                        tie_word_embeddings=True, rms_norm_eps=1e-5, sliding_window=a.window,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192},
                        use_cache=False, attn_implementation=a.attn)
torch.manual_seed(0)
if a.config is not None:
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(a.config)
    cfg.use_cache = False
    # built on the GPU directly: a multi-billion-parameter random init on the CPU takes minutes
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=a.attn, dtype=torch.bfloat16).train()
else:
    model = (MistralForCausalLM if a.window is not None else LlamaForCausalLM)(cfg).to(device="cuda", dtype=torch.bfloat16).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
if a.ckpt:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
if a.fp8:
    from torchao.float8 import convert_to_float8_training
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "lm_head")
step_fn = model
if a.compile:
    step_fn = torch.compile(model)
ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")

import contextlib
def step():
    with (torch.autograd.graph.save_on_cpu(pin_memory=True) if a.save_on_cpu else contextlib.nullcontext()):
        out = step_fn(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss

t0 = time.perf_counter()
step(); torch.cuda.synchronize()
first = time.perf_counter() - t0
times = []
torch.cuda.reset_peak_memory_stats()
for i in range(a.steps):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); loss = step(); e.record(); torch.cuda.synchronize()
    times.append(s.elapsed_time(e) / 1e3)
times.sort()
med = times[len(times) // 2]
tok = a.batch * a.seq / med
peak = torch.cuda.max_memory_allocated() / 2**30
res = {"impl": ("torch.compile" if a.compile else "torch eager") + (" + torchao float8" if a.fp8 else "") + (" + checkpointing" if a.ckpt else "") + (" + save_on_cpu" if a.save_on_cpu else "") + (f" window {a.window} ({a.attn})" if a.window else ""), "seq": a.seq, "batch": a.batch, "median_step_s": med,
       "tokens_per_s": tok, "first_step_s": first, "peak_gib": peak, "loss": float(loss), "torch": torch.__version__}
if a.kernels:
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(); torch.cuda.synchronize()
    per = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            n, c = per.get(ev.name, (0.0, 0))
            per[ev.name] = (n + ev.device_time_total / 1e3, c + 1)
    total = sum(t for t, _ in per.values())
    print(f"kernels of one profiled step: {total:.2f} ms of device time")
    for name, (ms, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"  {ms:9.3f} ms {n:5d}x  {name[:110]}")
print(json.dumps(res))
if a.json:
    json.dump(res, open(a.json, "w"))
