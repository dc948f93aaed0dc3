// A CUPTI injection library that writes every kernel a process runs (name, start,
// duration, grid, block) to a tab-separated file: the kernel list nsys would give, on a
// machine without nsys. Built and used on the device machine (CUPTI ships with CUDA):
//   bash bench/kernel_trace.sh build            (-> $TRACE_SO, default /tmp/kernel_trace.so)
//   CUDA_INJECTION64_PATH=/tmp/kernel_trace.so KERNEL_TRACE_OUT=k.tsv ./.gpu/weft run ...
//   python3 bench/kernel_trace.py k.tsv --last-ms 400
// The record type is the newest CUpti_ActivityKernelN of the installed headers, passed
// in as KREC by kernel_trace.sh; the fields read here exist in every version.
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef KREC
#error "KREC (the CUpti_ActivityKernelN type) must be defined"
#endif

#define BUF_BYTES (16u << 20)
static FILE *out;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = (uint8_t *)aligned_alloc(8, BUF_BYTES);
    *size = *buffer ? BUF_BYTES : 0;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer,
                                      size_t size, size_t valid) {
    (void)ctx; (void)stream; (void)size;
    CUpti_Activity *r = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
        const KREC *k = (const KREC *)r;
        if (out)
            fprintf(out, "%llu\t%llu\t%u\t%d,%d,%d\t%d,%d,%d\t%d\t%u\t%s\n",
                    (unsigned long long)k->start, (unsigned long long)(k->end - k->start),
                    k->streamId, k->gridX, k->gridY, k->gridZ, k->blockX, k->blockY,
                    k->blockZ, k->registersPerThread, k->dynamicSharedMemory,
                    k->name ? k->name : "?");
    }
    free(buffer);
}

static void flush_at_exit(void) {
    cuptiActivityFlushAll(1);
    if (out) fclose(out);
    out = NULL;
}

int InitializeInjection(void) {
    const char *path = getenv("KERNEL_TRACE_OUT");
    out = fopen(path ? path : "kernel_trace.tsv", "w");
    if (!out) return 0;
    fprintf(out, "start_ns\tdur_ns\tstream\tgrid\tblock\tregs\tdyn_smem\tname\n");
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(stderr, "kernel_trace: CUPTI activity setup failed\n");
        return 0;
    }
    atexit(flush_at_exit);
    return 1;
}
