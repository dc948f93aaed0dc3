//! Writing output files safely, for every verb and crate that writes one: the bytes go
//! to a temporary file in the destination's directory, which is renamed into place
//! only once complete (a failure or a full disk never leaves half a file, and never
//! destroys what was there); and an output that is one of the command's inputs is
//! refused before anything is read or written.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` through a temporary file renamed into place.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic_with(path, |f| f.write_all(bytes))
}

/// Like [`write_atomic`], with the bytes written by `fill`.
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut std::fs::File) -> io::Result<()>,
) -> io::Result<()> {
    write_atomic_via(path, |tmp| {
        let mut f = std::fs::File::create(tmp)?;
        fill(&mut f)?;
        f.flush()
    })
}

/// Like [`write_atomic`], with the temporary file created and written by `fill` from its
/// path (for writers that open their file themselves); synced, then renamed into place.
pub fn write_atomic_via(path: &Path, fill: impl FnOnce(&Path) -> io::Result<()>) -> io::Result<()> {
    let tmp = temporary_beside(path);
    let result = fill(&tmp)
        .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|_| std::fs::rename(&tmp, path));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// `dir/.name.weft-tmp-PID`: in the same directory, so the rename stays on one file
/// system and is atomic.
fn temporary_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    path.with_file_name(format!(".{name}.weft-tmp-{}", std::process::id()))
}

/// The path `p` names once links and `..` are resolved; for a file that does not
/// exist yet, its resolved directory joined with its name.
fn resolved(p: &Path) -> Option<PathBuf> {
    if let Ok(c) = p.canonicalize() {
        return Some(c);
    }
    let name = p.file_name()?;
    let parent = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Some(parent.canonicalize().ok()?.join(name))
}

/// True when `a` and `b` name the same file (or the same place, for one that does not
/// exist yet), or one is a directory holding the other.
pub fn same_or_inside(a: &Path, b: &Path) -> bool {
    match (resolved(a), resolved(b)) {
        (Some(x), Some(y)) => {
            x == y || (b.is_dir() && x.starts_with(&y)) || (a.is_dir() && y.starts_with(&x))
        }
        _ => false,
    }
}

/// `Err` naming both paths when the output `out` is (or is inside, or holds) one of
/// `inputs`: writing it would destroy what the command reads.
pub fn refuse_overwriting_input(out: &Path, inputs: &[(&str, &Path)]) -> Result<(), String> {
    for (what, input) in inputs {
        if same_or_inside(out, input) {
            return Err(format!(
                "output {} is the {what} {} (or inside it): writing it would destroy the input\nhelp: write the output somewhere else",
                out.display(),
                input.display()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_through_a_temporary_and_refuses_inputs() {
        let dir = std::env::temp_dir().join(format!("weft-output-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a.txt");
        write_atomic(&f, b"one").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"one");
        // A failing writer leaves the old file and no temporary.
        let e = write_atomic_with(&f, |_| Err(io::Error::other("disk full")));
        assert!(e.is_err());
        assert_eq!(std::fs::read(&f).unwrap(), b"one");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let via_dots = dir.join("..").join(dir.file_name().unwrap()).join("a.txt");
        assert!(refuse_overwriting_input(&via_dots, &[("weights", &f)]).is_err());
        assert!(refuse_overwriting_input(&dir.join("b.txt"), &[("weights", &f)]).is_ok());
        assert!(
            refuse_overwriting_input(&dir.join("new.txt"), &[("shard directory", &dir)]).is_err()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
