//! The PT2 zip archive of torch 2.9 and later: one root folder holding
//! `archive_format` (`pt2`), `byteorder`, `models/<model>.json`,
//! `data/weights/<model>_weights_config.json` with raw storages `data/weights/weight_N`,
//! and `data/constants/<model>_constants_config.json` with `data/constants/tensor_N`.
//! Each tensor is an `as_strided(sizes, strides, storage_offset)` view of its storage
//! bytes; several names may share one storage (tied weights). A storage of 0 bytes
//! means the program was saved without weights.
//!
//! Older layouts are recognised only to say which torch wrote them and how to re-export:
//! torch 2.6-2.8 `serialized_exported_program.json` + pickled `serialized_state_dict.pt`,
//! and PT2 archives whose payloads are pickled.

use super::error::Pt2Error;
use super::schema::{self, PayloadMeta, ScalarType, SymInt, TensorMeta};
use crate::mapped::{FileBytes, Shared};
use std::collections::BTreeMap;
use std::io::Cursor;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use weft_ir::{DType, HostTensor};

/// A read archive: where each entry's bytes lie in the archive (mapped from its file or
/// held in memory). torch stores every entry uncompressed, so an entry is a span of
/// the archive and reading a tensor copies nothing.
pub struct Archive {
    /// The archive's name for messages (its path, or a label for in-memory archives).
    pub name: String,
    /// The root folder inside the zip (`llama` for `llama/models/model.json`).
    pub root: String,
    source: Shared,
    /// Entry path (without the root folder) → its bytes in `source`.
    entries: BTreeMap<String, Range<usize>>,
}

/// Caps that keep a hostile archive from exhausting memory (a fuzzing finding class).
const MAX_ENTRIES: usize = 1 << 20;

/// The most bytes a view that repeats its storage's elements (a stride of 0) may be
/// copied into.
const MAX_EXPANDED_BYTES: u64 = 1 << 30;

/// Folders of tensor payloads: their CRC is not checked (it would read every byte of a
/// multi-GB archive at load); each is checked against its tensor's size instead.
const PAYLOAD_FOLDERS: [&str; 2] = ["data/weights/", "data/constants/"];

/// The PT2 archive spec version Weft reads (`archive_version`; torch's `ARCHIVE_VERSION_VALUE`).
const PT2_ARCHIVE_VERSION: &str = "0";

/// True when the central directory of the zip in `bytes` names the entries of a
/// torch.export archive (`models/<name>.json`, or an older layout's files, which the
/// importer then names). Reads only the directory, wherever it is: torch writes the
/// weights first, so the names can lie gigabytes into the file.
pub fn is_pt2_zip(bytes: &[u8]) -> bool {
    zip::ZipArchive::new(Cursor::new(bytes)).is_ok_and(|z| has_pt2_entries(z.file_names()))
}

/// [`is_pt2_zip`] of a file, reading only its central directory.
pub fn is_pt2_file(path: &Path) -> bool {
    std::fs::File::open(path)
        .ok()
        .and_then(|f| zip::ZipArchive::new(std::io::BufReader::new(f)).ok())
        .is_some_and(|z| has_pt2_entries(z.file_names()))
}

fn has_pt2_entries<'a>(mut names: impl Iterator<Item = &'a str>) -> bool {
    names.any(|n| {
        let rel = n.split_once('/').map_or(n, |(_, rest)| rest);
        (rel.starts_with("models/") && rel.ends_with(".json"))
            || rel == "serialized_exported_program.json"
            || rel.starts_with("data/aotinductor/")
    })
}

