#!/usr/bin/env bash
# Session 27: how long the compute stream lets a side-stream update run before it waits
# for it (UPDATE_WAIT_SLACK). `.gpu/weft` waits 2 of the update's durations after its
# predicted start, `.gpu/weftA` 6; against `--update-stream=false`, alternated, REPS
# times, on the 1.24B: 4096 --torch-adamw, 4096 f32 master weights, 16384 fused loss.
#   REPS=3 bash bench/sessions/session27_slack_ab.sh
PHASES=x; source bench/gpu_env.sh > /dev/null
one() { timeout 70 "$1" run llama3.2-1b --backend cuda --batch 1 --steps 5 "${@:2}" 2>&1 | grep -E '^mean|error' | cut -c1-70; }
master="--unfused-loss --checkpoint none --offload=false --zero 0 --micro-batches 1 --stream-optimizer-state=false"
for r in $(seq ${REPS:-3}); do
  for cfg in "4096 --torch-adamw --unfused-loss" "4096 $master" "16384 --torch-adamw --fused-loss"; do
    set -- $cfg; seq=$1; shift
    echo "== $seq ${1} inline: $(one ./.gpu/weft --seq $seq "$@" --update-stream=false)"
    echo "== $seq ${1} slack2: $(one ./.gpu/weft --seq $seq "$@")"
    echo "== $seq ${1} slack6: $(one ./.gpu/weftA --seq $seq "$@")"
  done
done
