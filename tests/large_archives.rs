//! Real-size `.pt2` archives: torch writes the weights first, so the entry names lie
//! past the first MiB of any real model's archive. The CLI detects an archive by its
//! zip central directory and imports it.

mod common;
use common::*;
use std::io::{Read, Write};

/// `tests/fixtures/pt2/<name>.pt2` rewritten with its first weight storage padded by
/// `pad` zero bytes (the tensor's view reads only its start), entries in the same order.
fn padded(name: &str, pad: usize) -> Vec<u8> {
    let bytes = std::fs::read(fixture("pt2").join(format!("{name}.pt2"))).unwrap();
    let mut z = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
    let mut out = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for i in 0..z.len() {
        let mut f = z.by_index(i).unwrap();
        let n = f.name().to_string();
        let mut data = Vec::new();
        f.read_to_end(&mut data).unwrap();
        if n.ends_with("data/weights/weight_0") {
            data.resize(data.len() + pad, 0);
        }
        out.start_file(n, opts).unwrap();
        out.write_all(&data).unwrap();
    }
    out.finish().unwrap().into_inner()
}

#[test]
fn a_pt2_over_one_mib_with_weights_first_imports_and_checks() {
    let big = padded("llama", 2 << 20);
    assert!(!big[..1 << 20].windows(7).any(|w| w == b"models/"));
    let dir = std::env::temp_dir().join(format!("weft-large-archives-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("llama.pt2");
    std::fs::write(&path, &big).unwrap();
    let path = path.to_str().unwrap();
    let config = "tests/fixtures/llama/config.json";
    let (code, out, err) = weft(&["import", path, "--config", config]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("graph "), "{out}");
    let (code, out, err) = weft(&[
        "check", path, "--config", config, "--mesh", "sp=2", "--train", "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["ok"], true, "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}
