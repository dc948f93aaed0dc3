#!/usr/bin/env bash
# Correctness sweep on the CPU reference: `weft check --train` (the parallel training step
# against autograd of the unsharded model) for every config fixture under tests/fixtures
# on several meshes and option sets. Prints only what did not pass (refusals included,
# with their message) and a count. Takes ~2 minutes on 2 cores with a release build.
#   WEFT=target/release/weft bash bench/check_sweep.sh
set -uo pipefail
W=${WEFT:-target/debug/weft}
MESHES=${MESHES:-"cp=2 cp=4 sp=2,cp=2 dp=2,sp=2 tp=2 sp=2,ep=2 dp=2"}
OPTS=("--seq 64 --batch 2" "--seq 32 --checkpoint selective --micro-batches 2 --zero 2"
      "--seq 48 --zero 3 --offload --checkpoint full" "--seq 40 --fused-loss --offload-optimizer")
runs=0; other=0
for f in tests/fixtures/*/; do
  f=${f%/}; [ -f "$f/config.json" ] || continue
  for m in $MESHES; do
    for o in "${OPTS[@]}"; do
      runs=$((runs + 1))
      # shellcheck disable=SC2086
      last=$(timeout 300 "$W" check "$f" --mesh "$m" --train $o 2>&1 | tail -1)
      case "$last" in *"  ok ("*) ;; *) other=$((other + 1)); echo "$(basename "$f") [$m] $o :: ${last:0:200}";; esac
    done
  done
done
echo "$runs checks, $((runs - other)) matched, $other refused or failed (listed above)"
