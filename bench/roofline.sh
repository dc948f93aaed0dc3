#!/usr/bin/env bash
# The roofline table of the 1.24B training step (issue 20) on the device machine, from
# the repo root with the binaries in .gpu/: for each SEQ, run 3 profiled steps
# (WEFT_PROFILE: device time per instruction, stream 0), keep the plan that ran, and
# compare per op class with the plan's predicted times (bench/roofline.py).
#   OUT=$OUT SEQS="4096 16384" bash bench/roofline.sh
# ARGS adds flags to `weft run` (e.g. ARGS=--fuse=false for the step before fusion).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; SEQS=${SEQS:-"4096 16384"}
MODEL=${MODEL:-llama3.2-1b}; PY=${PY:-python3}; ARGS=${ARGS:-}
W=./.gpu/weft
for SEQ in $SEQS; do
  WEFT_PROFILE=1 $W run $MODEL --backend cuda --dtype bf16 --steps 3 --seq $SEQ --batch 1 --torch-adamw $ARGS \
    --plan-out "$OUT/plan_$SEQ.json" > "$OUT/run_$SEQ.txt" 2> "$OUT/profile_$SEQ.txt"
  $W inspect "$OUT/plan_$SEQ.json" --trace "$OUT/trace_$SEQ.json" > /dev/null
  echo "== $MODEL seq $SEQ: $(grep -E 'mean step' "$OUT/run_$SEQ.txt" | cut -d';' -f1)"
  $PY bench/roofline.py "$OUT/trace_$SEQ.json" "$OUT/profile_$SEQ.txt" --tokens $SEQ | tee "$OUT/roofline_$SEQ.txt"
done
