#!/usr/bin/env bash
# Session 24's GPU calls, from the repo root on the device machine with .gpu/weft (HEAD):
#   ctx     the longest context: Weft at 262144 (--checkpoint full --offload), PyTorch with
#           HF checkpointing at 32768 and 65536 and with save_on_cpu at 65536, one call
#   grads   the step-1 gradients tensor by tensor (loss_parity.py --grads): Weft's bf16 and
#           PyTorch's bf16 each against PyTorch in float32, and Weft in float32 against it —
#           is Weft's 2-5% difference from PyTorch bf16 rounding on both sides, or math?
#   b8      Llama-3-8B (preset) at seq 8192, --torch-adamw: Weft, PyTorch eager and
#           torch.compile in the same call (an H200: PyTorch's step needs ~108 GiB)
#   hostopt the host optimizer (--offload-optimizer) now captured in the step's CUDA graph:
#           the GPU case against the CPU reference (graph vs eager), --check on tiny models,
#           and the 1.24B step with the device AdamW (f32 master weights), the host one
#           replayed as a graph, and the host one launched per kernel (WEFT_CUDA_GRAPH=0)
#   choice  what `weft run --backend cuda` chooses on its own where only the host optimizer
#           fits (1.24B at 4096 under --device-memory 10), trained 4 steps; Llama-3-8B at
#           8192 with --torch-adamw on this card, and PyTorch eager beside it
#   bench   the 1.24B step at 16384, unfused loss (the planner's choice) and fused, clocks
#   torch   PyTorch eager at 16384 in the same call
#   OUT=$OUT PHASES="grads bench torch" bash bench/sessions/session24_gpu_call.sh
PHASES=${PHASES:-"grads bench torch"}
source bench/gpu_env.sh
step() { timeout "$1" ./.gpu/weft run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-200; }
if has ctx; then
  OUT=$OUT/ctx WEFT_SEQS=262144 WEFT_TIMEOUT=220 TORCH_SEQS="32768 65536" TORCH_SAVE_SEQS=65536 TORCH_TIMEOUT=270 \
    PY=$PY bash bench/longest_context.sh
fi
if has grads; then
  timeout 400 $PY bench/loss_parity.py --weft ./.gpu/weft --grads --torch-runs 1 2>&1 | grep -E '^grad|^gradients|^\./|^ok|^FAIL|rror' | sed 's#^\./\.gpu/##'
fi
if has b8; then
  clocks_on w8b; echo "== weft 8b 8192: $(timeout 170 ./.gpu/weft run llama3-8b --backend cuda --dtype bf16 --batch 1 --torch-adamw --seq 8192 --steps 6 2>&1 | grep -E '^mean|error' | cut -c1-240)"; clocks_off w8b
  for c in "" --compile; do
    clocks_on t8b$c; echo "== torch 8b 8192 $c: $(timeout 300 $PY bench/torch_llama_step.py --config frontends/presets/llama3-8b.json --seq 8192 --steps 5 $c 2>&1 | tail -1 | cut -c1-300)"; clocks_off t8b$c
  done
fi
if has hostopt; then
  [ -x .gpu/host_adamw ] && { echo "== host AdamW rate on this host:"; .gpu/host_adamw 268435456; .gpu/host_adamw 268435456 8; }
  WEFT_GPU_ONLY="model mistral_sw4" timeout 120 ./.gpu/tests/gpu --nocapture --test-threads=1 > $OUT/hostopt_case.txt 2>&1
  echo "== gpu case: rc $?; $(grep -E 'host optimizer|^[0-9]+ cases|test result' $OUT/hostopt_case.txt | cut -c1-260 | tr '\n' ' ')"
  for m in "llama-tiny" "llama-tiny --dtype bf16" "gemma2-tiny --fused-loss"; do
    echo "== check $m --offload-optimizer: $(timeout 120 ./.gpu/weft run $m --backend cuda --steps 8 --check 8 --offload-optimizer 2>&1 | grep -iE 'check|graph|error' | tail -2 | cut -c1-200 | tr '\n' ' ')"
  done
  for SEQ in 4096 16384; do
    n=$([ $SEQ = 4096 ] && echo 8 || echo 5)
    base="./.gpu/weft run llama3.2-1b --backend cuda --dtype bf16 --batch 1 --seq $SEQ --steps $n"
    echo "== $SEQ device adamw_master: $(timeout 100 $base 2>&1 | grep -E '^mean|error' | cut -c1-220)"
    clocks_on host$SEQ; echo "== $SEQ host optimizer, graph: $(timeout 150 $base --offload-optimizer 2>&1 | grep -E "^mean|graph|error" | cut -c1-300 | tr '\n' ' ')"; clocks_off host$SEQ
    echo "== $SEQ host optimizer, per kernel: $(WEFT_CUDA_GRAPH=0 timeout 150 $base --offload-optimizer 2>&1 | grep -E '^mean|error' | cut -c1-220)"
    for g in 1 0; do
      WEFT_CUDA_GRAPH=$g timeout 150 $base --offload-optimizer --json > $OUT/host_${SEQ}_graph$g.json 2>/dev/null
      echo "   per step (graph $g): $($PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(' '.join(f\"{s['step_s'] * 1e3:.0f}\" for s in d['steps']))" $OUT/host_${SEQ}_graph$g.json 2>&1 | tail -1)"
    done
  done
fi
if has choice; then
  echo "== 1.24B under 10 GiB, options open: $(timeout 150 ./.gpu/weft run llama3.2-1b --backend cuda --dtype bf16 --batch 1 --seq 4096 --device-memory 10 --steps 5 2>&1 | grep -E '^note: chose|^mean|error' | cut -c1-260 | tr '\n' ' ')"
  echo "== weft 8b 8192 torch-adamw: $(timeout 170 ./.gpu/weft run llama3-8b --backend cuda --dtype bf16 --batch 1 --torch-adamw --seq 8192 --steps 5 2>&1 | grep -E '^note: chose|^mean|error' | cut -c1-260 | tr '\n' ' ')"
  echo "== torch eager 8b 8192: $(timeout 120 $PY bench/torch_llama_step.py --config frontends/presets/llama3-8b.json --seq 8192 --steps 4 2>&1 | grep -oE 'OutOfMemoryError|\{"impl.*' | head -1 | cut -c1-300)"
fi
if has bench; then
  clocks_on w16ku; echo "== weft 16384 unfused: $(step 75 --steps 4 --seq 16384 --unfused-loss)"; clocks_off w16ku
  clocks_on w16k; echo "== weft 16384 fused: $(step 75 --steps 4 --seq 16384 --fused-loss)"; clocks_off w16k
fi
if has torch; then
  clocks_on torch16384; echo "== torch eager 16384: $(timeout 120 $PY bench/torch_llama_step.py --seq 16384 --steps 6 2>&1 | tail -1 | cut -c1-200)"; clocks_off torch16384
fi
cd $OUT && tar -czf s24.tgz clk_*.csv ctx 2>/dev/null && rm -rf clk_*.csv ctx
exit 0
