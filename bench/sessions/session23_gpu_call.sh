#!/usr/bin/env bash
# Session 23's GPU call, from the repo root on the device machine with .gpu/weft (HEAD),
# .gpu/weftA (953a5e8, before session 22's kernel changes) and .gpu/tests/gpu:
#   parity  loss parity on real weights: PyTorch three times, each binary twice, from one
#           checkpoint and batch — is session 22's 4.4e-3 at step 4 a change or the noise
#           of cuDNN's atomic dQ accumulation (and AdamW's sign-like first steps)?
#   attnvar the same parity with Weft's attention on its own kernels (WEFT_ATTENTION=weft)
#           and on cuDNN's second backward plan (WEFT_CUDNN_ENGINE_BWD=1): is Weft's steady
#           ~3e-3 above PyTorch at step 4 from the attention backward?
#   grads   the step-1 gradients against PyTorch's, tensor by tensor (loss_parity.py
#           --grads), with cuDNN's attention and with Weft's own (WEFT_ATTENTION=weft)
#   bench   the 1.24B step at 4096 (unfused loss) and 16384 (fused and unfused), with the clocks
#   torch   PyTorch eager at 4096 and 16384 in the same call (the ratio's denominator)
#   roof    bench/roofline.sh at 4096 and 16384: the plan's per-class prediction against
#           the profiled step
#   OUT=$OUT PHASES="parity bench torch roof" bash bench/sessions/session23_gpu_call.sh
PHASES=${PHASES:-"parity bench torch roof"}
source bench/gpu_env.sh
step() { timeout "$1" ./.gpu/weft run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-200; }
if has parity; then
  timeout 420 $PY bench/loss_parity.py --weft ./.gpu/weft --weft ./.gpu/weftA --weft-runs 2 --torch-runs 3 \
    --json $OUT/parity.json 2>&1 | grep -E '^\./|^ok|^FAIL|rror' | sed 's#^\./\.gpu/##'
fi
if has attnvar; then
  for v in WEFT_ATTENTION=weft WEFT_CUDNN_ENGINE_BWD=1; do
    echo "== parity with $v:"
    env $v timeout 240 $PY bench/loss_parity.py --weft ./.gpu/weft --torch-runs 2 2>&1 | grep -E '^\./|^ok|^FAIL|rror' | sed 's#^\./\.gpu/##'
  done
fi
if has grads; then
  for v in WEFT_ATTENTION=auto WEFT_ATTENTION=weft; do
    echo "== gradients with $v:"
    env $v timeout 280 $PY bench/loss_parity.py --weft ./.gpu/weft --grads --torch-runs 1 2>&1 | grep -E '^grad|^gradients|^\./|^ok|^FAIL|rror' | sed 's#^\./\.gpu/##'
  done
fi
if has bench; then
  clocks_on w4096; echo "== weft 4096: $(step 60 --steps 10 --seq 4096 --unfused-loss)"; clocks_off w4096
  clocks_on w16k; echo "== weft 16384 fused: $(step 75 --steps 4 --seq 16384 --fused-loss)"; clocks_off w16k
  clocks_on w16ku; echo "== weft 16384 unfused: $(step 75 --steps 4 --seq 16384 --unfused-loss)"; clocks_off w16ku
fi
if has torch; then
  for SEQ in 4096 16384; do
    clocks_on torch$SEQ; echo "== torch eager $SEQ: $(timeout 120 $PY bench/torch_llama_step.py --seq $SEQ --steps 6 2>&1 | tail -1 | cut -c1-200)"; clocks_off torch$SEQ
  done
fi
if has roof; then OUT=$OUT/roof bash bench/roofline.sh; fi
cd $OUT && tar -czf s23.tgz clk_*.csv roof 2>/dev/null && rm -rf clk_*.csv roof
exit 0
