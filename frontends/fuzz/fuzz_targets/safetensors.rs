//! Arbitrary bytes as a safetensors file: the header and data checks return errors,
//! never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let p = std::env::temp_dir().join(format!("weft-fuzz-{}.safetensors", std::process::id()));
    if std::fs::write(&p, data).is_ok() {
        let _ = weft_frontends::read_safetensors(&p);
    }
});
