#!/usr/bin/env python3
"""An independent check of the frontend graphs: interprets weft text IR with torch in
float64 (op semantics as documented in ir/src/ops.rs) and compares loss and logits with
the HF float64 references of the fixtures.

    WEFT_DUMP_DIR=/tmp/irdump cargo test -p weft-frontends --test fixtures -- --ignored dump
    /tmp/tv/bin/python frontends/scripts/eval_ir.py /tmp/irdump tests/fixtures

Needs torch and safetensors (a throwaway venv; not a build dependency). Differences of
~1e-6 are the f32 storage of the references.
"""
import re, sys, math, torch
from safetensors.torch import load_file

def split_top(s, sep=','):
    out, depth, cur, q = [], 0, '', False
    for c in s:
        if c == '"': q = not q
        if not q:
            if c in '[({': depth += 1
            if c in '])}': depth -= 1
            if c == sep and depth == 0:
                out.append(cur.strip()); cur = ''; continue
        cur += c
    if cur.strip(): out.append(cur.strip())
    return out

def parse_attrs(s):
    d = {}
    for part in split_top(s):
        k, v = part.split('=', 1)
        d[k.strip()] = v.strip()
    return d

def dim_eval(s, env):
    return int(eval(s.replace('B', str(env['B'])).replace('S', str(env['S']))))

