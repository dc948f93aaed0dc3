#!/usr/bin/env python3
"""Burst against sustained rates of the roofline's two compute kernels (issue 20): a bf16
GEMM and PyTorch's cuDNN attention forward + backward at the 1.24B model's shape (32 query
/ 8 kv heads, head dim 64, causal, [B, S, H, D] memory), each run back to back for
--seconds while the SM clock, power and clock event reasons are sampled. The roofline's
rates were measured in short bursts; a training step holds the GPU at its power limit,
where the clock, and with it every compute-bound kernel, is lower.

    python3 bench/sustained_rates.py [--seconds 6] [--seq 4096 16384]

Prints, per kernel: the rate over the first 200 ms, over the last second, and the SM
clock and power sampled in that last second.
"""
import argparse
import subprocess
import threading
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

Q = "clocks.sm,power.draw,clocks_event_reasons.active"


class Sampler:
    """nvidia-smi every 50 ms on a thread: (host time, SM MHz, W, event reasons)."""

    def __init__(self):
        self.rows, self.stop = [], False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={Q}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.strip().split(", ")
            try:
                self.rows.append((time.time(), float(out[0]), float(out[1]), int(out[2], 16)))
            except (ValueError, IndexError):
                pass
            time.sleep(0.05)

    def window(self, t0, t1):
        r = [x for x in self.rows if t0 <= x[0] <= t1]
        if not r:
            return "no samples"
        cap = sum(1 for x in r if x[3] & 0x4)
        return (f"SM {sum(x[1] for x in r) / len(r):.0f} MHz (min {min(x[1] for x in r):.0f}), "
                f"{sum(x[2] for x in r) / len(r):.0f} W, power cap in {cap} of {len(r)} samples")


def run(name, fn, flop, seconds, sampler):
    """Back-to-back calls timed one by one with events for `seconds`."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    time.sleep(1.0)  # let the clock recover between kernels
    evs, t_start = [], time.time()
    host = []
    while time.time() - t_start < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        evs.append((a, b))
        host.append(time.time())
        if len(evs) % 8 == 0:
            evs[-8][1].synchronize()  # stay a few calls ahead, not seconds
    torch.cuda.synchronize()
    ms = [a.elapsed_time(b) for a, b in evs]
    t = 0.0
    first = []
    for m in ms:
        if t >= 200:
            break
        first.append(m)
        t += m
    last, t = [], 0.0
    for m in reversed(ms):
        if t >= 1000:
            break
        last.append(m)
        t += m
    rate = lambda xs: flop / (sum(xs) / len(xs) / 1e3) / 1e12
    t1 = host[-1]
    print(f"{name}: first 200 ms {rate(first):.0f} TFLOP/s, last second {rate(last):.0f} TFLOP/s "
          f"({rate(last) / rate(first):.3f}); last second: {sampler.window(t1 - 1.0, t1)}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    sampler = Sampler()
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    run(f"bf16 GEMM {n}^3", lambda: x @ w, 2 * n ** 3, a.seconds, sampler)
    # The step's own GEMM shapes at 4096 tokens: gate/up and down projections.
    t = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    wg = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16)
    run("bf16 GEMM 4096x2048x8192", lambda: t @ wg, 2 * 4096 * 2048 * 8192, a.seconds, sampler)
    del x, w, t, wg
    for s in a.seq:
        g = torch.Generator(device="cuda").manual_seed(0)

        def mk(h, grad=True):
            return torch.randn(1, s, h, 64, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2).requires_grad_(grad)

        q, k, v, do = mk(32), mk(8), mk(8), mk(32, False)

        def fwd_bwd():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            o.backward(do)

        fwd_flop = 4 * s * s * 64 * 32 / 2
        run(f"cuDNN attention fwd+bwd S={s}", fwd_bwd, 3.5 * fwd_flop, a.seconds, sampler)
    sampler.stop = True


if __name__ == "__main__":
    main()
