#!/usr/bin/env bash
# The GPU session in one command, run from the repo root on a machine with an NVIDIA GPU:
# kernel checks, 20-step tiny-model training checks against the CPU reference, then the
# 1.24B training step, Weft and PyTorch side by side. Results under $OUT (default
# ./gpu-out); a short table last. Exits 1 when any step failed (and says which).
#
# Prerequisites (docs/GPU.md):
#   - .gpu/weft and .gpu/tests/gpu: `cargo build --release --features cuda` and
#     `cargo test --release --features cuda --test gpu --no-run`, copied there
#     (or WEFT=path/to/weft GPU_TESTS=path/to/gpu-test-binary);
#   - the CUDA driver and NVRTC (libnvrtc) on the loader path;
#   - for the torch/link/compile phases: PY, a python3 with torch (CUDA) installed.
#   PHASES="link checks train bench torch torchckpt compile" VARIANTS="pass torch sel torchseloff" bench/gpu_bench.sh
#   Variants with WEFT_PROFILE=1 launch per kernel (profiling times each one); `graph` and
#   `nograph` (--torch-adamw, no profile) measure the step replayed as one CUDA graph or not;
#   `graphtune` is `graph` with WEFT_GEMM_TUNE=1 (GEMM algorithms timed on first use).
set -uo pipefail
FINAL=${OUT:-gpu-out}; OUT=$(mktemp -d /tmp/weft-gpu.XXXX); mkdir -p "$FINAL"
PHASES=${PHASES:-"checks train bench torch"}
SEQ=${SEQ:-4096}; STEPS=${STEPS:-8}
PY=${PY:-python3}
export WEFT_CACHE_DIR=${WEFT_CACHE_DIR:-/tmp/weft-kernels}
W=${WEFT:-./.gpu/weft}
GPU_TESTS=${GPU_TESTS:-./.gpu/tests/gpu}
has() { [[ " $PHASES " == *" $1 "* ]]; }
die() { echo "error: $1" >&2; echo "help: $2" >&2; exit 2; }
[ -x "$W" ] || die "no weft binary at $W" "build it with \`cargo build --release --features cuda\` and copy target/release/weft there, or set WEFT="
if has checks; then [ -x "$GPU_TESTS" ] || die "no GPU test binary at $GPU_TESTS" "\`cargo test --release --features cuda --test gpu --no-run\` prints its path; copy it there or set GPU_TESTS="; fi
if has torch || has torchckpt || has compile || has link; then
  "$PY" -c "import torch" 2>/dev/null || die "$PY cannot import torch" "set PY to a python3 with PyTorch (CUDA), or leave the torch phases out of PHASES"
fi
command -v nvidia-smi >/dev/null || die "nvidia-smi not found" "run this on a machine with an NVIDIA GPU and its driver"
# cuDNN (WEFT_ATTENTION=cudnn) comes from PyTorch's pip package, not on the default path.
CUDNN_LIB=$("$PY" -c 'import nvidia.cudnn; print(nvidia.cudnn.__path__[0] + "/lib")' 2>/dev/null)
[ -n "$CUDNN_LIB" ] && export LD_LIBRARY_PATH="$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
summary=()
failed=()
# step NAME RC: records a failed step.
step() { [ "$2" -eq 0 ] || failed+=("$1 (rc $2)"); }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > "$OUT/nvidia-smi.txt" 2>&1
if has checks; then
  # Three processes, so that a fault in one family (a sticky CUDA error) cannot hide the others.
  WEFT_GPU_SKIP=attention,model timeout 200 "$GPU_TESTS" --nocapture --test-threads=1 > "$OUT/gpu_tests_ops.txt" 2>&1; step "op checks" $?
  summary+=("op checks: $(grep -E '^[0-9]+ cases' "$OUT/gpu_tests_ops.txt" || echo 'did not finish')")
  WEFT_GPU_ONLY=attention timeout 200 "$GPU_TESTS" --nocapture --test-threads=1 > "$OUT/gpu_tests_attn.txt" 2>&1; step "attention checks" $?
  summary+=("attention checks: $(grep -E '^[0-9]+ cases' "$OUT/gpu_tests_attn.txt" || echo 'did not finish')")
  WEFT_GPU_BENCH=1 WEFT_GPU_ONLY=model timeout 200 "$GPU_TESTS" --nocapture --test-threads=1 > "$OUT/gpu_tests_models.txt" 2>&1; step "model checks" $?
  summary+=("model checks: $(grep -E '^[0-9]+ cases' "$OUT/gpu_tests_models.txt" || echo 'did not finish')")
  if [ -z "${SKIP_W8:-}" ]; then
    env ${W8_ENV:-WEFT_FA_WARPS=8} WEFT_GPU_BENCH=1 WEFT_GPU_ONLY=attention timeout 200 "$GPU_TESTS" --nocapture --test-threads=1 > "$OUT/gpu_tests_attn_w8.txt" 2>&1; step "8-warp attention checks" $?
    summary+=("attention checks, 8-warp forward: $(grep -E '^[0-9]+ cases' "$OUT/gpu_tests_attn_w8.txt" || echo 'did not finish')")
  fi
  cat "$OUT"/gpu_tests_*.txt > "$OUT/gpu_tests.txt"
  grep -E "FAIL|error|panicked" "$OUT/gpu_tests.txt" | cut -c1-300 | head -40
  grep -A5 "^benchmarks" "$OUT/gpu_tests_models.txt"; echo "8-warp forward:"; grep -A5 "^benchmarks" "$OUT/gpu_tests_attn_w8.txt"
