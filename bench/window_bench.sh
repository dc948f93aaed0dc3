#!/usr/bin/env bash
# Sliding-window attention on the GPU (issue 15), run on the device machine from the repo
# root after the binaries are in .gpu/ (weft, tests/gpu): in ONE call,
#   1. the windowed kernel checks and the 20-step tiny Mistral (window 4 < S 16) vs CPU;
#   2. the attention benchmark: band TFLOP/s of S=65536 W=4096 vs causal S=4096 (>= 70%);
#   3. the 1.24B training step (llama3.2-1b sizes as MistralForCausalLM, window 4096,
#      bench/window_1b) at SEQS (default 16384 65536) against full causal (llama3.2-1b)
#      and against PyTorch (SDPA with HF's sliding-window mask, and FlexAttention).
#   OUT=$OUT SEQS="16384 65536" STEPS=4 ARGS="--checkpoint selective" ATTNS="sdpa flex_attention" bash bench/window_bench.sh
set -uo pipefail
FINAL=${OUT:-gpu-out}; OUT=$(mktemp -d /tmp/weft-window.XXXX); mkdir -p "$FINAL"
SEQS=${SEQS:-"16384 65536"}; STEPS=${STEPS:-4}; ARGS=${ARGS:-"--checkpoint selective"}
PY=${PY:-/opt/torch/.venv/bin/python3}
export WEFT_CACHE_DIR=${WEFT_CACHE_DIR:-/tmp/weft-kernels}
W=./.gpu/weft
summary=()
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/nvidia-smi.txt" 2>&1

WEFT_GPU_ONLY="window,model mistral_sw4" timeout 300 ./.gpu/tests/gpu --nocapture --test-threads=1 > "$OUT/window_checks.txt" 2>&1
summary+=("window checks: $(grep -E '^[0-9]+ cases' "$OUT/window_checks.txt" || echo 'did not finish')")
grep -E "window|mistral_sw4" "$OUT/window_checks.txt" | cut -c1-200

timeout 120 $W run tests/fixtures/mistral_sw4 --backend cuda --steps 20 --check 20 > "$OUT/train_mistral_sw4.txt" 2>&1
summary+=("weft run mistral_sw4 20 steps --check 20: rc $? $(grep -c 'check failed' "$OUT/train_mistral_sw4.txt") failures")

WEFT_GPU_BENCH=1 WEFT_GPU_ONLY=nothing timeout 400 ./.gpu/tests/gpu --nocapture --test-threads=1 > "$OUT/attn_bench.txt" 2>&1
grep -E "attention (window [0-9]+|causal) bf16 S=(4096|16384|65536) d=(64|128) 32q/8kv \[(weft|cudnn)" "$OUT/attn_bench.txt" | tee -a "$OUT/attn_rows.txt"
summary+=("attention band TFLOP/s: $(grep -E 'window 4096 bf16 S=65536' "$OUT/attn_bench.txt" | sed -E 's/.*fwd\+bwd[^;]*; //' | tr '\n' ' ')")

for SEQ in $SEQS; do
  for m in "bench/window_1b window" "llama3.2-1b causal"; do
    set -- $m; model=$1; tag=$2
    timeout 400 $W run $model --backend cuda --dtype bf16 --steps $STEPS --seq $SEQ --batch 1 --json $ARGS > "$OUT/weft_${tag}_$SEQ.json" 2> "$OUT/weft_${tag}_$SEQ.err"
    rc=$?
    r=$($PY -c "import json;d=json.load(open('$OUT/weft_${tag}_$SEQ.json'));print(round(d['tokens_per_s']), 'tok/s, step', round(d['mean_step_s']*1e3,1), 'ms, measured peak', round(d['memory']['measured_peak_bytes']/2**30,2), 'GiB')" 2>/dev/null || echo "failed rc $rc: $(tail -2 "$OUT/weft_${tag}_$SEQ.err" | tr '\n' ' ')")
    summary+=("weft 1.24B $tag seq $SEQ: $r")
  done
  for attn in ${ATTNS:-sdpa flex_attention}; do
    timeout 400 $PY bench/torch_llama_step.py --seq $SEQ --steps $STEPS --window 4096 --attn $attn --ckpt --json "$OUT/torch_${attn}_$SEQ.json" > "$OUT/torch_${attn}_$SEQ.txt" 2>&1
    r=$($PY -c "import json;d=json.load(open('$OUT/torch_${attn}_$SEQ.json'));print(round(d['tokens_per_s']), 'tok/s, step', round(d['median_step_s']*1e3,1), 'ms, peak', round(d['peak_gib'],2), 'GiB')" 2>/dev/null || echo "failed: $(tail -2 "$OUT/torch_${attn}_$SEQ.txt" | tr '\n' ' ')")
    summary+=("torch 1.24B window 4096 [$attn + checkpointing] seq $SEQ: $r")
  done
done
printf '%s\n' "${summary[@]}" > "$OUT/summary.txt"
tar czf "$FINAL/window_results.tgz" -C "$OUT" . && cp "$OUT/summary.txt" "$FINAL/window_summary.txt"
echo; echo "==== summary ===="; cat "$OUT/summary.txt"
