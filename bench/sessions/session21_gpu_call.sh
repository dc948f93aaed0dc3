#!/usr/bin/env bash
# Session 21's GPU call: session 20's unmeasured cuDNN attention change (the K reshape's
# own strides, libcudnn through its soname), then the H200 figures. From the repo
# root on the device machine with .gpu/ from ../shared/gpu-pack --test gpu (xz'd). Phases
# in priority order, each printing as it goes so a call cut short returns what ran:
#   attn      the profiled 4096 step (cuDNN file, plans and engines, attention rows)
#   attn16    the profiled 16384 step (attention rows, cuDNN's picks)
#   torchk    PyTorch eager's own step profiled (top kernels) at 4096 and 16384
#   checks    attention GPU op cases, --check 20 on three tiny models (bf16)
#   bench     the 1.24B step at 4096 and at 16384 (fused loss), PyTorch eager at both
#   frontier  only on an H200: bench/sessions/session16_h200_frontier.sh (16384 memory frontier)
#   plans     the 4096 profile with each other backward plan (WEFT_CUDNN_ENGINE_BWD=n)
#   fplans    the 4096 profile with each other forward plan (WEFT_CUDNN_ENGINE_FWD=n)
#   parity    bench/loss_parity.py (4 steps on real weights against PyTorch)
#   OUT=$OUT PHASES="attn attn16 torchk checks bench frontier plans parity" bash bench/sessions/session21_gpu_call.sh
PHASES=${PHASES:-"attn checks bench frontier plans parity"}
source bench/gpu_env.sh
step() { timeout "$1" ./.gpu/weft run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-220; }
prof() { # seq, tag, then extra flags
  timeout 90 ./.gpu/weft run llama3.2-1b --backend cuda --dtype bf16 --steps 3 --seq $1 --batch 1 --torch-adamw --unfused-loss --profile-out $OUT/p$1$2.tsv "${@:3}" > /dev/null 2>$OUT/err$1$2.txt
  grep -E "attention: cuDNN|cuDNN sdpa|error" $OUT/err$1$2.txt | head -8 | cut -c1-200
  $PY bench/gap.py $OUT/p$1$2.tsv --top 300 | grep -E "attention|^step"
}
if has attn; then WEFT_CUDNN_ENGINE_LIST=1 WEFT_PROFILE=1 prof 4096 base; fi
if has attn16; then WEFT_CUDNN_ENGINE_LIST=1 WEFT_PROFILE=1 prof 16384 base; fi
if has torchk; then for SEQ in ${TORCHK_SEQS:-4096 16384}; do echo "== seq $SEQ torch eager kernels"; timeout 150 $PY bench/torch_llama_step.py --seq $SEQ --steps 4 --kernels 2>&1 | grep -vE '^\{' | tail -13 | cut -c1-160; done; fi
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
if has frontier && [[ "$GPU" == *H200* ]]; then bash bench/sessions/session16_h200_frontier.sh 2>&1 | tail -8; fi
if has plans; then for n in 1 2 3; do echo "== backward plan $n"; WEFT_CUDNN_ENGINE_BWD=$n WEFT_PROFILE=1 prof 4096 bwd$n | grep -E "backward|error|^step"; done; fi
if has fplans; then for n in 1 2; do echo "== forward plan $n"; WEFT_CUDNN_ENGINE_FWD=$n WEFT_PROFILE=1 prof 4096 fwd$n | grep -E "fwd +attention|error|^step"; done; fi
if has parity; then echo "== parity: $(timeout 150 $PY bench/loss_parity.py 2>&1 | tail -3)"; fi
cd $OUT && tar -czf profiles.tgz p*.tsv err*.txt 2>/dev/null && rm -f p*.tsv err*.txt
exit 0
