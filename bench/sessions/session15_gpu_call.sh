#!/usr/bin/env bash
# Session 15's GPU call, from the repo root on the device machine (needs .gpu/ from
# ../shared/gpu-pack --test gpu): the fused loss with its gradient (linear_cross_entropy_with_grad)
# checked against the CPU reference, then the 1.24B step with the unfused and the fused
# loss; PHASES adds PyTorch eager (torch), loss parity on real weights (parity), the
# 16384 memory frontier (frontier) and a profiled roofline (roofline).
#   OUT=$OUT PHASES="cases bench torch parity frontier roofline" bash bench/sessions/session15_gpu_call.sh
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; PHASES=${PHASES:-"cases bench torch parity frontier roofline"}
has() { [[ " $PHASES " == *" $1 "* ]]; }
export PY=/opt/torch/.venv/bin/python3
CUDNN_LIB=$($PY -c 'import nvidia.cudnn; print(nvidia.cudnn.__path__[0] + "/lib")' 2>/dev/null); export LD_LIBRARY_PATH="$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W=./.gpu/weft
nvidia-smi --query-gpu=name --format=csv,noheader
if has cases; then
  WEFT_GPU_ONLY=linear_cross_entropy timeout 90 .gpu/tests/gpu --nocapture --test-threads=1 > $OUT/lce.txt 2>&1; echo "lce cases rc $?"; grep -E "^[0-9]+ cases|FAIL|fail" $OUT/lce.txt | head -8
  for m in "gemma2-tiny --fused-loss" "llama-tiny --fused-loss --dtype bf16 --torch-adamw --micro-batches 2"; do
    echo "check $m: $(timeout 45 $W run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E '^check|error' | head -2)"
  done
fi
for SEQ in 4096 16384; do
  ST=$([ $SEQ = 4096 ] && echo 8 || echo 4)
  if has bench; then for f in --unfused-loss --fused-loss; do
    echo "== seq $SEQ $f: $(timeout 75 $W run llama3.2-1b --backend cuda --steps $ST --seq $SEQ --batch 1 --torch-adamw $f 2>&1 | grep -E '^mean|error' | cut -c1-260)"
  done; fi
  has torch && echo "== seq $SEQ torch eager: $(timeout 120 $PY bench/torch_llama_step.py --seq $SEQ --steps $ST 2>&1 | tail -1)"
done
has parity && timeout 150 $PY bench/loss_parity.py --weft $W --weft-args=--fused-loss --json $OUT/parity.json 2>&1 | tail -6
if has frontier; then for f in "--checkpoint budget=8G --offload" "--checkpoint budget=10G --offload"; do
  echo "== 16384 $f: $(timeout 60 $W run llama3.2-1b --backend cuda --steps 4 --seq 16384 --batch 1 --torch-adamw --fused-loss $f 2>&1 | grep -E '^mean|error' | cut -c1-260)"
done; fi
if has roofline; then
  mkdir -p $OUT/r && OUT2=$OUT/r; WEFT_PROFILE=1 timeout 90 $W run llama3.2-1b --backend cuda --dtype bf16 --steps 3 --seq 4096 --batch 1 --torch-adamw --fused-loss --plan-out $OUT2/plan.json > $OUT2/run.txt 2> $OUT2/profile.txt
  $W inspect $OUT2/plan.json --trace $OUT2/trace.json > /dev/null && $PY bench/roofline.py $OUT2/trace.json $OUT2/profile.txt --tokens 4096 2>&1 | tail -14
  tar -czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
fi
