#!/usr/bin/env python3
"""PyTorch's fused attention alone, forward and backward apart, at the 1.24B model's
shape (batch 1, 32 query / 8 kv heads, head dim 64, bf16, causal; q/k/v/dO laid out as
[B, S, H, D] like Weft's `layout=bshd`, and as [B, H, S, D]; back to back and with L2
flushed before each call): the rate Weft's cuDNN attention is measured
against (issue 20; `weft run --profile-out` + bench/gap.py give Weft's side).

    python3 bench/attn_torch.py [--seq 4096 16384]
"""
import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_ms(fn, reps, flush=None):
    """Mean ms of `fn`; with `flush` (a large buffer) each call is timed alone after
    overwriting it, so the inputs come from HBM as in a training step, not from L2."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    if flush is None:
        ev[0][0].record()
        for _ in range(reps):
            fn()
        ev[0][1].record()
        torch.cuda.synchronize()
        return ev[0][0].elapsed_time(ev[0][1]) / reps
    for a, b in ev:
        flush.zero_()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sum(a.elapsed_time(b) for a, b in ev) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for s in a.seq:
        reps = max(4, 40 * 4096 // s)
        g = torch.Generator(device="cuda").manual_seed(0)
        fwd_flop = 4 * s * s * a.d * a.hq / 2
        for layout in ["bshd", "bhsd"]:
            def mk(h, grad=True):
                t = torch.randn(1, s, h, a.d, device="cuda", dtype=torch.bfloat16, generator=g)
                t = t.transpose(1, 2) if layout == "bshd" else t.transpose(1, 2).contiguous()
                return t.requires_grad_(grad)
            q, k, v = mk(a.hq), mk(a.hkv), mk(a.hkv)
            do = mk(a.hq, False)
            for name, be in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]:
                if name == "flash" and layout == "bhsd":
                    continue
                try:
                    with sdpa_kernel(be):
                        f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                        o = f()
                        b = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                        tf, tb = time_ms(f, reps), time_ms(b, reps)
                        tfc, tbc = time_ms(f, reps, flush), time_ms(b, reps, flush)
                    print(f"seq {s} {name} {layout} (o strides {tuple(o.stride())}): forward {tf:.3f} ms ({fwd_flop / tf / 1e9:.0f} TFLOP/s), "
                          f"backward {tb:.3f} ms ({2.5 * fwd_flop / tb / 1e9:.0f} TFLOP/s); L2 flushed {tfc:.3f} / {tbc:.3f} ms; "
                          f"x16 layers {16 * tfc:.2f} + {16 * tbc:.2f} ms")
                except Exception as e:
                    print(f"seq {s} {name} {layout}: {type(e).__name__}: {str(e)[:160]}")


if __name__ == "__main__":
    main()
