#!/usr/bin/env bash
# Session 17's GPU call, from the repo root on the device machine (needs .gpu/ from
# ../shared/gpu-pack --test gpu). Phases in priority order, each writing under $OUT as it
# goes, so a call cut short still returns what ran:
#   frontier the host link (bench/host_link.py), then the 1.24B step at seq 16384: the
#            baseline (no checkpointing, unfused loss) against the memory frontier with
#            the fused loss, budget checkpointing, activation offload and streamed state
#   bench    the 1.24B step at 4096 and 16384, --unfused-loss against --fused-loss
#   roof4    a profiled 4096 step through bench/roofline.py and bench/gap.py
#   roof16   the same at 16384 with the fused loss
#   torch    PyTorch eager (cuDNN SDPA, fused AdamW) at both lengths, same machine
#   checks   the rope, reduction and add_rms_norm GPU op cases, --check 20 on tiny models
#   ab       per-kernel profiles at 4096 and 16384 of .gpu/weftA (a baseline binary:
#            gpu-pack at the base commit, .gpu/weft copied to .gpu/weftA before packing
#            the change) and .gpu/weft, then the 4096 step alternating the two. The tree
#            plus .gpu must stay under the 64 MiB a call carries: xz the binaries here
#            and `xz -d` them first on the device
#   parity   4-step loss parity on real weights (bench/loss_parity.py)
#   final    --check 20 on two tiny models, then the 1.24B step and PyTorch eager at 4096
#            and 16384, alternating, in one call
#   OUT=$OUT PHASES="frontier bench roof4 roof16 torch" bash bench/sessions/session17_gpu_call.sh
#   OUT=$OUT PHASES="checks ab parity" bash bench/sessions/session17_gpu_call.sh
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; PHASES=${PHASES:-"frontier bench roof4 roof16 torch"}
has() { [[ " $PHASES " == *" $1 "* ]]; }
export PY=/opt/torch/.venv/bin/python3
CUDNN_LIB=$($PY -c 'import nvidia.cudnn; print(nvidia.cudnn.__path__[0] + "/lib")' 2>/dev/null); export LD_LIBRARY_PATH="$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W=./.gpu/weft
nvidia-smi --query-gpu=name --format=csv,noheader
step() { timeout "$1" $W run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-260; }
roof() { # roof SEQ NAME args...: a profiled step, its plan's trace, bench/roofline.py's table and bench/gap.py's ranking
  local D=$OUT/$2; mkdir -p $D
  WEFT_PROFILE=1 timeout 90 $W run llama3.2-1b --backend cuda --dtype bf16 --steps 3 --seq $1 --batch 1 --torch-adamw "${@:3}" --plan-out $D/plan.json --profile-out $D/prof.tsv > $D/run.txt 2> $D/profile.txt
  $W inspect $D/plan.json --trace $D/trace.json > /dev/null && $PY bench/roofline.py $D/trace.json $D/profile.txt --tokens $1 2>&1 | tail -14
  $PY bench/gap.py $D/prof.tsv --top 24
  tar -czf $D.tgz -C $OUT $2 && rm -rf $D
}
if has frontier; then
  timeout 40 $PY bench/host_link.py 2>&1 | tail -4
  echo "== 16384 --unfused-loss (baseline): $(step 75 --steps 4 --seq 16384 --unfused-loss)"
  for f in "--checkpoint none --stream-optimizer-state" "--checkpoint budget=13G --offload --stream-optimizer-state" "--checkpoint budget=12G --offload --stream-optimizer-state" "--checkpoint budget=11G --offload --stream-optimizer-state" "--checkpoint budget=10G --offload"; do
    echo "== 16384 --fused-loss $f: $(step 75 --steps 4 --seq 16384 --fused-loss $f)"
  done
fi
if has bench; then for SEQ in 4096 16384; do
  ST=$([ $SEQ = 4096 ] && echo 8 || echo 4)
  for f in --unfused-loss --fused-loss; do echo "== seq $SEQ $f: $(step 75 --steps $ST --seq $SEQ $f)"; done
done; fi
if has checks; then
  WEFT_GPU_ONLY="rope,sum/mean/max,rms_norm" timeout 150 .gpu/tests/gpu --nocapture --test-threads=1 > $OUT/cases.txt 2>&1; echo "rope/reduce cases rc $?"; grep -E "^[0-9]+ cases|FAIL|fail" $OUT/cases.txt | head -8
  for m in "llama-tiny" "gemma2-tiny --fused-loss" "llama-tiny --dtype bf16 --torch-adamw --micro-batches 2" "llama-tiny --stream-optimizer-state --dtype bf16 --torch-adamw --checkpoint selective --offload" "llama-tiny --optimizer sgd" "mixtral-tiny --dtype bf16 --torch-adamw"; do
    echo "check $m: $(timeout 45 $W run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E '^check|error' | head -2)"
  done
fi
if has ab; then
  for SEQ in 4096 16384; do for B in weftA weft; do
    D=$OUT/p$SEQ$B; mkdir -p $D
    WEFT_PROFILE=1 timeout 90 ./.gpu/$B run llama3.2-1b --backend cuda --dtype bf16 --steps 3 --seq $SEQ --batch 1 --torch-adamw --fused-loss --profile-out $D/prof.tsv > $D/run.txt 2> $D/profile.txt
    echo "== profile $SEQ $B"; $PY bench/gap.py $D/prof.tsv --top 300 | grep -E "rope|rms_norm|sum|step"
  done; done
  for B in weftA weft weftA weft; do echo "== seq 4096 $B: $(W=./.gpu/$B; timeout 60 $W run llama3.2-1b --backend cuda --batch 1 --torch-adamw --steps 10 --seq 4096 --unfused-loss 2>&1 | grep -E '^mean|error' | cut -c1-120)"; done
fi
if has final; then
  for m in "llama-tiny --dtype bf16 --torch-adamw --micro-batches 2" "gemma2-tiny --fused-loss"; do
    echo "check $m: $(timeout 45 $W run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E '^check|error' | head -2)"
  done
  for SEQ in 4096 16384; do
    ST=$([ $SEQ = 4096 ] && echo 10 || echo 4)
    echo "== seq $SEQ weft: $(step 75 --steps $ST --seq $SEQ --unfused-loss)"
    echo "== seq $SEQ torch eager: $(timeout 120 $PY bench/torch_llama_step.py --seq $SEQ --steps $ST 2>&1 | tail -1)"
  done
fi
has parity && timeout 170 $PY bench/loss_parity.py --weft $W --json $OUT/parity.json 2>&1 | tail -6
has roof4 && roof 4096 r4
has roof16 && roof 16384 r16 --fused-loss
if has torch; then for SEQ in 4096 16384; do
  ST=$([ $SEQ = 4096 ] && echo 8 || echo 4)
  echo "== seq $SEQ torch eager: $(timeout 120 $PY bench/torch_llama_step.py --seq $SEQ --steps $ST 2>&1 | tail -1)"
done; fi
exit 0
