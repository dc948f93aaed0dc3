"""PyTorch side of the CPU executor's speed check (runtime/src/cpu/tests/llama.rs,
`speed_llama`): the same 2-layer, 512-hidden Llama at batch 1, sequence 512, forward +
backward in f32, plus the matmul throughput of `speed_gemm`. Usage: python3
torch_llama_512.py THREADS (pin cores with taskset for a fair comparison and give the
Rust side RAYON_NUM_THREADS=THREADS)."""
import sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
threads = int(sys.argv[1])
torch.set_num_threads(threads)
torch.manual_seed(0)
for impl in ["sdpa", "eager"]:
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                      attn_implementation=impl, use_cache=False)
    m = LlamaForCausalLM(cfg).float().train()
    ids = torch.randint(0, 32000, (1, 512))
    times = []
    for it in range(5):
        m.zero_grad(set_to_none=True)
        t = time.perf_counter()
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        times.append(time.perf_counter() - t)
    print(f"torch {torch.__version__} threads={threads} attn={impl}: fwd+bwd min {min(times):.3f}s all {[round(x,3) for x in times]}", flush=True)
for (m, k, n) in [(512, 512, 512), (512, 512, 1376), (512, 512, 32000)]:
    a = torch.ones(m, k); b = torch.ones(k, n); a @ b
    t = time.perf_counter()
    for _ in range(5): a @ b
    s = (time.perf_counter() - t) / 5
    print(f"torch gemm {m}x{k}x{n}: {s:.4f}s {2*m*k*n/s/1e9:.1f} GFLOP/s")
