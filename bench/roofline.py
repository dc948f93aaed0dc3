#!/usr/bin/env python3
"""Roofline of one training step (issue 20): per op class, the time at fixed rates (the
roofline), the time the plan predicts (its cost model, fitted to the kernels Weft runs),
the time the GPU measured (WEFT_PROFILE), and the gaps.

    weft run MODEL --seq S --batch 1 --dtype bf16 --torch-adamw --plan-out plan.json ...
    weft inspect plan.json --trace trace.json
    WEFT_PROFILE=1 weft run MODEL --backend cuda --seq S ... 2> profile.txt
    python3 bench/roofline.py trace.json [profile.txt] [--tokens B*S]
        [--rates gemm=790,attention=341,hbm=4300]

The roofline column prices each instruction on the compute stream (and each optimizer
update on the update stream) at
max(FLOPs / rate, bytes / HBM bandwidth), with the plan's own FLOP and byte counts (the
bytes its kernels read and write, so fusion shows); GEMMs (and the fused lm_head +
cross-entropy) at the `gemm` rate in TFLOP/s, attention forward and backward at
`attention` (TFLOP/s over the causal FLOPs the plan counts), everything else at `hbm`
(GB/s). Instructions the plan prices at zero (views) are left out. Without a profile
(no GPU) only the roofline and the prediction are printed.
"""
import json
import re
import sys
from collections import defaultdict

CLASSES = [
    ("GEMM", {"matmul", "linear", "batched_matmul", "grouped_matmul"}),
    ("attention", {"attention", "attention_grad"}),
    ("cross-entropy", {"cross_entropy", "cross_entropy_grad", "log_softmax", "softmax_cross_entropy"}),
    ("norms", {"rms_norm", "rms_norm_grad", "layer_norm", "layer_norm_grad", "add_rms_norm", "add_rms_norm_grad"}),
    ("optimizer", {"adamw", "sgd", "adamw_master"}),
    ("collectives", {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v"}),
    ("MoE routing", {"topk", "moe_dispatch", "moe_combine", "moe_combine_grad", "one_hot", "scatter_add", "index_select", "gather"}),
]


def op_class(op):
    base = op.split(" ")[0]
    for name, ops in CLASSES:
        if base in ops or any(base.startswith(o) for o in ops):
            return name
    if base in {"reshape", "transpose", "permute", "copy", "concat", "slice", "(update copies)", "expand", "broadcast"}:
        return "layout and copies"
    return "elementwise, rope, embedding, casts"


def roofline_ms(name, flops, bytes_, rates):
    """One instruction's time at the rates: the larger of its compute and memory times
    (GEMMs, the fused lm_head + loss among them, at the GEMM rate; attention at its own)."""
    rate = {"GEMM": rates["gemm"], "attention": rates["attention"]}.get(op_class(name))
    compute = flops / (rate * 1e12) if rate else 0.0
    return 1e3 * max(compute, bytes_ / (rates["hbm"] * 1e9))


def parse_rates(text):
    rates = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in ("gemm", "attention", "hbm") or not value:
            sys.exit(f"--rates: expected gemm=TFLOPS,attention=TFLOPS,hbm=GBPS, got `{part}`")
        rates[key] = float(value)
        if rates[key] <= 0:
            sys.exit(f"--rates: `{key}` must be positive")
    missing = {"gemm", "attention", "hbm"} - set(rates)
    if missing:
        sys.exit(f"--rates: missing {', '.join(sorted(missing))}")
    return rates


def main():
    argv = sys.argv[1:]
    opts = {}
    for flag in ("--tokens", "--rates"):
        if flag in argv:
            i = argv.index(flag)
            if i + 1 >= len(argv):
                sys.exit(f"{flag} needs a value")
            opts[flag] = argv[i + 1]
            del argv[i:i + 2]
    if not argv or len(argv) > 2:
        sys.exit(__doc__)
    tokens = float(opts["--tokens"]) if "--tokens" in opts else None
    rates = parse_rates(opts["--rates"]) if "--rates" in opts else None
    trace, profile = argv[0], argv[1] if len(argv) > 1 else None
    d = json.load(open(trace))
    events = d["traceEvents"] if isinstance(d, dict) else d
    pred = defaultdict(float)
    roof = defaultdict(float)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"]
    # The plan's step: its streams overlap, so not the sum of the rows.
    plan_step_ms = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3 if spans else 0.0
    for e in events:
        if e.get("ph") != "X" or e["dur"] <= 0:
            continue
        c = op_class(e["name"])
        # The compute stream, and the optimizer updates on their own stream (tid 4,
        # the default since session 27): the roofline counts the update's bytes wherever
        # it runs; the host's update (`host_adamw`, also tid 4) is not device work.
        if e.get("tid") == 0 or (e.get("tid") == 4 and c == "optimizer"):
            pred[c] += e["dur"] / 1e3
            if rates:
                args = e.get("args", {})
                roof[c] += roofline_ms(e["name"], args.get("flops", 0.0), args.get("bytes", 0.0), rates)
    meas = defaultdict(float)
    row = re.compile(r"^\s+([0-9.]+) ms\s+[0-9.]+%\s+(\d+)x\s+(.*)$")
    if profile:
        for line in open(profile):
            m = row.match(line)
            if m:
                meas[op_class(m.group(3).strip())] += float(m.group(1))
    cols = (["roofline ms"] if rates else []) + ["predicted ms"] + (["measured ms", "measured/predicted"] if profile else [])
    if rates and profile:
        cols.append("measured/roofline")
    print(f"{'op class':<38}" + "".join(f"{c:>20}" for c in cols))

    def line(label, r, p, m):
        cells = ([f"{r:.2f}"] if rates else []) + [f"{p:.2f}"]
        if profile:
            cells += [f"{m:.2f}", f"{m / p:.2f}x" if p > 0 else "-"]
            if rates:
                cells.append(f"{m / r:.2f}x" if r > 0 else "-")
        print(f"{label:<38}" + "".join(f"{c:>20}" for c in cells))

    classes = set(pred) | set(meas)
    for c in sorted(classes, key=lambda c: (-meas.get(c, 0), -pred.get(c, 0), c)):
        line(c, roof.get(c, 0.0), pred.get(c, 0.0), meas.get(c, 0.0))
    tr, tp, tm = sum(roof.values()), sum(pred.values()), sum(meas.values())
    line("step", tr, tp, tm)
    if tokens:
        parts = []
        if rates and tr > 0:
            parts.append(f"roofline {tokens / (tr / 1e3):,.0f} tok/s (at {opts['--rates']})")
        if plan_step_ms > 0:
            parts.append(f"the plan predicts {tokens / (plan_step_ms / 1e3):,.0f} ({plan_step_ms:.2f} ms a step)")
        if profile and tm > 0:
            parts.append(f"measured device time gives {tokens / (tm / 1e3):,.0f}"
                         + (f", {100 * tr / tm:.0f}% of the roofline" if rates and tr > 0 else "")
                         + f", {100 * tp / tm:.0f}% of the prediction")
        print("; ".join(parts))


if __name__ == "__main__":
    main()
