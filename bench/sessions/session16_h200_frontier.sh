#!/usr/bin/env bash
# Session 16's memory frontier on an H200 (needs .gpu/ from ../shared/gpu-pack): the host
# link first (bench/host_link.py: each direction, both at once, under a GEMM), then the
# 1.24B step at seq 16384 without checkpointing (the baseline) and with the fused loss,
# budget checkpointing, activation offload and streamed optimizer state.
#   bash bench/sessions/session16_h200_frontier.sh
set -u
export PY=/opt/torch/.venv/bin/python3
CUDNN_LIB=$($PY -c 'import nvidia.cudnn; print(nvidia.cudnn.__path__[0] + "/lib")' 2>/dev/null); export LD_LIBRARY_PATH="$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 40 $PY bench/host_link.py 2>&1 | tail -4
for f in "--unfused-loss" "--fused-loss --checkpoint budget=11G --offload --stream-optimizer-state" "--fused-loss --checkpoint budget=12G --offload --stream-optimizer-state" "--fused-loss --checkpoint none --stream-optimizer-state"; do
  echo "== 16384 $f: $(timeout 75 ./.gpu/weft run llama3.2-1b --backend cuda --batch 1 --torch-adamw --steps 4 --seq 16384 $f 2>&1 | grep -E '^mean|error' | cut -c1-230)"
done