fi
if has link; then
  "$PY" bench/host_link.py > "$OUT/host_link.txt" 2>&1; step "host link" $?
  summary+=("host link: $(tr '\n' ';' < "$OUT/host_link.txt" | cut -c1-300)")
fi
if has train; then
  # gemma2-tiny ties lm_head to the embedding (fuse's embedding_grad into an init).
  for m in llama-tiny mixtral-tiny gemma2-tiny "gemma2-tiny --dtype bf16" "llama-tiny --dtype bf16" "llama-tiny --dtype bf16 --torch-adamw" "llama-tiny --dtype bf16 --checkpoint selective --offload"; do
    f="$OUT/train_$(echo $m | tr ' ' '_' | tr -d '-').txt"
    timeout 120 $W run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 > "$f" 2>&1
    rc=$?; step "20-step $m" $rc
    if [ $rc -eq 0 ]; then
      summary+=("20-step $m vs CPU: $(grep -E '^check' "$f" | head -1)")
    else
      summary+=("20-step $m vs CPU: FAILED (rc $rc): $(tail -1 "$f" | cut -c1-200)")
    fi
    tail -3 "$f"
  done
fi
if has bench; then
  for variant in ${VARIANTS:-pass torch fa8}; do
    tag=$variant; args=""; envs="WEFT_PROFILE=1"
    case $variant in torch) args="--torch-adamw";; sel) args="--checkpoint selective";; full) args="--checkpoint full";;
      seloff) args="--checkpoint selective --offload";; torchsel) args="--torch-adamw --checkpoint selective";;
      torchseloff) args="--torch-adamw --checkpoint selective --offload";;
      torchb*off) b=${variant#torchb}; args="--torch-adamw --checkpoint budget=${b%off}G --offload";;
      torchb*) args="--torch-adamw --checkpoint budget=${variant#torchb}G";;
      cudnn) envs="WEFT_PROFILE=1 WEFT_ATTENTION=cudnn";; torchcudnn) args="--torch-adamw"; envs="WEFT_PROFILE=1 WEFT_ATTENTION=cudnn";;
      torchselcudnn) args="--torch-adamw --checkpoint selective"; envs="WEFT_PROFILE=1 WEFT_ATTENTION=cudnn";;
      torchseloffcudnn) args="--torch-adamw --checkpoint selective --offload"; envs="WEFT_PROFILE=1 WEFT_ATTENTION=cudnn";; fa8) envs="WEFT_PROFILE=1 WEFT_FA_WARPS=8";;
      graph) args="--torch-adamw"; envs="WEFT_CUDA_GRAPH=1";; graphtune) args="--torch-adamw"; envs="WEFT_CUDA_GRAPH=1 WEFT_GEMM_TUNE=1";; nograph) args="--torch-adamw"; envs="WEFT_CUDA_GRAPH=0";;
      graphsel) args="--torch-adamw --checkpoint selective"; envs="WEFT_CUDA_GRAPH=1";; bwd4) envs="WEFT_PROFILE=1 WEFT_FA_BWD_WARPS=4";; esac
    env $envs timeout 200 $W run llama3.2-1b --backend cuda --steps $STEPS --seq $SEQ --batch 1 --json $args > "$OUT/weft_1b_$tag.json" 2> "$OUT/weft_1b_$tag.err"
    rc=$?; step "1.24B [$variant]" $rc
    echo "== $variant"; head -${PROFILE_LINES:-24} "$OUT/weft_1b_$tag.err"
    wtok=$($PY -c "import json;d=json.load(open('$OUT/weft_1b_$tag.json'));print(round(d['tokens_per_s']), 'tok/s, step', round(d['mean_step_s']*1e3,1),'ms, mem planned', round(d['memory']['planned_peak_bytes']/2**30,2),'GiB measured', round(d['memory']['measured_peak_bytes']/2**30,2),'GiB, kernels', round(d['load']['kernel_compile_s'],1),'s, load', round(d['load_s'],1),'s, compile', round(d['compile_s'],1), 's')" 2>/dev/null || echo "failed rc $rc: $(tail -2 $OUT/weft_1b_$tag.err)")
    summary+=("weft 1.24B seq $SEQ [$variant]: $wtok")
  done
