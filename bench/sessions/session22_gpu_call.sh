#!/usr/bin/env bash
# Session 22's GPU call: name the kernels of Weft's step and PyTorch's (CUPTI, no nsys on
# the machine), with the SM clock and power while each runs, then the figures.
# From the repo root on the device machine with .gpu/ from ../shared/gpu-pack --test gpu
# (xz'd). Phases, each printing as it goes:
#   trace   both steps at 16384 (and 4096) under bench/kernel_trace.c, top kernels of one
#           step each, clocks/power sampled by nvidia-smi
#   checks  attention GPU op cases, --check 20 on three tiny models (bf16)
#   bench   the 1.24B step at 4096 and 16384 (fused loss), PyTorch eager at both
#   parity  bench/loss_parity.py (4 steps on real weights against PyTorch)
#   OUT=$OUT PHASES="trace checks bench parity" bash bench/sessions/session22_gpu_call.sh
PHASES=${PHASES:-"trace checks bench parity"}
source bench/gpu_env.sh
step() { timeout "$1" ./.gpu/weft run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-220; }
if has trace; then
  export TRACE_SO=/tmp/kernel_trace.so
  if bash bench/kernel_trace.sh; then
    for SEQ in 16384 4096; do
      [ $SEQ = 16384 ] && W=340 || W=62; [ $SEQ = 16384 ] && TW=440 || TW=92
      L=$([ $SEQ = 16384 ] && echo --fused-loss || echo --unfused-loss)
      clocks_on weft$SEQ
      echo "== weft $SEQ: $(CUDA_INJECTION64_PATH=$TRACE_SO KERNEL_TRACE_OUT=$OUT/kw$SEQ.tsv step 120 --steps 4 --seq $SEQ $L)"
      clocks_off weft$SEQ
      $PY bench/kernel_trace.py $OUT/kw$SEQ.tsv --last-ms $W --top 22 --width 150
      clocks_on torch$SEQ
      echo "== torch $SEQ: $(CUDA_INJECTION64_PATH=$TRACE_SO KERNEL_TRACE_OUT=$OUT/kt$SEQ.tsv timeout 150 $PY bench/torch_llama_step.py --seq $SEQ --steps 4 2>&1 | tail -1 | cut -c1-200)"
      clocks_off torch$SEQ
      $PY bench/kernel_trace.py $OUT/kt$SEQ.tsv --last-ms $TW --top 22 --width 150
    done
  fi
fi
if has checks; then
  WEFT_GPU_ONLY="attention" timeout 150 .gpu/tests/gpu --nocapture --test-threads=1 > $OUT/cases.txt 2>&1; echo "attention cases rc $?"; grep -E "cases|FAIL|fail" $OUT/cases.txt | tail -3
  for m in "llama-tiny --dtype bf16 --torch-adamw --micro-batches 2" "gemma2-tiny --dtype bf16 --fused-loss" "mixtral-tiny --dtype bf16 --torch-adamw"; do
    echo "check $m: $(timeout 45 ./.gpu/weft run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E '^check|error' | head -2)"
  done
fi
if has bench; then
  echo "== 4096: $(step 60 --steps 10 --seq 4096 --unfused-loss)"
  echo "== 16384 fused: $(step 75 --steps 4 --seq 16384 --fused-loss)"
  for SEQ in 4096 16384; do echo "== seq $SEQ torch eager: $(timeout 120 $PY bench/torch_llama_step.py --seq $SEQ --steps 6 2>&1 | tail -1 | cut -c1-200)"; done
fi
if has parity; then echo "== parity: $(timeout 150 $PY bench/loss_parity.py 2>&1 | tail -6)"; fi
cd $OUT && tar -czf traces.tgz k*.tsv clk_*.csv cases.txt 2>/dev/null && rm -f k*.tsv clk_*.csv cases.txt
exit 0
