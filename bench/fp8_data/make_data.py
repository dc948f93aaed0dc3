#!/usr/bin/env python3
"""Real-text token data for the FP8-vs-bf16 convergence-parity run (issue 20).

The text is English documentation installed from a package registry: the Rust
crates that cargo downloaded from crates.io into ~/.cargo/registry/src/*/ (the
dependencies of this workspace). From each crate it takes every *.md file and
the doc comments (`///` and `//!` lines, marker stripped) of every *.rs file.
Files are read in sorted path order (up to --max-mb of text); files whose text
is byte-identical to one already taken (the same README in two versions of a
crate) are skipped. The documents (one per file) are then put in a fixed
pseudo-random order (--shuffle-seed, Python's `random.Random`), so that any
stretch of the token file mixes all crates rather than walking them
alphabetically (which makes the loss jump as the run moves from one crate to
the next), and joined with the `<|endoftext|>` token (id 0).

A byte-level BPE tokenizer (the `tokenizers` package, vocab_size 32768) is
trained on that text, and the whole text is encoded to flat little-endian uint16
tokens, the format of `weft run --data FILE`.

Writes into --out (default .gpu/fp8_data/, ignored by git):
  tokens.u16      flat LE uint16 tokens
  tokenizer.json  the trained tokenizer
  stats.json      text bytes, files, tokens, vocab, per-crate counts, sha256s
  files.txt       every file that went in, in token-file order, with its text bytes

Needs only `tokenizers` (a throwaway venv, never a dependency of the build):
  python3 -m venv /tmp/tokv && /tmp/tokv/bin/pip install tokenizers
  /tmp/tokv/bin/python bench/fp8_data/make_data.py
"""

import argparse
import glob
import hashlib
import json
import os
import random
import re
import sys
from array import array
from collections import OrderedDict

EOT = "<|endoftext|>"
DOC_LINE = re.compile(r"^\s*(///|//!)(.*)$")


def doc_comments(src):
    """The `///` and `//!` lines of a Rust source, marker and one space stripped.

    `////...` is an ordinary comment, not a doc comment, and is left out. Runs of
    doc lines are kept together; a blank line separates one run from the next.
    """
    out, run = [], []
    for line in src.splitlines():
        m = DOC_LINE.match(line)
        if m and not (m.group(1) == "///" and m.group(2).startswith("/")):
            body = m.group(2)
            if body.startswith(" "):
                body = body[1:]
            run.append(body.rstrip())
        elif run:
            out.append("\n".join(run).strip("\n"))
            run = []
    if run:
        out.append("\n".join(run).strip("\n"))
    return "\n\n".join(r for r in out if r.strip())


def collect(roots, max_bytes):
    """(documents, per-file records) in sorted path order, up to max_bytes of text."""
    paths = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for f in filenames:
                if f.endswith(".md") or f.endswith(".rs"):
                    paths.append(os.path.join(dirpath, f))
    paths.sort()
    docs, records, seen, total = [], [], set(), 0
    for p in paths:
        if os.path.islink(p) or not os.path.isfile(p):
            continue
        with open(p, "rb") as fh:
            raw = fh.read()
        try:
            src = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        src = src.replace("\r\n", "\n")
        text = src if p.endswith(".md") else doc_comments(src)
        text = text.strip()
        if not text:
            continue
        h = hashlib.sha256(text.encode("utf-8")).digest()
        if h in seen:
            continue
        seen.add(h)
        n = len(text.encode("utf-8"))
        if total + n > max_bytes:
            break
        total += n
        docs.append(text)
        root = next(r for r in roots if p.startswith(r))
        rel = os.path.relpath(p, root)
        records.append((rel, n))
    return docs, records, total


def train_tokenizer(docs, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".gpu/fp8_data", help="output directory")
    ap.add_argument(
        "--registry",
        default=os.path.expanduser("~/.cargo/registry/src"),
        help="cargo's registry source directory (its */ subdirectories are read)",
    )
    ap.add_argument("--vocab", type=int, default=32768, help="BPE vocabulary size")
    ap.add_argument("--max-mb", type=float, default=40.0, help="cap on text, MB (10^6 bytes)")
    ap.add_argument("--min-mb", type=float, default=8.0, help="refuse less text than this")
    ap.add_argument(
        "--shuffle-seed",
        type=int,
        default=0,
        help="seed of the documents' order in the token file (-1: sorted path order)",
    )
    a = ap.parse_args()
    if a.vocab > 65536:
        sys.exit("--vocab must fit uint16 (at most 65536)")

    roots = sorted(os.path.join(d, "") for d in glob.glob(os.path.join(a.registry, "*")) if os.path.isdir(d))
    if not roots:
        sys.exit(f"no registry sources under {a.registry}")
    docs, records, total = collect(roots, int(a.max_mb * 1e6))
    if total < a.min_mb * 1e6:
        sys.exit(f"only {total} bytes of text under {a.registry}, fewer than --min-mb {a.min_mb}")
    if a.shuffle_seed >= 0:
        order = list(range(len(docs)))
        random.Random(a.shuffle_seed).shuffle(order)
        docs = [docs[i] for i in order]
        records = [records[i] for i in order]

    tok = train_tokenizer(docs, a.vocab)
    vocab = tok.get_vocab_size()
    eot = tok.token_to_id(EOT)
    assert eot == 0, eot

    tokens = array("H")
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        tokens.extend(enc.ids)
        tokens.append(eot)
    assert max(tokens) < vocab <= 65536
    if sys.byteorder != "little":
        tokens.byteswap()

    os.makedirs(a.out, exist_ok=True)
    tok_path = os.path.join(a.out, "tokens.u16")
    with open(tok_path, "wb") as fh:
        tokens.tofile(fh)
    tok.save(os.path.join(a.out, "tokenizer.json"))
    with open(os.path.join(a.out, "files.txt"), "w") as fh:
        for rel, n in records:
            fh.write(f"{n}\t{rel}\n")

    crates = OrderedDict()
    for rel, n in records:
        c = crates.setdefault(rel.split(os.sep)[0], {"files": 0, "bytes": 0})
        c["files"] += 1
        c["bytes"] += n
    md = [n for rel, n in records if rel.endswith(".md")]
    rs = [n for rel, n in records if rel.endswith(".rs")]
    sha = lambda p: hashlib.sha256(open(p, "rb").read()).hexdigest()
    stats = OrderedDict(
        source="crates.io sources under " + ", ".join(roots),
        text_bytes=total,
        files=len(records),
        md_files=len(md),
        md_bytes=sum(md),
        rs_files_with_doc_comments=len(rs),
        rs_doc_comment_bytes=sum(rs),
        crates=len(crates),
        tokens=len(tokens),
        bytes_per_token=round(total / len(tokens), 3),
        vocab=vocab,
        shuffle_seed=a.shuffle_seed,
        eot_token=EOT,
        eot_id=eot,
        tokens_sha256=sha(tok_path),
        tokenizer_sha256=sha(os.path.join(a.out, "tokenizer.json")),
        per_crate=crates,
    )
    with open(os.path.join(a.out, "stats.json"), "w") as fh:
        json.dump(stats, fh, indent=1)
        fh.write("\n")
    summary = {k: v for k, v in stats.items() if k != "per_crate"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
