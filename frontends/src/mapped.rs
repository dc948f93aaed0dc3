//! Files mapped into memory, shared by the tensors that point into them.
//!
//! Checkpoints and `.pt2` archives are memory-mapped rather than read: a tensor loaded
//! from one keeps its bytes in the file's own dtype as a view of the mapping
//! ([`weft_ir::RawBytes::shared`]), so loading costs no copy, pages come in only when a
//! tensor is used, and a 2.5 GB bf16 checkpoint needs about 2.5 GB of memory, not the
//! 10 GB its values would take as f64.
//!
//! A mapping reads the file as it is on disk: a file changed in place while mapped would
//! change (or, truncated, fault) under the tensors. Weft never writes a file it has
//! mapped in place (outputs are written to a new file).

use std::path::Path;
use std::sync::Arc;

/// The bytes of a file: mapped, or read into memory where mapping is not possible (an
/// empty file cannot be mapped) or not wanted (in-memory archives).
pub enum FileBytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl AsRef<[u8]> for FileBytes {
    fn as_ref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Owned(v) => v,
        }
    }
}

/// Shared bytes tensors can point into.
pub type Shared = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Maps `path` read-only.
pub fn map_file(path: &Path) -> std::io::Result<Arc<FileBytes>> {
    weft_ir::files::check_regular(path)?;
    let file = std::fs::File::open(path)?;
    if file.metadata()?.len() == 0 {
        return Ok(Arc::new(FileBytes::Owned(Vec::new())));
    }
    // SAFETY: the mapping is read-only and private to this process. The file could be
    // changed by another process while mapped (see the module header); Weft itself
    // writes outputs to new files, never in place over a mapped input.
    let map = unsafe { memmap2::Mmap::map(&file)? };
    Ok(Arc::new(FileBytes::Mapped(map)))
}
