//! Arbitrary text as an ExecutionPlan: loading (with its self-check) returns an error,
//! never panics; a plan that loads answers its analyses.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(p) = weft_ir::ExecutionPlan::from_json(text, "fuzz") {
            let _ = p.clocks();
            let _ = p.storage_roots();
        }
    }
});
