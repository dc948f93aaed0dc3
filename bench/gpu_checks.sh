#!/usr/bin/env bash
# Correctness on the GPU for this round's features, in one device call (repo root, binaries
# in .gpu/ from ../shared/gpu-pack): the windowed kernel cases and model cases of
# tests/gpu.rs, then 20 training steps of each tiny model against the CPU reference
# (`weft run --check 20`). Prints one line per step of the summary; exits 1 if any failed.
# gpt_oss needs attention sinks and the transposed, biased grouped matmul of its experts
# in the CUDA runtime (both refused by name until they land).
#   OUT=$OUT bash bench/gpu_checks.sh
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export WEFT_CACHE_DIR=${WEFT_CACHE_DIR:-/tmp/weft-kernels}
cudnn=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cudnn/lib 2>/dev/null | head -1)
[ -n "$cudnn" ] && export LD_LIBRARY_PATH="$cudnn:${LD_LIBRARY_PATH:-}"
W=./.gpu/weft
fail=0; summary=()
WEFT_GPU_ONLY="${GPU_ONLY:-window,model}" timeout 300 ./.gpu/tests/gpu --nocapture --test-threads=1 > "$OUT/gpu_cases.txt" 2>&1
rc=$?; [ $rc -ne 0 ] && fail=$((fail+1))
summary+=("tests/gpu (${GPU_ONLY:-window,model}): rc $rc; $(grep -E '^[0-9]+ cases|test result' "$OUT/gpu_cases.txt" | tr '\n' ' ')")
# deepseek_v3: MLA (v_head_dim != qk head dim), group-limited router, shared experts.
for m in ${MODELS:-llama mistral_sw4 mixtral_aux olmo2 granite qwen3_moe gpt_oss deepseek_v3}; do
  timeout 120 $W run tests/fixtures/$m --backend cuda --steps 20 --check 20 --inputs tests/fixtures/$m/inputs.safetensors > "$OUT/run_$m.txt" 2>&1
  rc=$?; [ $rc -ne 0 ] && fail=$((fail+1))
  summary+=("weft run $m --check 20: rc $rc; $(grep -iE 'check|max rel' "$OUT/run_$m.txt" | tail -1)")
done
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
exit $((fail > 0))
