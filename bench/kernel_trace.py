#!/usr/bin/env python3
"""Sums a kernel_trace.tsv (bench/kernel_trace.c) by kernel: count, device ms, mean us,
grid and block, heaviest first. `--last-ms T` keeps only kernels that start in the last T
ms of the trace (one step of a run, where a step takes about T ms); `--match RE` keeps
names matching RE. Names are demangled with c++filt where it is installed.

`--by-step RE` instead splits the trace into steps at each kernel whose name matches RE
(the step's first kernel, e.g. `^embedding`) and prints per step its span, kernel time and
the time of each class (GEMM, attention, optimizer, other), then for the kernels `--match`
picks their mean us/call in each step: how a kernel's speed moves from step to step (the
clock under the power limit) where the per-kernel sum hides it."""
import argparse, collections, re, shutil, subprocess

p = argparse.ArgumentParser()
p.add_argument("tsv")
p.add_argument("--last-ms", type=float, default=0.0)
p.add_argument("--top", type=int, default=25)
p.add_argument("--match", default="")
p.add_argument("--width", type=int, default=110)
p.add_argument("--by-step", default="")
a = p.parse_args()

CLASSES = [("GEMM", re.compile(r"nvjet|gemm|cutlass|sm90_xmma")),
           ("attention", re.compile(r"sdpa|fmha|flash|cudnn")),
           ("optimizer", re.compile(r"adam|multi_tensor"))]


def demangled(rows):
    names = sorted({r[4] for r in rows})
    if shutil.which("c++filt"):
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
        if len(out) >= len(names):
            return dict(zip(names, out))
    return {n: n for n in names}


def klass(name):
    return next((c for c, r in CLASSES if r.search(name)), "other")

rows = []
with open(a.tsv) as f:
    next(f, None)
    for line in f:
        parts = line.rstrip("\n").split("\t", 7)
        if len(parts) == 8:
            rows.append((int(parts[0]), int(parts[1]), parts[3], parts[4], parts[7]))
if not rows:
    raise SystemExit(f"{a.tsv}: no kernels")
if a.by_step:
    rows.sort()
    mark = re.compile(a.by_step)
    starts = [i for i, r in enumerate(rows) if mark.search(r[4])]
    if not starts:
        raise SystemExit(f"{a.tsv}: no kernel matches --by-step {a.by_step!r}")
    pick = re.compile(a.match) if a.match else None
    pretty = demangled(rows)
    per_kernel = collections.defaultdict(list)
    for n, (i, j) in enumerate(zip(starts, starts[1:] + [len(rows)])):
        seg = rows[i:j]
        span = (max(s + d for s, d, *_ in seg) - seg[0][0]) / 1e6
        by = collections.defaultdict(int)
        for s, d, _, _, name in seg:
            by[klass(name)] += d
            if pick and pick.search(pretty[name]):
                per_kernel[pretty[name]].append((n, d))
        print(f"step {n + 1}: {len(seg)} kernels, span {span:.2f} ms, kernel time {sum(by.values()) / 1e6:.2f} ms: "
              + ", ".join(f"{c} {by[c] / 1e6:.2f}" for c in ["GEMM", "attention", "optimizer", "other"]))
    for name, xs in sorted(per_kernel.items()):
        steps = collections.defaultdict(list)
        for n, d in xs:
            steps[n].append(d)
        print(f"  {name[:a.width]}: us/call by step " + " ".join(f"{sum(v) / len(v) / 1e3:.1f}" for _, v in sorted(steps.items())))
    raise SystemExit(0)
if a.last_ms > 0:
    end = max(s + d for s, d, *_ in rows)
    rows = [r for r in rows if r[0] >= end - a.last_ms * 1e6]
pretty = demangled(rows)
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