def rope_inv_freq(theta, dim, scaling):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if scaling.startswith('linear'):
        f = float(scaling[7:-1]); inv = inv / f
    elif scaling.startswith('llama3'):
        f, lo, hi, orig = [float(x) for x in scaling[7:-1].split(',')]
        low_wl, high_wl = orig / lo, orig / hi
        wl = 2 * math.pi / inv
        out = torch.where(wl > low_wl, inv / f, inv)
        smooth = (orig / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / f + smooth * out
        med = ~(wl < high_wl) & ~(wl > low_wl)
        inv = torch.where(med, smoothed, out)
    return inv

def run(text, weights, inputs):
    vals = {}
    env = {'B': inputs['input_ids'].shape[0], 'S': inputs['input_ids'].shape[1]}
    outs = {}
    for line in text.splitlines():
        line = line.split('  #')[0].strip()
        if not line or line.startswith('graph'): continue
        if line.startswith('return'):
            for p in split_top(line[len('return'):]):
                k, v = p.split('='); outs[k] = vals[v]
            continue
        lhs, rhs = line.split(' = ', 1)
        res = [r.split(':')[0].strip() for r in re.findall(r'%\d+:', lhs)]
        m = re.match(r'(\w+)\s*([^{]*)(\{.*\})?$', rhs)
        op, args, attrs = m.group(1), m.group(2), m.group(3)
        args = [vals[a.strip()] for a in args.split(',') if a.strip()]
        at = parse_attrs(attrs[1:-1]) if attrs else {}
        r = None
        if op == 'input': r = inputs[at['name'].strip('"')]
        elif op == 'param': r = weights[at['name'].strip('"')].double()
        elif op == 'embedding': r = args[1][args[0]]
        elif op == 'arange': r = torch.arange(env['S'])
        elif op == 'reshape':
            shape = [dim_eval(x, env) for x in split_top(at['shape'][1:-1])]
            r = args[0].reshape(shape)
        elif op == 'rope_table':
            theta, dim = float(at['theta']), int(at['dim'])
            inv = rope_inv_freq(theta, dim, at['scaling'])
            fr = args[0].double()[..., None] * inv
            emb = torch.cat([fr, fr], -1)
            r = [emb.cos(), emb.sin()]
        elif op == 'rms_norm':
            x, w = args; eps = float(at['eps'])
            r = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        elif op == 'linear':
            r = args[0] @ args[1].T + (args[2] if len(args) > 2 else 0)
        elif op == 'transpose': r = args[0].transpose(int(at['dim0']), int(at['dim1']))
        elif op == 'rope':
            x, c, s = args; rd = c.shape[-1]
            c = c[:, None]; s = s[:, None]
            xr, xp = x[..., :rd], x[..., rd:]
            x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
            rot = torch.cat([-x2, x1], -1)
            r = torch.cat([xr * c + rot * s, xp], -1)
        elif op == 'attention':
            q, k, v = args; g = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(g, 1); v = v.repeat_interleave(g, 1)
            sc = (q @ k.transpose(-1, -2)) * float(at['scale'])
            S = q.shape[2]
            mask = torch.ones(S, S, dtype=torch.bool).tril()
            sc = sc.masked_fill(~mask, float('-inf'))
            r = sc.softmax(-1) @ v
        elif op == 'add': r = args[0] + args[1]
        elif op == 'mul': r = args[0] * args[1]
        elif op == 'div': r = args[0] / args[1]
        elif op == 'silu': r = torch.nn.functional.silu(args[0])
        elif op == 'split':
            sizes = [dim_eval(x, env) for x in split_top(at['sizes'][1:-1])]
            r = list(torch.split(args[0], sizes, int(at['dim'])))
        elif op == 'softmax': r = args[0].softmax(int(at['dim']))
        elif op == 'topk':
            v, i = torch.topk(args[0], int(at['k']), dim=int(at['dim'])); r = [v, i]
        elif op == 'sum':
            dims = [int(x) for x in split_top(at['dims'][1:-1])]
            r = args[0].sum(dim=dims, keepdim=at['keepdim'] == 'true')
        elif op == 'cast': r = args[0]
        elif op == 'moe_dispatch':
            x, idx = args; E = int(at['num_experts'])
            flat = idx.reshape(-1)
            order = torch.argsort(flat, stable=True)
            rows = x[order // idx.shape[1]]
            counts = torch.bincount(flat, minlength=E)
            r = [rows, counts, order]
        elif op == 'grouped_matmul':
            x, w, counts = args; out = []; st = 0
            for e in range(w.shape[0]):
                n = int(counts[e]); out.append(x[st:st + n] @ w[e].T); st += n
            r = torch.cat(out, 0)
        elif op == 'moe_combine':
            rows, order, w = args
            T, k = w.shape
            out = torch.zeros(T, rows.shape[1], dtype=rows.dtype)
            for j in range(rows.shape[0]):
                f = int(order[j]); out[f // k] += w[f // k, f % k] * rows[j]
            r = out
        elif op == 'shift_labels':
            l = args[0]; r = torch.cat([l[:, 1:], torch.full_like(l[:, :1], int(at['ignore_index']))], 1)
        elif op == 'cross_entropy':
            lg, lb = args; ig = int(at['ignore_index'])
            r = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), lb.reshape(-1), ignore_index=ig, reduction='sum')
        elif op == 'count_valid': r = (args[0] != int(at['ignore_index'])).sum().double()
        else: raise SystemExit(f'unknown op {op}')
        if isinstance(r, list):
            for n, t in zip(res, r): vals[n] = t
        else: vals[res[0]] = r
    return outs

def main():
    import os
    dump, fixtures = sys.argv[1], sys.argv[2]
    worst = 0.0
    for name in sorted(f[:-5] for f in os.listdir(dump) if f.endswith('.weft')):
        text = open(f'{dump}/{name}.weft').read()
        w = load_file(f'{dump}/{name}.safetensors')
        inp = load_file(f'{fixtures}/{name}/inputs.safetensors')
        ref = load_file(f'{fixtures}/{name}/reference.safetensors')
        o = run(text, w, inp)
        dl = (o['logits'] - ref['logits'].double()).abs().max().item()
        dloss = abs(o['loss'].item() - ref['loss'].item())
        worst = max(worst, dl, dloss)
        print(f'{name:12s} loss={o["loss"].item():.6f} ref={ref["loss"].item():.6f} dloss={dloss:.2e} dlogits={dl:.2e}')
    sys.exit(0 if worst < 1e-4 else 1)


if __name__ == '__main__':
    main()
