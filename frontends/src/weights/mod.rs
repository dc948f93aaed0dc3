//! Safetensors checkpoints: reading (one file, or shards listed by
//! `model.safetensors.index.json`) into host tensors, converting Hub MoE checkpoints'
//! per-expert tensors to the fused transformers-5 layout the graph uses, checking every
//! tensor's name, dtype and shape against the graph's parameters (one error listing
//! every problem), and writing tensors back out.

mod experts;
pub mod floats;

use crate::error::{FrontendError, WeightProblem};
use crate::model::Model;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use weft_ir::{DType, HostData, HostTensor, TensorType};

/// Tensors read from a checkpoint, with the file each came from.
#[derive(Clone, Debug, Default)]
pub struct Checkpoint {
    /// The path given (file or directory), for messages.
    pub source: PathBuf,
    pub tensors: BTreeMap<String, HostTensor>,
    /// Tensor name → the file name it was read from.
    pub files: BTreeMap<String, String>,
}

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

/// Reads a checkpoint: a `.safetensors` file, an index json, or a directory holding
/// `model.safetensors.index.json` or `model.safetensors`.
pub fn read_checkpoint(path: &Path) -> Result<Checkpoint, FrontendError> {
    let mut ck = Checkpoint {
        source: path.to_path_buf(),
        ..Default::default()
    };
    let (dir, files) = if path.is_dir() {
        if path.join(INDEX).is_file() {
            (path.to_path_buf(), shard_files(&path.join(INDEX))?)
        } else if path.join(SINGLE).is_file() {
            (path.to_path_buf(), vec![SINGLE.to_string()])
        } else {
            return Err(FrontendError::Safetensors {
                file: path.display().to_string(),
                message: format!("the directory has neither {INDEX} nor {SINGLE}"),
            });
        }
    } else {
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        if name.ends_with(".json") {
            (dir, shard_files(path)?)
        } else {
            (dir, vec![name])
        }
    };
    for f in files {
        for (name, t) in read_safetensors(&dir.join(&f))? {
            if let Some(prev) = ck.files.get(&name) {
                return Err(FrontendError::Safetensors {
                    file: dir.join(&f).display().to_string(),
                    message: format!("tensor `{name}` is also in {prev}"),
                });
            }
            ck.files.insert(name.clone(), f.clone());
            ck.tensors.insert(name, t);
        }
    }
    Ok(ck)
}

/// The shard files an index lists, sorted and without repeats.
fn shard_files(index: &Path) -> Result<Vec<String>, FrontendError> {
    let file = index.display().to_string();
    let text = weft_ir::files::read_to_string(index).map_err(|e| FrontendError::io(index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| FrontendError::Json {
        file: file.clone(),
        message: e.to_string(),
    })?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| FrontendError::Json {
            file: file.clone(),
            message: "expected an object `weight_map` (tensor name → shard file)".into(),
        })?;
    let mut files = Vec::new();
    for (name, f) in map {
        let f = f.as_str().ok_or_else(|| FrontendError::Json {
            file: file.clone(),
            message: format!("weight_map entry `{name}` is not a file name"),
        })?;
        // Shards lie in the index's directory (HF writes plain names): a path that
        // leaves it (`../x`, `/dev/zero`) would read files that are not the checkpoint.
        let inside = !f.is_empty()
            && Path::new(f).components().all(|c| {
                matches!(
                    c,
                    std::path::Component::Normal(_) | std::path::Component::CurDir
                )
            });
        if !inside {
            return Err(FrontendError::Json {
                file: file.clone(),
                message: format!(
                    "weight_map entry `{name}` names `{f}`, which is not a file in the index's directory"
                ),
            });
        }
        files.push(f.to_string());
    }
    files.sort();
    files.dedup();
    Ok(files)
}

