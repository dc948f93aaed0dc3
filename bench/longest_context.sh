#!/usr/bin/env bash
# The longest context the 1.24B model (llama3.2-1b preset, bf16, batch 1, AdamW) trains on
# one GPU, Weft against PyTorch in the same call (issue 20). For each length, one process
# runs 3 steps (2 for Weft past 131072); a line says tokens/s and peak, or that it ran out
# of memory. Weft: --checkpoint full --offload (activations to pinned host memory), the
# fused chunked lm_head + cross-entropy (no logits tensor). PyTorch: HF gradient
# checkpointing, then checkpointing with torch.autograd.graph.save_on_cpu.
#   OUT=$OUT PY=python3 bash bench/longest_context.sh
# WEFT_SEQS, TORCH_SEQS (checkpointing) and TORCH_SAVE_SEQS (with save_on_cpu; default
# TORCH_SEQS) pick the lengths; WEFT_TIMEOUT and TORCH_TIMEOUT bound each run.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; PY=${PY:-python3}
W=./.gpu/weft
export WEFT_CACHE_DIR=${WEFT_CACHE_DIR:-/tmp/weft-kernels}
for S in ${WEFT_SEQS:-131072 262144}; do
  f="$OUT/weft_ctx_$S.txt"
  timeout ${WEFT_TIMEOUT:-240} $W run llama3.2-1b --backend cuda --dtype bf16 --torch-adamw --seq $S --batch 1 --steps 2 \
    --checkpoint full --offload > "$f" 2>&1
  rc=$?
  echo "weft seq $S (full + offload): rc $rc; $(grep -E 'mean step|peak|out of memory|error' "$f" | head -3 | tr '\n' ' ')"
done
for mode in "--ckpt" "--ckpt --save-on-cpu"; do
  seqs=${TORCH_SEQS:-65536 131072 262144}
  [ "$mode" != "--ckpt" ] && seqs=${TORCH_SAVE_SEQS:-$seqs}
  for S in $seqs; do
    f="$OUT/torch_ctx_${S}_$(echo $mode | tr -d ' -').txt"
    timeout ${TORCH_TIMEOUT:-240} $PY bench/torch_llama_step.py --seq $S --steps 2 $mode > "$f" 2>&1
    rc=$?
    echo "torch seq $S ($mode): rc $rc; $(grep -oE '"tokens_per_s": [0-9.]+|"peak_gib": [0-9.]+|OutOfMemoryError' "$f" | head -3 | tr '\n' ' ')"
  done
done
