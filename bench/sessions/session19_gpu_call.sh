#!/usr/bin/env bash
# Session 19's GPU call, from the repo root on the device machine (needs .gpu/ from
# ../shared/gpu-pack --test gpu with the change, and .gpu/weftA: the same build without
# it; xz both binaries and tests/gpu here, the script unpacks them). In priority order,
# each phase writing under $OUT as it goes, so a call cut short returns what ran:
#   checks    rms_norm / add_rms_norm GPU op cases, --check 20 on two tiny models
#   frontier  only on an H200: the 16384 memory frontier (bench/sessions/session16_h200_frontier.sh,
#             its baseline in the same call)
#   ab        per-kernel profiles of weftA and weft at 4096, then the 4096 step alternating
#             the two (twice each) and the 16384 step of each
#   torch     PyTorch eager (cuDNN SDPA, fused AdamW) at 4096 and 16384
#   OUT=$OUT PHASES="checks frontier ab torch" bash bench/sessions/session19_gpu_call.sh
PHASES=${PHASES:-"checks frontier ab torch"}
source bench/gpu_env.sh
step() { timeout "$2" ./.gpu/$1 run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:3}" 2>&1 | grep -E '^mean|error' | cut -c1-260; }
if has checks; then
  WEFT_GPU_ONLY="rms_norm" timeout 150 .gpu/tests/gpu --nocapture --test-threads=1 > $OUT/cases.txt 2>&1; echo "rms_norm cases rc $?"; grep -E "^[0-9]+ cases|FAIL|fail" $OUT/cases.txt | head -8
  for m in "llama-tiny --dtype bf16 --torch-adamw --micro-batches 2" "mixtral-tiny --dtype bf16 --torch-adamw"; do
    echo "check $m: $(timeout 45 ./.gpu/weft run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E '^check|error' | head -2)"
  done
fi
if has frontier && [[ "$GPU" == *H200* ]]; then
  bash bench/sessions/session16_h200_frontier.sh 2>&1 | tail -8
fi
if has ab; then
  for B in weftA weft; do
    D=$OUT/p4096$B; mkdir -p $D
    WEFT_PROFILE=1 timeout 90 ./.gpu/$B run llama3.2-1b --backend cuda --dtype bf16 --steps 3 --seq 4096 --batch 1 --torch-adamw --fused-loss --profile-out $D/prof.tsv > $D/run.txt 2> $D/profile.txt
    echo "== profile 4096 $B"; $PY bench/gap.py $D/prof.tsv --top 300 | grep -E "rms_norm|step"
  done
  tar -czf $OUT/profiles.tgz -C $OUT p4096weftA p4096weft && rm -rf $OUT/p4096*
  for B in weftA weft weftA weft; do echo "== seq 4096 $B: $(step $B 60 --steps 10 --seq 4096 --unfused-loss)"; done
  for B in weftA weft; do echo "== seq 16384 $B: $(step $B 75 --steps 4 --seq 16384 --fused-loss)"; done
fi
if has torch; then
  for SEQ in 4096 16384; do
    echo "== seq $SEQ torch eager: $(timeout 120 $PY bench/torch_llama_step.py --seq $SEQ --steps 6 2>&1 | tail -1)"
  done
fi
exit 0
