//! Device profiles: the rates the cost model uses. Presets for A100, H100 and H200
//! (figures measured on the device machine where we have them; see docs/GPU.md),
//! overridable by a JSON file with the same fields.

use weft_ir::plan::DeviceProfile;

/// Built-in profile names.
pub const PROFILES: &[&str] = &["h200", "h100", "a100"];

pub fn preset(name: &str) -> Option<DeviceProfile> {
    let p = |name: &str,
             matmul,
             (attention, attention_bwd, row_keys),
             vector,
             hbm,
             mem,
             nvlink,
             net,
             (host, duplex, slowdown)| {
        DeviceProfile {
            name: name.to_string(),
            matmul_tflops: matmul,
            attention_tflops: attention,
            attention_bwd_tflops: attention_bwd,
            attention_row_keys: row_keys,
            vector_tflops: vector,
            hbm_gbps: hbm,
            kernel_overhead_us: 4.0,
            memory_gib: mem,
            gpus_per_node: 8,
            intra_node_gbps: nvlink,
            intra_node_latency_us: 8.0,
            inter_node_gbps: net,
            inter_node_latency_us: 25.0,
            host_gbps: host,
            host_duplex_gbps: duplex,
            host_copy_compute_slowdown: slowdown,
            host_adam_params_per_s: weft_ir::plan::default_host_adam_params_per_s(),
            grouped_gemm_issue_us: weft_ir::plan::default_grouped_gemm_issue_us(),
            host_sync_us: weft_ir::plan::default_host_sync_us(),
        }
    };
    match name.to_ascii_lowercase().as_str() {
        // H200: cuBLASLt bf16 8192^3 reached ~790 TFLOP/s there; device copies ~4.3 TB/s.
        // Attention is priced at what the runtime's attention reaches there: cuDNN's fused
        // flash attention (the CUDA executor's default where libcudnn loads), causal, head
        // dim 64, S=16384, in a 1.24B training step: forward 37.2 ms and backward 123.6 ms
        // for 16 layers, 383 TFLOP/s over the 3.5x forward FLOPs the model counts (session 3 in
        // bench/GPU_NOTES.md). Weft's own kernels (WEFT_ATTENTION=weft) reach ~190; with
        // that rate the plan predicted 527.7 ms for the step at S=16384 that measured
        // 533.4 ms (run D).
        // Fitted since (session 21) to cuDNN 9.19's kernels profiled in the 1.24B step on
        // an H100 (16 layers, causal, head dim 64): forward 3.24 ms at S=4096 and ~40 at
        // 16384, backward 9.22 and ~121: long rows reach ~475 TFLOP/s forward and ~413
        // backward, and each query row costs ~770 keys' worth of fixed work more (so
        // 4096 runs at ~350/~300 TFLOP/s). The H200's 37.2 / 123.6 ms at 16384 fit the
        // same rates within 11% and 5%.
        // H100: the same SMs and clocks, so the same attention rates. Its GEMMs in the
        // step ran at 0.92-0.95 of a 700 TFLOP/s price (session 17: 41.21 ms against
        // 44.76 at S=4096, 169.60 against 179.16 at 16384; 798 at 8192^3 alone): 750.
        // Host link: pinned copies measured with bench/host_link.py (PCIe Gen5 x16). On the
        // H200 there: 55 GB/s each way, both directions at once ~101 GB/s together, a GEMM
        // unchanged beside them. On the H100 there (session 16): 43-54 GB/s each way (50
        // at 64 MiB), both at once 62-78 together, and a bf16 GEMM at 743 TFLOP/s beside
        // them against 799 alone (7% slower). A100: PCIe Gen4, about half, not measured.
        "h200" => Some(p(
            "h200",
            790.0,
            (475.0, 413.0, 770.0),
            60.0,
            4300.0,
            139.0,
            370.0,
            45.0,
            (55.0, 101.0, 0.0),
        )),
        "h100" => Some(p(
            "h100",
            750.0,
            (475.0, 413.0, 770.0),
            50.0,
            3000.0,
            80.0,
            370.0,
            45.0,
            (50.0, 72.0, 0.07),
        )),
        "a100" => Some(p(
            "a100",
            280.0,
            (190.0, 0.0, 0.0),
            19.5,
            1700.0,
            80.0,
            240.0,
            22.0,
            (20.0, 0.0, 0.0),
        )),
        _ => None,
    }
}

/// A preset name or a JSON file of a [`DeviceProfile`].
pub fn load(spec: &str) -> Result<DeviceProfile, String> {
    if let Some(p) = preset(spec) {
        return Ok(p);
    }
    let text = weft_ir::files::read_to_string(std::path::Path::new(spec)).map_err(|e| {
        format!(
            "`{spec}` is neither a device profile ({}) nor a readable file: {e}",
            PROFILES.join(", ")
        )
    })?;
    let p: DeviceProfile = serde_json::from_str(&text)
        .map_err(|e| format!("invalid device profile in {spec}: {e}"))?;
    p.validate()
        .map_err(|e| format!("invalid device profile in {spec}: {e}"))?;
    Ok(p)
}
