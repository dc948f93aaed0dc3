#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each, all at once (one process per target), from its
# committed seed corpus; new inputs go to a scratch corpus, crashes to $OUT/<target>/.
# Prints per target the executions, the coverage reached and any crash files.
#   bash frontends/fuzz/run.sh 600 [BIN_DIR] [OUT]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
secs=${1:-60}
bins=${2:-${CARGO_TARGET_DIR:-$here/target}/$(rustc -vV 2>/dev/null | sed -n 's/^host: //p' || echo x86_64-unknown-linux-gnu)/release}
out=${3:-$here/out}
targets="text_ir config_json safetensors plan_json layout_json pt2_zip pt2_json"
mkdir -p "$out"
for t in $targets; do
  mkdir -p "$out/$t/corpus" "$out/$t/crashes"
  # -max_len covers the largest seed (a compiled plan); rss/malloc limits catch runaway memory.
  "$bins/$t" "$out/$t/corpus" "$here/corpus/$t" -max_total_time="$secs" -max_len=131072 \
    -rss_limit_mb=2048 -malloc_limit_mb=2048 -timeout=20 -print_final_stats=1 \
    -artifact_prefix="$out/$t/crashes/" > "$out/$t/log.txt" 2>&1 &
done
wait
for t in $targets; do
  execs=$(grep -a 'stat::number_of_executed_units' "$out/$t/log.txt" | awk '{print $2}')
  cov=$(grep -a -E '^#[0-9]+' "$out/$t/log.txt" | tail -1 | grep -o 'cov: [0-9]*')
  crashes=$(ls "$out/$t/crashes" | wc -l)
  echo "$t: ${secs}s, ${execs:-?} executions, ${cov:-cov ?}, $crashes crash files"
done
