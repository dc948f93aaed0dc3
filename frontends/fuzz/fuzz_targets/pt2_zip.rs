//! Arbitrary bytes as a `.pt2` archive: the zip reader, layout checks, payload configs,
//! strided weight decoding and everything after must return an error, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_frontends::pt2::{import_bytes, Pt2Options};

fuzz_target!(|data: &[u8]| {
    let _ = import_bytes("fuzz.pt2", data.to_vec(), &Pt2Options::default());
});
