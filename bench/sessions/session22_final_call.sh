#!/usr/bin/env bash
# Session 22's last GPU call: the committed kernels' op cases, loss parity on real weights
# run twice on the new binary and once on the one before today's kernel changes (.gpu/weftA)
# — is the step-4 gap of 4.4e-3 seen in the A/B call run-to-run noise (cuDNN's backward
# accumulates dQ with atomics; AdamW's first steps move each weight by about lr whatever
# its gradient's size, so small differences in the gradients show in the loss) or a
# change — and the step at 4096 and 16384.
#   OUT=$OUT [PARITY_ONLY=1] bash bench/sessions/session22_final_call.sh
PHASES=x; source bench/gpu_env.sh
if [ -z "${PARITY_ONLY:-}" ]; then
  WEFT_GPU_ONLY="glu,add_rms_norm" timeout 120 .gpu/tests/gpu --nocapture --test-threads=1 > $OUT/cases.txt 2>&1
  echo "glu/add_rms_norm cases rc $?"; grep -E "cases" $OUT/cases.txt | tail -2
fi
for b in weft weftA weft; do
  echo "== parity $b: $(timeout 150 $PY bench/loss_parity.py --weft ./.gpu/$b 2>&1 | grep -E '^step|ok:|FAIL' | tr '\n' ' ')"
done
[ -n "${PARITY_ONLY:-}" ] && exit 0
step() { timeout "$1" ./.gpu/weft run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-160; }
echo "== 4096: $(step 60 --steps 10 --seq 4096 --unfused-loss)"
echo "== 16384 fused: $(step 75 --steps 4 --seq 16384 --fused-loss)"
