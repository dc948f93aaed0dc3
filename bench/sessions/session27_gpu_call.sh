#!/usr/bin/env bash
# Session 27's GPU call: the optimizer updates' own stream is now the default wherever
# the device runs the update (`--update-stream=false` turns it off). Phases, in order and
# only while DEADLINE seconds (default 560) leave their budget:
#   ab      --check on tiny models with the default, then the 1.24B step with the default
#           and with --update-stream=false, alternated: 4096 --torch-adamw (twice each) and
#           16384 --torch-adamw --fused-loss
#   b8 bench torch b8c   session 25's phases (bench/sessions/session25_gpu_call.sh), now
#           run with the default on
# Defaults by card: H200 (>100 GiB) "ab bench torch b8 b8c" (PyTorch's 8B step needs
# ~108 GiB), otherwise "ab bench torch"; H200_PHASES / H100_PHASES override.
#   DEADLINE=560 OUT=$OUT bash bench/sessions/session27_gpu_call.sh
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${MEM%%.*}" -gt 100000 ]; then ORDER=${H200_PHASES:-"ab bench torch b8 b8c"}; else ORDER=${H100_PHASES:-"ab bench torch"}; fi
declare -A BUDGET=([ab]=110 [b8]=200 [b8c]=260 [bench]=120 [torch]=90)
DEADLINE=${DEADLINE:-560}
ab() {
  ( PHASES=ab; source bench/gpu_env.sh > /dev/null
  for m in "llama-tiny" "mixtral-tiny --batch 2" "llama-tiny --dtype bf16 --batch 2 --micro-batches 2" \
      "llama-tiny --stream-optimizer-state --optimizer adamw" "llama-tiny --dtype bf16 --no-master-weights" \
      "llama-tiny --optimizer sgd"; do
    echo "== check $m (default): $(timeout 60 ./.gpu/weft run $m --backend cuda --steps 8 --check 8 2>&1 | grep -iE 'check|error|panic' | tail -1 | cut -c1-160)"
  done
  one() { timeout 70 ./.gpu/weft run llama3.2-1b --backend cuda --batch 1 --steps 5 "$@" 2>&1 | grep -E '^mean|error' | cut -c1-120; }
  for r in 1 2; do
    for u in --update-stream=false ""; do
      echo "== 4096 torch-adamw ${u:-default}: $(one --seq 4096 --torch-adamw --unfused-loss $u)"
    done
  done
  for u in --update-stream=false ""; do
    echo "== 16384 torch-adamw fused ${u:-default}: $(one --seq 16384 --torch-adamw --fused-loss $u)"
  done )
}
echo "card memory ${MEM} MiB, phases: $ORDER"
for p in $ORDER; do
  left=$((DEADLINE - SECONDS))
  if [ "$left" -lt "${BUDGET[$p]:-120}" ]; then echo "-- skipped $p: ${left}s left"; continue; fi
  echo "-- $p at ${SECONDS}s"
  if [ "$p" = ab ]; then ab; continue; fi
  PHASES="$p" OUT=$OUT/$p bash bench/sessions/session25_gpu_call.sh 2>&1 | grep -v '^$'
done
echo "-- done at ${SECONDS}s"
exit 0
