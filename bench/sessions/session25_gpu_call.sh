#!/usr/bin/env bash
# Session 25's GPU calls, from the repo root on the device machine with .gpu/weft (HEAD):
#   b8      Llama-3-8B (preset) at seq 8192, --torch-adamw: Weft and PyTorch eager in the
#           same call (an H200: PyTorch's step needs ~108 GiB)
#   b8c     PyTorch torch.compile on the same step (last: its compile takes minutes)
#   prof8   the same Weft step profiled: per op class against the roofline (roofline.sh)
#           and per instruction against the plan's prediction (gap.py)
#   bench   the 1.24B step at 16384, unfused loss (the planner's choice) and fused
#   torch   PyTorch eager at 16384 in the same call
#   choice  what `weft run --backend cuda` chooses on its own where only the host optimizer
#           fits (1.24B at 4096 under --device-memory 10), trained 5 steps
#   stream  streamed optimizer state where the host link cannot carry all of it (the
#           schedule keeps on the device what cannot arrive by its update): the 1.24B at
#           16384 with f32 master weights, Llama-3-8B at 8192 with --torch-adamw under
#           selective checkpointing, each with and without streaming, and Llama-3-8B with
#           f32 master weights at B=2 as the planner chooses it on an 80 GiB card
#   mb      --check on tiny models with micro-batches (the gradient sums now inside the
#           last backward)
#   OUT=$OUT bash bench/sessions/session25_gpu_call.sh
PHASES=${PHASES:-"b8 bench torch choice prof8 b8c"}
source bench/gpu_env.sh
step() { timeout "$1" ./.gpu/weft run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-200; }
if has b8; then
  clocks_on w8b; echo "== weft 8b 8192: $(timeout 120 ./.gpu/weft run llama3-8b --backend cuda --dtype bf16 --batch 1 --torch-adamw --seq 8192 --steps 6 2>&1 | grep -E '^note: chose|^mean|error' | cut -c1-240 | tr '\n' ' ')"; clocks_off w8b
  clocks_on t8b; echo "== torch eager 8b 8192: $(timeout 150 $PY bench/torch_llama_step.py --config frontends/presets/llama3-8b.json --seq 8192 --steps 5 2>&1 | tail -1 | cut -c1-300)"; clocks_off t8b
fi
if has prof8; then
  OUT=$OUT/prof8 MODEL=llama3-8b SEQS=8192 ATTN_TFLOPS=${ATTN8:-455} PY=$PY timeout 150 bash bench/roofline.sh
  timeout 100 ./.gpu/weft run llama3-8b --backend cuda --dtype bf16 --batch 1 --torch-adamw --seq 8192 --steps 3 \
    --profile-out $OUT/prof8/gap_8192.tsv > /dev/null 2>&1
  $PY bench/gap.py $OUT/prof8/gap_8192.tsv --top 30 | tee $OUT/prof8/gap_8192.txt | head -40
fi
if has bench; then
  clocks_on w16ku; echo "== weft 16384 unfused: $(step 75 --steps 4 --seq 16384 --unfused-loss)"; clocks_off w16ku
  clocks_on w16k; echo "== weft 16384 fused: $(step 75 --steps 4 --seq 16384 --fused-loss)"; clocks_off w16k
fi
if has torch; then
  clocks_on torch16384; echo "== torch eager 16384: $(timeout 120 $PY bench/torch_llama_step.py --seq 16384 --steps 6 2>&1 | tail -1 | cut -c1-200)"; clocks_off torch16384
fi
if has choice; then
  echo "== 1.24B under 10 GiB, options open: $(timeout 150 ./.gpu/weft run llama3.2-1b --backend cuda --dtype bf16 --batch 1 --seq 4096 --device-memory 10 --steps 5 2>&1 | grep -E '^note: chose|^mean|error' | cut -c1-260 | tr '\n' ' ')"
fi
if has stream; then
  fixed="--zero 0 --micro-batches 1 --offload=false"
  for st in false true; do
    echo "== 1b 16384 master none stream=$st: $(timeout 100 ./.gpu/weft run llama3.2-1b --backend cuda --dtype bf16 --batch 1 --seq 16384 --steps 5 --fused-loss --checkpoint none $fixed --stream-optimizer-state=$st 2>&1 | grep -E '^plan|^mean|error' | cut -c1-200 | tr '\n' ' ')"
  done
  for st in false true; do
    echo "== 8b 8192 torch-adamw selective stream=$st: $(timeout 130 ./.gpu/weft run llama3-8b --backend cuda --dtype bf16 --batch 1 --seq 8192 --steps 4 --torch-adamw --checkpoint selective $fixed --stream-optimizer-state=$st 2>&1 | grep -E '^plan|^mean|error' | cut -c1-200 | tr '\n' ' ')"
  done
  [ -n "${STREAM_B2:-}" ] && echo "== 8b 8192 B=2 master, chosen: $(timeout 170 ./.gpu/weft run llama3-8b --backend cuda --dtype bf16 --batch 2 --seq 8192 --steps 3 2>&1 | grep -E '^note: chose|^plan|^mean|error' | cut -c1-220 | tr '\n' ' ')"
fi
if has mb; then
  for m in "llama-tiny --batch 2" "llama-tiny --dtype bf16 --batch 2" "mixtral-tiny --batch 2"; do
    echo "== check $m --micro-batches 2: $(timeout 120 ./.gpu/weft run $m --backend cuda --steps 8 --check 8 --micro-batches 2 2>&1 | grep -iE 'check|error' | tail -2 | cut -c1-200 | tr '\n' ' ')"
  done
fi
if has b8c; then
  clocks_on t8bc; echo "== torch compile 8b 8192: $(timeout ${COMPILE_TIMEOUT:-260} $PY bench/torch_llama_step.py --config frontends/presets/llama3-8b.json --seq 8192 --steps 5 --compile 2>&1 | tail -1 | cut -c1-300)"; clocks_off t8bc
fi
cd $OUT && tar -czf s25.tgz clk_*.csv prof8 2>/dev/null && rm -rf clk_*.csv prof8
exit 0
