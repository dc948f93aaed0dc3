#!/usr/bin/env bash
# Session 20's check of the cuDNN attention changes (the K reshape's strides as
# cudnn-frontend gives them; libcudnn loaded through its soname so LD_LIBRARY_PATH's
# cuDNN wins over the system's), from the repo root on the device machine with .gpu/ from
# ../shared/gpu-pack --test gpu (xz'd): the profiled 4096 step's attention rows and the
# cuDNN in use, the attention GPU op cases, --check 20 on three tiny models, the 1.24B
# step at 4096 (twice) and 16384, PyTorch eager at both, and loss parity on real weights.
#   OUT=$OUT bash bench/sessions/session20_verify.sh
PHASES=""; source bench/gpu_env.sh
step() { timeout "$1" ./.gpu/weft run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-200; }
prof() { WEFT_CUDNN_ENGINE_LIST=1 WEFT_PROFILE=1 timeout 120 ./.gpu/weft run llama3.2-1b --backend cuda --dtype bf16 --steps 3 --seq $1 --batch 1 --torch-adamw $2 --profile-out $OUT/p$1$3.tsv > /dev/null 2>$OUT/err$1$3.txt; grep -E "attention: cuDNN|cuDNN sdpa" $OUT/err$1$3.txt | head -6 | cut -c1-200; $PY bench/gap.py $OUT/p$1$3.tsv --top 300 | grep -E "attention|^step"; }
prof 4096 --unfused-loss new
WEFT_GPU_ONLY="attention" timeout 150 .gpu/tests/gpu --nocapture --test-threads=1 > $OUT/cases.txt 2>&1; echo "attention cases rc $?"; grep -E "cases|FAIL|fail" $OUT/cases.txt | tail -3
for m in "llama-tiny --dtype bf16 --torch-adamw --micro-batches 2" "gemma2-tiny --dtype bf16 --fused-loss" "mixtral-tiny --dtype bf16 --torch-adamw"; do echo "check $m: $(timeout 45 ./.gpu/weft run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E "^check|error" | head -2)"; done
for r in 1 2; do echo "== 4096: $(step 60 --steps 10 --seq 4096 --unfused-loss)"; done
echo "== 16384 fused: $(step 75 --steps 4 --seq 16384 --fused-loss)"
for SEQ in 4096 16384; do echo "== seq $SEQ torch eager: $(timeout 120 $PY bench/torch_llama_step.py --seq $SEQ --steps 6 2>&1 | tail -1 | cut -c1-200)"; done
echo "== parity: $(timeout 150 $PY bench/loss_parity.py 2>&1 | tail -3)"
