//! The host optimizer's update rate (`--offload-optimizer`, `weft_runtime::host_adamw_math`)
//! on this machine's CPUs: f32 master weights and moments, bf16 gradient and parameter,
//! as the CUDA runtime runs it on a bf16 model, in place. Prints parameters per second
//! and the host memory traffic (28 bytes a parameter) for the chunked loop, and for the
//! same update element by element (the loop before session 24) as the baseline. Not a
//! timed test: a number for the device profile's `host_adam_params_per_s`.
//!
//! ```text
//! cargo bench -p weft-runtime --bench host_adamw -- [ELEMENTS (default 2^26)] [THREADS (default all)]
//! ```

use std::time::Instant;
use weft_ir::DType;
use weft_runtime::host_adamw_math::{adamw_range, AdamWConstants, AdamWSpans, HostSpan};

/// Bytes a parameter moves: master, m, v read and written (24), gradient read and
/// parameter written (2 + 2 in bf16).
const BYTES_PER_PARAM: f64 = 28.0;

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let n: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(1 << 26);
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let mut p: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 1e-3).collect();
    let mut m = vec![0f32; n];
    let mut v = vec![0f32; n];
    let mut g: Vec<u16> = (0..n)
        .map(|i| half::bf16::from_f32(((i % 777) as f32 - 388.0) * 1e-4).to_bits())
        .collect();
    let mut param = vec![0u16; n];
    let span = |ptr: u64, dtype| HostSpan { ptr, dtype };
    let s = AdamWSpans {
        master: span(p.as_mut_ptr() as u64, DType::F32),
        grad: span(g.as_mut_ptr() as u64, DType::BF16),
        m: span(m.as_mut_ptr() as u64, DType::F32),
        v: span(v.as_mut_ptr() as u64, DType::F32),
        out_master: span(p.as_mut_ptr() as u64, DType::F32),
        out_m: span(m.as_mut_ptr() as u64, DType::F32),
        out_v: span(v.as_mut_ptr() as u64, DType::F32),
        out_param: span(param.as_mut_ptr() as u64, DType::BF16),
    };
    println!(
        "{n} parameters, {threads} threads, bf16 gradient and parameter, f32 master and moments"
    );
    for (name, chunked) in [("element by element", false), ("chunked", true)] {
        let mut best = f64::INFINITY;
        for t in 1..=4 {
            let k = AdamWConstants::new([1e-4, 0.9, 0.95, 1e-8, 0.1], None, t as f64);
            let per = n.div_ceil(threads);
            let start = Instant::now();
            std::thread::scope(|sc| {
                for i in 0..threads {
                    let (lo, hi) = (i * per, ((i + 1) * per).min(n));
                    let (k, s) = (&k, &s);
                    if lo < hi {
                        // SAFETY: the spans hold n elements; the ranges are disjoint.
                        sc.spawn(move || unsafe {
                            if chunked {
                                adamw_range(s, k, lo, hi)
                            } else {
                                element_by_element(s, k, lo, hi)
                            }
                        });
                    }
                }
            });
            best = best.min(start.elapsed().as_secs_f64());
        }
        println!(
            "{name:<20} {:>8.3} s  {:>6.2} G params/s  {:>6.1} GB/s",
            best,
            n as f64 / best / 1e9,
            n as f64 * BYTES_PER_PARAM / best / 1e9
        );
    }
    std::hint::black_box((&p, &m, &v, &param));
}

/// The update as it ran before the chunked loop: one element at a time, the dtype
/// decided per element, through raw pointers that may alias.
///
/// # Safety
/// As [`adamw_range`], with a bf16 gradient and parameter.
unsafe fn element_by_element(s: &AdamWSpans, k: &AdamWConstants, lo: usize, hi: usize) {
    let f = |h: HostSpan| h.ptr as *mut f32;
    for i in lo..hi {
        let g = half::bf16::from_bits(*(s.grad.ptr as *const u16).add(i)).to_f32();
        let (np, nm, nv) = k.update(*f(s.master).add(i), g, *f(s.m).add(i), *f(s.v).add(i));
        *f(s.out_master).add(i) = np;
        *f(s.out_m).add(i) = nm;
        *f(s.out_v).add(i) = nv;
        *(s.out_param.ptr as *mut u16).add(i) = half::bf16::from_f32(np).to_bits();
    }
}
