#!/usr/bin/env bash
# Session 22's second GPU call: the changed bandwidth kernels (glu8 / glu_bwd8 two vectors
# an iteration, add_rms_bwd8 with the next row loaded before the reduction) against the
# binary before them, in one machine, with why the SM clock moves (nvidia-smi's clock
# event reasons) sampled through each run. From the repo root on the device machine with
# .gpu/weft (new), .gpu/weftA (before) and .gpu/tests/gpu:
#   cases   the fused ops' and attention's GPU op cases against the CPU reference
#   checks  --check 20 on three tiny models (bf16)
#   ab      the 1.24B step at 4096, A B A B (10 steps each), then 16384 fused A B
#   trace   the new step at 4096 under bench/kernel_trace.c: the changed kernels' us/call
#   graph0  the new step at 4096 traced with and without the CUDA graph: attention us/call
#           by step (is the in-step slowdown the clock or the graph?)
#   torch   PyTorch eager at 4096 and 16384 (the ratio's denominator)
#   parity  bench/loss_parity.py on the new binary
#   OUT=$OUT PHASES="cases checks ab trace graph0 torch parity" bash bench/sessions/session22_ab_call.sh
PHASES=${PHASES:-"cases checks ab trace graph0 torch parity"}
source bench/gpu_env.sh
step() { local bin=$1; shift; timeout "$1" $bin run llama3.2-1b --backend cuda --batch 1 --torch-adamw "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-200; }
if has cases; then
  WEFT_GPU_ONLY="glu,add_rms_norm,attention" timeout 200 .gpu/tests/gpu --nocapture --test-threads=1 > $OUT/cases.txt 2>&1
  echo "op cases (glu, add_rms_norm, attention) rc $?"; grep -E "cases|FAIL|fail|mismatch" $OUT/cases.txt | tail -4
fi
if has checks; then
  for m in "llama-tiny --dtype bf16 --torch-adamw --micro-batches 2" "gemma2-tiny --dtype bf16 --fused-loss" "mixtral-tiny --dtype bf16 --torch-adamw"; do
    echo "check $m: $(timeout 45 ./.gpu/weft run $m --backend cuda --steps 20 --check 20 --seq 32 --batch 2 2>&1 | grep -E '^check|error' | head -2)"
  done
fi
if has ab; then
  for r in 1 2; do for b in weftA weft; do
    clocks_on $b$r; echo "== 4096 $b: $(step ./.gpu/$b 60 --steps 10 --seq 4096 --unfused-loss)"; clocks_off $b$r
  done; done
  for b in weftA weft; do
    clocks_on ${b}16k; echo "== 16384 fused $b: $(step ./.gpu/$b 75 --steps 4 --seq 16384 --fused-loss)"; clocks_off ${b}16k
  done
fi
if has trace; then
  export TRACE_SO=/tmp/kernel_trace.so
  if bash bench/kernel_trace.sh >/dev/null; then
    for b in weftA weft; do
      echo "== traced $b 4096: $(CUDA_INJECTION64_PATH=$TRACE_SO KERNEL_TRACE_OUT=$OUT/k$b.tsv step ./.gpu/$b 60 --steps 3 --seq 4096 --unfused-loss)"
      $PY bench/kernel_trace.py $OUT/k$b.tsv --last-ms 64 --match 'glu|add_rms|adamw|rope|colsum' --width 60
    done
  fi
fi
# Per step: the attention kernels' mean us/call, graph replay against eager launches
# (WEFT_CUDA_GRAPH=0), to tell the clock from the graph.
attn_by_step() { $PY bench/kernel_trace.py $1 --by-step '^embedding_bf16$' --match 'sdpa.*(bprop|fprop)' --width 90; }
if has graph0; then
  export TRACE_SO=/tmp/kernel_trace.so
  if bash bench/kernel_trace.sh >/dev/null; then
    for g in 1 0; do
      clocks_on graph$g
      echo "== WEFT_CUDA_GRAPH=$g 4096: $(WEFT_CUDA_GRAPH=$g CUDA_INJECTION64_PATH=$TRACE_SO KERNEL_TRACE_OUT=$OUT/kg$g.tsv step ./.gpu/weft 60 --steps 6 --seq 4096 --unfused-loss)"
      clocks_off graph$g; attn_by_step $OUT/kg$g.tsv
    done
  fi
fi
if has torch; then
  for SEQ in 4096 16384; do
    clocks_on torch$SEQ; echo "== seq $SEQ torch eager: $(timeout 120 $PY bench/torch_llama_step.py --seq $SEQ --steps 6 2>&1 | tail -1 | cut -c1-200)"; clocks_off torch$SEQ
  done
fi
if has parity; then echo "== parity: $(timeout 150 $PY bench/loss_parity.py 2>&1 | tail -6)"; fi
cd $OUT && tar -czf ab.tgz k*.tsv clk_*.csv cases.txt 2>/dev/null && rm -f k*.tsv clk_*.csv cases.txt
exit 0
