#!/usr/bin/env bash
# Run from the repo root on the device machine: bash bench/sessions/session13_gpu_call.sh (needs .gpu/pack.tar.xz with weft, weftA, tests/gpu).
set -u
mkdir -p .gpu && tar -xJf .gpu/pack.tar.xz -C .gpu
export PY=/opt/torch/.venv/bin/python3
CUDNN_LIB=$($PY -c 'import nvidia.cudnn; print(nvidia.cudnn.__path__[0] + "/lib")' 2>/dev/null); export LD_LIBRARY_PATH="$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name --format=csv,noheader
WEFT_GPU_ONLY=attention timeout 150 .gpu/tests/gpu --nocapture --test-threads=1 > $OUT/attn.txt 2>&1; echo "attention rc $?"; grep -E "^[0-9]+ cases|FAIL" $OUT/attn.txt | head -8
WEFT_GPU_ONLY=rope timeout 60 .gpu/tests/gpu --nocapture --test-threads=1 > $OUT/rope.txt 2>&1; echo "rope rc $?"; grep -E "^[0-9]+ cases|FAIL" $OUT/rope.txt | head -5
for m in llama-tiny gemma2-tiny "llama-tiny --dtype bf16 --torch-adamw"; do timeout 60 .gpu/weft run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E "^check|error" | head -2; done
WEFT_GEMM_TUNE=1 timeout 60 .gpu/weft run llama-tiny --backend cuda --steps 20 --check 20 --seq 32 --batch 2 --dtype bf16 2>&1 | grep -E "^check|error|gemm" | head -3
for w in weft weftA; do timeout 90 .gpu/$w run llama3.2-1b --backend cuda --steps 10 --seq 4096 --batch 1 --torch-adamw 2>&1 | grep -E "^mean|gemm|error" | cut -c1-160; done
WEFT_GEMM_TUNE=1 timeout 90 .gpu/weft run llama3.2-1b --backend cuda --steps 10 --seq 4096 --batch 1 --torch-adamw 2>&1 | grep -E "^mean|gemm|error" | cut -c1-200
timeout 100 $PY bench/torch_llama_step.py --seq 4096 --steps 10 2>&1 | tail -2
