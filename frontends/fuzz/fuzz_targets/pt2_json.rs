//! Arbitrary text as `models/model.json` of an archive that is otherwise the tiny
//! fixture's: the JSON reader, the export schema, FX normalization, constant
//! evaluation and lowering must return an error, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::io::{Read, Write};
use std::sync::OnceLock;
use weft_frontends::pt2::{import_bytes, Pt2Options};

/// The tiny fixture's entries other than model.json.
fn base() -> &'static Vec<(String, Vec<u8>)> {
    static B: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    B.get_or_init(|| {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/pt2/tiny.pt2");
        let bytes = std::fs::read(path).expect("tests/fixtures/pt2/tiny.pt2");
        let mut z = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
        let mut out = Vec::new();
        for i in 0..z.len() {
            let mut f = z.by_index(i).unwrap();
            let mut d = Vec::new();
            f.read_to_end(&mut d).unwrap();
            if !f.name().ends_with("models/model.json") {
                out.push((f.name().to_string(), d));
            }
        }
        out
    })
}

fuzz_target!(|data: &[u8]| {
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let o = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (n, d) in base() {
        w.start_file(n.as_str(), o).unwrap();
        w.write_all(d).unwrap();
    }
    w.start_file("tiny/models/model.json", o).unwrap();
    w.write_all(data).unwrap();
    let bytes = w.finish().unwrap().into_inner();
    let _ = import_bytes("fuzz.pt2", bytes, &Pt2Options::default());
});
