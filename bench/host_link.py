"""Pinned host <-> device copy bandwidth on this GPU, alone and under a concurrent
bf16 GEMM load on another stream (what offloaded activations see during a step).
Usage: python3 bench/host_link.py  -> one line per case, GB/s (1e9 bytes/s)."""
import torch, time

def bw(fn, nbytes, reps=10):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - t) / 1e9

dev = torch.device("cuda")
copy = torch.cuda.Stream()
for mb in (64, 256, 512):
    n = mb << 20
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    h2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d2 = torch.empty(n, dtype=torch.uint8, device=dev)
    d2h = bw(lambda: h.copy_(d, non_blocking=True), n)
    h2d = bw(lambda: d.copy_(h, non_blocking=True), n)
    s2 = torch.cuda.Stream()
    def both():
        with torch.cuda.stream(copy):
            h.copy_(d, non_blocking=True)
        with torch.cuda.stream(s2):
            d2.copy_(h2, non_blocking=True)
    bi = bw(both, 2 * n)
    print(f"{mb:4d} MiB: d2h {d2h:6.1f} GB/s  h2d {h2d:6.1f} GB/s  both directions {bi:6.1f} GB/s total")
# Under load: GEMMs on the default stream, d2h on a side stream.
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
n = 512 << 20
d = torch.empty(n, dtype=torch.uint8, device=dev)
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
for _ in range(5):  # warm up cuBLAS
    a @ a
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(20):
    a @ a
torch.cuda.synchronize()
gemm_alone = (time.perf_counter() - t) / 20
torch.cuda.synchronize()
t = time.perf_counter()
ev = []
for _ in range(20):
    a @ a
torch.cuda.synchronize()
t0 = time.perf_counter()
with torch.cuda.stream(copy):
    for _ in range(4):
        h.copy_(d, non_blocking=True)
for _ in range(40):
    a @ a
copy.synchronize()
t_copy = time.perf_counter() - t0
torch.cuda.synchronize()
t_all = time.perf_counter() - t0
print(f"under GEMM load: d2h {4 * n / t_copy / 1e9:6.1f} GB/s; GEMM {2 * 8192**3 / gemm_alone / 1e12:5.0f} TFLOP/s alone, {40 * 2 * 8192**3 / t_all / 1e12:5.0f} with the copies")
