#!/usr/bin/env bash
# Session 20's GPU call, from the repo root on the device machine (needs .gpu/ from
# ../shared/gpu-pack --test gpu; xz .gpu/weft and .gpu/tests/gpu here, the prelude unpacks
# them). In priority order, each phase writing under $OUT as it goes:
#   engines   cuDNN's attention engines against each other: the 4096 step profiled with
#             each backward plan that finalizes (WEFT_CUDNN_ENGINE_BWD), and PyTorch's
#             cuDNN / flash attention alone at the same shape (bench/attn_torch.py)
#   attn      PyTorch's attention alone in both layouts, back to back and with L2 flushed,
#             and Weft's per-kernel profile at 4096 and 16384
#   checks    --check 20 on two tiny models
#   bench     the 1.24B step at 4096 (twice) and 16384
#   torch     PyTorch eager (cuDNN SDPA, fused AdamW) at 4096 and 16384
#   frontier  only on an H200: the 16384 memory frontier (bench/sessions/session16_h200_frontier.sh)
#   OUT=$OUT PHASES="engines checks bench torch frontier" bash bench/sessions/session20_gpu_call.sh
PHASES=${PHASES:-"engines checks bench torch frontier"}
source bench/gpu_env.sh
step() { timeout "$1" ./.gpu/weft run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-260; }
if has engines; then
  for E in 0 1 2 3; do
    D=$OUT/eng$E; mkdir -p $D
    WEFT_CUDNN_ENGINE_LIST=1 WEFT_CUDNN_ENGINE_BWD=$E WEFT_PROFILE=1 timeout 90 ./.gpu/weft run llama3.2-1b --backend cuda --dtype bf16 --steps 3 --seq 4096 --batch 1 --torch-adamw --unfused-loss --profile-out $D/prof.tsv > $D/run.txt 2> $D/err.txt
    grep -q "only .* cuDNN plans finalize\|cannot run" $D/err.txt && { echo "== engine $E: none"; grep -m1 "finalize" $D/err.txt | cut -c1-200; break; }
    echo "== engine bwd $E"; grep -m4 "cuDNN sdpa" $D/err.txt | cut -c1-200; $PY bench/gap.py $D/prof.tsv --top 300 | grep -E "attention|^step"
  done
  (cd $OUT && tar -czf engines.tgz eng[0-9] && rm -rf eng[0-9])
  timeout 120 $PY bench/attn_torch.py 2>&1 | tail -8
fi
if has attn; then
  timeout 150 $PY bench/attn_torch.py 2>&1 | tail -8
  for SEQ in 4096 16384; do
    D=$OUT/attn$SEQ; mkdir -p $D
    WEFT_PROFILE=1 timeout 120 ./.gpu/weft run llama3.2-1b --backend cuda --dtype bf16 --steps 3 --seq $SEQ --batch 1 --torch-adamw --fused-loss --profile-out $D/prof.tsv > $D/run.txt 2> $D/err.txt
    echo "== weft $SEQ"; $PY bench/gap.py $D/prof.tsv --top 300 | grep -E "attention|^step"
  done
  (cd $OUT && tar -czf attn.tgz attn[0-9]* && rm -rf attn[0-9]*)
fi
if has checks; then
  for m in "llama-tiny --dtype bf16 --torch-adamw --micro-batches 2" "mixtral-tiny --dtype bf16 --torch-adamw"; do
    echo "check $m: $(timeout 45 ./.gpu/weft run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E '^check|error' | head -2)"
  done
fi
if has bench; then
  for r in 1 2; do echo "== seq 4096 unfused: $(step 60 --steps 10 --seq 4096 --unfused-loss)"; done
  echo "== seq 16384 fused: $(step 75 --steps 4 --seq 16384 --fused-loss)"
fi
if has torch; then
  for SEQ in 4096 16384; do
    echo "== seq $SEQ torch eager: $(timeout 120 $PY bench/torch_llama_step.py --seq $SEQ --steps 6 2>&1 | tail -1)"
  done
fi
if has frontier && [[ "$GPU" == *H200* ]]; then
  bash bench/sessions/session16_h200_frontier.sh 2>&1 | tail -8
fi
exit 0