/// The files reading the checkpoint at `path` opens: a `.safetensors` file itself; an
/// index json with the shards it lists; for a directory, those of its index or its
/// `model.safetensors`. The outputs of a command must not be any of them. Best effort: an
/// index that cannot be read lists only itself (reading the checkpoint reports why).
pub fn checkpoint_files(path: &Path) -> Vec<PathBuf> {
    let index = if path.is_dir() {
        if path.join(INDEX).is_file() {
            path.join(INDEX)
        } else if path.join(SINGLE).is_file() {
            return vec![path.join(SINGLE)];
        } else {
            return Vec::new();
        }
    } else if path.extension().is_some_and(|e| e == "json") {
        path.to_path_buf()
    } else {
        return vec![path.to_path_buf()];
    };
    let dir = index.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut files = vec![index.clone()];
    if let Ok(shards) = shard_files(&index) {
        files.extend(shards.iter().map(|f| dir.join(f)));
    }
    files
}

/// Reads one safetensors file, memory-mapped: each tensor is a view of the mapping in
/// the file's dtype (f64/f32/bf16/f16/i64/i32/bool), so reading copies nothing and a
/// tensor's pages are read from disk when it is first used.
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, HostTensor>, FrontendError> {
    let map = crate::mapped::map_file(path).map_err(|e| FrontendError::io(path, e))?;
    let shared: weft_ir::SharedBytes = map.clone();
    let bytes: &[u8] = (*map).as_ref();
    let file = path.display().to_string();
    let st = SafeTensors::deserialize(bytes).map_err(|e| FrontendError::Safetensors {
        file: file.clone(),
        message: e.to_string(),
    })?;
    // The header is a JSON object read into a map: a tensor named twice would keep the
    // last entry silently (and the other's bytes would go unread). Refused, as in configs.
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("a valid file has its length"));
    let header = std::str::from_utf8(&bytes[8..8 + n as usize]).unwrap_or("{}");
    crate::fields::parse_json_no_duplicates(header).map_err(|e| FrontendError::Safetensors {
        file: file.clone(),
        message: format!("header: {e}"),
    })?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let t = to_host(&view, bytes, &shared).map_err(|message| FrontendError::Safetensors {
            file: file.clone(),
            message: format!("tensor `{name}`: {message}"),
        })?;
        out.insert(name, t);
    }
    Ok(out)
}

/// A view of `file` (whose bytes `view` lies in) as a host tensor of its dtype.
fn to_host(
    v: &TensorView,
    file: &[u8],
    shared: &weft_ir::SharedBytes,
) -> Result<HostTensor, String> {
    let dtype = match v.dtype() {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::BOOL => DType::Bool,
        other => {
            return Err(format!(
                "dtype {other:?} is not supported (use f32, bf16, f16, f64, i64, i32 or bool)"
            ))
        }
    };
    let data = v.data();
    let start = (data.as_ptr() as usize)
        .checked_sub(file.as_ptr() as usize)
        .ok_or("its data lies outside the file")?;
    let bytes = weft_ir::RawBytes::shared(shared.clone(), start..start + data.len())
        .ok_or("its data lies outside the file")?;
    HostTensor::raw(dtype, v.shape().to_vec(), bytes)
}

