#!/usr/bin/env bash
# The `weft plan` searches issue 17 lists, each timed (wall and CPU) with its winning
# configuration. A benchmark, not a test: run it on an idle machine for wall times.
#   bash bench/plan_search.sh [path/to/weft]   (default target/debug/weft)
# Results of a run are in bench/PLAN_SEARCH.md.
set -u
WEFT=${1:-target/debug/weft}
run() {
  local what=$1; shift
  echo "== $what: weft plan $*"
  local t0=$(date +%s.%N)
  /usr/bin/time -f "cpu %U s user, %e s wall, max rss %M KiB" "$WEFT" plan "$@" 2>&1 \
    | grep -E "^(weft plan|searched|best|why|error|help|cpu )" | cut -c1-400
  local t1=$(date +%s.%N)
  echo "wall $(echo "$t1 - $t0" | bc) s"
}
run "llama3-8b on 8 GPUs at 131072" llama3-8b --gpus 8 --seq 131072 --device h100
run "llama3-70b on 64 GPUs at 32768" llama3-70b --gpus 64 --seq 32768 --device h100
run "mixtral-8x7b on 32 GPUs at 4096" mixtral-8x7b --gpus 32 --seq 4096 --device h100
run "qwen3-30b-a3b on 32 GPUs at 4096" qwen3-30b-a3b --gpus 32 --seq 4096 --device h100
run "llama3.1-405b on 1024 GPUs at 131072" llama3.1-405b --gpus 1024 --seq 131072 --device h100
