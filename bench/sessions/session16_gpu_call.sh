#!/usr/bin/env bash
# Session 16's GPU call, from the repo root on the device machine (needs .gpu/ from
# ../shared/gpu-pack --test gpu). Phases in priority order, each writing under $OUT as it
# goes, so a call cut short still returns what ran:
#   cases    the linear_cross_entropy GPU op cases (the 16-byte lce_row_grad path: 520 classes)
#   stream   --stream-optimizer-state: --check on tiny models, then the 16384 memory frontier
#   profstream a profiled 16384 step with streamed state (budget=12G --offload)
#   bench    the 1.24B step at 4096 and 16384, --unfused-loss against --fused-loss
#   prof16   a profiled 16384 step with the fused loss through bench/roofline.py (per-op times)
#   torch    PyTorch eager (cuDNN SDPA, fused AdamW) at both lengths, same machine
#   parity   4-step loss parity on real weights with the fused loss
#   frontier the 16384 memory frontier with the fused loss (budget checkpointing + offload)
#   roofline a profiled 4096 step (the default loss) through bench/roofline.py
#   prof8g   the same profile of the 16384 frontier step (budget=8G --offload)
#   prof4f   the same profile of the 4096 step with the fused loss
#   compile  PyTorch torch.compile at 4096
#   OUT=$OUT PHASES="cases bench prof16 torch parity frontier roofline compile" bash bench/sessions/session16_gpu_call.sh
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; PHASES=${PHASES:-"cases bench prof16 torch parity frontier roofline compile"}
has() { [[ " $PHASES " == *" $1 "* ]]; }
export PY=/opt/torch/.venv/bin/python3
CUDNN_LIB=$($PY -c 'import nvidia.cudnn; print(nvidia.cudnn.__path__[0] + "/lib")' 2>/dev/null); export LD_LIBRARY_PATH="$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W=./.gpu/weft
nvidia-smi --query-gpu=name --format=csv,noheader
step() { timeout "$1" $W run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-260; }
if has cases; then
  WEFT_GPU_ONLY=linear_cross_entropy timeout 90 .gpu/tests/gpu --nocapture --test-threads=1 > $OUT/lce.txt 2>&1; echo "lce cases rc $?"; grep -E "^[0-9]+ cases|FAIL|fail" $OUT/lce.txt | head -8
  for m in "gemma2-tiny --fused-loss" "llama-tiny --fused-loss --dtype bf16 --torch-adamw --micro-batches 2"; do
    echo "check $m: $(timeout 45 $W run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E '^check|error' | head -2)"
  done
fi
if has stream; then
  for m in "llama-tiny --stream-optimizer-state" "gemma2-tiny --stream-optimizer-state --fused-loss" "llama-tiny --stream-optimizer-state --dtype bf16 --torch-adamw --micro-batches 2 --checkpoint selective --offload"; do
    echo "check $m: $(timeout 45 $W run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E '^check|error' | head -2)"
  done
  echo "== 16384 --unfused-loss (baseline): $(step 75 --steps 4 --seq 16384 --unfused-loss)"
  for f in "--checkpoint none --stream-optimizer-state" "--checkpoint budget=12G --offload --stream-optimizer-state" "--checkpoint budget=11G --offload --stream-optimizer-state" "--checkpoint budget=8G --offload"; do
    echo "== 16384 --fused-loss $f: $(step 75 --steps 4 --seq 16384 --fused-loss $f)"
  done
fi
has profstream && roof 16384 r12s --fused-loss --checkpoint budget=12G --offload --stream-optimizer-state
if has bench; then for SEQ in 4096 16384; do
  ST=$([ $SEQ = 4096 ] && echo 8 || echo 4)
  for f in --unfused-loss --fused-loss; do echo "== seq $SEQ $f: $(step 75 --steps $ST --seq $SEQ $f)"; done
done; fi
roof() { # roof SEQ NAME args...: a profiled step, its plan's trace and bench/roofline.py's table
  local D=$OUT/$2; mkdir -p $D
  WEFT_PROFILE=1 timeout 90 $W run llama3.2-1b --backend cuda --dtype bf16 --steps 3 --seq $1 --batch 1 --torch-adamw "${@:3}" --plan-out $D/plan.json --profile-out $D/prof.tsv > $D/run.txt 2> $D/profile.txt
  $W inspect $D/plan.json --trace $D/trace.json > /dev/null && $PY bench/roofline.py $D/trace.json $D/profile.txt --tokens $1 2>&1 | tail -14
  grep -iE "linear_cross_entropy" $D/profile.txt | head -3
  $PY bench/gap.py $D/prof.tsv --top 16
  tar -czf $D.tgz -C $OUT $2 && rm -rf $D
}
has prof16 && roof 16384 r16 --fused-loss
if has torch; then for SEQ in 4096 16384; do
  ST=$([ $SEQ = 4096 ] && echo 8 || echo 4)
  echo "== seq $SEQ torch eager: $(timeout 120 $PY bench/torch_llama_step.py --seq $SEQ --steps $ST 2>&1 | tail -1)"
done; fi
has parity && timeout 150 $PY bench/loss_parity.py --weft $W --weft-args=--fused-loss --json $OUT/parity.json 2>&1 | tail -6
if has frontier; then for f in "--checkpoint budget=8G --offload" "--checkpoint budget=10G --offload"; do
  echo "== 16384 --fused-loss $f: $(step 60 --steps 4 --seq 16384 --fused-loss $f)"
done; fi
has roofline && roof 4096 r4
has prof8g && roof 16384 r8g --fused-loss --checkpoint budget=8G --offload
has prof4f && roof 4096 r4f --fused-loss
has compile && echo "== seq 4096 torch compile: $(timeout 200 $PY bench/torch_llama_step.py --seq 4096 --steps 8 --compile 2>&1 | tail -1)"
exit 0