/// Reads the checkpoint at `path` for `model`: converts per-expert MoE tensors to the
/// fused layout, resolves tied aliases (a tied model's `lm_head.weight` is dropped, or
/// stands for `model.embed_tokens.weight` when only it is present), and checks that
/// the tensors are exactly the model's parameters (and checkpoint buffers, see
/// [`Model::buffers`]) with the same dtypes and shapes. deepseek_v3's
/// multi-token-prediction layers are dropped first, as HF drops them.
pub fn load_weights(
    model: &Model,
    path: &Path,
) -> Result<BTreeMap<String, HostTensor>, FrontendError> {
    let mut ck = read_checkpoint(path)?;
    drop_mtp_layers(model, &mut ck);
    let mut params: BTreeMap<String, TensorType> = model.params().into_iter().collect();
    params.extend(model.buffers());
    let mut problems = Vec::new();
    let accounted = experts::fuse_experts(&mut ck, &params, &mut problems);
    for (alias, target) in &model.tied {
        if params.contains_key(alias) {
            continue;
        }
        // The alias is the target under a second name: use it only if the target is absent.
        if let Some(t) = ck.tensors.remove(alias) {
            let f = ck.files.remove(alias).unwrap_or_default();
            match ck.tensors.get(target) {
                None => {
                    ck.tensors.insert(target.clone(), t);
                    ck.files.insert(target.clone(), format!("{f} (as {alias})"));
                }
                // HF 5 (`tie_weights` in from_pretrained) does not tie two tensors the
                // checkpoint holds with different values: it warns and keeps both, an
                // untied model. Weft would build the tied one: refused.
                Some(kept) if !same_values(kept, &t) => {
                    return Err(FrontendError::Safetensors {
                        file: if ck.source.is_dir() {
                            ck.source.join(&f)
                        } else {
                            ck.source.clone()
                        }
                        .display()
                        .to_string(),
                        message: format!(
                            "`{alias}` differs from `{target}`, but the config ties them (tie_word_embeddings): HF then unties them and uses both, while Weft would use `{target}` for both; set `tie_word_embeddings` to false in config.json (an untied model), or drop `{alias}` from the checkpoint"
                        ),
                    });
                }
                Some(_) => {}
            }
        }
    }
    problems.extend(compare(&params, &ck.tensors, &ck.files, &accounted));
    sort_problems(&mut problems);
    if !problems.is_empty() {
        return Err(FrontendError::WeightMismatch {
            checkpoint: path.display().to_string(),
            problems,
        });
    }
    Ok(ck.tensors)
}

/// True when two tensors hold the same dtype, shape and values (HF's `torch.equal`).
fn same_values(a: &HostTensor, b: &HostTensor) -> bool {
    if a.dtype != b.dtype || a.shape != b.shape {
        return false;
    }
    match (&a.data, &b.data) {
        (HostData::Raw(x), HostData::Raw(y)) => x.bytes() == y.bytes(),
        _ if a.dtype.is_float() => a.to_f64() == b.to_f64(),
        _ => a.to_i64() == b.to_i64(),
    }
}

/// The checkpoint names of deepseek_v3's multi-token-prediction layers: the
/// `num_nextn_predict_layers` layers after the last decoder layer
/// (`model.layers.{num_hidden_layers + i}.`). HF's forward never runs them and its
/// loader ignores them ([`crate::deepseek::MlaConfig::mtp_layers`]).
pub fn mtp_layer_prefixes(model: &Model) -> Vec<String> {
    let Some(c) = &model.config else {
        return vec![];
    };
    let Some(mla) = &c.mla else { return vec![] };
    (0..mla.mtp_layers)
        .map(|i| format!("model.layers.{}.", c.num_hidden_layers + i))
        .collect()
}

/// Drops the multi-token-prediction layers' tensors, as HF's loader does.
fn drop_mtp_layers(model: &Model, ck: &mut Checkpoint) {
    let prefixes = mtp_layer_prefixes(model);
    if prefixes.is_empty() {
        return;
    }
    ck.tensors
        .retain(|name, _| !prefixes.iter().any(|p| name.starts_with(p.as_str())));
    ck.files
        .retain(|name, _| !prefixes.iter().any(|p| name.starts_with(p.as_str())));
}

/// Checks in-memory tensors against the model's parameters (as `load_weights` does).
pub fn check_weights(
    model: &Model,
    weights: &BTreeMap<String, HostTensor>,
) -> Result<(), FrontendError> {
    let mut params: BTreeMap<String, TensorType> = model.params().into_iter().collect();
    params.extend(model.buffers());
    let mut problems = compare(&params, weights, &BTreeMap::new(), &Default::default());
    sort_problems(&mut problems);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(FrontendError::WeightMismatch {
            checkpoint: "the given tensors".into(),
            problems,
        })
    }
}

