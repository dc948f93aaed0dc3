#!/usr/bin/env bash
# The short form of bench/sessions/session20_verify.sh (what a nearly spent device budget allows):
# the profiled 4096 step's attention rows, the attention GPU op cases, --check 20 on two
# tiny models, the step at 4096 and 16384, PyTorch eager at 4096.
#   OUT=$OUT bash bench/sessions/session20_verify_short.sh
PHASES=""; source bench/gpu_env.sh
step() { timeout "$1" ./.gpu/weft run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-200; }
WEFT_CUDNN_ENGINE_LIST=1 WEFT_PROFILE=1 timeout 60 ./.gpu/weft run llama3.2-1b --backend cuda --dtype bf16 --steps 3 --seq 4096 --batch 1 --torch-adamw --unfused-loss --profile-out $OUT/p4096.tsv > /dev/null 2>$OUT/err4096.txt; grep -E "attention: cuDNN|cuDNN sdpa" $OUT/err4096.txt | head -6 | cut -c1-200; $PY bench/gap.py $OUT/p4096.tsv --top 300 | grep -E "attention|^step"
WEFT_GPU_ONLY="attention" timeout 60 .gpu/tests/gpu --nocapture --test-threads=1 > $OUT/cases.txt 2>&1; echo "attention cases rc $?"; grep -E "cases|FAIL|fail" $OUT/cases.txt | tail -3
for m in "gemma2-tiny --dtype bf16 --fused-loss" "mixtral-tiny --dtype bf16 --torch-adamw"; do echo "check $m: $(timeout 30 ./.gpu/weft run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E "^check|error" | head -2)"; done
echo "== 4096: $(step 40 --steps 10 --seq 4096 --unfused-loss)"
echo "== 16384 fused: $(step 50 --steps 4 --seq 16384 --fused-loss)"
echo "== seq 4096 torch eager: $(timeout 60 $PY bench/torch_llama_step.py --seq 4096 --steps 6 2>&1 | tail -1 | cut -c1-200)"
