#!/usr/bin/env bash
# Session 26's GPU calls: session 25's phases (see session25_gpu_call.sh for what each
# measures) and this session's own, run in the order given and only while time is left,
# chosen by the card:
#   H200 (>100 GiB): H200_PHASES, default "upd b8 bench torch mb" (the 8B against
#   PyTorch needs ~108 GiB); otherwise H100_PHASES, default "upd mb stream bench torch".
#   upd     --update-stream (the optimizer updates on a low-priority stream of their own
#           beside the backward): --check against the CPU reference on tiny models, then
#           the 1.24B step with and without it, alternated, at 4096 (--torch-adamw and
#           f32 master weights) and 16384 (--torch-adamw, fused loss).
# A phase starts only if DEADLINE seconds (default 540) minus its budget are left.
#   OUT=$OUT bash bench/sessions/session26_gpu_call.sh
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${MEM%%.*}" -gt 100000 ]; then ORDER=${H200_PHASES:-"upd b8 bench torch mb"}; else ORDER=${H100_PHASES:-"upd mb stream bench torch"}; fi
declare -A BUDGET=([upd]=240 [b8]=200 [b8c]=260 [prof8]=200 [bench]=120 [torch]=90 [choice]=120 [stream]=330 [mb]=60)
DEADLINE=${DEADLINE:-540}
upd() {
  ( PHASES=upd; source bench/gpu_env.sh > /dev/null
  chk() { for m in "$@"; do
    echo "== check $m --update-stream: $(timeout 60 ./.gpu/weft run $m --backend cuda --steps 8 --check 8 --update-stream 2>&1 | grep -iE 'check|error|panic' | tail -2 | cut -c1-200 | tr '\n' ' ')"
  done; }
  one() { timeout 60 ./.gpu/weft run llama3.2-1b --backend cuda --batch 1 --steps 5 "$@" 2>&1 | grep -E '^mean|error' | cut -c1-160; }
  chk "llama-tiny" "llama-tiny --dtype bf16 --batch 2 --micro-batches 2"
  for r in 1 2; do
    for u in "" --update-stream; do
      echo "== 4096 torch-adamw ${u:-inline}: $(one --seq 4096 --torch-adamw --unfused-loss $u)"
    done
  done
  chk "llama-tiny --stream-optimizer-state --optimizer adamw" "mixtral-tiny --batch 2" "llama-tiny --dtype bf16 --no-master-weights"
  for u in "" --update-stream; do
    echo "== 4096 master ${u:-inline}: $(one --seq 4096 --unfused-loss --checkpoint none --offload=false --zero 0 --micro-batches 1 --stream-optimizer-state=false $u)"
  done
  for u in "" --update-stream ""; do
    echo "== 16384 torch-adamw fused ${u:-inline}: $(one --seq 16384 --torch-adamw --fused-loss $u)"
  done )
}
echo "card memory ${MEM} MiB, phases: $ORDER"
for p in $ORDER; do
  left=$((DEADLINE - SECONDS))
  if [ "$left" -lt "${BUDGET[$p]:-120}" ]; then echo "-- skipped $p: ${left}s left"; continue; fi
  echo "-- $p at ${SECONDS}s"
  if [ "$p" = upd ]; then upd; continue; fi
  PHASES="$p" OUT=$OUT/$p bash bench/sessions/session25_gpu_call.sh 2>&1 | grep -v '^$'
done
echo "-- done at ${SECONDS}s"
cd $OUT && tar -czf s26.tgz */s25.tgz 2>/dev/null; exit 0