impl Archive {
    /// Reads the directory of a zip held in memory.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<Archive, Pt2Error> {
        Archive::from_shared(name, Arc::new(FileBytes::Owned(bytes)))
    }

    /// Maps the archive at `path` (named by its path in messages).
    pub fn open(path: &Path) -> Result<Archive, Pt2Error> {
        let map = crate::mapped::map_file(path).map_err(|source| Pt2Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Archive::from_shared(&path.display().to_string(), map)
    }

    /// Reads the directory of a zip in `source` and finds every entry's bytes.
    pub fn from_shared(name: &str, source: Shared) -> Result<Archive, Pt2Error> {
        let zerr = |e: zip::result::ZipError| Pt2Error::Zip {
            archive: name.to_string(),
            message: e.to_string(),
        };
        let bytes: &[u8] = (*source).as_ref();
        let total = bytes.len() as u64;
        let mut z = zip::ZipArchive::new(Cursor::new(bytes)).map_err(zerr)?;
        if z.len() > MAX_ENTRIES {
            return Err(Pt2Error::Zip {
                archive: name.to_string(),
                message: format!("{} entries is too many", z.len()),
            });
        }
        let mut entries = BTreeMap::new();
        let mut root: Option<String> = None;
        for i in 0..z.len() {
            let f = z.by_index_raw(i).map_err(zerr)?;
            if f.is_dir() {
                continue;
            }
            let full = f.name().to_string();
            let eerr = |message: String| Pt2Error::Entry {
                archive: name.to_string(),
                entry: full.clone(),
                message,
            };
            let (r, rest) = match full.split_once('/') {
                Some((r, rest)) => (r.to_string(), rest.to_string()),
                None => (String::new(), full.clone()),
            };
            match &root {
                None => root = Some(r.clone()),
                Some(r0) if *r0 != r => {
                    return Err(Pt2Error::Zip {
                        archive: name.to_string(),
                        message: format!(
                        "entries lie in two root folders, `{r0}` and `{r}`; a .pt2 archive has one"
                    ),
                    })
                }
                _ => {}
            }
            if f.compression() != zip::CompressionMethod::Stored {
                return Err(eerr(format!(
                    "is compressed ({}); torch.export.save stores entries uncompressed, and Weft reads only those",
                    f.compression()
                )));
            }
            let start = f
                .data_start()
                .ok_or_else(|| eerr("has no data offset".into()))?;
            let size = f.size();
            // A declared size past the end of the file is a corrupt or hostile header.
            let end = start
                .checked_add(size)
                .filter(|&e| e <= total && f.compressed_size() == size)
                .ok_or_else(|| {
                    eerr(format!(
                        "declared size {size} at offset {start} exceeds what the archive can hold ({total} bytes)"
                    ))
                })?;
            let span = start as usize..end as usize;
            if !PAYLOAD_FOLDERS.iter().any(|p| rest.starts_with(p))
                && crc32fast::hash(&bytes[span.clone()]) != f.crc32()
            {
                return Err(eerr("fails its CRC check (a damaged archive)".into()));
            }
            entries.insert(rest, span);
        }
        Ok(Archive {
            name: name.to_string(),
            root: root.unwrap_or_default(),
            source: source.clone(),
            entries,
        })
    }

    /// Full entry name for messages (`llama/models/model.json`).
    pub fn entry_name(&self, rel: &str) -> String {
        if self.root.is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.root)
        }
    }

    pub fn get(&self, rel: &str) -> Option<&[u8]> {
        let bytes: &[u8] = (*self.source).as_ref();
        self.entries.get(rel).map(|r| &bytes[r.clone()])
    }

    pub fn require(&self, rel: &str) -> Result<&[u8], Pt2Error> {
        self.get(rel).ok_or_else(|| Pt2Error::MissingEntry {
            archive: self.name.clone(),
            entry: self.entry_name(rel),
        })
    }

    pub fn text(&self, rel: &str) -> Result<&str, Pt2Error> {
        std::str::from_utf8(self.require(rel)?).map_err(|e| Pt2Error::Entry {
            archive: self.name.clone(),
            entry: self.entry_name(rel),
            message: format!("not UTF-8 text: {e}"),
        })
    }

    pub fn entry_names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Checks the layout (format, archive version, byte order) and returns the model name (`model` for `models/model.json`).
    pub fn check_layout(&self) -> Result<String, Pt2Error> {
        let old = |writer: &str, message: &str| Pt2Error::OldArchive {
            archive: self.name.clone(),
            writer: writer.to_string(),
            message: message.to_string(),
        };
        if self.get("serialized_exported_program.json").is_some()
            || self.get("serialized_state_dict.pt").is_some()
        {
            let v = self
                .get("version")
                .map(|b| String::from_utf8_lossy(b).trim().to_string());
            return Err(old(
                &format!(
                    "torch 2.6-2.8{}",
                    v.map(|v| format!(" (export archive version {v})"))
                        .unwrap_or_default()
                ),
                "its weights are a pickled state_dict, which Weft does not unpickle",
            ));
        }
        if self
            .entry_names()
            .any(|n| n.starts_with("data/aotinductor/"))
            && !self.entry_names().any(|n| n.starts_with("models/"))
        {
            return Err(old(
                "torch AOTInductor (aoti_compile_and_package)",
                "it holds compiled kernels, not an ExportedProgram",
            ));
        }
        if let Some(f) = self.get("archive_format") {
            let f = String::from_utf8_lossy(f).trim().to_string();
            if f != "pt2" {
                return Err(Pt2Error::Zip {
                    archive: self.name.clone(),
                    message: format!(
                        "`{}` says `{f}`, expected `pt2`",
                        self.entry_name("archive_format")
                    ),
                });
            }
        }
        if let Some(v) = self.get("archive_version") {
            let v = String::from_utf8_lossy(v).trim().to_string();
            if v != PT2_ARCHIVE_VERSION {
                return Err(Pt2Error::Zip {
                    archive: self.name.clone(),
                    message: format!(
                        "`{}` says `{v}`; Weft reads PT2 archive version {PT2_ARCHIVE_VERSION} (torch.export.save of torch 2.9-2.11), and torch refuses a version it does not know for the same reason",
                        self.entry_name("archive_version")
                    ),
                });
            }
        }
        if let Some(b) = self.get("byteorder") {
            let b = String::from_utf8_lossy(b).trim().to_string();
            if b != "little" {
                return Err(Pt2Error::Zip {
                    archive: self.name.clone(),
                    message: format!("byte order `{b}`; only little-endian archives are read"),
                });
            }
        }
        let models: Vec<&str> = self
            .entry_names()
            .filter_map(|n| {
                n.strip_prefix("models/")
                    .and_then(|m| m.strip_suffix(".json"))
            })
            .filter(|m| !m.contains('/'))
            .collect();
        match models.as_slice() {
            [] => Err(Pt2Error::MissingEntry {
                archive: self.name.clone(),
                entry: self.entry_name("models/model.json"),
            }),
            [one] => Ok(one.to_string()),
            many if many.contains(&"model") => Ok("model".to_string()),
            many => Err(Pt2Error::Zip {
                archive: self.name.clone(),
                message: format!(
                    "it holds several programs ({}); save one with torch.export.save",
                    many.join(", ")
                ),
            }),
        }
    }

    /// Reads a payload config (`data/weights/model_weights_config.json`); absent → empty.
    pub fn payload_config(&self, rel: &str) -> Result<BTreeMap<String, PayloadMeta>, Pt2Error> {
        if self.get(rel).is_none() {
            return Ok(BTreeMap::new());
        }
        let entry = self.entry_name(rel);
        let v = schema::parse_json(&entry, self.text(rel)?)?;
        schema::read_payload_config(&entry, &v)
    }

    /// Decodes every tensor of a payload folder (`data/weights`, `data/constants`).
    /// Returns `None` for tensors whose storage is empty (saved without weights).
    pub fn tensors(
        &self,
        folder: &str,
        config: &BTreeMap<String, PayloadMeta>,
    ) -> Result<BTreeMap<String, Option<HostTensor>>, Pt2Error> {
        let mut out = BTreeMap::new();
        for (name, p) in config {
            let rel = format!("{folder}/{}", p.path_name);
            let entry = self.entry_name(&rel);
            if p.use_pickle {
                return Err(Pt2Error::OldArchive {
                    archive: self.name.clone(),
                    writer: "torch 2.8 or a custom-object exporter".into(),
                    message: format!("payload `{name}` ({entry}) is pickled"),
                });
            }
            let meta = p.meta.as_ref().ok_or_else(|| Pt2Error::TensorData {
                entry: entry.clone(),
                tensor: name.clone(),
                message: "no tensor_meta (a custom object?)".into(),
            })?;
            let bytes = self.require(&rel)?;
            let start = self.entries[&rel].start;
            out.insert(
                name.clone(),
                decode_view(&entry, name, meta, bytes, Some((&self.source, start)))?,
            );
        }
        Ok(out)
    }
}

