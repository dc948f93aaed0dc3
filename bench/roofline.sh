#!/usr/bin/env bash
# The roofline table of the 1.24B training step (issue 20), from the repo root with the
# binary in .gpu/weft (W=... for another): for each SEQ, run 3 profiled steps
# (WEFT_PROFILE: device time per instruction, stream 0), keep the plan that ran, and
# compare per op class the roofline at fixed rates, the plan's predicted times and the
# measured ones (bench/roofline.py).
#   OUT=$OUT SEQS="4096 16384" bash bench/roofline.sh
# PLAN_ONLY=1 needs no GPU: it plans the step for DEVICE (default h200) and prints the
# roofline and the prediction only, e.g. W=target/release/weft PLAN_ONLY=1 bash bench/roofline.sh
# The rates are issue 20's, measured on an H200: bf16 GEMM 790 TFLOP/s (cuBLASLt, 8192^3),
# cuDNN attention fwd+bwd 341 TFLOP/s at S=4096 and 455 at 16384 (head dim 64, causal),
# HBM 4300 GB/s; GEMM_TFLOPS, ATTN_TFLOPS and HBM_GBPS override them (the sustained rates
# of bench/sustained_rates.py, for one).
# ARGS adds flags to `weft run` (e.g. ARGS=--fuse=false for the step before fusion).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; SEQS=${SEQS:-"4096 16384"}
MODEL=${MODEL:-llama3.2-1b}; PY=${PY:-python3}; ARGS=${ARGS:-}; W=${W:-./.gpu/weft}
for SEQ in $SEQS; do
  case $SEQ in 4096) A=341 ;; 16384) A=455 ;; *) A=${ATTN_TFLOPS:-} ;; esac
  A=${ATTN_TFLOPS:-$A}
  RATES=(); [ -n "$A" ] && RATES=(--rates "gemm=${GEMM_TFLOPS:-790},attention=$A,hbm=${HBM_GBPS:-4300}")
  if [ -n "${PLAN_ONLY:-}" ]; then
    $W run $MODEL --dtype bf16 --steps 0 --seq $SEQ --batch 1 --torch-adamw --device ${DEVICE:-h200} $ARGS \
      --plan-out "$OUT/plan_$SEQ.json" > "$OUT/run_$SEQ.txt" 2>&1
    PROFILE=()
  else
    WEFT_PROFILE=1 $W run $MODEL --backend cuda --dtype bf16 --steps 3 --seq $SEQ --batch 1 --torch-adamw $ARGS \
      --plan-out "$OUT/plan_$SEQ.json" > "$OUT/run_$SEQ.txt" 2> "$OUT/profile_$SEQ.txt"
    PROFILE=("$OUT/profile_$SEQ.txt")
  fi
  $W inspect "$OUT/plan_$SEQ.json" --trace "$OUT/trace_$SEQ.json" > /dev/null
  echo "== $MODEL seq $SEQ: $(grep -E 'mean step|^plan' "$OUT/run_$SEQ.txt" | cut -d';' -f1)"
  $PY bench/roofline.py "$OUT/trace_$SEQ.json" "${PROFILE[@]}" --tokens $SEQ "${RATES[@]}" | tee "$OUT/roofline_$SEQ.txt"
done
