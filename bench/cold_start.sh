#!/usr/bin/env bash
# Time to first step on the GPU (issue 20): `weft run` of one training step with an
# empty kernel cache, NVRTC on one thread (WEFT_NVRTC_SPLIT=1) and split over every core
# (the default), then again with the cache warm. Run from the repo root on the device
# machine with the binaries in .gpu/ (docs/GPU.md).
#   MODEL=llama3.2-1b SEQ=4096 bash bench/cold_start.sh
set -uo pipefail
MODEL=${MODEL:-llama3.2-1b}; SEQ=${SEQ:-4096}
W=./.gpu/weft
for split in 1 0; do
  dir=$(mktemp -d /tmp/weft-cold.XXXX)
  for state in cold warm; do
    t0=$(date +%s.%N)
    line=$(WEFT_CACHE_DIR=$dir WEFT_NVRTC_SPLIT=$split $W run $MODEL --backend cuda --dtype bf16 --steps 1 --seq $SEQ --batch 1 2>&1 | grep -E "kernels [0-9.]+s" | sed -E 's/.*(compile [0-9.]+s, kernels [0-9.]+s \([a-z]+\), load [0-9.]+s).*/\1/')
    t1=$(date +%s.%N)
    printf 'split=%s %s: wall %.1f s to the end of step 1; %s\n' "$split" "$state" "$(awk "BEGIN{print $t1 - $t0}")" "$line"
  done
  rm -rf "$dir"
done
