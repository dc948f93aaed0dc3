#!/usr/bin/env python3
"""Roofline of one training step (issue 20): per op class, the time the plan predicts at
the device profile's measured rates (bf16 GEMM, fused attention, HBM bandwidth), the time
the GPU measured (WEFT_PROFILE), and the gap.

    weft compile MODEL --seq S --batch 1 --dtype bf16 -o plan.json
    weft inspect plan.json --trace trace.json
    WEFT_PROFILE=1 weft run MODEL --backend cuda --seq S ... 2> profile.txt
    python3 bench/roofline.py trace.json profile.txt [--tokens B*S]

The predicted column is the plan's cost model (compute stream only: what the step waits
on); the measured one is the sum of device time between instruction events on stream 0.
"""
import json
import re
import sys
from collections import defaultdict

CLASSES = [
    ("GEMM", {"matmul", "linear", "batched_matmul"}),
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


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tokens = None
    if "--tokens" in sys.argv:
        tokens = float(sys.argv[sys.argv.index("--tokens") + 1])
        args = [a for a in args if a != sys.argv[sys.argv.index("--tokens") + 1]]
    trace, profile = args[0], args[1]
    d = json.load(open(trace))
    events = d["traceEvents"] if isinstance(d, dict) else d
    pred = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e.get("tid") == 0:
            pred[op_class(e["name"])] += e["dur"] / 1e3
    meas = defaultdict(float)
    row = re.compile(r"^\s+([0-9.]+) ms\s+[0-9.]+%\s+(\d+)x\s+(.*)$")
    for line in open(profile):
        m = row.match(line)
        if m:
            meas[op_class(m.group(3).strip())] += float(m.group(1))
    tp, tm = sum(pred.values()), sum(meas.values())
    print(f"{'op class':<38}{'predicted ms':>14}{'measured ms':>13}{'gap ms':>10}{'measured/predicted':>20}")
    for c in sorted(set(pred) | set(meas), key=lambda c: -meas.get(c, 0)):
        p, m = pred.get(c, 0.0), meas.get(c, 0.0)
        ratio = f"{m / p:.2f}x" if p > 0 else "-"
        print(f"{c:<38}{p:>14.2f}{m:>13.2f}{m - p:>10.2f}{ratio:>20}")
    print(f"{'step':<38}{tp:>14.2f}{tm:>13.2f}{tm - tp:>10.2f}{(tm / tp if tp else 0):>19.2f}x")
    if tokens and tp > 0 and tm > 0:
        print(f"roofline {tokens / (tp / 1e3):,.0f} tok/s (the plan's prediction); measured device time gives {tokens / (tm / 1e3):,.0f} tok/s, {100 * tp / tm:.0f}% of the roofline")


if __name__ == "__main__":
    main()
