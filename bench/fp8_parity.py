"""FP8 convergence parity (issue 20): the same model, data and optimizer trained twice by
`weft run`, in bf16 and with --fp8, and the per-step losses compared: the mean loss of the
last 50 steps must be within 1% of bf16's, and no step more than 3% away.

Usage (on the GPU machine, after bench/fp8_data/make_data.py made the tokens here and
they were carried):
    python3 bench/fp8_parity.py --weft ./.gpu/weft --data .gpu/fp8_tokens.u16 \
        [--config bench/fp8_data/config.json] [--steps 200] [--seq 4096] [--lr 3e-4] [--out dir]
Prints one JSON object (and writes it, with both loss curves, to OUT/fp8_parity.json).
"""
import argparse, json, os, subprocess, sys

p = argparse.ArgumentParser()
p.add_argument("--weft", default="./.gpu/weft")
p.add_argument("--config", default="bench/fp8_data/config.json")
p.add_argument("--data", required=True)
p.add_argument("--steps", type=int, default=200)
p.add_argument("--seq", type=int, default=4096)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--lr", type=float, default=3e-4)
p.add_argument("--out", default=".")
p.add_argument("--backend", default="cuda")
p.add_argument("--extra", default="", help="more weft run flags for both runs")
a = p.parse_args()


def train(fp8):
    cmd = [a.weft, "run", a.config, "--backend", a.backend, "--dtype", "bf16", "--data", a.data,
           "--seq", str(a.seq), "--batch", str(a.batch), "--steps", str(a.steps), "--lr", str(a.lr),
           "--json"] + a.extra.split() + (["--fp8"] if fp8 else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-4000:])
        raise SystemExit(f"{' '.join(cmd)} failed with {r.returncode}")
    steps = []
    try:
        # The CUDA backend prints one JSON document with every step under "steps".
        doc = json.loads(r.stdout)
        if isinstance(doc, dict) and isinstance(doc.get("steps"), list):
            return cmd, [s for s in doc["steps"] if "loss" in s], r.stderr
    except ValueError:
        pass
    # The CPU backend prints JSON lines, one a step.
    for l in r.stdout.splitlines():
        try:
            s = json.loads(l)
        except ValueError:
            continue
        if isinstance(s, dict) and "loss" in s:
            steps.append(s)
    return cmd, steps, r.stderr


runs = {}
for name, fp8 in [("bf16", False), ("fp8", True)]:
    cmd, steps, err = train(fp8)
    runs[name] = {"cmd": " ".join(cmd), "loss": [s["loss"] for s in steps],
                  "step_s": [s.get("step_s") for s in steps], "stderr_tail": err[-1500:]}
b, f = runs["bf16"]["loss"], runs["fp8"]["loss"]
n = min(len(b), len(f))
if n == 0:
    raise SystemExit(f"no steps parsed: bf16 {len(b)}, fp8 {len(f)}; stderr: {runs['fp8']['stderr_tail']}")
last = min(50, n)
mb, mf = sum(b[n - last:n]) / last, sum(f[n - last:n]) / last
rel = [abs(f[i] - b[i]) / abs(b[i]) for i in range(n)]
worst = max(range(n), key=lambda i: rel[i])
med = lambda xs: sorted(xs)[len(xs) // 2]
res = {
    "steps": n, "seq": a.seq, "batch": a.batch, "lr": a.lr,
    "mean_last50_bf16": mb, "mean_last50_fp8": mf, "mean_last50_rel": abs(mf - mb) / mb,
    "max_step_rel": rel[worst], "max_step": worst + 1,
    "first_loss": [b[0], f[0]], "last_loss": [b[n - 1], f[n - 1]],
    "median_step_s_bf16": med(runs["bf16"]["step_s"][1:]), "median_step_s_fp8": med(runs["fp8"]["step_s"][1:]),
    "pass": abs(mf - mb) / mb <= 0.01 and rel[worst] <= 0.03,
}
print(json.dumps(res))
os.makedirs(a.out, exist_ok=True)
json.dump({"summary": res, "runs": runs}, open(os.path.join(a.out, "fp8_parity.json"), "w"), indent=1)
