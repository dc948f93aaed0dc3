#!/usr/bin/env python3
"""How far PyTorch's own bf16 step-1 gradients are from its float32 ones on the same
weights (the scale for reading `loss_parity.py --grads`): a random Llama of L layers,
hidden H, seq S, tied embeddings, one batch; runs on the CPU.

    python3 bench/bf16_gap.py L H S      e.g. 8 512 512
"""
import statistics
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

if len(sys.argv) != 4:
    sys.exit(__doc__)
L, H, S = (int(x) for x in sys.argv[1:])
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=4096, hidden_size=H, intermediate_size=4 * H, num_hidden_layers=L,
                  num_attention_heads=max(1, H // 64), num_key_value_heads=max(1, H // 256),
                  tie_word_embeddings=True, attn_implementation="sdpa")
m = LlamaForCausalLM(cfg).to(torch.bfloat16)
ids = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(1))


def grads(model):
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters()}


bf16 = grads(m)
m32 = LlamaForCausalLM(cfg)
m32.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
f32 = grads(m32)
rel = {n: ((bf16[n] - f32[n]).norm() / f32[n].norm()).item() for n in bf16}
top = [v for n, v in rel.items() if f"layers.{L - 1}." in n]
print(f"L={L} H={H} S={S}: bf16 against float32 step-1 gradients, relative L2: median "
      f"{statistics.median(rel.values()):.2e}, max {max(rel.values()):.2e}, last layer median "
      f"{statistics.median(top):.2e}, final norm {rel['model.norm.weight']:.2e}")
