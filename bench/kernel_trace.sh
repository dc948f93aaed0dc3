#!/usr/bin/env bash
# Builds bench/kernel_trace.c (a CUPTI kernel tracer) on the device machine:
#   bash bench/kernel_trace.sh        -> ${TRACE_SO:-/tmp/kernel_trace.so}, or exits 1 saying why
# Then: CUDA_INJECTION64_PATH=$TRACE_SO KERNEL_TRACE_OUT=k.tsv <any CUDA program>
set -u
SO=${TRACE_SO:-/tmp/kernel_trace.so}
CUDA=${CUDA_HOME:-/usr/local/cuda}
HDR=$(find $CUDA/ $CUDA/extras/CUPTI /usr/include -name cupti_activity.h 2>/dev/null | head -1)
[ -n "$HDR" ] || { echo "kernel_trace: no cupti_activity.h under $CUDA"; exit 1; }
INC=$(dirname "$HDR")
LIB=$(find $CUDA/ -name 'libcupti.so*' 2>/dev/null | head -1)
[ -n "$LIB" ] || { echo "kernel_trace: no libcupti.so under $CUDA"; exit 1; }
KREC=$(grep -ohE 'CUpti_ActivityKernel[0-9]+' $INC/cupti_activity*.h | sort -uV | tail -1)
CC=$(command -v gcc || command -v cc || command -v clang)
[ -n "$CC" ] || { echo "kernel_trace: no C compiler"; exit 1; }
$CC -O2 -shared -fPIC -DKREC=$KREC -I"$INC" -I$CUDA/include bench/kernel_trace.c -o "$SO" -L"$(dirname $LIB)" -lcupti -Wl,-rpath,"$(dirname $LIB)" \
  && echo "kernel_trace: $SO ($KREC, $LIB)"
