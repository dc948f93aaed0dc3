//! Every input the fuzzers crashed on (`frontends/fuzz/regressions/<target>/`), replayed
//! through the same entry point as its fuzz target: each must now be refused with an
//! error, never a panic.

use std::path::Path;

fn inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("frontends/fuzz/regressions")
        .join(target);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let p = e.unwrap().path();
            (p.display().to_string(), std::fs::read(&p).unwrap())
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no regression inputs in {}", dir.display());
    out
}

#[test]
fn text_ir_crashes_are_refused() {
    for (name, bytes) in inputs("text_ir") {
        let text = String::from_utf8_lossy(&bytes);
        let parsed = weft_ir::parse(&text);
        let refused = match &parsed {
            Err(_) => true,
            Ok(g) => weft_ir::verify(g).is_err(),
        };
        assert!(refused, "{name}: accepted");
        if let Err(e) = &parsed {
            assert!(!e.to_string().is_empty(), "{name}: an empty message");
        }
    }
}
