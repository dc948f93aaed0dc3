//! Arbitrary text as Weft text IR: the parser and the verifier return errors, never
//! panic, and never allocate by the numbers inside the text.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(g) = weft_ir::parse(text) {
            if let Err(r) = weft_ir::verify(&g) {
                let _ = r.in_source(&g, text, "fuzz.weft");
            }
        }
    }
});
