#!/usr/bin/env python3
"""Where a step's time goes against its plan (issue 20): reads `weft run --profile-out`'s
per-instruction table and ranks the instructions by measured minus predicted device time,
grouped by op and the source layer's kind (the layer index dropped: q_proj of every layer
is one row), forward and backward apart (an instruction whose source names a gradient, or
that runs after the loss, is backward).

    weft run MODEL --backend cuda --steps 3 ... --profile-out prof.tsv
    python3 bench/gap.py prof.tsv [--top 25]
"""
import re
import sys
from collections import defaultdict


def main():
    args = sys.argv[1:]
    top = 25
    if "--top" in args:
        top = int(args[args.index("--top") + 1])
    rows = [l.rstrip("\n").split("\t") for l in open(args[0])][1:]
    loss_at = next((k for k, r in enumerate(rows) if "cross_entropy" in r[1]), len(rows))
    groups = defaultdict(lambda: [0, 0.0, 0.0])
    for k, (idx, op, source, pred, meas) in enumerate(rows):
        kind = re.sub(r"\.\d+\.", ".*.", source)
        phase = "bwd" if k > loss_at or "grad" in op else "fwd"
        g = groups[(phase, op, kind)]
        g[0] += 1
        g[1] += float(pred)
        g[2] += float(meas)
    tp = sum(g[1] for g in groups.values())
    tm = sum(g[2] for g in groups.values())
    print(f"{'phase':<5} {'op':<32} {'source':<40} {'n':>4} {'pred ms':>9} {'meas ms':>9} {'gap ms':>8} {'meas/pred':>9}")
    for (phase, op, kind), (n, p, m) in sorted(groups.items(), key=lambda kv: -(kv[1][2] - kv[1][1]))[:top]:
        ratio = f"{m / p:.2f}" if p > 0 else "-"
        print(f"{phase:<5} {op[:32]:<32} {kind[:40]:<40} {n:>4} {p:>9.2f} {m:>9.2f} {m - p:>8.2f} {ratio:>9}")
    print(f"{'step':<5} {'':<32} {'':<40} {len(rows):>4} {tp:>9.2f} {tm:>9.2f} {tm - tp:>8.2f} {tm / tp if tp else 0:>9.2f}")


if __name__ == "__main__":
    main()
