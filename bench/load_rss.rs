//! Peak memory of loading a checkpoint against its size: loads MODEL's weights from
//! CHECKPOINT (safetensors file or directory, or a `.pt2` archive with its weights)
//! and prints the file size, the resident set before, and the peak resident set
//! (VmHWM of /proc/self/status) after, with their ratio to the size. Not a timed test:
//! a number for the report (issue 15 asks loading to need at most ~1.2x the size).
//!
//! ```text
//! python bench/make_big_checkpoint.py /tmp/llama1b            # ~2.5 GB bf16
//! cargo bench -p weft-frontends --bench load_rss -- /tmp/llama1b /tmp/llama1b/model.safetensors
//! python bench/make_big_pt2.py /tmp/llama1b.pt2                 # its .pt2 (torch.export)
//! cargo bench -p weft-frontends --bench load_rss -- /tmp/llama1b.pt2 /tmp/llama1b/config.json
//! ```

use std::path::Path;

/// A field of /proc/self/status in bytes (`VmRSS`, `VmHWM`).
fn status_bytes(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    // MODEL CHECKPOINT, or ARCHIVE.pt2 [CONFIG.json] (the config for llama3 rope scaling).
    let (model_spec, checkpoint, config) = match args.as_slice() {
        [pt2] => (None, pt2.clone(), None),
        [pt2, c] if pt2.ends_with(".pt2") => (None, pt2.clone(), Some(c.into())),
        [m, c] => (Some(m.clone()), c.clone(), None),
        _ => {
            eprintln!("usage: load_rss MODEL CHECKPOINT | load_rss ARCHIVE.pt2 [CONFIG.json]");
            std::process::exit(2);
        }
    };
    let ck = Path::new(&checkpoint);
    let size: u64 = if ck.is_dir() {
        std::fs::read_dir(ck)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
            .map(|e| e.metadata().unwrap().len())
            .sum()
    } else {
        std::fs::metadata(ck).unwrap().len()
    };
    let before = status_bytes("VmRSS");
    let t = std::time::Instant::now();
    // The weights stay alive until the resident set is read.
    let weights = match &model_spec {
        Some(m) => {
            let model = weft_frontends::load(m).expect("model");
            weft_frontends::load_weights(&model, ck).expect("weights")
        }
        None => {
            let opts = weft_frontends::pt2::Pt2Options {
                config,
                ..Default::default()
            };
            weft_frontends::pt2::import(ck, &opts)
                .expect("archive")
                .weights
        }
    };
    let secs = t.elapsed().as_secs_f64();
    let (rss, peak) = (status_bytes("VmRSS"), status_bytes("VmHWM"));
    let tensors = weights.len();
    let elements: usize = weights.values().map(|t| t.numel()).sum();
    // Touch every page of every tensor, as a run reading them all would (a mapped tensor
    // is read from disk on first use, and its pages then count as resident).
    let sum: u64 = weights
        .values()
        .map(|t| match &t.data {
            weft_ir::HostData::Raw(b) => b.bytes().iter().step_by(4096).map(|&x| x as u64).sum(),
            _ => 0,
        })
        .sum();
    let peak_used = status_bytes("VmHWM");
    drop(weights);
    let gb = |b: u64| b as f64 / 1e9;
    println!(
        "checkpoint {checkpoint}: {:.3} GB, {tensors} tensors, {elements} elements",
        gb(size)
    );
    println!("  resident before loading {:.3} GB", gb(before));
    println!("  resident after loading  {:.3} GB", gb(rss));
    println!(
        "  peak resident (VmHWM)   {:.3} GB = {:.2}x the checkpoint ({:.2}x counting only what loading added)",
        gb(peak),
        peak as f64 / size as f64,
        peak.saturating_sub(before) as f64 / size as f64
    );
    println!("  load took {secs:.2} s");
    println!(
        "  peak after touching every page of every tensor: {:.3} GB = {:.2}x (checksum {sum})",
        gb(peak_used),
        peak_used as f64 / size as f64
    );
}
