#!/usr/bin/env bash
# Session 18's GPU call, from the repo root on the device machine (needs .gpu/ from
# ../shared/gpu-pack --test gpu, and .gpu/weftA: the same build without the change, for
# the A/B; xz both binaries here and the script unpacks them). Phases, each writing under
# $OUT as it goes:
#   checks  the rms_norm / add_rms_norm GPU op cases (bf16 fast paths included) and
#           --check 20 on tiny models against the CPU reference
#   ab      per-kernel profiles (bench/gap.py) of .gpu/weftA and .gpu/weft at 4096 and
#           16384, then the 4096 step alternating the two, then PyTorch eager at 4096
#   h200    only on an H200: the 1.24B step at 4096 and 16384, PyTorch eager at both,
#           and the memory frontier at 16384 (bench/sessions/session16_h200_frontier.sh)
#   OUT=$OUT PHASES="checks ab h200" bash bench/sessions/session18_gpu_call.sh
#   (QUICK=1: one --check model, 4096 only, one A/B pair, no PyTorch: for a short
#   device budget)
PHASES=${PHASES:-"checks ab h200"}
source bench/gpu_env.sh
W=./.gpu/weft
step() { timeout "$1" $W run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-260; }
if has checks; then
  WEFT_GPU_ONLY="rms_norm" timeout 150 .gpu/tests/gpu --nocapture --test-threads=1 > $OUT/cases.txt 2>&1; echo "rms_norm cases rc $?"; grep -E "^[0-9]+ cases|FAIL|fail" $OUT/cases.txt | head -8
  MODELS=("llama-tiny --dtype bf16 --torch-adamw --micro-batches 2")
  [ -z "${QUICK:-}" ] && MODELS+=("gemma2-tiny --fused-loss --dtype bf16" "llama-tiny" "mixtral-tiny --dtype bf16 --torch-adamw")
  for m in "${MODELS[@]}"; do
    echo "check $m: $(timeout 45 $W run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E '^check|error' | head -2)"
  done
fi
if has ab; then
  SEQS="4096 16384"; [ -n "${QUICK:-}" ] && SEQS=4096
  for SEQ in $SEQS; do for B in weftA weft; do
    D=$OUT/p$SEQ$B; mkdir -p $D
    WEFT_PROFILE=1 timeout 90 ./.gpu/$B run llama3.2-1b --backend cuda --dtype bf16 --steps 3 --seq $SEQ --batch 1 --torch-adamw --fused-loss --profile-out $D/prof.tsv > $D/run.txt 2> $D/profile.txt
    echo "== profile $SEQ $B: $(grep -E '^chose' $D/run.txt $D/profile.txt | head -1 | cut -c1-120)"; $PY bench/gap.py $D/prof.tsv --top 300 | grep -E "rms_norm|colsum|step"
  done; done
  tar -czf $OUT/profiles.tgz -C $OUT $(cd $OUT && ls -d p4096* p16384*) && rm -rf $OUT/p4096* $OUT/p16384*
  ORDER="weftA weft weftA weft"; [ -n "${QUICK:-}" ] && ORDER="weftA weft"
  for B in $ORDER; do echo "== seq 4096 $B: $(W=./.gpu/$B; step 60 --steps 10 --seq 4096 --unfused-loss)"; done
  if [ -z "${QUICK:-}" ]; then
    for B in weftA weft; do echo "== seq 16384 $B: $(W=./.gpu/$B; step 75 --steps 4 --seq 16384 --unfused-loss)"; done
    echo "== seq 4096 torch eager: $(timeout 120 $PY bench/torch_llama_step.py --seq 4096 --steps 8 2>&1 | tail -1)"
  fi
fi
if has h200 && [[ "$GPU" == *H200* ]]; then
  for SEQ in 4096 16384; do
    ST=$([ $SEQ = 4096 ] && echo 10 || echo 4)
    for f in --unfused-loss --fused-loss; do echo "== seq $SEQ $f: $(step 75 --steps $ST --seq $SEQ $f)"; done
    echo "== seq $SEQ torch eager: $(timeout 120 $PY bench/torch_llama_step.py --seq $SEQ --steps $ST 2>&1 | tail -1)"
  done
  bash bench/sessions/session16_h200_frontier.sh 2>&1 | tail -6
fi
exit 0