fi
if has torch; then
  timeout 240 $PY bench/torch_llama_step.py --seq $SEQ --steps $STEPS --json "$OUT/torch_eager.json" > "$OUT/torch_eager.txt" 2>&1; step "torch eager" $?
  ttok=$($PY -c "import json;d=json.load(open('$OUT/torch_eager.json'));print(round(d['tokens_per_s']), 'tok/s, step', round(d['median_step_s']*1e3,1), 'ms, peak', round(d['peak_gib'],2), 'GiB')" 2>/dev/null || echo "failed: $(tail -2 $OUT/torch_eager.txt)")
  summary+=("torch eager 1.24B seq $SEQ: $ttok")
fi
if has torchckpt; then
  timeout 240 $PY bench/torch_llama_step.py --seq $SEQ --steps $STEPS --ckpt --json "$OUT/torch_ckpt.json" > "$OUT/torch_ckpt.txt" 2>&1; step "torch checkpointing" $?
  ttok=$($PY -c "import json;d=json.load(open('$OUT/torch_ckpt.json'));print(round(d['tokens_per_s']), 'tok/s, step', round(d['median_step_s']*1e3,1), 'ms, peak', round(d['peak_gib'],2), 'GiB')" 2>/dev/null || echo "failed: $(tail -2 $OUT/torch_ckpt.txt)")
  summary+=("torch eager + per-layer checkpointing 1.24B seq $SEQ: $ttok")
fi
if has compile; then
  timeout 300 $PY bench/torch_llama_step.py --seq $SEQ --steps $STEPS --compile --json "$OUT/torch_compile.json" > "$OUT/torch_compile.txt" 2>&1; step "torch.compile" $?
  ttok=$($PY -c "import json;d=json.load(open('$OUT/torch_compile.json'));print(round(d['tokens_per_s']), 'tok/s, step', round(d['median_step_s']*1e3,1), 'ms, peak', round(d['peak_gib'],2), 'GiB, first step', round(d.get('first_step_s',0),1), 's')" 2>/dev/null || echo "failed: $(tail -2 $OUT/torch_compile.txt)")
  summary+=("torch.compile 1.24B seq $SEQ: $ttok")
fi
printf '%s\n' "${summary[@]}" > "$OUT/summary.txt"
tar czf "$FINAL/results.tgz" -C "$OUT" . && cp "$OUT/summary.txt" "$FINAL/summary.txt"
echo; echo "==== summary ===="; cat "$OUT/summary.txt"
if [ ${#failed[@]} -gt 0 ]; then
  echo; echo "FAILED: ${#failed[@]} step(s):"; printf '  %s\n' "${failed[@]}"
  exit 1
fi
echo "all steps passed"