/// Missing, extra and misshaped tensors, in name order (missing first).
fn compare(
    params: &BTreeMap<String, TensorType>,
    tensors: &BTreeMap<String, HostTensor>,
    files: &BTreeMap<String, String>,
    accounted: &std::collections::BTreeSet<String>,
) -> Vec<WeightProblem> {
    let file_of = |n: &str| files.get(n).cloned().unwrap_or_else(|| "memory".into());
    let mut problems = Vec::new();
    for (name, ty) in params {
        if !tensors.contains_key(name) && !accounted.contains(name) {
            problems.push(WeightProblem::Missing {
                name: name.clone(),
                want: ty.to_string(),
            });
        }
    }
    for (name, t) in tensors {
        match params.get(name) {
            None => problems.push(WeightProblem::Extra {
                name: name.clone(),
                file: file_of(name),
            }),
            Some(ty) => {
                let want: Vec<Option<i64>> = ty.shape.iter().map(|d| d.as_const()).collect();
                let got: Vec<Option<i64>> = t.shape.iter().map(|&d| Some(d as i64)).collect();
                if t.dtype != ty.dtype || want != got {
                    problems.push(WeightProblem::Misshaped {
                        name: name.clone(),
                        file: file_of(name),
                        got: host_type(t),
                        want: ty.to_string(),
                    });
                }
            }
        }
    }
    problems
}

/// Missing, then extra, then misshaped; each by name.
fn sort_problems(p: &mut [WeightProblem]) {
    p.sort_by(|a, b| {
        let key = |w: &WeightProblem| match w {
            WeightProblem::Missing { name, .. } => (0, name.clone()),
            WeightProblem::Extra { name, .. } => (1, name.clone()),
            WeightProblem::Misshaped { name, .. } => (2, name.clone()),
        };
        key(a).cmp(&key(b))
    });
}

/// `bf16[4, 32]`: a host tensor's type as the IR prints types.
pub fn host_type(t: &HostTensor) -> String {
    let dims: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
    format!("{}[{}]", t.dtype, dims.join(", "))
}

/// Writes tensors as safetensors: floats as f32, integers as i64, bools as bool. Each
/// tensor is encoded when the writer reaches it and streamed to a temporary file beside
/// `path`, renamed over it once complete: the host holds the tensors and one encoded
/// tensor, not a second copy of the file (the target may also be a file whose mapping
/// backs the very tensors being written).
pub fn save_safetensors<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (&'a String, &'a HostTensor)>,
) -> Result<(), FrontendError> {
    let write_err = |message: String| FrontendError::Write {
        path: path.to_path_buf(),
        message,
    };
    let mut views = Vec::new();
    for (name, t) in tensors {
        let numel = t.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if numel != Some(t.data_len()) {
            return Err(write_err(format!(
                "tensor `{name}` has shape {:?} but {} values",
                t.shape,
                t.data_len()
            )));
        }
        // As the values widen: floats (f64) to f32, integers (i64) to i64, bools to bool.
        let float = match &t.data {
            HostData::F64(_) => true,
            HostData::I64(_) => false,
            HostData::Raw(_) => t.dtype.is_float(),
        };
        let dtype = match (float, t.dtype) {
            (true, _) => Dtype::F32,
            (false, DType::Bool) => Dtype::BOOL,
            (false, _) => Dtype::I64,
        };
        views.push((name.clone(), Encoded { tensor: t, dtype }));
    }
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    weft_ir::output::write_atomic_via(path, |tmp| {
        safetensors::serialize_to_file(views.iter().map(|(n, v)| (n.as_str(), v)), Some(meta), tmp)
            .map_err(|e| std::io::Error::other(e.to_string()))
    })
    .map_err(|e| write_err(e.to_string()))
}

/// A host tensor as `save_safetensors` writes it, encoded on demand.
struct Encoded<'a> {
    tensor: &'a HostTensor,
    dtype: Dtype,
}

impl safetensors::View for &Encoded<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.tensor.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let t = self.tensor.widened();
        let bytes = match (&t.data, self.dtype) {
            (HostData::I64(v), Dtype::BOOL) => v.iter().map(|&x| (x != 0) as u8).collect(),
            (HostData::I64(v), _) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            (HostData::F64(v), _) => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
            (HostData::Raw(_), _) => unreachable!("widened above"),
        };
        std::borrow::Cow::Owned(bytes)
    }
    fn data_len(&self) -> usize {
        let size = match self.dtype {
            Dtype::BOOL => 1,
            Dtype::F32 => 4,
            _ => 8,
        };
        self.tensor.numel() * size
    }
}