fn int_of(entry: &str, tensor: &str, what: &str, s: &SymInt) -> Result<i64, Pt2Error> {
    match s {
        SymInt::Int(i) => Ok(*i),
        SymInt::Expr { expr, .. } => Err(Pt2Error::TensorData {
            entry: entry.into(),
            tensor: tensor.into(),
            message: format!("{what} is symbolic (`{expr}`); stored tensors need constant sizes"),
        }),
    }
}

/// Decodes one strided view of `bytes` into a contiguous host tensor of its dtype.
#[cfg(test)]
pub fn decode_tensor(
    entry: &str,
    name: &str,
    meta: &TensorMeta,
    bytes: &[u8],
) -> Result<Option<HostTensor>, Pt2Error> {
    decode_view(entry, name, meta, bytes, None)
}

/// [`decode_tensor`]; with `shared` (the archive's bytes and where `bytes` starts in
/// them), a contiguous view is a view of the archive, not a copy.
fn decode_view(
    entry: &str,
    name: &str,
    meta: &TensorMeta,
    bytes: &[u8],
    shared: Option<(&Shared, usize)>,
) -> Result<Option<HostTensor>, Pt2Error> {
    let terr = |message: String| Pt2Error::TensorData {
        entry: entry.into(),
        tensor: name.into(),
        message,
    };
    let dtype = ScalarType::dtype(meta.dtype).ok_or_else(|| Pt2Error::DType {
        entry: entry.into(),
        tensor: name.into(),
        code: meta.dtype,
        name: ScalarType::name(meta.dtype).into(),
    })?;
    let elem = ScalarType::size_bytes(meta.dtype).unwrap_or(1);
    let sizes: Vec<i64> = meta
        .sizes
        .iter()
        .map(|s| int_of(entry, name, "a size", s))
        .collect::<Result<_, _>>()?;
    let mut strides: Vec<i64> = meta
        .strides
        .iter()
        .map(|s| int_of(entry, name, "a stride", s))
        .collect::<Result<_, _>>()?;
    let offset = int_of(entry, name, "the storage offset", &meta.storage_offset)?;
    if strides.is_empty() && !sizes.is_empty() {
        // Contiguous strides when the writer left them out.
        let mut acc = 1i64;
        strides = vec![0; sizes.len()];
        for i in (0..sizes.len()).rev() {
            strides[i] = acc;
            acc = acc.saturating_mul(sizes[i].max(1));
        }
    }
    if strides.len() != sizes.len() {
        return Err(terr(format!(
            "{} sizes but {} strides",
            sizes.len(),
            strides.len()
        )));
    }
    if let Some(s) = sizes.iter().find(|&&s| s < 0) {
        return Err(terr(format!("negative size {s} in {sizes:?}")));
    }
    if strides.iter().any(|&s| s < 0) || offset < 0 {
        return Err(terr(format!(
            "negative stride or offset (strides {strides:?}, offset {offset})"
        )));
    }
    let numel = sizes
        .iter()
        .try_fold(1u64, |a, &s| a.checked_mul(s as u64))
        .ok_or_else(|| terr(format!("sizes {sizes:?} overflow")))?;
    let shape: Vec<usize> = sizes.iter().map(|&s| s as usize).collect();
    if numel == 0 {
        return Ok(Some(empty(dtype, shape)));
    }
    if bytes.is_empty() {
        return Ok(None);
    }
    if bytes.len() % elem != 0 {
        return Err(terr(format!(
            "storage has {} bytes, not a multiple of the {elem}-byte {}",
            bytes.len(),
            ScalarType::name(meta.dtype)
        )));
    }
    let storage_len = (bytes.len() / elem) as u64;
    // Largest element index the view touches.
    let mut last = offset as u64;
    for (&s, &st) in sizes.iter().zip(&strides) {
        last = (s as u64 - 1)
            .checked_mul(st as u64)
            .and_then(|x| x.checked_add(last))
            .ok_or_else(|| terr("strides overflow".into()))?;
    }
    if last >= storage_len {
        return Err(terr(format!(
            "shape {sizes:?} with strides {strides:?} and offset {offset} reads element {last}, but the storage holds {storage_len} {} elements ({} bytes)",
            ScalarType::name(meta.dtype),
            bytes.len()
        )));
    }
    if numel > (1 << 34) {
        return Err(terr(format!("{numel} elements is too many to load")));
    }
    // A view that reads elements more than once (a stride of 0: an expanded tensor) is
    // copied out whole: its bytes are bounded by its sizes, not by the archive, so a
    // few bytes of storage must not become gigabytes.
    if numel > storage_len && numel * elem as u64 > MAX_EXPANDED_BYTES {
        return Err(terr(format!(
            "shape {sizes:?} with strides {strides:?} repeats the storage's {storage_len} elements as {numel} ({} bytes once copied, more than the {} GiB Weft copies out of an expanded view)",
            numel * elem as u64,
            MAX_EXPANDED_BYTES >> 30
        )));
    }
    let raw = |b: weft_ir::RawBytes| HostTensor::raw(dtype, shape.clone(), b).map_err(terr);
    let contiguous = {
        let mut acc = 1u64;
        sizes.iter().zip(&strides).rev().all(|(&size, &st)| {
            let ok = size == 1 || st as u64 == acc;
            acc = acc.saturating_mul(size as u64);
            ok
        })
    };
    if contiguous {
        let span = offset as usize * elem..(offset as usize + numel as usize) * elem;
        if let Some((source, start)) = shared {
            let whole = start + span.start..start + span.end;
            if let Some(b) = weft_ir::RawBytes::shared(source.clone(), whole) {
                return raw(b).map(Some);
            }
        }
        return raw(weft_ir::RawBytes::owned(bytes[span].to_vec())).map(Some);
    }
    // Walk the view in row-major order, copying each element's bytes.
    let mut idx = vec![0usize; shape.len()];
    let mut out = Vec::with_capacity(numel as usize * elem);
    for _ in 0..numel {
        let mut e = offset as usize;
        for (i, &k) in idx.iter().enumerate() {
            e += k * strides[i] as usize;
        }
        out.extend_from_slice(&bytes[e * elem..(e + 1) * elem]);
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    raw(weft_ir::RawBytes::owned(out)).map(Some)
}

fn empty(dtype: DType, shape: Vec<usize>) -> HostTensor {
    if dtype.is_float() {
        HostTensor::floats(dtype, shape, vec![])
    } else {
        HostTensor::ints(dtype, shape, vec![])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(dtype: i64, sizes: &[i64], strides: &[i64], offset: i64) -> TensorMeta {
        TensorMeta {
            dtype,
            sizes: sizes.iter().map(|&s| SymInt::Int(s)).collect(),
            strides: strides.iter().map(|&s| SymInt::Int(s)).collect(),
            storage_offset: SymInt::Int(offset),
            requires_grad: false,
        }
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn strided_views_of_one_storage() {
        let bytes = f32_bytes(&[0., 1., 2., 3., 4., 5.]);
        // The transpose of a [2, 3] tensor, offset into the storage.
        let t = decode_tensor("e", "w", &meta(7, &[3, 2], &[1, 3], 0), &bytes)
            .unwrap()
            .unwrap();
        assert_eq!(t.to_f64(), vec![0., 3., 1., 4., 2., 5.]);
        let t = decode_tensor("e", "w", &meta(7, &[2], &[1], 4), &bytes)
            .unwrap()
            .unwrap();
        assert_eq!(t.to_f64(), vec![4., 5.]);
    }

    #[test]
    fn shape_bytes_mismatch_is_an_error() {
        let bytes = f32_bytes(&[0., 1., 2.]);
        let e = decode_tensor(
            "m/data/weights/weight_0",
            "w",
            &meta(7, &[2, 2], &[2, 1], 0),
            &bytes,
        )
        .unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("weight_0")
                && s.contains("reads element 3")
                && s.contains("3 float32 elements"),
            "{s}"
        );
        let e = decode_tensor("e", "w", &meta(99, &[1], &[1], 0), &bytes).unwrap_err();
        assert!(matches!(e, Pt2Error::DType { code: 99, .. }), "{e}");
        // An empty storage: saved without weights.
        assert!(decode_tensor("e", "w", &meta(7, &[2], &[1], 0), &[])
            .unwrap()
            .is_none());
    }

    #[test]
    fn expanded_views_are_bounded() {
        // Four bytes of storage viewed as 2^34 elements (a stride of 0): refused, not
        // copied out as 64 GiB.
        let bytes = f32_bytes(&[1.0]);
        let e = decode_tensor("e", "w", &meta(7, &[1 << 32, 4], &[0, 0], 0), &bytes)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("repeats the storage's 1 elements") && e.contains("`w`"),
            "{e}"
        );
        // A small expanded view is copied.
        let t = decode_tensor("e", "w", &meta(7, &[3, 2], &[0, 0], 0), &bytes)
            .unwrap()
            .unwrap();
        assert_eq!(t.to_f64(), vec![1.0; 6]);
    }

    #[test]
    fn half_types_widen() {
        let b: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect();
        let t = decode_tensor("e", "w", &meta(13, &[2], &[1], 0), &b)
            .unwrap()
            .unwrap();
        assert_eq!((t.dtype, t.to_f64()), (DType::BF16, vec![1.5, -2.0]));
    }
}
