#!/usr/bin/env bash
# Builds every fuzz target with libFuzzer on the stable toolchain (what `cargo fuzz build`
# does, without needing cargo-fuzz or nightly): SanitizerCoverage through RUSTFLAGS, applied
# to the target triple only so build scripts link normally, with debug assertions and
# overflow checks on so that wrapped arithmetic is a crash. Binaries land in
# $CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/<target>.
#   bash frontends/fuzz/build.sh        (then frontends/fuzz/run.sh SECONDS)
set -euo pipefail
cd "$(dirname "$0")"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow_checks"
cargo build --release --bins --target "$(rustc -vV | sed -n 's/^host: //p')"
