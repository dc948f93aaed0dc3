#!/usr/bin/env python3
"""Sums a kernel_trace.tsv (bench/kernel_trace.c) by kernel: count, device ms, mean us,
grid and block, heaviest first. `--last-ms T` keeps only kernels that start in the last T
ms of the trace (one step of a run, where a step takes about T ms); `--match RE` keeps
names matching RE. Names are demangled with c++filt where it is installed."""
import argparse, collections, re, shutil, subprocess

p = argparse.ArgumentParser()
p.add_argument("tsv")
p.add_argument("--last-ms", type=float, default=0.0)
p.add_argument("--top", type=int, default=25)
p.add_argument("--match", default="")
p.add_argument("--width", type=int, default=110)
a = p.parse_args()

rows = []
with open(a.tsv) as f:
    next(f, None)
    for line in f:
        parts = line.rstrip("\n").split("\t", 7)
        if len(parts) == 8:
            rows.append((int(parts[0]), int(parts[1]), parts[3], parts[4], parts[7]))
if not rows:
    raise SystemExit(f"{a.tsv}: no kernels")
if a.last_ms > 0:
    end = max(s + d for s, d, *_ in rows)
    rows = [r for r in rows if r[0] >= end - a.last_ms * 1e6]
names = sorted({r[4] for r in rows})
if shutil.which("c++filt"):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    pretty = dict(zip(names, out)) if len(out) >= len(names) else {n: n for n in names}
else:
    pretty = {n: n for n in names}
sums = collections.defaultdict(lambda: [0, 0, "", ""])
for s, d, grid, block, name in rows:
    e = sums[name]
    e[0] += 1; e[1] += d; e[2] = grid; e[3] = block
pick = re.compile(a.match) if a.match else None
total = sum(e[1] for e in sums.values())
span = (max(s + d for s, d, *_ in rows) - min(s for s, *_ in rows)) / 1e6
print(f"{len(rows)} kernels, {total/1e6:.2f} ms of kernel time in a {span:.2f} ms span")
for name, (n, d, grid, block) in sorted(sums.items(), key=lambda kv: -kv[1][1]):
    if pick and not pick.search(pretty[name]):
        continue
    print(f"{d/1e6:10.3f} ms {n:6d}x {d/n/1e3:9.1f} us  grid {grid:>14} block {block:>9}  {pretty[name][:a.width]}")
    a.top -= 1
    if a.top == 0:
        break
