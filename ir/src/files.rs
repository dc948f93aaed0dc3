//! Reading input files: only regular files. A FIFO blocks the open forever, and a
//! device such as `/dev/zero` never ends, so reading it whole allocates without bound;
//! both are refused by their kind before anything is opened.

use std::io;
use std::path::Path;

/// `Ok` for a regular file (or a link to one); an error saying what it is otherwise.
/// Checked with `stat`, which never blocks.
pub fn check_regular(path: &Path) -> io::Result<()> {
    let m = std::fs::metadata(path)?;
    if m.is_file() {
        return Ok(());
    }
    let what = if m.is_dir() {
        "a directory"
    } else {
        "a special file (a device, FIFO or socket)"
    };
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("it is {what}, not a regular file"),
    ))
}

/// [`std::fs::read`] of a regular file only.
pub fn read(path: &Path) -> io::Result<Vec<u8>> {
    check_regular(path)?;
    std::fs::read(path)
}

/// [`std::fs::read_to_string`] of a regular file only.
pub fn read_to_string(path: &Path) -> io::Result<String> {
    check_regular(path)?;
    std::fs::read_to_string(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_are_read() {
        let e = read(Path::new("/dev/zero")).unwrap_err();
        assert!(e.to_string().contains("special file"), "{e}");
        let e = read_to_string(Path::new("/")).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        assert!(read(Path::new("/nonexistent/weft")).is_err());
    }
}
